"""MCP servers that fail: ``exit`` dies at once, ``hang`` never answers initialize, ``garbage`` answers
with HTML. python bad_mcp_server.py MODE [--marker=ANYTHING]"""

import sys
import time

mode = sys.argv[1]
if mode == "exit":
    print("fatal: cannot start without a license file", file=sys.stderr)
    sys.exit(3)
if mode == "hang":
    for _ in sys.stdin:
        pass
    time.sleep(3600)
if mode == "garbage":
    for _ in sys.stdin:
        print("<html><body>502 Bad Gateway</body></html>", flush=True)
