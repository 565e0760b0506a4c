"""MCP servers that fail: ``exit`` dies at once, ``exit_token`` too, after printing its TOKEN on stderr
where a 4,000-character tail would cut it, ``hang`` never answers initialize, ``garbage`` answers
with HTML, ``stdout_token`` prints its TOKEN on stdout before it answers initialize (a debug line,
as servers that log to stdout print), ``odd_list`` lists tools the database can't hold as they
are beside ones it can, ``rpc_error`` starts and answers every call with a JSON-RPC server error (-32000) whose
message is 100 KB. python bad_mcp_server.py MODE [--marker=ANYTHING]"""

import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

mode = sys.argv[1]
if mode == "exit":
    print("fatal: cannot start without a license file", file=sys.stderr)
    sys.exit(3)
if mode == "exit_token":
    print(f"fatal: the upstream refused token {os.environ['TOKEN']}" + "\n" * 3990, file=sys.stderr)
    sys.exit(3)
if mode == "hang":
    for _ in sys.stdin:
        pass
    time.sleep(3600)
if mode == "garbage":
    for _ in sys.stdin:
        print("<html><body>502 Bad Gateway</body></html>", flush=True)


def requests() -> Iterator[dict[str, Any]]:
    """The client's requests (notifications left out), each answered by ``answer``."""
    for line in sys.stdin:
        message = json.loads(line)
        if "id" in message:
            yield message


def answer(message: dict[str, Any], **reply: Any) -> None:
    """Answer ``message`` with ``result=`` or ``error=``; an initialize, by name, with ``started=``."""
    if "started" in reply:
        info = {"name": reply.pop("started"), "version": "1"}
        reply["result"] = {
            "protocolVersion": message["params"]["protocolVersion"],
            "capabilities": {"tools": {}},
            "serverInfo": info,
        }
    print(json.dumps({"jsonrpc": "2.0", "id": message["id"], **reply}), flush=True)


if mode == "stdout_token":
    for message in requests():
        if message["method"] == "initialize":
            print(f"debug: token={os.environ['TOKEN']}", flush=True)
            answer(message, started="stdout-token")
if mode == "odd_list":
    NESTED = "^(?:(?:a{100}){100}){100}$"
    schema = {"type": "object", "properties": {}}
    tools = [
        {"name": "whoami", "inputSchema": schema},
        {"name": "a" * 200, "inputSchema": schema},  # a Python name is cut to fit; the server's is kept
        {"name": "n" * 300, "inputSchema": schema},
        {"name": "nul_desc", "description": "a\u0000b", "inputSchema": schema},
        {"name": "nul_schema", "inputSchema": {"type": "object", "properties": {"q": {"description": "\u0000"}}}},
        {"name": "", "inputSchema": schema},  # no name to call it by
        {"name": "whoami", "description": "listed again", "inputSchema": schema},
        {"name": f"leak_{os.environ.get('TOKEN', '')}", "inputSchema": schema},  # a name that holds its secret
        # A pattern whose nested repeats no call could be checked against, in each schema.
        {"name": "huge_in", "inputSchema": {"type": "object", "properties": {"s": {"pattern": NESTED}}}},
        {"name": "huge_out", "inputSchema": schema, "outputSchema": {"type": "object", "patternProperties": {NESTED: {}}}},
    ]
    for message in requests():
        if message["method"] == "initialize":
            answer(message, started="odd-list")
        else:
            answer(message, result={"tools": tools})
if mode == "rpc_error":
    for message in requests():
        if message["method"] == "initialize":
            answer(message, started="rpc-error")
        else:
            answer(message, error={"code": -32000, "message": "quota exceeded " + "x" * 100_000})
