import importlib.util
import logging
import os

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class KeyValueFormatter(logging.Formatter):
    """Append a record's ``extra`` fields as ``key=value``, so ``job_id`` and ``call_id`` reach the log."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = " ".join(f"{k}={v}" for k, v in record.__dict__.items() if k not in _STANDARD)
        return f"{line} {extras}" if extras else line


class DropFromPackage(logging.Filter):
    """Drop the records logged from one package's files: for a library whose logger has a name
    another might use (the mcp SDK's ClientSession logs as ``client``)."""

    def __init__(self, package: str) -> None:
        super().__init__()
        spec = importlib.util.find_spec(package)
        self.folder = os.path.dirname(spec.origin) + os.sep if spec is not None and spec.origin else None

    def filter(self, record: logging.LogRecord) -> bool:
        return self.folder is None or not record.pathname.startswith(self.folder)
