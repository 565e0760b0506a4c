"""A local fake of Anthropic's Messages API for one managed programmatic-tool-calling exchange,
speaking its wire format (POST /v1/messages, JSON), served on loopback from a thread of the test.

Turn 1: the model "writes code" in its container (a ``server_tool_use`` of ``code_execution``), and the
code calls a tool: a ``tool_use`` block with ``caller`` = that code-execution tool use, the response's
``container``, and ``stop_reason: tool_use``. Turn 2: the client sent the ``tool_result`` back with the
``container`` id; the model answers with the result in text, ``stop_reason: end_turn``. Every request
is kept in ``requests`` for the test to check.
"""

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        pass

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("request-id", f"req_{uuid.uuid4().hex[:12]}")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length))
        if self.path != "/v1/messages":
            self._send(404, {"type": "error", "error": {"type": "not_found_error", "message": self.path}})
            return
        self.server.requests.append({"headers": dict(self.headers), "body": body})
        self._send(200, self.server.reply(body))


class _Server(ThreadingHTTPServer):
    requests: list[dict[str, Any]]
    reply: Any


class FakeMessagesApi:
    """``tool`` and ``arguments``: the call the model's code makes. ``url`` is the base URL to give the SDK."""

    def __init__(self, *, tool: str, arguments: dict[str, Any]) -> None:
        self.tool, self.arguments = tool, arguments
        self.container = f"container_{uuid.uuid4().hex[:16]}"
        self.server_tool_use = f"srvtoolu_{uuid.uuid4().hex[:16]}"
        self.tool_use = f"toolu_{uuid.uuid4().hex[:16]}"
        self.server = _Server(("127.0.0.1", 0), _Handler)
        self.server.requests = []
        self.server.reply = self._reply
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def requests(self) -> list[dict[str, Any]]:
        return self.server.requests

    def __enter__(self) -> "FakeMessagesApi":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _message(self, content: list[dict[str, Any]], stop_reason: str, model: str) -> dict[str, Any]:
        return {
            "id": f"msg_{uuid.uuid4().hex[:16]}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": {"input_tokens": 100, "output_tokens": 20},
            "container": {"id": self.container, "expires_at": "2030-01-01T00:00:00Z"},
        }

    def _reply(self, body: dict[str, Any]) -> dict[str, Any]:
        version = next(t["type"] for t in body["tools"] if t.get("name") == "code_execution")
        last = body["messages"][-1]
        results = (
            [b for b in last["content"] if isinstance(b, dict) and b.get("type") == "tool_result"]
            if isinstance(last["content"], list)
            else []
        )
        if not results:
            code = f"result = await {self.tool}(**{json.dumps(self.arguments)})\nprint(result)"
            return self._message(
                [
                    {"type": "text", "text": "Let me compute that in code."},
                    {"type": "server_tool_use", "id": self.server_tool_use, "name": "code_execution", "input": {"code": code}},
                    {
                        "type": "tool_use",
                        "id": self.tool_use,
                        "name": self.tool,
                        "input": self.arguments,
                        "caller": {"type": version, "tool_id": self.server_tool_use},
                    },
                ],
                "tool_use",
                body["model"],
            )
        [result] = results
        answer = result["content"] if isinstance(result["content"], str) else json.dumps(result["content"])
        prefix = "The tool failed: " if result.get("is_error") else "The answer is "
        return self._message([{"type": "text", "text": prefix + answer}], "end_turn", body["model"])
