"""What every benchmark shares: a stack on a fresh database, a user, and a table printer.

Figures are medians and p95 over repeated runs, each next to a baseline measured in the same
process, because these machines are noisy: the ratio travels, the absolute figure less so.
"""

import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ptcproject.heap import heap_freeze  # noqa: E402
from tests.servers import api_key, redis_keys_drop  # noqa: E402  (after the path is set)
from tests.stack import Process, Stack  # noqa: E402


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def row(name: str, values: list[float], unit: str, baseline: list[float] | None = None, target: str = "") -> list[str]:
    med = statistics.median(values)
    ratio = f"{med / statistics.median(baseline):.1f}x" if baseline else ""
    return [name, f"{med:.2f} {unit}", f"{p95(values):.2f} {unit}", str(len(values)), ratio, target]


def print_table(title: str, rows: list[list[str]]) -> None:
    header = ["measure", "median", "p95", "n", "vs baseline", "target"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n### {title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")


def timed(fn: Callable[[], Any], runs: int) -> list[float]:
    """Return the wall time of each run of ``fn``, in milliseconds."""
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1000)
    return out


@contextmanager
def running_stack(
    extra_env: dict[str, str] | None = None, exec_workers: int = 1, tools_workers: int = 1, name: str = ""
) -> Iterator[tuple[Stack, httpx.Client]]:
    """Start ``exec_workers`` exec workers, ``tools_workers`` tools workers and the web process on a
    fresh database, with ``extra_env`` (the policy's seed too: it is read at migrate); yield an
    authed client. ``name`` tells apart the logs of two stacks in one run (bench/ab.py)."""
    server = os.environ["TEST_DATABASE_URL"]
    redis = os.environ["REDIS_URL"]
    database = f"ptc_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{database}"')
    db_url = f"{server.rsplit('/', 1)[0]}/{database}"
    env = {
        **os.environ,
        "DATABASE_URL": db_url,
        "CELERY_BROKER_URL": redis,
        "REDIS_URL": redis,
        "DJANGO_SETTINGS_MODULE": "ptcproject.settings",
        "PTC_LOG_LEVEL": "WARNING",
        # Queues and channels of this stack's own: two stacks on one Redis (two benchmarks at once,
        # or one beside the tests) must not take each other's jobs.
        "PTC_REDIS_PREFIX": f"{database}:",
        **(extra_env or {}),
    }
    # For Django in this process too, and for bare Celery's client here (bench/bare.py).
    os.environ.update(DATABASE_URL=db_url, CELERY_BROKER_URL=redis, PTC_REDIS_PREFIX=env["PTC_REDIS_PREFIX"])
    stack = Stack(env, name)
    for n in range(1, exec_workers):
        extra = Process(
            f"exec-worker-{n + 1}",
            [*stack.exec_worker.argv[:-4], "-n", f"exec{n + 1}-{os.getpid()}@%h", "-l", "info"],
            env,
            ready=" ready.",
        )
        stack.processes.insert(0, extra)
    for n in range(1, tools_workers):
        argv = [*stack.tools_worker.argv[:-4], "-n", f"tools{n + 1}-{os.getpid()}@%h", "-l", "info"]
        stack.processes.insert(0, Process(f"tools-worker-{n + 1}", argv, env, ready=" ready."))
    try:
        subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)
        key = api_key(env, "bench", credits=100_000_000)
        stack.start(beat=False)
        client = httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=120)
        # This process's own full collections (27 ms seen) would land on a figure or its baseline.
        heap_freeze()
        yield stack, client
    finally:
        stack.stop()
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        redis_keys_drop(redis, f"{database}:")


def run_job(client: httpx.Client, code: str, **body: Any) -> dict[str, Any]:
    response = client.post("/api/v1/exec", json={"code": code, "toolsets": ["demo"], "wait": 60, **body})
    response.raise_for_status()
    job = response.json()
    if job["status"] != "completed":
        raise RuntimeError(f"bench job failed: {job['error']}")
    return job


def sandbox_limits() -> Any:
    """The limits the sandbox benchmarks run jobs under (Django must be set up)."""
    from execution.sandbox.limits import Limits

    return Limits(
        timeout=30,
        memory_mb=512,
        max_output_bytes=10**6,
        max_tool_calls=10,
        max_parallel_tool_calls=4,
        max_processes=64,
        max_file_mb=16,
        max_open_files=256,
    )
