"""The MCP server over streamable HTTP at ``/mcp``, beside Django in one ASGI application.

``with_mcp(django_app)`` returns a small ASGI router: ``/mcp`` goes to the SDK's
``StreamableHTTPSessionManager`` behind our API-key check, everything else to Django untouched.
The router also speaks the ASGI lifespan protocol, which Django's handler does not: the session
manager's ``run()`` context (its task group) is entered at start-up and left at shutdown, so
``uvicorn ptcproject.asgi:application`` is still all it takes.

Auth: ``Authorization: Bearer <user API key>``. No key, or an unknown, expired or revoked one, is
401 in the API's error shape; a job-scoped key is 403, as everywhere but POST /api/v1/tools/execute.
A stateful MCP session is bound to the key that opened it: another key gets the SDK's 404.
"""

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from django.conf import settings
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

from execution.events import db_read
from execution.mcp_server import SCOPE_DISCOVERY, SCOPE_KEY_ID, SCOPE_USER_ID, mcp_server_build
from ptcproject.accounts.authentication import KEY_REFUSED
from ptcproject.accounts.models import ApiKey
from ptcproject.accounts.services import api_key_authenticate
from ptcproject.api import outage_error
from ptcproject.errors import ApplicationError, error_body

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
# Django's handler types its scope as a dict: any ASGI callable will do.
Asgi = Callable[..., Awaitable[None]]

MCP_PATH = "/mcp"


@db_read
def _key(plaintext: str) -> ApiKey | None:
    return api_key_authenticate(plaintext=plaintext)


async def _answer(send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = json.dumps(body).encode()
    start_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()), *(headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": start_headers})
    await send({"type": "http.response.body", "body": payload})


async def _refuse(send: Send, exc: ApplicationError) -> None:
    headers = [(b"www-authenticate", b'Bearer realm="ptc"')] if exc.status == 401 else []
    if exc.status in (429, 503):
        headers.append((b"retry-after", b"5"))
    await _answer(send, exc.status, error_body(exc.code, exc.message, exc.details), headers)


async def _authenticate(scope: Scope) -> ApiKey:
    """Return the user key the request carries. Raise ApplicationError (401, 403, 503) otherwise."""
    header = _header(scope, b"authorization")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApplicationError("not_authenticated", "Send Authorization: Bearer <api key> (a key from create_api_key).")
    try:
        key = await _key(token.strip())
    except Exception as exc:
        outage = outage_error(exc)
        if outage is None:
            raise
        raise outage from exc
    if key is None:
        raise ApplicationError("authentication_failed", KEY_REFUSED)
    if key.exec_job_id is not None:
        raise ApplicationError("permission_denied", "A job-scoped key can only call POST /api/v1/tools/execute, not MCP.")
    return key


class McpHttp:
    """``/mcp``: the API-key check, then the SDK's session manager."""

    def __init__(self) -> None:
        # No DNS-rebinding allowlist: every request must carry an API key, which a page a browser
        # was tricked into loading does not have.
        self.manager = StreamableHTTPSessionManager(
            app=mcp_server_build(),
            # The REST API's body limit: the SDK's own (4 MiB) let one request hold ~100 MB of parsed
            # JSON in this process for as long as its job ran.
            max_request_body_size=settings.DATA_UPLOAD_MAX_MEMORY_SIZE,
            session_idle_timeout=settings.PTC_MCP_SESSION_IDLE_SECONDS,
        )
        self.running = False  # the lifespan entered the manager's run(); False with --lifespan off
        # Which user opened each session: the SDK caps sessions per process only, so one user
        # could otherwise take every slot.
        self.owners: dict[str, int] = {}
        # Requests that may open a session, by user, until their response names it (or they end):
        # counted with the open ones, or a burst of them all passed the check before any opened.
        self.opening: dict[int, int] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.running:
            message = "The MCP server needs the ASGI lifespan, which this server was started without (uvicorn --lifespan off)."
            await _refuse(send, ApplicationError("not_ready", message))
            return
        try:
            key = await _authenticate(scope)
        except ApplicationError as exc:
            await _refuse(send, exc)
            return
        query = scope.get("query_string", b"").decode("latin-1")
        scope = {
            **scope,
            SCOPE_USER_ID: key.user_id,
            SCOPE_KEY_ID: key.pk,  # checked again while a job it started runs
            SCOPE_DISCOVERY: "discovery=1" in query.split("&") or "discovery=true" in query.split("&"),
            # The SDK binds a stateful session to the principal that opened it: here, the key.
            "user": AuthenticatedUser(
                AccessToken(token=key.prefix, client_id=f"key-{key.pk}", scopes=[], subject=str(key.user_id))
            ),
        }
        opening = not _header(scope, b"mcp-session-id")  # a request that opens a session
        if opening:
            opened = self._sessions_of(key.user_id) + self.opening.get(key.user_id, 0)
            if opened >= settings.PTC_MCP_SESSIONS_PER_USER:
                message = (
                    f"You have {opened} MCP sessions open or opening, the most one user may "
                    f"(PTC_MCP_SESSIONS_PER_USER); close one (DELETE /mcp) or wait for one to go idle."
                )
                await _refuse(send, ApplicationError("throttled", message, status=429))
                return
            # Taken with the check, no await between: this process's requests run on one loop.
            self.opening[key.user_id] = self.opening.get(key.user_id, 0) + 1
            send, settled = self._owned_by(key.user_id, send)
        try:
            await self._handle(scope, receive, send)
        finally:
            if opening:
                settled()

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("method") == "POST":
            # Read the body here, held to the API's limit: a client that goes away mid-body is let
            # go quietly (the SDK would log it as an error, with a traceback, every time).
            body = await _body(receive, limit=settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
            if body is None:
                return
            if len(body) > settings.DATA_UPLOAD_MAX_MEMORY_SIZE:
                limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
                await _refuse(send, ApplicationError("code_too_large", f"The body is over {limit} bytes.", status=413))
                return
            receive = _replayed(body, receive)
        await self.manager.handle_request(scope, receive, send)

    def _sessions_of(self, user_id: int) -> int:
        """How many open sessions ``user_id`` opened (sessions the SDK has closed are forgotten)."""
        open_now = self.manager._server_instances  # the SDK's live sessions; tests/execution/test_mcp_server.py checks it is used
        for session_id in [s for s in self.owners if s not in open_now]:
            del self.owners[session_id]
        return sum(1 for owner in self.owners.values() if owner == user_id)

    def _owned_by(self, user_id: int, send: Send) -> tuple[Send, Callable[[], None]]:
        """Wrap ``send`` to note the user of the session its response opens; return it and what
        gives back the request's place among those opening (once: at its response's start, or at
        its end if none started)."""
        done = False

        def settled() -> None:
            nonlocal done
            if not done:
                done = True
                left = self.opening[user_id] - 1
                if left:
                    self.opening[user_id] = left
                else:
                    del self.opening[user_id]

        async def sending(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                for name, value in message.get("headers", []):
                    if name.lower() == b"mcp-session-id":
                        self.owners[value.decode("latin-1")] = user_id
                settled()
            await send(message)

        return sending, settled


async def _body(receive: Receive, *, limit: int) -> bytes | None:
    """The request's body, read until its end or past ``limit``; None if the client went away."""
    chunks = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks += message.get("body", b"")
        if not message.get("more_body") or len(chunks) > limit:
            return bytes(chunks)


def _replayed(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` once, then what the client sends next (its disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> MutableMapping[str, Any]:
        return pending.pop() if pending else await receive()

    return replay


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key == name:
            return str(value.decode("latin-1"))
    return ""


class Router:
    """The ASGI application: ``/mcp`` to the MCP server, the rest to Django, and the lifespan."""

    def __init__(self, django: Asgi, mcp: McpHttp) -> None:
        self.django = django
        self.mcp = mcp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http" and scope["path"].rstrip("/") == MCP_PATH:
            await self.mcp(scope, receive, send)
        else:
            await self.django(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """Hold the session manager's run() context from start-up to shutdown (the ASGI lifespan protocol)."""
        await receive()  # lifespan.startup
        try:
            async with self.mcp.manager.run():
                self.mcp.running = True
                await send({"type": "lifespan.startup.complete"})
                await receive()  # lifespan.shutdown
                self.mcp.running = False
        except Exception as exc:
            await send({"type": "lifespan.startup.failed", "message": f"the MCP session manager failed: {exc}"})
            raise
        await send({"type": "lifespan.shutdown.complete"})


def with_mcp(django: Asgi) -> Router:
    """Return the ASGI application serving ``django`` and, at /mcp, the MCP server."""
    return Router(django, McpHttp())
