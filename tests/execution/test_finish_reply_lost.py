"""A tools worker's finish of a call that PostgreSQL committed, its reply lost on the way back (the
connection dropped after the commit): the worker can't tell it committed, tries again, and finds
the call closed. The call's end still reaches its job's events, once.

The deployment is its own; its tools worker reaches PostgreSQL through a proxy (``_ReplyCutter``,
a PostgresProxy) that passes everything on but the reply to one statement, the finish of a call
whose output it is told: that statement reaches PostgreSQL, which runs and commits it, and the
connection is then cut before its reply reaches the worker.
"""

import json
import random
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import Api, own_deployment
from tests.servers import PostgresProxy, api_key
from tests.stack import Stack

# PostgreSQL's ReadyForQuery, idle: the server sends it once the statement is done, its
# transaction committed (an implicit one: the finish runs in autocommit).
READY = b"Z\x00\x00\x00\x05I"


class _ReplyCutter(PostgresProxy):
    """A PostgresProxy that, once armed with a marker, passes on the first statement whose bytes hold
    it and the finish's own key (``"settles"``: the claim's bytes hold the call's input, never that
    key); its reply is held until the server says it is done, then dropped, and that connection cut
    at both ends."""

    def __init__(self, upstream: str) -> None:
        self.marker = b""
        self.cuts = 0  # how many replies were cut
        self.marking = threading.Lock()
        super().__init__(upstream)

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        armed = threading.Event()  # this connection's next reply is cut
        threading.Thread(target=self._to_server, args=(client, server, armed), daemon=True).start()
        threading.Thread(target=self._to_client, args=(server, client, armed), daemon=True).start()

    def _to_server(self, client: socket.socket, server: socket.socket, armed: threading.Event) -> None:
        seen = b""
        try:
            while chunk := client.recv(65536):
                seen = (seen + chunk)[-(1 << 16) :]
                with self.marking:
                    if self.marker and self.marker in seen and b'"settles"' in seen:
                        self.marker, seen = b"", b""
                        armed.set()
                server.sendall(chunk)
        except OSError:
            pass

    def _to_client(self, server: socket.socket, client: socket.socket, armed: threading.Event) -> None:
        held = b""
        try:
            while chunk := server.recv(65536):
                if not armed.is_set():
                    client.sendall(chunk)
                    continue
                held += chunk
                if READY in held:  # committed: the reply is lost with the connection
                    self.cuts += 1
                    for sock in (client, server):
                        sock.shutdown(socket.SHUT_RDWR)
                        sock.close()
                    return
        except OSError:
            pass


@pytest.fixture(scope="module")
def cutting(stack_env: dict[str, str]) -> Iterator[tuple[Stack, _ReplyCutter]]:
    """A deployment whose tools worker reaches PostgreSQL through a ``_ReplyCutter``."""
    with own_deployment(stack_env, "reply-lost") as stack:
        proxy = _ReplyCutter(stack.env["DATABASE_URL"])
        try:
            stack.tools_worker.stop()
            stack.tools_worker.env = {**stack.env, "DATABASE_URL": proxy.url(stack.env["DATABASE_URL"])}
            stack.tools_worker.start()
            yield stack, proxy
        finally:
            stack.tools_worker.stop()
            proxy.stop()


def _events(api: Api, job_id: str) -> list[tuple[str, dict[str, Any]]]:
    """The job's events, as its event stream sends them from the start to its end."""
    events: list[tuple[str, dict[str, Any]]] = []
    name = ""
    with api.http.stream("GET", f"/api/v1/exec/{job_id}/events", timeout=30) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
    return events


def test_a_calls_end_whose_finish_committed_and_whose_reply_was_lost_is_in_its_jobs_events_once(
    cutting: tuple[Stack, _ReplyCutter],
) -> None:
    """The finish of a job's call commits, and its reply is lost: the worker tries it again, finds
    the call closed, and pushes its result to the code, and the job goes on and ends. The call's
    ``tool_call_end`` is in the job's events, once. Before, the retry pushed the result only: the
    end was never appended, and the stream (and the timeline it feeds) had the call start and the
    job end, never the call's end."""
    stack, proxy = cutting
    username = f"lost-reply-{uuid.uuid4().hex[:8]}"
    api = Api(stack.base_url, api_key(stack.env, username, credits=100), username)
    ms = random.randrange(100, 1000)  # the finish's bytes hold its output: {"slept_ms": ms}
    proxy.marker = f'"slept_ms": {ms}'.encode()
    code = f"from ptc_tools.demo import Demo\nDemo.sleep(ms={ms})"
    job = api.run(code, toolsets=["demo"])
    assert (job["status"], job["return_value"]) == ("completed", {"slept_ms": ms}), (job["error"], job["stderr"][-2000:])
    assert proxy.cuts == 1, "the finish's reply was not cut: nothing was tested"
    (call,) = job["tool_calls"]
    assert (call["status"], call["output"], call["credits"]) == ("completed", {"slept_ms": ms}, 1)
    events = _events(api, job["id"])
    ends = [name for name, data in events if data.get("call_id") == call["call_id"] and name != "tool_call_start"]
    assert ends == ["tool_call_end"], [name for name, _ in events]
    assert events[-1][0] == "exec_end"
    assert api.get("/api/v1/billing/balance").json()["balance"] == 99  # charged once
