"""Event latency: from a tool call's finish (its record's finished_at) to its SSE frame at a client.

Run it with `make bench`, or `python bench/events.py` with TEST_DATABASE_URL and REDIS_URL set.
"""

import json
import os
import threading
import time
from datetime import datetime

import redis
from harness import print_table, row, run_job, running_stack

JOB = """
from ptc_tools.demo import Demo
for i in range(N):
    Demo.echo(value=i)
"""


def redis_stream_hop(n: int) -> list[float]:
    """XADD → a blocked XREAD waking in another thread: the floor under any stream-based push."""
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    key = f"bench:hop:{os.getpid()}"
    client.delete(key)
    samples: list[float] = []
    ready = threading.Event()

    def reader() -> None:
        cursor = "$"
        ready.set()
        while len(samples) < n:
            for _, entries in client.xread({key: cursor}, block=5000) or []:
                for entry_id, fields in entries:
                    cursor = entry_id
                    samples.append((time.time() - float(fields[b"t"])) * 1000)

    thread = threading.Thread(target=reader)
    thread.start()
    ready.wait()
    time.sleep(0.05)
    for _ in range(n):
        client.xadd(key, {"t": repr(time.time())})
        time.sleep(0.002)
    thread.join()
    client.delete(key)
    return samples


def main() -> None:
    with running_stack() as (_, client):
        run_job(client, "print(1)")  # warm up
        latencies: list[float] = []
        for _ in range(3):
            job = client.post("/api/v1/exec", json={"code": JOB.replace("N", "100"), "toolsets": ["demo"], "wait": 0}).json()
            with client.stream("GET", f"/api/v1/exec/{job['id']}/events", timeout=60) as response:
                event = None
                for line in response.iter_lines():
                    if line.startswith("event: "):
                        event = line[7:]
                    elif line.startswith("data: ") and event == "tool_call_end":
                        arrived = time.time()
                        finished = datetime.fromisoformat(json.loads(line[6:])["finished_at"].replace("Z", "+00:00"))
                        latencies.append((arrived - finished.timestamp()) * 1000)
        hop = redis_stream_hop(300)
    print_table(
        "Events (SSE through uvicorn, Redis Streams)",
        [
            row("tool call finished → SSE frame at the client", latencies, "ms", hop, "≤ 20 ms p50 (Refly polls: up to 1500)"),
            row("  baseline: Redis XADD → blocked XREAD", hop, "ms"),
        ],
    )


if __name__ == "__main__":
    main()
