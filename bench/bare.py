"""The baseline every hot-path figure is measured against: bare Celery on the same Redis.

A trivial task on its own queue and worker (the threads pool, as ours), with a Redis result
backend so a round trip can be timed with ``.get()``. Nothing of ours is in it: no database, no
records, no billing, no events.

    celery -A bare worker -Q bare -P threads -c 64    (from bench/, with REDIS_URL set)
"""

import os

from celery import Celery

QUEUE = f"bare-{os.environ.get('PTC_REDIS_PREFIX', '')}bench"

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
)


@app.task(name="bare.add")
def add(a: int, b: int) -> int:
    return a + b
