"""Under load: 100 jobs at once, 20 tool calls each, on 2 exec workers and 1 tools worker.

What it checks and prints: every job completed and every call recorded (nothing lost), the ledger
exact (`check_ledger`, and the credits charged equal to the calls billed), and how long jobs waited
in the queue (p50, p95) and took end to end.

Run it with `make bench`, or `python bench/load.py` with TEST_DATABASE_URL and REDIS_URL set.
"""

import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from harness import ROOT, p95, running_stack

JOBS = 100
CALLS = 20
JOB = f"""
from concurrent.futures import ThreadPoolExecutor
from ptc_tools.demo import Demo
with ThreadPoolExecutor(4) as pool:
    sums = list(pool.map(lambda i: Demo.add(a=i, b=1), range({CALLS})))
sum(sums)
"""
EXPECTED = sum(i + 1 for i in range(CALLS))


def main() -> None:
    with running_stack(exec_workers=2) as (stack, client):
        client.post("/api/v1/exec", json={"code": "print(1)", "toolsets": ["demo"], "wait": 30}).raise_for_status()
        balance_before = client.get("/api/v1/billing/balance").json()["balance"]
        started = time.perf_counter()

        def submit(_: int) -> dict:
            response = client.post("/api/v1/exec", json={"code": JOB, "toolsets": ["demo"], "wait": 0})
            response.raise_for_status()
            return response.json()

        # Sixteen clients submit them: all 100 are queued within a second or so.
        with ThreadPoolExecutor(16) as pool:
            submitted = list(pool.map(submit, range(JOBS)))

        def finished(job: dict) -> dict:
            while True:  # a bench client, not the product: it may poll
                current = client.get(f"/api/v1/exec/{job['id']}").json()
                if current["success"] is not None:
                    return current
                time.sleep(0.2)

        with ThreadPoolExecutor(16) as pool:
            jobs = list(pool.map(finished, submitted))
        wall = time.perf_counter() - started
        balance_after = client.get("/api/v1/billing/balance").json()["balance"]
        ledger = subprocess.run(
            [sys.executable, "manage.py", "check_ledger"], cwd=ROOT, env=stack.env, capture_output=True, text=True
        )
        import django

        django.setup()
        from execution.models import ExecJob

        timings = {str(j.pk): j.timings for j in ExecJob.objects.filter(pk__in=[job["id"] for job in jobs])}

    completed = [job for job in jobs if job["status"] == "completed" and job["return_value"] == EXPECTED]
    calls = sum(len(job["tool_calls"]) for job in jobs)
    ok_calls = sum(1 for job in jobs for call in job["tool_calls"] if call["status"] == "completed")
    charged = sum(job["credits_charged"] for job in jobs)
    queue_ms = [timings[job["id"]].get("queue_ms", 0.0) for job in jobs]
    total_ms = [job["execution_time_seconds"] * 1000 for job in jobs if job["execution_time_seconds"] is not None]
    print(f"\n### Load: {JOBS} jobs × {CALLS} Demo.add at once (2 exec workers, 1 tools worker)\n")
    print("| measure | value |")
    print("|---|---|")
    print(f"| jobs completed with the right answer | {len(completed)} / {JOBS} |")
    print(f"| calls recorded / completed | {calls} / {ok_calls} of {JOBS * CALLS} |")
    print(f"| credits charged / balance change | {charged} / {balance_before - balance_after} (expected {JOBS * CALLS}) |")
    print(f"| check_ledger | {'exact' if ledger.returncode == 0 else 'MISMATCH: ' + ledger.stdout + ledger.stderr} |")
    print(f"| queue wait p50 / p95 | {statistics.median(queue_ms):.0f} ms / {p95(queue_ms):.0f} ms |")
    print(f"| run time p50 / p95 | {statistics.median(total_ms):.0f} ms / {p95(total_ms):.0f} ms |")
    print(f"| wall, all jobs | {wall:.1f} s ({JOBS * CALLS / wall:.0f} calls/s) |")
    if len(completed) != JOBS or ok_calls != JOBS * CALLS or ledger.returncode != 0 or charged != JOBS * CALLS:
        raise SystemExit("load: something was lost or mis-charged")


if __name__ == "__main__":
    main()
