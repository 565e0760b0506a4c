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
if mode == "stdout_token":
    for line in sys.stdin:
        message = json.loads(line)
        if message.get("method") == "initialize":
            print(f"debug: token={os.environ['TOKEN']}", flush=True)
            info = {"name": "stdout-token", "version": "1"}
            answer = {"protocolVersion": message["params"]["protocolVersion"], "capabilities": {"tools": {}}, "serverInfo": info}
            print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": answer}), flush=True)
if mode == "odd_list":
    schema = {"type": "object", "properties": {}}
    tools = [
        {"name": "whoami", "inputSchema": schema},
        {"name": "a" * 200, "inputSchema": schema},  # a Python name is cut to fit; the server's is kept
        {"name": "n" * 300, "inputSchema": schema},
        {"name": "nul_desc", "description": "a\u0000b", "inputSchema": schema},
        {"name": "nul_schema", "inputSchema": {"type": "object", "properties": {"q": {"description": "\u0000"}}}},
        {"name": "", "inputSchema": schema},  # no name to call it by
        {"name": "whoami", "description": "listed again", "inputSchema": schema},
    ]
    for line in sys.stdin:
        message = json.loads(line)
        if "id" not in message:
            continue
        if message["method"] == "initialize":
            info = {"name": "odd-list", "version": "1"}
            answer = {"protocolVersion": message["params"]["protocolVersion"], "capabilities": {"tools": {}}, "serverInfo": info}
        else:
            answer = {"tools": tools}
        print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": answer}), flush=True)
if mode == "rpc_error":
    for line in sys.stdin:
        message = json.loads(line)
        if "id" not in message:
            continue
        if message["method"] == "initialize":
            info = {"name": "rpc-error", "version": "1"}
            answer = {"protocolVersion": message["params"]["protocolVersion"], "capabilities": {"tools": {}}, "serverInfo": info}
            print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": answer}), flush=True)
        else:
            error = {"code": -32000, "message": "quota exceeded " + "x" * 100_000}
            print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "error": error}), flush=True)
