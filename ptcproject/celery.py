"""The Celery app. One worker command per queue (ARCHITECTURE.md):

celery -A ptcproject worker -Q exec     # runs sandboxes, bridges their tool calls
celery -A ptcproject worker -Q tools    # runs one tool call per task
celery -A ptcproject worker -Q tools.slow  # the same, for toolsets routed there (PTC_TOOLS_QUEUES)

Every worker also consumes the maintenance queue, beat's rounds (_maintenance_on_every_worker).
"""

import logging
import os
import uuid
from typing import Any

from celery import Celery
from celery.signals import celeryd_init, worker_init

from ptcproject import queues

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ptcproject.settings")

app = Celery("ptcproject")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.task_routes = queues.TASK_ROUTES
app.conf.task_default_queue = queues.EXEC
app.autodiscover_tasks()

# Celery's loggers of each task's receipt, its outcome and its request (read when a worker starts).
TASK_LOGGERS = ("celery.worker.strategy", "celery.app.trace", "celery.worker.request")


@celeryd_init.connect
def _fit_worker_to_queue(conf: Any = None, options: dict[str, Any] | None = None, **_: Any) -> None:
    """Give each queue's worker its own default thread count, unless ``-c`` was given, and its own
    way of taking messages.

    An exec thread holds one sandbox for the job's whole life; a tools thread holds one call. The
    command line's ``--concurrency`` still wins: Celery reads this only when the CLI left it unset.
    A tools worker takes a burst of calls several at a time (ptcproject/broker.py); an exec worker
    takes one job at a time, so a burst of jobs spreads over the exec workers, each job a sandbox.
    """
    from django.conf import settings

    wanted = set((options or {}).get("queues") or [])
    if conf is None:
        return
    # A worker on tools queues only (-Q tools, -Q tools.slow, -Q tools,tools.slow) is a tools worker.
    tools_worker = bool(wanted) and wanted <= set(queues.tools_queues())
    if conf.worker_concurrency is None:
        if tools_worker:
            conf.worker_concurrency = settings.PTC_TOOLS_CONCURRENCY
        else:
            conf.worker_concurrency = settings.PTC_EXEC_CONCURRENCY
    if not tools_worker and conf.broker_transport_options:
        conf.broker_transport_options = {**conf.broker_transport_options, "pop_most": 1}
    if tools_worker and not settings.PTC_TOOLS_TASK_EVENTS:
        # Three event publishes per task on the consumer's one thread are what a tools worker
        # spends most on between calls; each call already has its record and its live events.
        conf.worker_send_task_events = False
        # And Celery's two INFO lines a task ("received", on that thread too, and "succeeded"):
        # each call logs its own line ("tool call ran", with its call_id, tool and time). They
        # cost a busy tools worker a sixth of its CPU (1,000 calls from one job, by turns).
        for name in TASK_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


@worker_init.connect
def _worker_without_mingle_and_gossip(sender: Any = None, **_: Any) -> None:
    """Start every worker as ``--without-mingle --without-gossip`` would, whatever its command line.

    Mingle asks every other worker at a worker's start for the tasks revoked and their clocks, and
    waits a second for their replies; gossip has each worker take every other worker's heartbeat
    events, so N workers each take those of N - 1. Nothing here revokes a task, or elects a worker
    (a job is cancelled through its record), so they cost a second at each start and Redis traffic
    that grows with the square of the fleet, and wrote to Redis at a start while it was full.
    Heartbeat and task events stay on (flower, ``celery events``). The worker's options are read to
    build its consumer after this signal."""
    if sender is not None:
        sender.options.update(without_mingle=True, without_gossip=True)


@worker_init.connect
def _maintenance_on_every_worker(sender: Any = None, **_: Any) -> None:
    """Have every worker, whatever its ``-Q``, consume beat's rounds (queues.MAINTENANCE): the reaper
    runs while any worker is up, a tools worker's too. Two workers may run rounds at once, as every
    exec worker runs its own (execution.tasks): each item of a round is a conditional write, or skips
    the rows another holds locked, so a second round finds nothing left to do. Its queues are chosen
    (``-Q``) before this signal, and consumed from after it."""
    if sender is not None:
        sender.app.amqp.queues.select_add(queues.MAINTENANCE)


def task_publish(
    task: Any,
    producer: Any,
    args: tuple[Any, ...],
    *,
    queue: str,
    retry: bool = True,
    argsrepr: str = "",
    headers: dict[str, str] | None = None,
) -> None:
    """Publish ``task(*args)`` to the queue named ``queue``: Celery's own task message (protocol 2,
    from ``create_task_message``) straight to the queue, as ``apply_async`` sends a task to a
    direct queue. Without ``apply_async``'s option merging, router and per-message queue
    declaration (the workers declare their queues), which were half the CPU of each enqueue.
    ``argsrepr`` is what the worker's log shows of the arguments (by default, all of them);
    ``headers`` go with Celery's (the task reads them in ``request.headers``; a worker that does
    not know one ignores it, where an argument it does not take would fail the task).
    Celery's publish signals are not sent: nothing of ours listens to them."""
    message = task.app.amqp.create_task_message(
        uuid.uuid4().hex, task.name, args, {}, ignore_result=True, argsrepr=argsrepr or repr(args), kwargsrepr="{}"
    )
    producer.publish(
        message.body,
        exchange="",
        routing_key=queue,
        headers={**message.headers, **(headers or {})},
        serializer="json",
        retry=retry,
        retry_policy=task.app.conf.task_publish_retry_policy,
        **message.properties,
    )
