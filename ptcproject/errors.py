from typing import Any


class ApplicationError(Exception):
    """An error a user or agent sees: a stable ``code``, a sentence that says what to do, details.

    Services raise it; the API renders it as ``{"error": {...}}`` with ``status``.
    """

    def __init__(self, code: str, message: str, *, status: int = 400, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        self.details = details or {}
