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

from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

from execution.events import db_read
from execution.mcp_server import SCOPE_DISCOVERY, SCOPE_USER_ID, mcp_server_build
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
    if exc.status == 503:
        headers.append((b"retry-after", b"5"))
    await _answer(send, exc.status, error_body(exc.code, exc.message, exc.details), headers)


async def _authenticate(scope: Scope) -> ApiKey:
    """Return the user key the request carries. Raise ApplicationError (401, 403, 503) otherwise."""
    header = ""
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            header = value.decode("latin-1")
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
        raise ApplicationError("authentication_failed", "The API key is unknown, expired or revoked.")
    if key.exec_job_id is not None:
        raise ApplicationError("permission_denied", "A job-scoped key can only call POST /api/v1/tools/execute, not MCP.")
    return key


class McpHttp:
    """``/mcp``: the API-key check, then the SDK's session manager."""

    def __init__(self) -> None:
        # No DNS-rebinding allowlist: every request must carry an API key, which a page a browser
        # was tricked into loading does not have.
        self.manager = StreamableHTTPSessionManager(app=mcp_server_build())
        self.running = False  # the lifespan entered the manager's run(); False with --lifespan off

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
            SCOPE_DISCOVERY: "discovery=1" in query.split("&") or "discovery=true" in query.split("&"),
            # The SDK binds a stateful session to the principal that opened it: here, the key.
            "user": AuthenticatedUser(
                AccessToken(token=key.prefix, client_id=f"key-{key.pk}", scopes=[], subject=str(key.user_id))
            ),
        }
        await self.manager.handle_request(scope, receive, send)


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
