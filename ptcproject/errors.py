"""The one error vocabulary. Every error a user or an agent sees has a stable ``code`` from CODES,
a sentence for a person that says what happened and what to do, and, at the API, an HTTP status.

- A request that fails answers ``{"error": {"code", "message", "details"}}`` (``error_body``).
- A tool call that fails records ``{"code", "message"}`` on the call (``call_error``); the code in
  the sandbox gets it as ``ToolError(code=...)``.
- A job that fails records ``{"type", "message", "traceback"}`` (``job_error``): ``type`` is the
  Python exception's name, or one of JOB_ERROR_TYPES.

``tests/test_error_codes.py`` checks that every code the code base uses is in CODES, and that the
README's table of codes lists each of them.
"""

from typing import Any

# code -> (HTTP status when a request fails with it, what it means). Calls' codes carry the status
# their request would have had; a call's own failure is recorded with the call, not answered.
CODES: dict[str, tuple[int, str]] = {
    # Any request
    "validation_error": (400, "the input is invalid; `details` has the errors per field"),
    "parse_error": (400, "the body is not JSON, or nested too deep to read"),
    "not_authenticated": (401, "no API key was sent"),
    "authentication_failed": (401, "the key is unknown, expired or revoked"),
    "permission_denied": (403, "not allowed: not staff, or a job-scoped key outside its one endpoint"),
    "not_found": (404, "no such endpoint or object, or another user's"),
    "method_not_allowed": (405, "the endpoint does not take this method"),
    "not_acceptable": (406, "the response can't be given in the format asked for"),
    "conflict": (409, "the request conflicts with the object's state"),
    "too_many_keys": (
        409,
        "POST /keys, or a PATCH that makes an expired key work again: the user has PTC_MAX_KEYS_PER_USER keys that work; "
        "revoke one first",
    ),
    "code_too_large": (413, "the code, or the whole body, is over its limit"),
    "unsupported_media_type": (415, "the body is not application/json"),
    "length_required": (411, "the body was sent chunked, without a Content-Length"),
    "throttled": (429, "too many requests; wait as Retry-After says"),
    "rate_limited": (
        429,
        "past a tenant quota (jobs at once, tool calls in flight, jobs per minute, managed containers open); "
        "retry after Retry-After seconds",
    ),
    "internal_error": (500, "the server failed; it is logged (as a call's code: the worker failed running it)"),
    "database_unavailable": (503, "the database is unreachable (nothing was changed), or cancelled a statement; retry"),
    "broker_unavailable": (503, "the broker is unreachable, or Redis is full (its maxmemory); nothing was queued; retry"),
    "not_ready": (503, "/readyz: a part the service needs is unreachable"),
    "worker_unavailable": (
        503,
        "a running job's worker did not answer in time whether its call over HTTP may start; nothing was run; retry",
    ),
    # Jobs
    "ptc_disabled": (403, "the rollout policy says no; the message gives its reason"),
    "job_finished": (409, "the job has already finished"),
    "invalid_last_event_id": (400, "Last-Event-ID is not an event id"),
    # Client tools and approvals
    "call_not_found": (404, "no call of this job (or visible to you) has this id"),
    "call_not_awaiting": (409, "the call is not waiting for this answer: a server tool's, or it (or its job) ended or timed out"),
    "result_conflict": (409, "the call already has its result; a second answer changes nothing"),
    "decision_conflict": (409, "the call was already approved or denied; a second decision changes nothing"),
    # Sessions and files of /work
    "session_busy": (409, "a job is queued or running in the session; it runs one at a time"),
    "session_expired": (410, "the session expired (idle_timeout or max_lifetime) or was deleted; `details` has expires_at"),
    "session_lost": (
        410,
        "the session's sandbox is gone: its worker died or shut down, or a job's timeout, cancel or crash killed it",
    ),
    "too_many_sessions": (409, "the user has PTC_MAX_SESSIONS_PER_USER active sessions"),
    "invalid_path": (
        400,
        "a file path is absolute, has '..', '.', an empty part, a NUL, is too long, or names a file beside a folder of its name",
    ),
    "files_too_large": (413, "the files are over PTC_FILES_MAX_BYTES in all"),
    "too_many_files": (413, "the files are over PTC_FILES_MAX_COUNT"),
    # Toolsets
    "toolset_exists": (409, "a toolset with this key exists"),
    "key_mismatch": (400, "the body's key differs from the URL's"),
    "builtin_toolset": (400, "builtin toolsets are defined in code"),
    "not_mcp": (400, "only an MCP toolset can be synced"),
    # Toolset writes: the first problem's code; `details` has every problem by field
    "invalid_key": (400, "a toolset write's key is not a Python identifier, or is a name the SDK uses itself"),
    "invalid_config": (400, "a toolset write's config is not what its kind takes"),
    "unknown_secret": (400, "a toolset's config names `{{secrets.NAME}}` for a secret it does not set"),
    "invalid_tool_name": (400, "a tool's name is not a Python identifier the SDK can use"),
    "duplicate_tool_name": (400, "a toolset write defines one tool name twice"),
    "invalid_json_schema": (400, "a tool's input or output schema is not a valid JSON Schema of keyword arguments"),
    "invalid_http_spec": (400, "an http tool's `http` is not `{method, path, query}`, or a tool of another kind has one"),
    "unknown_http_parameter": (
        400,
        "an http tool's path or query names a parameter its input schema lacks (a path's must be required)",
    ),
    "invalid_allowed_callers": (400, "a tool's allowed_callers holds a value that is not a caller"),
    # Tool calls: refused before they run
    "unknown_toolset": (400, "there is no such toolset"),
    "unknown_tool": (400, "the toolset has no such tool"),
    "ambiguous_tool": (400, "`tools.<name>` or describe_tool names a tool several granted toolsets have; name its toolset"),
    "toolset_not_granted": (403, "the toolset was not granted to the job"),
    "tool_not_ptc": (403, "a direct tool can't be called from code"),
    "call_id_mismatch": (
        403,
        "x-ptc-call-id is not the call_id of the key's job, or came with a user's key: only a job's own key makes its calls",
    ),
    "tool_call_limit": (
        403,
        "over HTTP: the job has made its max_tool_calls calls (its code's and those over HTTP together); no more can run",
    ),
    "tool_bytes_limit": (
        403,
        "over HTTP: the job's calls have passed `PTC_MAX_JOB_TOOL_BYTES` (a managed container's job too); no more can run",
    ),
    "parallel_limit": (
        429,
        "over HTTP: the job has its parallel cap of calls in flight, its code's and those over HTTP together "
        "(1 if sequential); retry",
    ),
    "approval_required": (403, "the tool needs an approval before each call; only a job's code can wait for one"),
    "invalid_arguments": (400, "the arguments don't match the tool's input schema, or nest too deep"),
    "insufficient_credits": (400, "the call costs more than the balance has available"),
    "budget_exceeded": (400, "the call would take the job past its max_credits"),
    "denied": (403, "the call needed an approval and was denied"),
    # Tool calls: failed while or after running
    "client_error": (502, "the client that runs this client tool reported an error (is_error)"),
    "job_ended": (
        409,
        "the job ended before the call started; it was not run (also a call made with the key of a job that has ended)",
    ),
    "worker_lost": (500, "the tools worker running the call died; it was not run again"),
    "tool_timeout": (504, "no result within the tool's timeout"),
    "tool_error": (500, "the call failed"),
    "tool_failed": (500, "the tool itself reported a failure"),
    "tool_exception": (500, "the builtin tool raised"),
    "tool_not_found": (500, "the builtin tool is not in this server's code"),
    "tool_disabled": (403, "the tool or its toolset was disabled after the call was made, before it started; it was not run"),
    "kind_unsupported": (500, "this server can't run the toolset's kind"),
    "output_too_large": (500, "the tool's output is over the size limit"),
    "invalid_output": (500, "the tool's output is not JSON"),
    "secret_missing": (500, "the toolset's config names a secret it does not have"),
    "http_config_invalid": (500, "the HTTP toolset's config can't be sent: a header (with its secrets) that is not ASCII"),
    "http_error": (502, "the HTTP tool answered a non-2xx status"),
    "http_invalid_json": (502, "the HTTP tool answered something that is not JSON"),
    "http_timeout": (504, "the HTTP tool did not answer in time"),
    "http_connection_error": (502, "the HTTP tool could not be reached"),
    "mcp_config_invalid": (500, "the MCP toolset's config is invalid"),
    "mcp_start_failed": (502, "the MCP server could not be started or reached"),
    "mcp_init_timeout": (504, "the MCP server did not finish initializing in time"),
    "mcp_timeout": (504, "the MCP server did not answer in time"),
    "mcp_connection_lost": (502, "the MCP server went away during the call"),
    "mcp_bad_response": (502, "the MCP server answered something invalid"),
    "mcp_error": (502, "the MCP server answered with a protocol error"),
    "mcp_tool_error": (502, "the MCP tool reported an error"),
    "mcp_invalid_output": (502, "the MCP tool's output is not what its schema says"),
    "bridge_closed": (500, "(in the sandbox) the bridge to the worker closed before the result came"),
}

# A failed job's ``error.type``, when it is not the Python exception the code raised.
JOB_ERROR_TYPES = {
    "Timeout": "the code ran past its timeout",
    "Cancelled": "the job was cancelled",
    "ResourceLimit": (
        "memory, processes, file size, tool-call count, the bytes its tool calls passed, output or return value over its limit"
    ),
    "SandboxCrashed": "the sandbox died or could not start (the message says why)",
    "ToolError": "a tool call failed and the code did not catch it",
    "WorkerLost": "the worker running the job died, or no worker took it",
    "BridgeError": "the sandbox sent a malformed bridge frame",
    "InternalError": "the worker failed around the job (see its log)",
    "SystemExit": "the code exited with a non-zero status",
    "SessionEnded": "the job's session ended (expired, deleted or lost) before or while the job ran",
    "InputFiles": "a file sent with the job, or uploaded to its session, could not be written to /work; the code was not run",
}


def status_of(code: str) -> int:
    """The HTTP status a request that fails with ``code`` answers (400 for an unknown code)."""
    return CODES.get(code, (400, ""))[0]


class ApplicationError(Exception):
    """An error a user or agent sees: a stable ``code``, a sentence that says what to do, details.

    Services raise it; the API renders it as ``{"error": {...}}`` with ``status`` (by default the
    code's, from CODES).
    """

    def __init__(self, code: str, message: str, *, status: int | None = None, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status if status is not None else status_of(code)
        self.details = details or {}

    def as_dict(self) -> dict[str, str]:
        """The error as a tool call records it."""
        return call_error(self.code, self.message)


# The most characters of a tool call's error message that are kept: a tool's failure may say
# anything (Demo.fail's own argument, a remote server's error text), and its message goes into the
# call's row, its event and the error raised in the code.
MAX_ERROR_MESSAGE = 4000


def call_error(code: str, message: str) -> dict[str, str]:
    """A tool call's recorded error, its message cut to MAX_ERROR_MESSAGE characters."""
    if len(message) > MAX_ERROR_MESSAGE:
        said = f"… ({len(message)} characters, cut)"
        message = message[: MAX_ERROR_MESSAGE - len(said)] + said
    return {"code": code, "message": message}


def job_error(kind: str, message: str, traceback: str = "") -> dict[str, str]:
    """A job's recorded error: ``kind`` is an exception's name or one of JOB_ERROR_TYPES."""
    return {"type": kind, "message": message, "traceback": traceback}


def error_body(code: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    """The body of a failed request (API.md)."""
    return {"error": {"code": code, "message": message, "details": details or {}}}
