import logging
from typing import Any

from celery import shared_task
from celery.signals import worker_ready
from django.conf import settings
from django.db import InterfaceError, OperationalError

from execution.sandbox import process
from execution.services import exec_job_run, exec_jobs_reap, worker_name
from ptcproject import queues
from ptcproject.periodic import run_every

logger = logging.getLogger("ptc.execution")


# No soft or hard time limit: the threads pool can't enforce them. The session kills the sandbox at
# the job's own timeout, and everything after the claim ends the job whatever fails.
@shared_task(
    queue=queues.EXEC,
    acks_late=True,
    # Only the claim raises, and only when the database is unreachable: a job accepted during a
    # PostgreSQL restart runs as soon as it is back. The claim makes a retry safe; past
    # PTC_QUEUED_MAX_SECONDS the reaper has failed the job and the claim finds nothing to do.
    autoretry_for=(OperationalError, InterfaceError),
    retry_backoff=1,
    retry_backoff_max=5,
    retry_jitter=False,
    max_retries=settings.PTC_QUEUED_MAX_SECONDS // 5,
)
def run_exec(job_id: str) -> None:
    exec_job_run(job_id=job_id, worker=worker_name())


@shared_task(queue=queues.MAINTENANCE, acks_late=True)
def reap_jobs() -> int:
    return exec_jobs_reap()


@worker_ready.connect
def _reap_while_up(sender: Any = None, **_: Any) -> None:
    """An exec worker fails the jobs and calls whose worker died, at start and then every
    PTC_REAP_EVERY seconds: leases are enforced while any exec worker runs, with or without beat."""
    consumer_queues = {q.name for q in getattr(getattr(sender, "task_consumer", None), "queues", [])}
    if not consumer_queues or queues.EXEC in consumer_queues:
        run_every("ptc-reaper", settings.PTC_REAP_EVERY, exec_jobs_reap, now=True)
        try:
            process.check()
        except process.SandboxUnavailable as exc:  # said at start, not first at a user's job
            logger.error("this exec worker cannot run sandboxes: %s", exc)
