from celery import shared_task
from django.db import OperationalError

from execution.services import tool_call_execute
from ptcproject import queues


@shared_task(
    queue=queues.TOOLS,
    acks_late=True,
    soft_time_limit=300,
    time_limit=330,
    # Only a database that is briefly unreachable is worth a retry; the claim makes a retry safe.
    autoretry_for=(OperationalError,),
    retry_backoff=True,
    max_retries=3,
)
def execute_tool(call_id: str) -> None:
    tool_call_execute(call_id=call_id)
