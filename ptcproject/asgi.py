import logging
import multiprocessing
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import django
from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.handlers.asgi import ASGIHandler
from django.http import HttpRequest
from django.http.response import HttpResponseBase
from django.urls import get_resolver

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ptcproject.settings")


class _Threads:
    """Single-thread executors, one a request at a time, kept for the next requests (at most
    ``idle`` of them waiting)."""

    def __init__(self, idle: int) -> None:
        self.idle = idle
        self._kept: list[ThreadPoolExecutor] = []
        self._lock = threading.Lock()

    def take(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._kept:
                return self._kept.pop()
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="request")

    def give(self, executor: ThreadPoolExecutor) -> None:
        with self._lock:
            if len(self._kept) < self.idle:
                self._kept.append(executor)
                return
        executor.shutdown(wait=False)


_request_threads = _Threads(idle=64)


class SyncChainASGIHandler(ASGIHandler):
    """Django's ASGI handler, with the middleware chain run as the sync chain it is, on one thread.

    Django's own middleware (security, sessions, CSRF, messages, ...) is sync underneath. Its async
    handler runs each one's process_request and process_response on a thread of its own (a hop
    there and back each), or, with one sync-only middleware in the chain, the whole chain on a
    thread that hops back to the event loop and out again for the view. Here a request makes one
    hop: the chain and the view run on the request's thread (its ThreadSensitiveContext), as under
    WSGI. An async view (the SSE stream) is awaited from that thread; its stream is still sent by
    the event loop."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await super().__call__(scope, receive, send)  # which refuses it
        # Django's own enters a ThreadSensitiveContext without an executor: asgiref starts a thread
        # for each request, and another to join it after. Here the request's thread is a kept one
        # (a GET of a job: 4.0 -> 3.6 ms). Django's per-thread state is reset per request, as
        # under a threaded WSGI server: its connection goes back to the pool at the request's end.
        executor = _request_threads.take()
        try:
            async with ThreadSensitiveContext(executor=executor):
                await self.handle(scope, receive, send)
        finally:
            _request_threads.give(executor)

    def load_middleware(self, is_async: bool = False) -> None:
        super().load_middleware(is_async=False)

    async def get_response_async(self, request: HttpRequest) -> HttpResponseBase:
        return await sync_to_async(self.get_response, thread_sensitive=True)(request)


try:
    django.setup(set_prefix=False)
except SystemExit as stop:
    # Settings stop start-up with one line per bad variable (ptcproject/envvars.py). uvicorn's
    # supervisor (--workers N) starts a worker that exits again, for ever, unless it exits with
    # uvicorn's STARTUP_FAILURE (3): then it stops, as a single process does.
    if isinstance(stop.code, str):
        print(stop.code, file=sys.stderr)
    raise SystemExit(3) from None
if multiprocessing.parent_process() is not None and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    # One of uvicorn's --workers (or --reload's worker): each keeps its own counts in memory, and a
    # scrape of /metrics reaches one of them, at random.
    logging.getLogger("ptc.web").warning(
        "this web process is one of uvicorn's workers: with --workers N, set PROMETHEUS_MULTIPROC_DIR "
        "(an empty directory, shared by them), or each scrape of /metrics reads one worker's counts only"
    )
# The admin's and Swagger UI's assets come from the installed apps, served by Django itself, so
# `uvicorn ptcproject.asgi:application` is all it takes: no collectstatic, no CDN.
django_application = ASGIStaticFilesHandler(SyncChainASGIHandler())

# Imported once the apps are loaded: it reaches the models. /mcp is the MCP server; the rest is Django.
from execution.mcp_http import with_mcp  # noqa: E402
from ptcproject.heap import heap_freeze  # noqa: E402

application = with_mcp(django_application)

# The URLconf and the views it imports are loaded now rather than by the first request, and with the
# rest of start-up frozen out of the collector's sight (ptcproject/heap.py).
get_resolver().url_patterns  # noqa: B018 - loaded for its imports
heap_freeze()
