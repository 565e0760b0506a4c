from ptcproject.errors import ApplicationError


class ToolFailure(ApplicationError):
    """A tool call that did not succeed: recorded on the call (``as_dict``), raised in the code as
    ``ToolError``. Its ``code`` is one of ptcproject.errors.CODES."""
