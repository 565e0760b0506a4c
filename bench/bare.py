"""The baseline every hot-path figure is measured against: bare Celery on the same Redis.

A trivial task on its own queue and worker (the threads pool, as ours), with a Redis result
backend so a round trip can be timed with ``.get()``. Nothing of ours is in it: no database, no
records, no billing, no events. Beside it, the same task with the one thing of ours the
architecture's invariants require of every task: its record, before and after (``recorded``).

    celery -A bare worker -Q bare -P threads -c 64    (from bench/, with REDIS_URL set)
"""

import os
import threading

import psycopg
from celery import Celery

# Every key of its own under the run's prefix, as ours are (PTC_REDIS_PREFIX): the queue, its
# binding, kombu's unacked records and the results, all dropped with the run's keys.
PREFIX = os.environ.get("PTC_REDIS_PREFIX", "")
QUEUE = "bare-bench"

app = Celery("bare", broker=os.environ["REDIS_URL"], backend=os.environ["REDIS_URL"])
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    result_serializer="json",
    task_default_queue=QUEUE,
    worker_prefetch_multiplier=1,
    task_acks_late=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    broker_transport_options={"global_keyprefix": PREFIX},
    result_backend_transport_options={"global_keyprefix": PREFIX},
)


@app.task(name="bare.add")
def add(a: int, b: int) -> int:
    return a + b


# What the invariants alone add to a task: its record written (committed) before the work and
# updated after, two statements on PostgreSQL, as a tools worker's claim and finish are. Nothing
# else of ours: no signing, no billing, no events, no Django.
RECORDS = "bare_record"
_connections = threading.local()


def _db() -> psycopg.Connection:
    if getattr(_connections, "conn", None) is None:
        _connections.conn = psycopg.connect(os.environ["DATABASE_URL"], autocommit=True)
        _connections.conn.execute(f"CREATE TABLE IF NOT EXISTS {RECORDS} (id text PRIMARY KEY, status text, output jsonb)")
    return _connections.conn


@app.task(name="bare.recorded")
def recorded(call_id: str, value: int) -> int:
    db = _db()
    db.execute(f"INSERT INTO {RECORDS} (id, status) VALUES (%s, 'executing')", (call_id,), prepare=True)
    db.execute(f"UPDATE {RECORDS} SET status = 'completed', output = %s WHERE id = %s", (str(value), call_id), prepare=True)
    return value
