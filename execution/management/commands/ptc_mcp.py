"""python manage.py ptc_mcp --user NAME [--discovery]

Serves the MCP server (execution/mcp_server.py) over stdin and stdout for desktop clients
(Claude Desktop, Cursor, ...): every call runs as NAME, through the same services, workers,
records and billing as the API. Logs go to stderr; stdout carries only the protocol.
"""

import os
import signal
import sys
from typing import Any

import anyio
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from mcp.server.stdio import stdio_server

from execution.mcp_server import FOLLOWING, McpUser, mcp_server_build

# How long a stopping server waits for its requests to cancel their jobs.
STOP_SECONDS = 10


class Command(BaseCommand):
    help = "Serve PTC as an MCP server over stdio, as one user."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--user", required=True, help="The user every call runs as.")
        parser.add_argument(
            "--discovery", action="store_true", help="Describe exec_code with tool names only (look tools up with describe_tool)."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        user = get_user_model().objects.filter(username=options["user"], is_active=True).first()
        if user is None:
            raise CommandError(f"There is no active user '{options['user']}'.")
        server = mcp_server_build(user=McpUser(user.pk, options["discovery"]))

        async def serve() -> None:
            async with anyio.create_task_group() as group:

                async def stop_on_signal() -> None:
                    # How a client (or a desktop app quitting) stops a stdio server: the request
                    # being served is cancelled, and its job with it, before the process goes.
                    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                        async for _ in signals:
                            group.cancel_scope.cancel()
                            # The thread reading stdin can't be cancelled: wait for the requests
                            # to cancel their jobs, then go without it.
                            with anyio.CancelScope(shield=True), anyio.move_on_after(STOP_SECONDS):
                                await anyio.sleep(0)
                                while FOLLOWING:
                                    await anyio.sleep(0.05)
                            sys.stdout.flush()
                            os._exit(0)

                group.start_soon(stop_on_signal)
                async with stdio_server() as (read_stream, write_stream):
                    await server.run(read_stream, write_stream, server.create_initialization_options())
                group.cancel_scope.cancel()  # stdin closed: the signal watcher goes too

        anyio.run(serve)
