"""Tenant quotas: how much of the fleet one user may hold at once, checked when a job is submitted,
and when a call is made over HTTP without a job's key (POST /tools/execute: standalone, or a
managed container's).

A user past a quota gets 429 ``rate_limited`` with ``Retry-After``, and nothing is created. The
tool-call quota is also held per job, through its parallel cap (``Quotas.parallel_cap``), so it
costs a job's calls' path nothing.
"""

import math
from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.db.models import Exists, OuterRef
from django.utils import timezone

from billing.models import Reservation
from execution.models import ExecJob, ExecSession, ToolCall
from execution.selectors import container_jobs_idle_since, container_jobs_open, sessions_in_state
from ptcproject.errors import ApplicationError
from ptcproject.policy.selectors import Quotas

# What a client waits before trying again when its own jobs or calls must end first: they free a
# slot at an unknown moment, so a short wait, not the worst case.
BUSY_RETRY_SECONDS = 2


def _limited(message: str, *, quota: str, limit: int, retry_after: int) -> ApplicationError:
    return ApplicationError(
        "rate_limited", message, status=429, details={"quota": quota, "limit": limit, "retry_after": max(1, retry_after)}
    )


def _user_lock(user: User) -> None:
    """Lock ``user``'s row until the transaction ends: one user's requests are counted one after
    the other, and other users are not held up."""
    list(get_user_model().objects.select_for_update().filter(pk=user.pk).values_list("pk"))


def _tool_calls_check(*, user: User, quotas: Quotas, then: str) -> None:
    """Raise ``rate_limited`` if ``user`` has ``quotas.concurrent_tool_calls`` calls in flight; the
    message ends with ``then``, what to do. Call it with the user's row locked."""
    in_flight = ToolCall.objects.filter(user=user, status=ToolCall.Status.EXECUTING).count()
    # A job's calls for tools workers have no row until a worker claims one: those queued are
    # counted by the prices held for them (a free tool's, queued, is not seen).
    recorded = ToolCall.objects.filter(call_id=OuterRef("tool_call_id"))
    held = Reservation.objects.filter(account__user=user, status=Reservation.Status.HELD)
    in_flight += held.filter(~Exists(recorded)).count()
    if in_flight >= quotas.concurrent_tool_calls:
        raise _limited(
            f"You have {in_flight} tool calls in flight; your quota is {quotas.concurrent_tool_calls}. {then}",
            quota="concurrent_tool_calls",
            limit=quotas.concurrent_tool_calls,
            retry_after=BUSY_RETRY_SECONDS,
        )


def exec_quota_check(*, user: User, quotas: Quotas, session: ExecSession | None = None) -> None:
    """Raise ApplicationError ``rate_limited`` (429) if a new job (or a new session: ``quotas``
    say only its jobs count) would take ``user`` past a quota. An open session holds a sandbox, so
    it counts as a job while none of its jobs runs; a job in ``session`` takes that session's place.

    Call it inside the transaction that creates the job: it locks the user's row, so two requests
    of one user at once are counted one after the other (other users are not held up).
    """
    if not quotas.any:
        return
    _user_lock(user)
    jobs = ExecJob.objects.filter(user=user)
    if quotas.concurrent_jobs:
        busy = (ExecJob.Status.QUEUED, ExecJob.Status.RUNNING)
        active = jobs.run_here().filter(status__in=busy).count()  # a managed container's job holds no worker
        # Open as each session reads now: one past its time takes no more jobs (410), and the
        # reaper ends it at its next round.
        active_sessions = sessions_in_state(ExecSession.objects.filter(user=user), ExecSession.Status.ACTIVE)
        idle_sessions = active_sessions.exclude(jobs__status__in=busy)
        if session is not None:
            idle_sessions = idle_sessions.exclude(pk=session.pk)
        active += idle_sessions.count()
        if active >= quotas.concurrent_jobs:
            raise _limited(
                f"You have {active} jobs queued or running, or sessions open; your quota is {quotas.concurrent_jobs} "
                "at once. Submit this one when one of them has finished.",
                quota="concurrent_jobs",
                limit=quotas.concurrent_jobs,
                retry_after=BUSY_RETRY_SECONDS,
            )
    if quotas.concurrent_tool_calls:
        _tool_calls_check(user=user, quotas=quotas, then="Submit this job when some have finished.")
    if quotas.jobs_per_minute:
        now = timezone.now()
        window = list(
            jobs.filter(created_at__gt=now - timedelta(seconds=60)).order_by("created_at").values_list("created_at", flat=True)
        )
        if len(window) >= quotas.jobs_per_minute:
            # A slot frees when the oldest job that keeps the window full leaves it.
            leaves = window[len(window) - quotas.jobs_per_minute] + timedelta(seconds=60)
            raise _limited(
                f"You submitted {len(window)} jobs in the last minute; your quota is {quotas.jobs_per_minute} a minute.",
                quota="jobs_per_minute",
                limit=quotas.jobs_per_minute,
                retry_after=math.ceil((leaves - now).total_seconds()),
            )


def tool_call_quota_check(*, user: User, quotas: Quotas) -> None:
    """Raise ApplicationError ``rate_limited`` (429) if ``user`` already has their quota of tool
    calls in flight (counted as for a job's submission): for a call made over HTTP without a job's
    key, whose job (if any: a managed container's) has no parallel cap of ours.

    Call it inside the transaction that records the call: it locks the user's row, so calls of one
    user at once are counted one after the other, each seeing those recorded before it."""
    if not quotas.concurrent_tool_calls:
        return
    _user_lock(user)
    _tool_calls_check(user=user, quotas=quotas, then="Make this call when one of them has finished.")


def container_quota_check(*, user: User, container_id: str) -> None:
    """Raise ApplicationError ``rate_limited`` (429) if ``user`` has PTC_MAX_CONTAINERS_PER_USER
    managed containers' jobs open besides ``container_id``'s: its first call would open one more.

    Call it inside the transaction that creates the job: it locks the user's row, so two new
    containers of one user at once are counted one after the other."""
    most = settings.PTC_MAX_CONTAINERS_PER_USER
    if not most:
        return
    _user_lock(user)
    # A call beside this one may have made this container's job meanwhile: it takes no new place.
    count = container_jobs_open(user=user).exclude(container_id=container_id).count()
    if count < most:
        return
    idle = settings.PTC_CONTAINER_IDLE_SECONDS
    retry_after = BUSY_RETRY_SECONDS
    oldest = container_jobs_idle_since(user=user, container_id=container_id) if idle else None
    if oldest is not None:
        # A place frees when the one unused longest is closed: its idle time out, then the reaper's round.
        closes = oldest + timedelta(seconds=idle + settings.PTC_REAP_EVERY)
        retry_after = math.ceil((closes - timezone.now()).total_seconds())
    raise _limited(
        f"You have {count} managed containers' jobs open; your quota is {most} (PTC_MAX_CONTAINERS_PER_USER). "
        "Call from one of those containers, or cancel the job of one you are done with (POST /api/v1/exec/{id}/cancel)"
        + (f"; one with no call for {idle} s is closed." if idle else "."),
        quota="containers",
        limit=most,
        retry_after=retry_after,
    )
