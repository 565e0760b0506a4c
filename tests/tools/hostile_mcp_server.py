"""MCP servers that answer, but not as a client would hope: ``deep`` lists one tool, ``nested``,
whose every call answers a text of JSON nested 5,000 deep; ``pages`` lists its tools a page at a
time, each page empty and naming the same next page; ``redos`` lists ``spell``, whose output schema's
pattern backtracks (``^(a+)+$``), and ``plain``, and answers ``spell`` with a string that takes
Python's ``re`` days to refuse; ``long`` lists ``huge``, whose call answers a line of 24 MiB (a
text of ``x``), and ``plain``, answered as ``redos`` does; ``long_list`` answers ``tools/list``
with a line of 24 MiB; ``heavy`` lists 24 tools a page at a time, each with a description of 1 MiB.
python hostile_mcp_server.py MODE [--marker=ANYTHING]"""

import json
import sys

mode = sys.argv[1]
SCHEMA = {"type": "object", "properties": {}}
LONG = "x" * (24 << 20)
SPELLED = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}}}


def answer(message: dict, result: dict) -> None:
    print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}), flush=True)


for line in sys.stdin:
    message = json.loads(line)
    if "id" not in message or "method" not in message:  # a notification, or an answer to the server
        continue
    if message["method"] == "initialize":
        info = {"name": f"hostile-{mode}", "version": "1"}
        version = message["params"]["protocolVersion"]
        answer(message, {"protocolVersion": version, "capabilities": {"tools": {}}, "serverInfo": info})
    elif message["method"] == "tools/list":
        if mode == "heavy":
            page = int((message.get("params") or {}).get("cursor") or 0)
            tool = {"name": f"t{page}", "description": "x" * (1 << 20), "inputSchema": SCHEMA}
            answer(message, {"tools": [tool], **({"nextCursor": str(page + 1)} if page < 23 else {})})
        elif mode == "long_list":
            answer(message, {"tools": [{"name": LONG, "inputSchema": SCHEMA}]})
        elif mode == "long":
            answer(message, {"tools": [{"name": name, "inputSchema": SCHEMA} for name in ("huge", "plain")]})
        elif mode == "pages":
            answer(message, {"tools": [], "nextCursor": "the-same-page"})
        elif mode == "redos":
            tools = [{"name": "spell", "inputSchema": SCHEMA, "outputSchema": SPELLED}, {"name": "plain", "inputSchema": SCHEMA}]
            answer(message, {"tools": tools})
        else:
            answer(message, {"tools": [{"name": "nested", "inputSchema": SCHEMA}]})
    elif message["method"] == "tools/call" and mode in ("redos", "long"):
        if message["params"]["name"] == "huge":
            answer(message, {"content": [{"type": "text", "text": LONG}]})
        elif message["params"]["name"] == "spell":
            answer(message, {"content": [], "structuredContent": {"s": "a" * 40 + "!"}})
        else:
            answer(message, {"content": [{"type": "text", "text": "plain"}]})
    elif message["method"] == "tools/call":
        answer(message, {"content": [{"type": "text", "text": "[" * 5000 + "]" * 5000}]})
    else:
        answer(message, {})
