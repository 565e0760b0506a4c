import logging
from typing import Any

from celery import shared_task
from celery.signals import worker_ready
from django.conf import settings

from execution.sandbox import process
from execution.services import exec_job_run, exec_jobs_reap, worker_name
from ptcproject import queues

logger = logging.getLogger("ptc.execution")


@shared_task(
    queue=queues.EXEC,
    acks_late=True,
    # The session enforces the job's own timeout; these only stop a wedged worker thread.
    soft_time_limit=settings.CELERY_TASK_HARD_LIMIT - 30,
    time_limit=settings.CELERY_TASK_HARD_LIMIT,
)
def run_exec(job_id: str) -> None:
    exec_job_run(job_id=job_id, worker=worker_name())


@shared_task(queue=queues.MAINTENANCE, acks_late=True, soft_time_limit=60, time_limit=90)
def reap_jobs() -> int:
    return exec_jobs_reap()


@worker_ready.connect
def _reap_on_start(sender: Any = None, **_: Any) -> None:
    """An exec worker that starts fails the jobs a dead worker left running, without waiting for beat."""
    consumer_queues = {q.name for q in getattr(getattr(sender, "task_consumer", None), "queues", [])}
    if not consumer_queues or queues.EXEC in consumer_queues:
        reap_jobs.delay()
        try:
            process.check()
        except process.SandboxUnavailable as exc:  # said at start, not first at a user's job
            logger.error("this exec worker cannot run sandboxes: %s", exc)
