"""A small HTTP API for the http-kind tests, served from a thread of the test process.

The tools worker (another process) calls it on 127.0.0.1. It answers JSON, a 500 whose body echoes
the request's ``X-Key`` header (a secret, which must come back redacted), HTML, or nothing in time;
and hostile answers: the secret in the status line, a body over the output limit, JSON nested
5,000 deep, a secret of digits echoed as a number, an error page that echoes the secret past where its excerpt is cut, headers or a body sent a byte at a time (each drip's end is in ``drips``).
"""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        pass

    def _send(self, status: int, body: str, content_type: str = "application/json") -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self) -> None:
        url = urlsplit(self.path)
        query = {k: v if len(v) > 1 else v[0] for k, v in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        key = self.headers.get("X-Key", "")
        parts = [unquote(part) for part in url.path.strip("/").split("/")]
        if parts[0] == "forecast" and len(parts) == 2:
            self._send(200, json.dumps({"city": parts[1], "query": query, "authorized": key == self.server.expected_key}))  # type: ignore[attr-defined]
        elif parts[0] == "items":
            self._send(201, json.dumps({"method": self.command, "path": url.path, "query": query, "body": body}))
        elif parts[0] == "whoami":
            self._send(200, json.dumps({"you_sent": key}))
        elif parts[0] == "account":  # a secret of digits echoed back as a JSON number
            self._send(200, json.dumps({"account": int(key), "balance": 12.5}))
        elif parts[0] == "explode":
            self._send(500, f"Internal error: upstream refused key {key} for this request")
        elif parts[0] == "html":
            self._send(200, "<html><head><title>Login</title></head><body>Please sign in</body></html>", "text/html")
        elif parts[0] == "slow":
            time.sleep(float(query.get("seconds", 5)))
            self._send(200, "{}")
        elif parts[0] == "empty":
            self._send(204, "")
        elif parts[0] == "reason":  # the status line itself echoes the secret header
            self.send_response(500, f"Bad key {key}")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif parts[0] == "huge":  # a JSON string of ``bytes`` bytes, sent in pieces
            size = int(query.get("bytes", 0))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(size))
            self.end_headers()
            self.wfile.write(b'"')
            for start in range(1, size - 1, 1 << 16):
                self.wfile.write(b"x" * min(1 << 16, size - 1 - start))
            self.wfile.write(b'"')
        elif parts[0] == "moved":  # a redirect whose Location carries the secret header
            self.send_response(302)
            self.send_header("Location", f"https://elsewhere.example/v2/?key={key}")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif parts[0] == "padded":  # a 401 that echoes the secret header after ``pad`` spaces
            self._send(401, "Unauthorized." + " " * int(query.get("pad", 0)) + f"key={key}", "text/plain")
        elif parts[0] == "drip":  # a byte every 0.3 s, of the headers or of a 1 MiB body, for at most ``cap`` s
            self._drip(query.get("part", "body"), float(query.get("cap", 20)))
        elif parts[0] == "deep":
            self._send(200, "[" * 5000 + "]" * 5000)
        else:
            self._send(404, json.dumps({"error": "no such route"}))

    def _drip(self, part: str, cap: float) -> None:
        started = time.monotonic()
        how = "server cap"
        try:
            self.send_response(200)
            if part == "body":
                self.send_header("Content-Length", str(1 << 20))
                self.end_headers()
            else:
                self.flush_headers()  # the status line and the first headers, then one never ended
            self.wfile.write(b"X-Slow: " if part == "headers" else b'"')
            self.wfile.flush()
            while time.monotonic() - started < cap:
                time.sleep(0.3)
                self.wfile.write(b"x")
                self.wfile.flush()
        except OSError:
            how = "client closed"
        self.server.drips.append({"part": part, "how": how, "seconds": time.monotonic() - started})  # type: ignore[attr-defined]
        self.close_connection = True

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _route


class HttpApi:
    def __init__(self, expected_key: str) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.expected_key = expected_key  # type: ignore[attr-defined]
        self.server.drips = []  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def drips(self) -> list[dict[str, Any]]:
        """How each drip ended ("client closed" or "server cap"), its part and its seconds, in order."""
        return self.server.drips  # type: ignore[attr-defined]

    def __enter__(self) -> "HttpApi":
        self.thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
