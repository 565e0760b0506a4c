import logging

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class KeyValueFormatter(logging.Formatter):
    """Append a record's ``extra`` fields as ``key=value``, so ``job_id`` and ``call_id`` reach the log."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = " ".join(f"{k}={v}" for k, v in record.__dict__.items() if k not in _STANDARD)
        return f"{line} {extras}" if extras else line
