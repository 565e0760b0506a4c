import logging
import queue
import threading
import traceback
from collections.abc import Callable
from typing import Any

from django.conf import settings

from tools.builtin import registry
from tools.errors import ToolFailure
from tools.models import Tool, Toolset

logger = logging.getLogger("ptc.tools")
# Idle threads kept for the next builtin calls, at most: starting a thread costs more than most
# builtins take to run. As many as the worker's threads, so a fan-out as wide as the pool starts no
# thread the second time. Not concurrent.futures: its threads are not daemons, so a hung builtin
# would hold up the worker's exit.
MAX_IDLE_THREADS = settings.PTC_TOOLS_CONCURRENCY
# The most of an exception's message quoted: it may quote what the call was given (an argument's
# name, its value), as an excerpt elsewhere is quoted (tools/kinds/http.py).
EXCERPT_CHARS = 300
# The most of its traceback logged: its start (the outer frames) and its end (the inner, and the message).
TRACEBACK_CHARS = 8000
_idle: list["queue.SimpleQueue[Callable[[], None]]"] = []
_idle_lock = threading.Lock()


def run(*, toolset: Toolset, tool: Tool, arguments: dict[str, Any], timeout: float) -> Any:
    """Call the builtin's Python function, at most ``timeout`` seconds. The arguments were validated
    against its schema.

    The function runs on a thread of its own while the task's thread waits for it: one that hangs
    ends the call as ``tool_timeout`` at its timeout and frees the worker's thread. Python can't
    stop a thread, so the hung function is left to finish on its own (a daemon thread: it never
    holds up the worker's exit). Threads are kept for the next calls (``_start``).
    """
    spec = registry().get(toolset.key)
    func = next((t.func for t in spec.tools if t.name == tool.name), None) if spec else None
    if func is None:
        raise ToolFailure("tool_not_found", f"Builtin tool '{toolset.key}.{tool.name}' is not in this server's code.")
    outcome: list[tuple[bool, Any]] = []
    done = threading.Event()

    def call() -> None:
        try:
            outcome.append((True, func(**arguments)))
        except BaseException as exc:  # handed to the waiting thread, which decides
            outcome.append((False, exc))
        finally:
            done.set()

    _start(call)
    if not done.wait(timeout):
        logger.warning("builtin tool %s.%s ran past its %g s timeout", toolset.key, tool.name, timeout)
        raise ToolFailure("tool_timeout", f"'{toolset.key}.{tool.name}' did not finish within its {timeout:g} s timeout")
    ok, value = outcome[0]
    if ok:
        return value
    if isinstance(value, ToolFailure):
        raise value
    # A builtin's bug is the call's failure, never the worker's. Its traceback is logged cut: the
    # message may quote what the call was given, 500 KB a call into the operator's log.
    logger.error("builtin tool %s.%s raised:\n%s", toolset.key, tool.name, _traceback(value))
    raise ToolFailure("tool_exception", _said(value)) from value


def _traceback(exc: BaseException) -> str:
    """Return ``exc``'s traceback as logging writes one, cut in its middle past TRACEBACK_CHARS."""
    try:
        text = "".join(traceback.format_exception(exc)).rstrip()
    except Exception:  # a message that can't be made: the frames alone
        text = "".join(traceback.format_tb(exc.__traceback__)) + _said(exc)
    if len(text) <= TRACEBACK_CHARS:
        return text
    half = TRACEBACK_CHARS // 2
    return f"{text[:half]}\n… ({len(text) - TRACEBACK_CHARS:,} characters cut) …\n{text[-half:]}"


def _said(exc: BaseException) -> str:
    """Return what ``exc`` says, its type and the start of its message, for the call's error."""
    try:
        message = str(exc)
    except Exception:  # a message that can't be made is not the call's failure
        message = "(its message could not be read)"
    text = f"{type(exc).__name__}: {message}"
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "…"


def _start(work: Callable[[], None]) -> None:
    """Run ``work`` on an idle daemon thread, or on a new one when none is idle. A thread whose
    work hangs is simply not idle: it rejoins when (if ever) the work returns."""
    with _idle_lock:
        inbox = _idle.pop() if _idle else None
    if inbox is None:
        inbox = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(inbox,), name="builtin-call", daemon=True).start()
    inbox.put(work)


def _serve(inbox: "queue.SimpleQueue[Callable[[], None]]") -> None:
    while True:
        inbox.get()()  # the work catches everything itself
        with _idle_lock:
            if len(_idle) >= MAX_IDLE_THREADS:
                return
            _idle.append(inbox)
