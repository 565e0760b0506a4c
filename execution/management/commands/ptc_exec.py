"""python manage.py ptc_exec FILE.py --user NAME [--toolsets a,b] [--timeout N] [--client-tools MODULE]

Submits a job and follows its events: each tool call as a live line (a spinner, then ✓ or ✗ with
its duration), stdout as it arrives, and a summary with the admin URL of its timeline. The exit
code is 0 only if the job completed. With no TTY it prints plain lines. Stopped before the job's end
(Ctrl-C, SIGTERM), it cancels the job.

A call that waits on the client or an approval shows as a line "⏸ waiting for ...". With
``--client-tools MODULE`` (a module name or a .py file), the module's public functions are the job's
client tools (``from ptc_tools.client import Client``; or its ``CLIENT_TOOLS`` list of definitions,
if it has one): each call runs the function of that name with the call's input, here, and its return
value is posted as the result; an exception is posted as an error (``is_error``). With
``--approvals approve`` (or ``deny``), calls that wait for an approval are decided at once as the
job's user; by default (``wait``) they wait for someone to decide them (the API or the timeline).
"""

import asyncio
import importlib
import importlib.util
import inspect
import logging
import signal
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from rich.console import Console, Group
from rich.live import Live
from rich.spinner import Spinner
from rich.text import Text

from execution.events import Event, event_stream, job_view
from execution.models import ExecJob, ToolCall
from execution.sandbox.output import LIVE_CUT, tail_of
from execution.selectors import exec_job_with_calls
from execution.serializers import ExecCreateSerializer
from execution.services.jobs import exec_job_cancel_await, exec_job_create
from execution.services.waiting import tool_call_decide, tool_results_submit
from ptcproject.api import first_message
from ptcproject.errors import ApplicationError

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


def _load_module(name: str) -> types.ModuleType:
    """Import ``name``: a module name on sys.path, or the path of a .py file. Raise CommandError,
    saying why, if it can't be imported: the module's own error, not a traceback of this command."""
    path = Path(name)
    try:
        if name.endswith(".py") or path.is_file():
            spec = importlib.util.spec_from_file_location(path.stem, path)
            if spec is None or spec.loader is None:
                raise CommandError(f"{name} is not a Python file that can be imported.")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(name)
    except CommandError:
        raise
    except Exception as exc:  # whatever importing it raised (ImportError, SyntaxError, its own code's)
        raise CommandError(f"--client-tools {name} could not be imported: {type(exc).__name__}: {exc}") from None


def _functions(module: types.ModuleType) -> dict[str, Any]:
    """The module's own public functions, by name."""
    return {
        name: fn
        for name, fn in vars(module).items()
        if inspect.isfunction(fn) and fn.__module__ == module.__name__ and not name.startswith("_")
    }


def _definition(name: str, fn: Any) -> dict[str, Any]:
    """A client tool definition from a function's signature: annotated types, defaults optional."""
    properties: dict[str, Any] = {}
    required = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        kind = _JSON_TYPES.get(param.annotation)
        properties[param.name] = {"type": kind} if kind else {}
        if param.default is param.empty:
            required.append(param.name)
    description = inspect.getdoc(fn) or ""
    return {
        "name": name,
        "description": description,
        "input_schema": {"type": "object", "properties": properties, "required": required},
    }


def client_tools_from(module: types.ModuleType) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Return a module's client tool definitions and the functions that run them, by name."""
    functions = _functions(module)
    declared = getattr(module, "CLIENT_TOOLS", None)
    if declared is not None and (not isinstance(declared, list | tuple) or not all(isinstance(d, dict) for d in declared)):
        raise CommandError(f"{module.__name__}.CLIENT_TOOLS must be a list of tool definitions (dicts with a name).")
    definitions = list(declared) if declared is not None else [_definition(n, fn) for n, fn in sorted(functions.items())]
    missing = [d.get("name") for d in definitions if d.get("name") not in functions]
    if missing:
        raise CommandError(f"CLIENT_TOOLS names tools the module has no function for: {', '.join(map(str, missing))}.")
    if not definitions:
        raise CommandError(f"{module.__name__} has no public functions to offer as client tools.")
    return definitions, functions


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
        self.cut: set[str] = set()  # the streams whose live output stopped at the job's limit

    def render(self) -> Group:
        return Group(*(Spinner("dots", text=self._running_text(d)) for d in self.running.values()))

    @staticmethod
    def _running_text(data: dict[str, Any]) -> Text:
        if data.get("waiting"):
            return Text(f"waiting for {data['waiting']}: {_call_label(data)}", style="yellow")
        return Text(_call_label(data), style="cyan")

    def on_event(self, event: Event) -> None:
        data = event.data
        if event.event in ("stdout", "stderr"):
            self.saw_output = True
            if data["text"].endswith(f"{LIVE_CUT}\n"):
                self.cut.add(event.event)
            style = "" if event.event == "stdout" else "red"
            self.console.print(Text(data["text"].rstrip("\n"), style=style), highlight=False)
        elif event.event == "tool_call_pending":
            waiting = "client" if data["awaiting"] == "client" else "approval"
            label = _call_label(data["call"])
            self.running[data["id"]] = {**data["call"], "waiting": waiting}
            hint = "" if waiting == "client" else f" (POST /api/v1/tool-calls/{data['id']}/approval, or the timeline)"
            self.console.print(Text.assemble(("⏸ ", "yellow"), f"waiting for {waiting}: {label}", (hint, "dim")), highlight=False)
        elif event.event == "tool_call_approved":
            self.running[data["call_id"]] = data
            self.console.print(Text.assemble(("▶ ", "yellow"), f"approved: {_call_label(data)}"), highlight=False)
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
        parser.add_argument(
            "--client-tools",
            default=None,
            metavar="MODULE",
            help="A module (name or .py file) whose functions answer the job's client tools, run here.",
        )
        parser.add_argument(
            "--approvals",
            choices=["wait", "approve", "deny"],
            default="wait",
            help="Calls that need an approval: wait for someone (default), or approve or deny them as --user.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # The job's own lines only; -v 2 adds the services' log lines (job queued, key made, ...).
        services = logging.getLogger("ptc")
        level = services.level
        if options["verbosity"] < 2:
            services.setLevel(max(level, logging.WARNING))
        try:
            self._run(options)
        finally:
            services.setLevel(level)  # as it was for whoever called (call_command)

    def _run(self, options: dict[str, Any]) -> None:
        path = Path(options["file"])
        if not path.is_file():
            raise CommandError(f"{path} is not a file.")
        # As the API refuses a deactivated user's key (and ptc_mcp its name), so does this.
        user = get_user_model().objects.filter(username=options["user"], is_active=True).first()
        if user is None:
            raise CommandError(f"There is no active user '{options['user']}'.")
        toolsets = [t.strip() for t in options["toolsets"].split(",") if t.strip()] if options["toolsets"] else None
        self.user, self.approvals = user, options["approvals"]
        definitions: list[dict[str, Any]] = []
        self.functions: dict[str, Any] = {}
        if options["client_tools"]:
            definitions, self.functions = client_tools_from(_load_module(options["client_tools"]))
        try:
            code = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CommandError(f"{path} can't be read as UTF-8 text: {exc}") from None
        # The API's own rules for a job's body (a timeout of at least 0.1 s, a title of at most 500
        # characters, code without NUL, client tools' definitions): the service takes them as checked.
        body = {"code": code, "timeout": options["timeout"], "title": options["title"], "client_tools": definitions}
        checked = ExecCreateSerializer(data={**body, **({"toolsets": toolsets} if toolsets is not None else {})})
        if not checked.is_valid():
            raise CommandError(f"validation_error: Invalid input. {first_message(checked.errors)}")
        started = time.monotonic()
        try:
            job = exec_job_create(
                user=user,
                code=code,
                toolsets=toolsets,
                timeout=checked.validated_data.get("timeout"),
                title=checked.validated_data["title"],
                client_tools=checked.validated_data["client_tools"],
            )
        except ApplicationError as exc:
            raise CommandError(f"{exc.code}: {exc.message}") from exc
        # OutputWrapper._out is the stream it wraps; django-stubs lacks it, so its __getattr__ calls it a callable.
        console = Console(file=self.stdout._out, highlight=False, soft_wrap=True)  # type: ignore[arg-type]
        interactive = console.is_terminal
        console.print(f"job {job.call_id} submitted, id {job.pk}")  # the id is what /api/v1/exec/{id} takes
        progress = Progress(console, live=interactive)
        # A SIGTERM stops it as Ctrl-C does (KeyboardInterrupt), and either cancels the job. Only
        # the main thread may set a handler (call_command may run elsewhere); the caller's comes back.
        main = threading.current_thread() is threading.main_thread()
        before = signal.signal(signal.SIGTERM, signal.default_int_handler) if main else None
        try:
            final = asyncio.run(self._follow(job, progress, interactive))
        except KeyboardInterrupt:
            console.print(f"stopped: cancelling job {job.call_id}")
            final = self._cancel(job)
        finally:
            if main and before is not None:  # None: a handler set outside Python, left as it is
                signal.signal(signal.SIGTERM, before)
        for stream, style in (("stdout", ""), ("stderr", "red")):
            if not progress.saw_output and final.get(stream):  # no live chunks (their log lost them): once
                console.print(Text(final[stream].rstrip("\n"), style=style), highlight=False)
            elif stream in progress.cut and (tail := tail_of(final.get(stream) or "")):
                # Its live output stopped at the job's limit, saying exec_end has the tail: shown,
                # as the output's end (a result, the last of a traceback) is what is looked for.
                console.print(Text(f"… the end of {stream}, from exec_end:", style="dim"), highlight=False)
                console.print(Text(tail.rstrip("\n"), style=style), highlight=False)
        self._summary(console, job, final, time.monotonic() - started)
        if final.get("status") != "completed":
            sys.exit(1)

    def _cancel(self, job: ExecJob) -> dict[str, Any]:
        """Cancel the job this command submitted, stopped before the job's end: left running, nobody
        followed it (its client tools, answered here, waited their timeouts) and it held its place
        among its user's jobs to its own timeout, as ptc_mcp's do not. Return the job as it ended."""
        try:
            end = exec_job_cancel_await(job=job)
        except ApplicationError:  # it ended on its own meanwhile (job_finished): as it ended
            end = None
        if end is not None and end.job is not None:
            return end.job
        return job_view(exec_job_with_calls(job_id=job.pk))

    def _answer(self, job: ExecJob, block: dict[str, Any]) -> None:
        """Run one client tool call here and post its result (on a thread: calls stay parallel)."""
        try:
            result: dict[str, Any] = {"content": self.functions[block["name"]](**block["input"]), "is_error": False}
        except Exception as exc:  # the tool's failure is the call's, reported to the code as is_error
            result = {"content": f"{type(exc).__name__}: {exc}", "is_error": True}
        try:
            tool_results_submit(job=job, results=[{"tool_use_id": block["id"], **result}])
        except ApplicationError as exc:  # timed out or cancelled meanwhile: the stream shows it
            self.stderr.write(f"could not post the result of {block['id']}: {exc.code}: {exc.message}")

    def _decide(self, block: dict[str, Any]) -> None:
        """Approve or deny a call as the job's user (``--approvals``), on a thread."""
        call = ToolCall.objects.get(call_id=block["id"])
        try:
            tool_call_decide(call=call, actor=self.user, approve=self.approvals == "approve", reason="--approvals on ptc_exec")
        except ApplicationError as exc:  # decided elsewhere meanwhile: the stream shows it
            self.stderr.write(f"could not decide {block['id']}: {exc.code}: {exc.message}")

    async def _follow(self, job: ExecJob, progress: Progress, interactive: bool) -> dict[str, Any]:
        job_id = job.pk
        answering: set[asyncio.Task[None]] = set()
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
                data = event.data
                work = None
                if event.event == "tool_call_pending" and data["awaiting"] == "client" and data["name"] in self.functions:
                    work = asyncio.to_thread(self._answer, job, data)
                elif event.event == "tool_call_pending" and data["awaiting"] == "approval" and self.approvals != "wait":
                    work = asyncio.to_thread(self._decide, data)
                if work is not None:
                    task = asyncio.create_task(work)
                    answering.add(task)
                    task.add_done_callback(answering.discard)
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
