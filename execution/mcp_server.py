"""PTC as an MCP server: ``exec_code`` (and the seed's ``programmatic_tool_calling``) for any MCP client.

One low-level ``mcp.server.Server`` serves both transports:
- streamable HTTP at ``/mcp`` (``execution.mcp_http``), where each request carries the user of its
  API key in the ASGI scope;
- stdio (``manage.py ptc_mcp --user NAME``), where the user is fixed when the server is built.

A tool call runs a job exactly as ``POST /api/v1/exec`` does: ``exec_job_create`` checks the
policy and records it, a real exec worker runs it, every tool call is recorded and billed there.
While it runs, its event log (``execution.events.event_stream``, pushed, never polled) becomes
MCP progress notifications: tool-call starts and ends, stdout and stderr chunks. If the client
cancels the request (``notifications/cancelled``, or on the 2026-07-28 wire by closing the
response), the handler is cancelled and the job with it (``exec_job_cancel``: the sandbox's
process tree is killed and its queued calls never run).

MCP Tasks: mcp 2.3.0 has the protocol's task types (``CallToolRequestParams.task``) but no
server-side task support (no ``tasks/get``/``tasks/result`` handling), so long jobs are ordinary
requests with progress notifications; ``GET /api/v1/exec/{id}`` still serves any job by its id.
"""

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import mcp_types as types
from django.contrib.auth.models import User
from mcp.server import Server
from mcp.server.context import ServerRequestContext
from mcp.shared.exceptions import MCPError

from execution.events import db_read, event_stream, follow_admit
from execution.models import ExecJob
from execution.selectors import exec_jobs_for
from execution.serializers import ExecCreateSerializer, ExecJobSerializer
from execution.services.jobs import exec_job_cancel, exec_job_create
from ptcproject.accounts.services import still_signed_in
from ptcproject.api import first_message, outage_error
from ptcproject.errors import ApplicationError, error_body
from ptcproject.policy.models import Policy
from ptcproject.policy.selectors import policy_get
from tools.context import EXEC_CODE, ptc_context
from tools.models import Tool, Toolset
from tools.sdk import catalog_entry, class_name, ptc_tools_of
from tools.selectors import toolset_keys_for_ptc, toolsets_named

logger = logging.getLogger("ptc.mcp")

SEED_TOOL = "programmatic_tool_calling"
LIST_TOOLSETS = "list_toolsets"
DESCRIBE_TOOL = "describe_tool"
# The seed's default; exec_code's default is the policy's.
SEED_DEFAULT_TIMEOUT = 30.0
# Where the HTTP layer puts the user of the request's API key (execution.mcp_http).
SCOPE_USER_ID = "ptc.user_id"
SCOPE_KEY_ID = "ptc.key_id"
SCOPE_DISCOVERY = "ptc.discovery"

_CODE = {"type": "string", "description": "Python 3 source. The value of the last expression is returned."}
_TIMEOUT = {"type": "number", "exclusiveMinimum": 0, "description": "Seconds; at most the policy's maximum."}


@dataclass(frozen=True)
class McpUser:
    """Who a request runs as, and whether its exec_code description names tools only (discovery)."""

    user_id: int
    discovery: bool = False
    key_id: Any = None  # the API key of an HTTP request (None on stdio: the server's own user)


# -- Reads and writes, each on a pooled connection handed back at once (db_read) ------------------
def _user(user_id: int) -> User:
    """The caller, or 401 ``authentication_failed`` if it was deactivated (or deleted) since it connected."""
    user = User.objects.filter(pk=user_id, is_active=True).first()
    if user is None:
        raise ApplicationError("authentication_failed", "The user this MCP server runs as is no longer active; nothing was run.")
    return user


@db_read
def _max_timeout() -> float:
    return float(policy_get().max_timeout)


@db_read
def _tool_list(user_id: int, discovery: bool) -> list[types.Tool]:
    """The MCP tools for this user: exec_code and the seed's tool, described by the prompt context
    of ``POST /api/v1/ptc/context`` (its compact reference and system prompt) for the toolsets an
    exec_code without ``toolsets`` is granted, and the discovery tools."""
    user = _user(user_id)
    context = ptc_context(user=user, keys=_mcp_keys(user, policy_get()), title="", fmt="anthropic", discovery=discovery)
    if context["ptc_enabled"]:
        exec_code = next(tool for tool in context["tools"] if tool["name"] == EXEC_CODE)
        description = f"{exec_code['description']}\n\n{context['system_prompt']}"
    else:
        description = f"PTC is disabled for you: {context['reason']}. Calls are refused until the policy allows them."
    tools_line = "Also: `tools.<tool>(...)` calls the one granted tool of that name, whatever its toolset."
    return [
        types.Tool(
            name=EXEC_CODE,
            description=f"{description}\n{tools_line}",
            input_schema={
                "type": "object",
                "properties": {
                    "code": _CODE,
                    "toolsets": {
                        "type": "array",
                        "items": {"type": "string"},
                        "description": "Toolset keys to grant; default: every PTC toolset you may use, but client toolsets.",
                    },
                    "timeout": _TIMEOUT,
                    "title": {"type": "string", "description": "A title for the job (the debug opt-in/opt-out rules read it)."},
                },
                "required": ["code"],
                "additionalProperties": False,
            },
        ),
        types.Tool(
            name=SEED_TOOL,
            description=(
                "Run Python code with tool calls and get a structured result (success, stdout, stderr, "
                f"tool_calls, tool_results, return_value, error). The same sandbox and tools as {EXEC_CODE}:\n"
                f"{description}\n{tools_line}"
            ),
            input_schema={
                "type": "object",
                "properties": {
                    "code": _CODE,
                    "filename": {"type": "string", "description": "A name for the script; reported back as file_path."},
                    "timeout": {
                        **_TIMEOUT,
                        "default": SEED_DEFAULT_TIMEOUT,
                        "description": "Seconds; default 30, or the policy's maximum if that is lower.",
                    },
                },
                "required": ["code"],
                "additionalProperties": False,
            },
        ),
        types.Tool(
            name=LIST_TOOLSETS,
            description="List the toolsets you may use in code, each with its tools' names and one-line signatures.",
            input_schema={"type": "object", "properties": {}, "additionalProperties": False},
            annotations=types.ToolAnnotations(read_only_hint=True),
        ),
        types.Tool(
            name=DESCRIBE_TOOL,
            description='Return one tool\'s full definition: its parameters, input and output schemas. Name it "toolset.tool".',
            input_schema={
                "type": "object",
                "properties": {"name": {"type": "string", "description": 'e.g. "demo.add"'}},
                "required": ["name"],
                "additionalProperties": False,
            },
            annotations=types.ToolAnnotations(read_only_hint=True),
        ),
    ]


def _mcp_keys(user: User, policy: Policy) -> list[str]:
    """The toolsets an MCP job without ``toolsets`` is granted: the user's PTC toolsets but client
    ones (their calls wait for a result no MCP client can send)."""
    return toolset_keys_for_ptc(user=user, allowlist=policy.toolset_allowlist, blocklist=policy.toolset_blocklist, client=False)


def _ptc_tools(user: User) -> list[tuple[Toolset, list[Tool]]]:
    """Those toolsets with their PTC tools, as the SDK of such a job has them."""
    policy = policy_get()
    return ptc_tools_of(toolsets_named(user=user, keys=_mcp_keys(user, policy)), frozenset(policy.direct_only_tools))


@db_read
def _toolsets(user_id: int) -> dict[str, Any]:
    return {
        "toolsets": [
            {
                "key": toolset.key,
                "name": toolset.name,
                "description": toolset.description,
                "import": f"from ptc_tools.{toolset.key} import {class_name(toolset.key)}",
                "tools": [catalog_entry(toolset, tool)["signature"] for tool in tools],
            }
            for toolset, tools in _ptc_tools(_user(user_id))
            if tools
        ]
    }


@db_read
def _describe(user_id: int, name: str) -> dict[str, Any]:
    wanted = name.strip()
    prefix, _, tool_name = wanted.rpartition(".")
    found = [
        catalog_entry(toolset, tool)
        for toolset, tools in _ptc_tools(_user(user_id))
        for tool in tools
        if tool.name == tool_name and prefix in ("", toolset.key, class_name(toolset.key))
    ]
    if len(found) == 1:
        return found[0]
    if found:
        raise ApplicationError(
            "ambiguous_tool",
            f"'{wanted}' is in several toolsets ({', '.join(t['toolset'] for t in found)}): name it as toolset.tool.",
            details={"toolsets": [t["toolset"] for t in found]},
        )
    raise ApplicationError("unknown_tool", f"There is no tool '{_named(wanted)}' you may use: list_toolsets lists them.")


def _named(name: str) -> str:
    """A name the client sent, as an error quotes it: cut past any real toolset.tool's length."""
    return name if len(name) <= 200 else f"{name[:200]}…"


@db_read
def _job_create(user_id: int, body: Mapping[str, Any]) -> Any:
    """Validate ``body`` as ``POST /api/v1/exec`` does and create the job. Return its id."""
    serializer = ExecCreateSerializer(data=body)
    if not serializer.is_valid():
        raise ApplicationError(
            "validation_error", f"Invalid input. {first_message(serializer.errors)}", details=dict(serializer.errors)
        )
    data = serializer.validated_data
    user = _user(user_id)
    toolsets = data.get("toolsets")
    if toolsets is None:
        toolsets = _mcp_keys(user, policy_get())
    job = exec_job_create(user=user, code=data["code"], toolsets=toolsets, timeout=data.get("timeout"), title=data["title"])
    return job.pk


@db_read
def _job_get(user_id: int, job_id: Any) -> dict[str, Any]:
    """The job as ``GET /api/v1/exec/{id}`` shows it, without its code."""
    data = dict(ExecJobSerializer(exec_jobs_for(user=_user(user_id)).get(pk=job_id)).data)
    data.pop("code", None)
    return data


_still_signed_in = db_read(still_signed_in)


@db_read
def _job_cancel(user_id: int, job_id: Any) -> None:
    # The caller's own job, whatever has become of the caller: a revoked key's job is cancelled too.
    job = ExecJob.objects.get(pk=job_id, user_id=user_id)
    try:
        exec_job_cancel(job=job)
    except ApplicationError:  # job_finished: it ended as the cancel came
        pass


# -- Running a job -------------------------------------------------------------------------------
def _progress_message(name: str, data: Mapping[str, Any], job_id: Any) -> str | None:
    """A line for the client's progress display of job ``job_id``, or None for events it need not see."""
    if name in ("stdout", "stderr"):
        return f"{name}: {data.get('text', '')}"
    if not name.startswith("tool_call_"):
        return None
    if name == "tool_call_pending":  # a tool_use block: the call waits on the job's caller, or an approval
        label = f"{data.get('toolset')}.{data.get('name')}"
        if data.get("awaiting") == "approval":
            return (
                f"tool call waits for an approval: {label} {data.get('id')} (POST /api/v1/tool-calls/{data.get('id')}/approval)"
            )
        return (
            f"tool call waits for its result from the client: {label} {data.get('id')} (POST /api/v1/exec/{job_id}/tool-results)"
        )
    label = f"{data.get('toolset')}.{data.get('tool')}"
    if name == "tool_call_start":
        return f"tool call started: {label} {data.get('call_id')}"
    if name == "tool_call_approved":
        return f"tool call approved: {label} {data.get('call_id')}"
    took = f" in {data['duration_ms']:.0f} ms" if data.get("duration_ms") is not None else ""
    if name == "tool_call_end":
        return f"tool call finished: {label} {data.get('call_id')}{took}"
    if name != "tool_call_error":
        return None  # an event of a later version: nothing to say of it
    error = (data.get("error") or {}).get("message", "")
    return f"tool call failed: {label} {data.get('call_id')}{took}: {error}"


# The jobs this process's requests are following now: a stdio server stopping waits until each
# one's request has been cancelled, and its job with it (execution/management/commands/ptc_mcp.py).
FOLLOWING: set[Any] = set()


async def job_run(ctx: ServerRequestContext[Any, Any], *, caller: McpUser, body: Mapping[str, Any]) -> dict[str, Any]:
    """Create a job from ``body`` (as POST /api/v1/exec takes it), follow it to its end sending its
    events as progress, and return it as GET /api/v1/exec/{id} shows it. Cancelled, it cancels the job.

    Raise ApplicationError if the job is refused (policy, validation, outage): nothing ran; or
    ``authentication_failed`` if the caller's key was revoked (or expired, or its user deactivated)
    while it ran, found at a heartbeat: the job is cancelled, and its progress goes no further.
    """
    user_id = caller.user_id
    # Its place among the user's follows (429 throttled past PTC_EVENT_STREAMS_PER_USER), taken
    # before the job is made, held until this call returns: it follows the job with a Redis
    # connection of its own, as an event stream does.
    place = follow_admit(user_id=user_id)
    # Shielded: a cancel that comes while the job is being created must not lose its id (the job
    # would run on, unseen); it is delivered at the checkpoint below, which cancels the job.
    with anyio.CancelScope(shield=True):
        job_id = await _job_create(user_id, body)
    FOLLOWING.add(job_id)
    sent = 0
    last_event_id: str | None = None
    try:
        await anyio.lowlevel.checkpoint()
        logger.info("mcp job started", extra={"job_id": str(job_id), "user_id": user_id})
        while True:
            async for event in event_stream(job_id=job_id, last_event_id=last_event_id):
                if event is None:  # a heartbeat
                    if not await _still_signed_in(user_id=user_id, key_id=caller.key_id):
                        with anyio.CancelScope(shield=True):
                            await _job_cancel(user_id, job_id)
                        logger.info("mcp job cancelled: its caller's key no longer works", extra={"job_id": str(job_id)})
                        raise ApplicationError(
                            "authentication_failed",
                            "The key this call was made with was revoked or expired, or its user deactivated, while "
                            "the job ran; the job was cancelled.",
                        )
                    continue
                last_event_id = event.id
                if event.event == "exec_end":
                    logger.info("mcp job ended", extra={"job_id": str(job_id), "status": event.data.get("status")})
                    return await _job_get(user_id, job_id)
                message = _progress_message(event.event, event.data, job_id)
                if message is not None:
                    sent += 1
                    await ctx.session.report_progress(sent, None, message)
            # The stream was cut (Redis restarted) before the end: the records may already say it.
            job = await _job_get(user_id, job_id)
            if job["status"] in ExecJob.FINISHED:
                return job
            await anyio.sleep(1)  # only after a cut stream: give Redis a moment before resuming
    except anyio.get_cancelled_exc_class():
        # The client cancelled the request: the job goes too. Shielded, or the cancel that is
        # unwinding this handler would cancel the cancel.
        with anyio.CancelScope(shield=True):
            await _job_cancel(user_id, job_id)
        logger.info("mcp job cancelled by its client", extra={"job_id": str(job_id)})
        raise
    finally:
        FOLLOWING.discard(job_id)
        del place


def seed_result(job: Mapping[str, Any], *, file_path: str | None) -> dict[str, Any]:
    """The job in the shape of the seed's ``programmatic_tool_calling`` result."""
    calls = job.get("tool_calls") or []
    refused = {"unknown_toolset", "unknown_tool", "invalid_arguments", "toolset_not_granted", "tool_not_ptc"}
    error = job.get("error")
    return {
        "success": bool(job.get("success")),
        "execution_time_seconds": job.get("execution_time_seconds"),
        "timeout_limit_seconds": job.get("timeout_limit_seconds"),
        "stdout": job.get("stdout", ""),
        "stderr": job.get("stderr", ""),
        "tool_calls": [
            {
                "tool_name": call["tool"],
                "toolset": call["toolset"],
                "args": call["input"],
                "tool_call_id": call["call_id"],
                # Parsed: the call named a tool it may use with arguments its schema accepts.
                "parsed": (call.get("error") or {}).get("code") not in refused,
                "has_error": call["status"] == "failed",
            }
            for call in calls
        ],
        "tool_results": [
            {
                "tool_call_id": call["call_id"],
                "observation": call["output"] if call["status"] == "completed" else (call.get("error") or {}).get("message"),
                "has_error": call["status"] == "failed",
            }
            for call in calls
            if call["status"] != "executing"
        ],
        "return_value": job.get("return_value"),
        "error": None if not error else (error.get("traceback") or f"{error.get('type')}: {error.get('message')}"),
        "file_path": file_path,
        "job_id": job.get("id"),
    }


def _result(value: Any, *, is_error: bool = False) -> types.CallToolResult:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return types.CallToolResult(content=[types.TextContent(text=text)], structured_content=value, is_error=is_error)


def _refused(exc: ApplicationError) -> types.CallToolResult:
    """A refusal as the tool's error result: the API's error body, so the model can read the reason."""
    return _result(error_body(exc.code, exc.message, exc.details), is_error=True)


def _refusal(exc: Exception, **log: Any) -> ApplicationError:
    """What a request that raised ``exc`` is told: its own refusal, an outage's 503, or
    ``internal_error`` (logged with ``log``). Never the exception's text: the SDK would send it
    as it is, and a driver's names the database's host and user."""
    if isinstance(exc, ApplicationError):
        return exc
    outage = outage_error(exc)
    if outage is not None:
        return outage
    logger.exception("an MCP request failed", extra=log)
    return ApplicationError("internal_error", "The server failed on this call; it is logged.")


# -- The server ----------------------------------------------------------------------------------
def _caller(ctx: ServerRequestContext[Any, Any], fixed: McpUser | None) -> McpUser:
    """The user this request runs as: fixed (stdio), or the one its HTTP layer authenticated."""
    if fixed is not None:
        return fixed
    scope = getattr(ctx.request, "scope", None) or {}
    if SCOPE_USER_ID not in scope:  # the HTTP layer authenticates every request; this is a bug
        raise MCPError(types.INTERNAL_ERROR, "The request reached the MCP server unauthenticated.")
    return McpUser(scope[SCOPE_USER_ID], bool(scope.get(SCOPE_DISCOVERY)), scope.get(SCOPE_KEY_ID))


# The arguments each tool takes; any other is refused before anything runs.
_ARGUMENTS = {
    EXEC_CODE: {"code", "toolsets", "timeout", "title"},
    SEED_TOOL: {"code", "filename", "timeout"},
    LIST_TOOLSETS: set(),
    DESCRIBE_TOOL: {"name"},
}


async def _call(ctx: ServerRequestContext[Any, Any], caller: McpUser, name: str, args: dict[str, Any]) -> types.CallToolResult:
    unknown = sorted(set(args) - _ARGUMENTS.get(name, set(args)))
    if unknown:
        raise ApplicationError(
            "validation_error",
            f"Invalid input. {name} takes no argument {', '.join(repr(a[:40]) for a in unknown[:5])}.",
            details={"unknown": [a[:40] for a in unknown[:5]]},
        )
    if name == EXEC_CODE:
        body: dict[str, Any] = {k: args[k] for k in ("code", "toolsets", "timeout", "title") if k in args}
        return _result(await job_run(ctx, caller=caller, body=body))
    if name == SEED_TOOL:
        filename = args.get("filename")
        if filename is not None and (not isinstance(filename, str) or len(filename) > 255):
            raise ApplicationError("validation_error", "Invalid input. filename: a string of at most 255 characters.")
        timeout = args.get("timeout")  # left out or null: the seed's default
        body = {
            "timeout": min(SEED_DEFAULT_TIMEOUT, await _max_timeout()) if timeout is None else timeout,
            "title": filename or "",
        }
        if "code" in args:  # left out, the serializer says it is required
            body["code"] = args["code"]
        return _result(seed_result(await job_run(ctx, caller=caller, body=body), file_path=filename))
    if name == LIST_TOOLSETS:
        return _result(await _toolsets(caller.user_id))
    if name == DESCRIBE_TOOL:
        if not isinstance(args.get("name"), str):
            raise ApplicationError("validation_error", 'Invalid input. name: a tool\'s name, like "demo.add".')
        return _result(await _describe(caller.user_id, args["name"]))
    raise MCPError(types.INVALID_PARAMS, f"Unknown tool '{_named(name)}': tools/list lists this server's tools.")


def mcp_server_build(*, user: McpUser | None = None) -> Server[Any]:
    """Return the MCP server. With ``user`` every request runs as that user (stdio); without, as the
    user the HTTP layer put in the request's scope."""

    async def on_list_tools(
        ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        caller = _caller(ctx, user)
        try:
            return types.ListToolsResult(tools=await _tool_list(caller.user_id, caller.discovery))
        except Exception as exc:  # the user was deactivated since this server started, or an outage
            refusal = _refusal(exc, method="tools/list")
            code = types.INTERNAL_ERROR if refusal.status >= 500 else types.INVALID_REQUEST
            raise MCPError(code, refusal.message, data={"code": refusal.code}) from None

    async def on_call_tool(ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams) -> types.CallToolResult:
        caller = _caller(ctx, user)
        try:
            return await _call(ctx, caller, params.name, dict(params.arguments or {}))
        except MCPError:
            raise
        except Exception as exc:
            return _refused(_refusal(exc, tool=params.name))

    return Server(
        "ptc",
        version="1",
        instructions=(
            f"Call {EXEC_CODE} (or {SEED_TOOL}) with Python that calls tools as functions; many calls in one "
            f"program, in parallel where they are independent. {LIST_TOOLSETS} and {DESCRIBE_TOOL} look tools up."
        ),
        on_list_tools=on_list_tools,
        on_call_tool=on_call_tool,
    )
