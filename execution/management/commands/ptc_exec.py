"""python manage.py ptc_exec FILE.py --user NAME [--toolsets a,b] [--timeout N]

Submits a job and follows its events: each tool call as a live line (a spinner, then ✓ or ✗ with
its duration), stdout as it arrives, and a summary with the admin URL of its timeline. The exit
code is 0 only if the job completed. With no TTY it prints plain lines.
"""

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from rich.console import Console, Group
from rich.live import Live
from rich.spinner import Spinner
from rich.text import Text

from execution.events import Event, event_stream
from execution.services.jobs import exec_job_create
from ptcproject.errors import ApplicationError


def _call_label(data: dict[str, Any]) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in (data.get("input") or {}).items())
    if len(args) > 60:
        args = args[:57] + "..."
    return f"{data['toolset']}.{data['tool']}({args})"


class Progress:
    """What the terminal shows: calls in flight with spinners above, finished lines printed once."""

    def __init__(self, console: Console, live: bool) -> None:
        self.console = console
        self.live = live
        self.running: dict[str, dict[str, Any]] = {}
        self.saw_output = False

    def render(self) -> Group:
        return Group(*(Spinner("dots", text=Text(_call_label(d), style="cyan")) for d in self.running.values()))

    def on_event(self, event: Event) -> None:
        data = event.data
        if event.event in ("stdout", "stderr"):
            self.saw_output = True
            style = "" if event.event == "stdout" else "red"
            self.console.print(Text(data["text"].rstrip("\n"), style=style), highlight=False)
        elif event.event == "tool_call_start":
            self.running[data["call_id"]] = data
            if not self.live:
                self.console.print(f"… {_call_label(data)}", highlight=False)
        elif event.event in ("tool_call_end", "tool_call_error"):
            self.running.pop(data["call_id"], None)
            ms = f"{data['duration_ms']:.0f} ms" if data.get("duration_ms") is not None else ""
            if event.event == "tool_call_end":
                self.console.print(Text.assemble(("✓ ", "green"), _call_label(data), (f"  {ms}", "dim")), highlight=False)
            else:
                error = (data.get("error") or {}).get("message", "")
                line = Text.assemble(("✗ ", "red"), _call_label(data), (f"  {ms}", "dim"), (f"  {error}", "red"))
                self.console.print(line, highlight=False)


class Command(BaseCommand):
    help = "Run a Python file as a PTC job and follow its tool calls live."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", help="The Python file to run.")
        parser.add_argument("--user", required=True, help="The user the job runs as.")
        parser.add_argument("--toolsets", default=None, help="Comma-separated toolset keys (default: all the user may use).")
        parser.add_argument("--timeout", type=float, default=None, help="Seconds (default: the policy's).")
        parser.add_argument("--title", default="", help="The node title (feeds the debug opt-in/opt-out rules).")

    def handle(self, *args: Any, **options: Any) -> None:
        path = Path(options["file"])
        if not path.is_file():
            raise CommandError(f"{path} is not a file.")
        user = get_user_model().objects.filter(username=options["user"]).first()
        if user is None:
            raise CommandError(f"There is no user '{options['user']}'.")
        toolsets = [t.strip() for t in options["toolsets"].split(",") if t.strip()] if options["toolsets"] else None
        started = time.monotonic()
        try:
            job = exec_job_create(
                user=user, code=path.read_text(), toolsets=toolsets, timeout=options["timeout"], title=options["title"]
            )
        except ApplicationError as exc:
            raise CommandError(f"{exc.code}: {exc.message}") from exc
        # OutputWrapper._out is the stream it wraps; django-stubs lacks it, so its __getattr__ calls it a callable.
        console = Console(file=self.stdout._out, highlight=False, soft_wrap=True)  # type: ignore[arg-type]
        interactive = console.is_terminal
        console.print(f"job {job.call_id} submitted")
        progress = Progress(console, live=interactive)
        final = asyncio.run(self._follow(job.pk, progress, interactive))
        if not progress.saw_output:  # no live chunks (the embedded setup): the final output, once
            for stream, style in (("stdout", ""), ("stderr", "red")):
                if final.get(stream):
                    console.print(Text(final[stream].rstrip("\n"), style=style), highlight=False)
        self._summary(console, job, final, time.monotonic() - started)
        if final.get("status") != "completed":
            sys.exit(1)

    async def _follow(self, job_id: Any, progress: Progress, interactive: bool) -> dict[str, Any]:
        final: dict[str, Any] = {}
        live = Live(progress.render(), console=progress.console, refresh_per_second=12, transient=True) if interactive else None
        if live:
            live.start()
        try:
            async for event in event_stream(job_id=job_id):
                if event is None:
                    continue
                if event.event == "exec_end":
                    final = event.data
                    break
                progress.on_event(event)
                if live:
                    live.update(progress.render())
        finally:
            if live:
                live.stop()
        return final

    def _summary(self, console: Console, job: Any, final: dict[str, Any], seconds: float) -> None:
        status = final.get("status", "unknown")
        colour = "green" if status == "completed" else "red"
        calls = final.get("tool_calls") or []
        failed = sum(1 for c in calls if c.get("status") == "failed")
        console.print(
            Text.assemble(
                ("status ", "bold"),
                (status, f"bold {colour}"),
                f"   calls {len(calls)}" + (f" ({failed} failed)" if failed else ""),
                f"   credits {final.get('credits_charged', 0)}",
                f"   wall {seconds:.2f} s",
            )
        )
        if final.get("error"):
            console.print(Text(f"{final['error'].get('type')}: {final['error'].get('message')}", style="red"))
        if final.get("return_value") is not None:
            console.print(f"return value: {final['return_value']!r}")
        console.print(f"timeline: {settings.PTC_PUBLIC_URL.rstrip('/')}/admin/execution/execjob/{job.pk}/change/")
