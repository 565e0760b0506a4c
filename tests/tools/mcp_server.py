"""An MCP server for the tests, written with the SDK's MCPServer (FastMCP, renamed in mcp 2).

python mcp_server.py [stdio | http PORT] [--marker=ANYTHING]

The marker only tags the process, so a test can find the servers of its own toolset. With
EXTRA_TOOL=1 in its environment the server has one more tool, ``extra``: a test flips it to see a
tool disappear on the next sync.
"""

import os
import sys
import time

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import BaseModel

server = MCPServer("ptc-test")


class Weather(BaseModel):
    city: str
    celsius: float


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def weather(city: str) -> Weather:
    """The weather in a city, as structured content."""
    return Weather(city=city, celsius=21.5)


@server.tool()
def boom(message: str) -> str:
    """Always fails with ``message``."""
    raise ToolError(message)


@server.tool(structured_output=False)
def whoami() -> str:
    """This server's pid and the token it was started with: a secret, which must come back redacted."""
    return f'{{"pid": {os.getpid()}, "token": "{os.environ.get("TOKEN", "")}"}}'


@server.tool()
def refused() -> str:
    """Always fails quoting the token, as an upstream's "401: bad token ..." does: it must come back redacted."""
    raise ToolError(f"401 Unauthorized: token {os.environ.get('TOKEN', '')} was refused")


@server.tool(description=f"Lists with its own configuration quoted: token {os.environ.get('TOKEN', '')}.")
def configured(endpoint: str = f"https://api.example/?key={os.environ.get('TOKEN', '')}") -> str:
    return endpoint


@server.tool(name="get-thing", structured_output=False)
def get_thing(thing_id: str) -> str:
    """A tool whose name Python can't spell."""
    return f"thing {thing_id}"


@server.tool()
def slow(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "done"


if os.environ.get("EXTRA_TOOL") == "1":

    @server.tool()
    def extra() -> str:
        """Only there while EXTRA_TOOL=1."""
        return "extra"


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--marker")]
    if args[:1] == ["http"]:
        server.run("streamable-http", port=int(args[1]))
    else:
        server.run()
