"""Writes for sessions: a sandbox kept alive between exec jobs, on one exec worker, with expiry.

The database is the truth about a session (``ExecSession``); the exec worker holding its sandbox
(``worker``, a Celery node name) keeps it in this process's registry (``_live``) and renews the
session's lease while it does. Every change of state is a conditional UPDATE from ``active``, so
the reaper, a DELETE and the holder never undo each other:

- created ``active`` with no worker; its first job goes to the ``exec`` queue, and the worker that
  takes it claims the session and starts its sandbox; every later job goes to that worker's direct
  queue (``<nodename>.dq2``);
- one job at a time: a second ``POST /exec`` while one is queued or running is 409 ``session_busy``;
- it ends ``expired`` (idle_timeout or max_lifetime, by the reaper), ``deleted``, or ``lost`` (its
  worker stopped renewing the lease, shut down, or its sandbox was killed: a job's timeout, cancel
  or crash). The holder kills the sandbox of a session that is no longer active at its next lease
  round; a job queued for it fails at once.

Files of ``/work`` (a session's, or a job's inputs and outputs) are ``WorkFile`` rows; they travel
over the bridge with the job (see guest.py).
"""

import base64
import binascii
import bisect
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from execution.models import ExecJob, ExecSession, WorkFile
from execution.sandbox.limits import Limits
from execution.sandbox.pool import Sandbox, sandbox_start
from execution.sandbox.session import Outcome
from execution.selectors import sessions_in_state
from execution.services.quotas import exec_quota_check
from ptcproject.db import LockedRows, unless_locked
from ptcproject.errors import ApplicationError, job_error
from ptcproject.policy.selectors import policy_get, ptc_decision, quotas_for
from ptcproject.storage import storable, unstorable
from tools.selectors import toolset_keys_for_ptc, toolset_keys_named

logger = logging.getLogger("ptc.execution")
Status = ExecSession.Status
# The longest name of one file or folder Linux takes, in bytes.
NAME_MAX = 255


# -- Paths and quotas ----------------------------------------------------------------------------
def work_path_check(path: Any) -> str:
    """Return ``path`` if it is a plain relative path under /work; else ApplicationError
    ``invalid_path`` (400): absolute, ``..``, ``.``, an empty part, a NUL, a backslash, too long."""
    if not isinstance(path, str) or not path or len(path) > 1024:
        reason = "a path of 1 to 1024 characters"
    elif "\0" in path or "\\" in path or any(ord(c) < 32 for c in path):
        reason = "no NUL, backslash or control character"
    elif unstorable(path):  # a name the code made of bytes that are not UTF-8
        reason = "a path that is text (UTF-8)"
    elif any(len(part.encode()) > NAME_MAX for part in path.split("/")):
        reason = f"no file or folder name over {NAME_MAX} bytes"
    elif path.startswith("/"):
        reason = "a path relative to /work, not an absolute one"
    elif any(part in ("", ".", "..") for part in path.split("/")):
        reason = "no '..', '.' or empty part: it must stay under /work"
    else:
        return path
    shown = path[:100] if isinstance(path, str) else repr(path)[:100]
    raise ApplicationError("invalid_path", f"The file path {shown!r} is invalid: use {reason}.", details={"path": shown})


def work_paths_clash(paths: list[str], existing: Iterable[str] = ()) -> None:
    """Raise ``invalid_path`` (400) if one of ``paths`` is a folder of another, or of one of
    ``existing``, or the other way round (``a`` and ``a/b``): /work can't hold both as files."""
    files = set(existing) | set(paths)
    # In order, the files in a folder ``a`` follow ``a/`` side by side: one look-up a path, where
    # comparing every path with every other took 30 s for 20,000 of them.
    ordered = sorted(files)
    for path in paths:
        parts = path.split("/")
        folders = ["/".join(parts[:i]) for i in range(1, len(parts))]
        clash = next((folder for folder in folders if folder in files), None)
        if clash is None:
            at = bisect.bisect_left(ordered, path + "/")
            clash = ordered[at] if at < len(ordered) and ordered[at].startswith(path + "/") else None
        if clash is not None:
            shown = path[:100]
            raise ApplicationError(
                "invalid_path",
                f"The file path {shown!r} clashes with {clash[:100]!r}: /work can't hold a file and a folder of one name.",
                details={"path": shown},
            )


def _quota_check(*, count: int, size: int) -> None:
    """Raise ``too_many_files`` or ``files_too_large`` (413) if files of ``count`` and ``size`` in
    all are over the quota (PTC_FILES_MAX_COUNT, PTC_FILES_MAX_BYTES)."""
    if count > settings.PTC_FILES_MAX_COUNT:
        raise ApplicationError(
            "too_many_files",
            f"That makes {count} files; the limit is {settings.PTC_FILES_MAX_COUNT}. Remove some, or send fewer.",
            status=413,
            details={"count": count, "limit": settings.PTC_FILES_MAX_COUNT},
        )
    if size > settings.PTC_FILES_MAX_BYTES:
        raise ApplicationError(
            "files_too_large",
            f"That makes {size} bytes of files; the limit is {settings.PTC_FILES_MAX_BYTES}. Send less.",
            status=413,
            details={"size": size, "limit": settings.PTC_FILES_MAX_BYTES},
        )


def work_files_decode(*, files: dict[str, Any]) -> dict[str, bytes]:
    """Check a request's ``files`` (``{path: base64}``): paths, encoding and quota. Return the bytes by path."""
    _quota_check(count=len(files), size=0)  # first: each path is checked, and against the others
    decoded: dict[str, bytes] = {}
    for path, data in files.items():
        work_path_check(path)
        try:
            decoded[path] = base64.b64decode(data if isinstance(data, str) else "", validate=True)
        except (binascii.Error, ValueError):
            raise ApplicationError(
                "validation_error",
                f"The file {path[:100]!r} is not base64.",
                details={"files": [f"{path[:100]}: not base64"]},
            ) from None
    work_paths_clash(list(decoded))
    _quota_check(count=len(decoded), size=sum(len(data) for data in decoded.values()))
    return decoded


def _encoded(rows: Any) -> dict[str, str]:
    return {row.path: base64.b64encode(bytes(row.content)).decode() for row in rows}


# -- Sessions: the API's side --------------------------------------------------------------------
def exec_session_create(
    *,
    user: User,
    toolsets: list[str] | None,
    idle_timeout: float | None,
    max_lifetime: float | None,
    memory_mb: int | None = None,
) -> ExecSession:
    """Record a new session, ``active``. Its sandbox starts with its first job.

    Raise ApplicationError: ``unknown_toolset`` (400), ``ptc_disabled`` (403), ``validation_error``
    (400) for a memory limit above the policy's, ``too_many_sessions`` (409) when the user has
    PTC_MAX_SESSIONS_PER_USER active sessions already.
    """
    policy = policy_get()
    if toolsets is None:
        keys = toolset_keys_for_ptc(user=user, allowlist=policy.toolset_allowlist, blocklist=policy.toolset_blocklist)
    else:
        keys = toolset_keys_named(user=user, keys=toolsets)
    decision = ptc_decision(policy=policy, user=user, toolsets=keys)
    if not decision.enabled:
        raise ApplicationError(
            "ptc_disabled", f"PTC is disabled here: {decision.reason}.", status=403, details={"reason": decision.reason}
        )
    if memory_mb is not None and memory_mb > policy.memory_limit_mb:
        raise ApplicationError(
            "validation_error",
            f"memory_mb {memory_mb} is above the policy's {policy.memory_limit_mb}.",
            details={"limits": [f"memory_mb: ensure this value is less than or equal to {policy.memory_limit_mb}."]},
        )
    # The per-job timeout and tool-call limits come with each job; these hold for the sandbox's life.
    from execution.services.jobs import job_limits

    parallel_cap = quotas_for(policy=policy, user=user).parallel_cap()
    limits = job_limits(policy=policy, timeout=policy.max_timeout, parallel_cap=parallel_cap).as_dict()
    if memory_mb is not None:
        limits["memory_mb"] = memory_mb
    idle = settings.PTC_SESSION_IDLE_TIMEOUT if idle_timeout is None else idle_timeout
    lifetime = settings.PTC_SESSION_MAX_LIFETIME if max_lifetime is None else max_lifetime
    now = timezone.now()
    with transaction.atomic():
        # Counted under the user's row lock: two concurrent creates can't both take the last place.
        User.objects.select_for_update().filter(pk=user.pk).first()
        # An open session holds a sandbox: it counts against the user's jobs-at-once quota.
        exec_quota_check(user=user, quotas=quotas_for(policy=policy, user=user))
        active = sessions_in_state(ExecSession.objects.filter(user=user), Status.ACTIVE).count()
        if active >= settings.PTC_MAX_SESSIONS_PER_USER:
            raise ApplicationError(
                "too_many_sessions",
                f"You have {active} active sessions; the limit is {settings.PTC_MAX_SESSIONS_PER_USER}. "
                "Delete one (DELETE /api/v1/sessions/{id}) or let it expire.",
                details={"active": active, "limit": settings.PTC_MAX_SESSIONS_PER_USER},
            )
        ends = now + timedelta(seconds=lifetime)
        session = ExecSession.objects.create(
            user=user,
            toolsets=keys,
            limits=limits,
            idle_timeout_seconds=idle,
            max_lifetime_seconds=lifetime,
            last_used_at=now,
            expires_at=min(ends, now + timedelta(seconds=idle)),
            max_expires_at=ends,
        )
    logger.info("session created", extra={"session_id": str(session.pk)})
    return session


def exec_session_usable(*, session: ExecSession) -> None:
    """Raise 410 ``session_expired`` (expired or deleted) or ``session_lost`` unless ``session`` is
    active; details say its status, why it ended and ``expires_at``."""
    status, reason = session.state()
    if status == Status.ACTIVE:
        return
    raise ApplicationError(
        "session_lost" if status == Status.LOST else "session_expired",
        f"The session is {status}: {reason or 'it ended'}. Create a new one.",
        status=410,
        details={"status": status, "reason": reason, "expires_at": session.expires_at.isoformat()},
    )


def exec_session_take(*, session_id: Any, job: ExecJob) -> ExecSession:
    """Inside the job's transaction: make ``job`` the session's one job. Raise 410 (see
    exec_session_usable) or 409 ``session_busy`` if a job is queued or running in it."""
    session = ExecSession.objects.select_for_update().get(pk=session_id)
    exec_session_usable(session=session)
    _session_idle_check(session, "a session runs one job at a time. Wait for it to end.")
    # A job queued or running keeps the session from idling out; max_lifetime still holds.
    ExecSession.objects.filter(pk=session.pk).update(current_job=job, expires_at=session.max_expires_at)
    return session


def _session_idle_check(session: ExecSession, then: str) -> None:
    """Raise 409 ``session_busy``, its message ending with ``then``, if a job is queued or running in
    ``session``. A job cancelled while it ran still holds the session until its worker closes it:
    the worker still has its sandbox (and, killed by the cancel, ends the session ``lost`` with it)."""
    current = session.current_job_id
    unfinished = ~Q(status__in=ExecJob.FINISHED) | Q(status=ExecJob.Status.CANCELLED, closed_at__isnull=True)
    if current is not None and ExecJob.objects.filter(unfinished, pk=current).exists():
        raise ApplicationError(
            "session_busy", f"A job is queued or running in this session; {then}", details={"job": str(current)}
        )


def exec_session_delete(*, session: ExecSession, ended_too: bool = True) -> ExecSession:
    """End an active session now: its job (if any) is cancelled, its holder kills its sandbox at
    its next lease round, and its files are deleted (an expired or lost session's stay readable).
    Deleting an ended session deletes its files too and changes nothing else; with ``ended_too``
    False (the admin's "End"), one that has ended, if only just now, is left as it is, files and all."""
    ended = _session_end(session_id=session.pk, status=Status.DELETED, reason="it was deleted")
    if ended or ended_too:
        WorkFile.objects.filter(session=session).delete()
    session.refresh_from_db()
    if ended and session.current_job_id:
        from execution.services.jobs import exec_job_cancel

        job = ExecJob.objects.filter(pk=session.current_job_id, status=ExecJob.Status.RUNNING).first()
        if job is not None:
            try:
                exec_job_cancel(job=job)
            except ApplicationError:  # it ended meanwhile
                pass
    return session


def session_file_upload(*, session: ExecSession, path: str, content: bytes) -> WorkFile:
    """Store a file for the session's /work; its sandbox gets it with the session's next job.
    Raise ``invalid_path`` (400), 410 (see exec_session_usable), ``files_too_large`` or
    ``too_many_files`` (413)."""
    work_path_check(path)
    with transaction.atomic():
        session = ExecSession.objects.select_for_update().get(pk=session.pk)
        exec_session_usable(session=session)
        [row] = session_files_put(session=session, files={path: content})
    return row


def session_files_put(*, session: ExecSession, files: dict[str, bytes]) -> list[WorkFile]:
    """Store ``files`` (paths checked) as the session's uploads, each within the quota and clashing
    with no other file, in order; return their rows. In the caller's transaction, which holds the
    session's row (an upload, or a job that brings files)."""
    sizes = dict(WorkFile.objects.filter(session=session).values_list("path", "size"))
    work_paths_clash(list(files), sizes)  # one that replaces a file of its path is no clash
    put = []
    total = sum(sizes.values())  # kept as each file is put: not summed again for each
    for path, content in files.items():
        total += len(content) - sizes.get(path, 0)
        sizes[path] = len(content)
        _quota_check(count=len(sizes), size=total)
        row, _ = WorkFile.objects.update_or_create(
            session=session,
            path=path,
            defaults={"content": content, "size": len(content), "kind": WorkFile.Kind.INPUT, "pending": True},
        )
        put.append(row)
    return put


def session_ended_before_start(reason: str) -> str:
    """The error message (``SessionEnded``) of a job whose session ended, for ``reason``, before it started."""
    return f"its session ended before it started: {reason}"


def _session_end(*, session_id: Any, status: str, reason: str) -> bool:
    """End an active session (the database's side). A job of it still queued fails now: it would
    wait for a sandbox that is gone (or, should this be cut short, at the reaper's next round:
    exec_sessions_reap). Return whether this call ended it."""
    now = timezone.now()
    ended = ExecSession.objects.filter(pk=session_id, status=Status.ACTIVE).update(
        status=status, end_reason=reason[:500], ended_at=now
    )
    if not ended:
        return False
    logger.info("session ended", extra={"session_id": str(session_id), "status": status, "reason": reason})
    from execution.services.jobs import exec_job_fail_queued

    for job_id in ExecJob.objects.filter(session_id=session_id, status=ExecJob.Status.QUEUED).values_list("pk", flat=True):
        exec_job_fail_queued(job_id=job_id, reason=reason)
    return True


def exec_sessions_reap() -> int:
    """End the sessions past their time (``expired``) and those whose worker stopped renewing their
    lease (``lost``), and fail the jobs still queued in a session that ended. Run by the reaper.
    Return how many sessions ended."""
    now = timezone.now()
    ended = 0
    # One whose row a stuck transaction holds locked waits for a later round, not the rest of the reaper's.
    for session in ExecSession.objects.filter(status=Status.ACTIVE, expires_at__lte=now):
        status, reason = session.state()
        end = functools.partial(_session_end, session_id=session.pk, status=status, reason=reason)
        ended += unless_locked(end, what="ending a session past its time", session_id=str(session.pk)) or 0
    stale = now - timedelta(seconds=settings.PTC_JOB_LEASE_SECONDS)
    lost = list(
        ExecSession.objects.filter(status=Status.ACTIVE, heartbeat_at__lt=stale).exclude(worker="").values_list("pk", flat=True)
    )
    _reaper_found_locked.keep_only(set(lost))
    for session_id in lost:
        if _reaper_found_locked.waits(session_id):
            continue  # its worker's renewals were held up by the lock its row was held by: judged later
        end = functools.partial(
            _session_end,
            session_id=session_id,
            status=Status.LOST,
            reason="the exec worker holding its sandbox stopped (it died or lost the database)",
        )
        done = unless_locked(end, what="ending a session whose worker stopped", session_id=str(session_id))
        if done is None:
            _reaper_found_locked.held(session_id)
        ended += done or 0
    _session_jobs_fail_queued()
    return ended


def _session_jobs_fail_queued() -> None:
    """Fail the jobs still queued in a session that ended, each of which its end (``_session_end``)
    left queued: cut short after the session's UPDATE, which is committed on its own (a fail
    cancelled on a row held locked, as the reaper's statements wait on a lock a moment only; the
    database lost; the process killed). Nothing else ended such a job in time: a retry of the end
    finds the session ended already, and the job's message may wait on the queue of a worker that
    is gone, so the job stayed queued until PTC_QUEUED_MAX_SECONDS (half an hour), its client
    waiting on it, and it counted against its user's jobs at once. Each is its own item of the
    round: one whose row is held locked waits for a later round, not the rest."""
    from execution.services.jobs import exec_job_fail_queued

    ended = [status for status in Status if status != Status.ACTIVE]
    left = ExecJob.objects.filter(status=ExecJob.Status.QUEUED, session__status__in=ended)
    for job_id, reason in left.values_list("pk", "session__end_reason"):
        fail = functools.partial(exec_job_fail_queued, job_id=job_id, reason=reason)
        unless_locked(fail, what="failing a job queued in a session that ended", job_id=str(job_id))


# The sessions whose rows this process's reaper found held locked: their workers could not renew
# them meanwhile (their renewals skip a locked row), so each is judged a lease after the lock went,
# as a job or a call is; the reaper ended it lost before its worker's next renewal.
_reaper_found_locked = LockedRows(ExecSession, "pk")


# -- Sessions: the holding worker's side ---------------------------------------------------------
@dataclass
class LiveSession:
    """A session's sandbox on this worker, between jobs or running one (``busy``)."""

    sandbox: Sandbox
    user_id: int = 0
    sdk_hash: str = ""
    busy: bool = False
    idle_since: float = 0.0  # time.monotonic() when its last job ended
    # Set when this worker ended it while a job ran in it: that job's error says why.
    ended: str = ""


_live: dict[str, LiveSession] = {}
_starting: dict[str, int] = {}  # sessions whose sandbox is being started here (their users): they count as live
_live_lock = threading.Lock()


def session_sandbox_take(*, session: ExecSession, node: str) -> "LiveSession | Outcome":
    """For a claimed job of ``session`` (as read with the claim): its sandbox on this worker, marked
    busy. The session's first job claims the session for this worker (``node``) and starts it.
    Return the Outcome that ends the job when there is no sandbox to be had (the session then ends
    ``lost``), or when the session has ended."""
    status, reason = session.state()
    if status != Status.ACTIVE:
        # Its end fails its queued jobs, but this worker may take one first (its message was on this
        # worker's queue, and the end was cut short after the session's UPDATE), or the end is not
        # recorded yet (past its time, its row held locked): its sandbox, held here until the lease
        # round after the end is recorded, would run the code in a session that is over.
        return Outcome(status="failed", error=job_error("SessionEnded", session_ended_before_start(reason)))
    session_id, user_id, key = session.pk, session.user_id, str(session.pk)
    died: LiveSession | None = None
    with _live_lock:
        live = _live.get(key)
        if live is not None and not live.busy and live.sandbox.proc.poll() is None:
            live.busy = True
            return live
        if live is not None and not live.busy:
            died = _live.pop(key)
    if died is not None:  # between jobs: a thread the code left called os._exit, or the OOM killer
        died.sandbox.discard()
        return _unavailable(session_id=session_id, reason=_exited(died))
    if live is not None:
        return Outcome(status="failed", error=job_error("InternalError", "another job is running in this session"))
    claimed = ExecSession.objects.filter(pk=session_id, status=Status.ACTIVE, worker="").update(
        worker=node, heartbeat_at=timezone.now()
    )
    if not claimed:
        # Started before on a worker that is gone, or restarted under the same name: its state is gone.
        return _unavailable(session_id=session_id, reason="its sandbox is gone: the exec worker holding it stopped")
    if not _room_made(key, user_id=user_id):
        most = settings.PTC_SESSIONS_PER_WORKER
        reason = f"its exec worker holds the most sessions it may (PTC_SESSIONS_PER_WORKER, {most}), each running a job"
        _session_end(session_id=session_id, status=Status.LOST, reason=f"its sandbox could not start: {reason}")
        return Outcome(status="failed", error=job_error("SandboxCrashed", f"the session's sandbox could not start: {reason}"))
    try:
        sandbox = sandbox_start()
    except Exception as exc:  # SandboxUnavailable, or any start failure: the session can't live
        with _live_lock:
            del _starting[key]
        _session_end(session_id=session_id, status=Status.LOST, reason=f"its sandbox could not start: {exc}")
        return Outcome(status="failed", error=job_error("SandboxCrashed", f"the session's sandbox could not start: {exc}"))
    live = LiveSession(sandbox=sandbox, user_id=user_id, busy=True)
    with _live_lock:
        del _starting[key]
        _live[key] = live
    return live


def _room_made(key: str, *, user_id: int) -> bool:
    """Make room on this worker for session ``key``'s sandbox (``user_id``'s), which is then
    starting: past PTC_SESSIONS_PER_WORKER (each may hold up to its memory limit, for as long as
    its idle timeout), end an idle session, ``expired``, and kill its sandbox: one of the user who
    has the most here (the newcomer's counted), idle the longest. So a user making sessions ends
    their own before anyone else's. Return False if every one is running a job (or starting)."""
    with _live_lock:
        evicted: tuple[str, LiveSession] | None = None
        if len(_live) + len(_starting) >= settings.PTC_SESSIONS_PER_WORKER:
            held = Counter([*(live.user_id for live in _live.values()), *_starting.values(), user_id])
            idle = [(-held[live.user_id], live.idle_since, other) for other, live in _live.items() if not live.busy]
            if not idle:
                return False
            *_, other = min(idle)
            evicted = other, _live.pop(other)
        _starting[key] = user_id
    if evicted is not None:
        most = settings.PTC_SESSIONS_PER_WORKER
        reason = (
            f"idle the longest of its user's on its exec worker, which keeps at most {most} (PTC_SESSIONS_PER_WORKER), "
            "when a new one came"
        )
        # Ended before its sandbox is killed (which waits for it): a job of it taken meanwhile
        # finds it expired, and says so, not that its worker stopped.
        _session_end(session_id=evicted[0], status=Status.EXPIRED, reason=reason)
        evicted[1].sandbox.discard()
    return True


def _exited(live: LiveSession) -> str:
    return f"its sandbox exited between jobs (status {live.sandbox.proc.returncode}): a thread the code left ended it"


def _unavailable(*, session_id: Any, reason: str) -> Outcome:
    """End the session ``lost`` for ``reason`` (unless it has ended already, for its own reason);
    return the Outcome that ends its job."""
    if not _session_end(session_id=session_id, status=Status.LOST, reason=reason):
        session = ExecSession.objects.filter(pk=session_id).first()
        reason = f"it is {session.status}: {session.end_reason}" if session else "it was deleted"
    return Outcome(status="failed", error=job_error("SessionEnded", f"the session's sandbox is not available: {reason}"))


def session_sandbox_release(*, session_id: Any, live: LiveSession, kept: bool, sdk_hash: str) -> None:
    """After a job in the session: keep its sandbox for the next job, or, if the job's end killed it
    (timeout, cancel, crash) or the session ended meanwhile, drop it and end the session ``lost``."""
    key = str(session_id)
    with _live_lock:
        live.busy = False
        if kept and not live.ended:
            live.sdk_hash = sdk_hash
            live.idle_since = time.monotonic()
            return
        _live.pop(key, None)
    live.sandbox.discard()
    if not live.ended:
        _session_end(
            session_id=session_id,
            status=Status.LOST,
            reason="its sandbox was killed when a job in it ended (timeout, cancel or crash)",
        )


def session_file_withdraw(*, session: ExecSession, path: str) -> None:
    """Withdraw an upload the session's sandbox has not received yet (one that can't be written
    there, say). Raise ``not_found`` (404), ``conflict`` (409) for a file already in /work (the
    code removes it), ``session_busy`` (409) while a job runs (it may be taking the upload)."""
    with transaction.atomic():
        session = ExecSession.objects.select_for_update().get(pk=session.pk)
        row = WorkFile.objects.filter(session=session, path=path).first()
        if row is None:
            raise ApplicationError("not_found", f"The session has no file {path[:100]!r}.", status=404)
        if not row.pending:
            raise ApplicationError(
                "conflict",
                f"The file {path[:100]!r} is in the session's /work already: remove it from code (os.remove).",
            )
        _session_idle_check(session, "it may be taking the upload: withdraw it after.")
        row.delete()


def session_job_done(*, job_id: Any, session_id: Any, outcome: Outcome, files_sent: list[tuple[int, datetime]]) -> None:
    """Record what a session's job left: its files under /work (upserted within the session's
    quota, removed ones deleted), the uploads it received, and the session's next expiry."""
    now = timezone.now()
    with transaction.atomic():
        session = ExecSession.objects.select_for_update().filter(pk=session_id).first()
        if session is None or session.status == Status.DELETED:
            return  # deleted while the job ran: its files went with it
        for pk, updated_at in files_sent:  # an upload replaced meanwhile stays pending: it was not the one sent
            WorkFile.objects.filter(pk=pk, updated_at=updated_at).update(pending=False)
        removed = [path for path in outcome.files_removed if not unstorable(path)]  # no row has any other
        WorkFile.objects.filter(session=session, path__in=removed, pending=False).delete()
        written, omitted = _store_files(
            outcome=outcome, existing=WorkFile.objects.filter(session=session), lookup={"session": session}
        )
        ExecJob.objects.filter(pk=job_id).update(output_files=written, output_files_omitted=omitted)
        ExecSession.objects.filter(pk=session_id).update(last_used_at=now, jobs_run=session.jobs_run + 1)


def exec_session_job_ended(*, session_id: Any, job_id: Any) -> None:
    """A job of the session ended, however (finished, cancelled while queued, reaped): the session
    is free and idles from now. Idempotent; a later job's take is left alone."""
    session = ExecSession.objects.filter(pk=session_id, status=Status.ACTIVE, current_job_id=job_id).first()
    if session is None:
        return
    now = timezone.now()
    ExecSession.objects.filter(pk=session_id, status=Status.ACTIVE, current_job_id=job_id).update(
        current_job=None,
        last_used_at=now,
        expires_at=min(session.max_expires_at, now + timedelta(seconds=session.idle_timeout_seconds)),
    )


def job_files_done(*, job_id: Any, outcome: Outcome) -> None:
    """Record the files a job without a session wrote, as its output files, within the quota."""
    with transaction.atomic():
        job = ExecJob.objects.get(pk=job_id)
        existing = WorkFile.objects.filter(exec_job=job, kind=WorkFile.Kind.OUTPUT)
        lookup = {"exec_job": job, "kind": WorkFile.Kind.OUTPUT}
        written, omitted = _store_files(outcome=outcome, existing=existing, lookup=lookup)
        ExecJob.objects.filter(pk=job_id).update(output_files=written, output_files_omitted=omitted)


def _store_files(
    *, outcome: Outcome, existing: QuerySet[WorkFile], lookup: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[str]]:
    """Upsert the files of ``outcome`` (rows found by ``lookup`` and the path) into ``existing``'s
    set while the set stays within the quota. Return the files stored (``{"path", "size"}``) and the
    paths left out."""
    stored = list(existing.values_list("path", "size", "pending"))
    sizes = {path: size for path, size, _ in stored}
    # A session's upload that came while the job ran is newer than what the code wrote: it stays.
    uploaded = {path for path, _, pending in stored if pending}
    written: list[dict[str, Any]] = []
    omitted = [storable(path) for path in outcome.files_omitted]
    for item in outcome.files:
        path, data = item.get("path"), item.get("data")
        try:
            work_path_check(path)
            content = base64.b64decode(data if isinstance(data, str) else "", validate=True)
        except (ApplicationError, binascii.Error, ValueError):
            # A name that can't be a stored file's (not UTF-8, a newline, too long): named, as
            # storable, among those left out; the job's other files are stored all the same.
            if isinstance(path, str):
                omitted.append(storable(path))
            continue
        assert isinstance(path, str)
        if path in uploaded:
            continue
        others = {p: s for p, s in sizes.items() if p != path}
        if len(others) + 1 > settings.PTC_FILES_MAX_COUNT or sum(others.values()) + len(content) > settings.PTC_FILES_MAX_BYTES:
            omitted.append(path)
            continue
        WorkFile.objects.update_or_create(
            **lookup,
            path=path,
            defaults={"content": content, "size": len(content), "kind": WorkFile.Kind.OUTPUT, "pending": False},
        )
        sizes[path] = len(content)
        written.append({"path": path, "size": len(content)})
    return written, omitted


def session_job_inputs(*, session_id: Any) -> tuple[dict[str, str], list[tuple[int, datetime]]]:
    """The session's uploaded files its sandbox has not received yet, base64 by path, and which
    versions they are (id, updated_at), to mark them received after the job."""
    rows = list(WorkFile.objects.filter(session_id=session_id, pending=True))
    return _encoded(rows), [(row.pk, row.updated_at) for row in rows]


def job_inputs(*, job_id: Any) -> dict[str, str]:
    """A job's own input files, base64 by path."""
    return _encoded(WorkFile.objects.filter(exec_job_id=job_id, kind=WorkFile.Kind.INPUT))


# What a session's sandbox is started with and keeps for its life. The rest of a job's limits (its
# timeout, calls, calls at once, output, client wait) are the policy's as that job is made.
SANDBOX_LIMITS = ("memory_mb", "max_processes", "max_file_mb", "max_open_files")


def session_limits(*, session: ExecSession, job: Limits) -> Limits:
    """A job's limits in the session: ``job``'s, the policy's now (a policy made sequential, or its
    max_tool_calls lowered, after the session opened holds its next job), with the sandbox's own."""
    return Limits.from_dict({**job.as_dict(), **{k: session.limits[k] for k in SANDBOX_LIMITS if k in session.limits}})


def session_guest_limits(*, session: ExecSession) -> dict[str, int]:
    """The rlimits the session's sandbox sets once, at its first job. CPU time adds up over the
    sandbox's life, so its limit is the session's max_lifetime, not one job's timeout."""
    return Limits.from_dict({**session.limits, "timeout": session.max_lifetime_seconds}).guest()


def exec_sessions_heartbeat() -> None:
    """On a worker, every PTC_JOB_HEARTBEAT_SECONDS: renew the lease of each session it holds, and
    kill the sandbox of each one that is no longer active (expired, deleted, lost)."""
    with _live_lock:
        keys = list(_live)
    if not keys:
        return
    # Those whose rows are held locked now are skipped (SKIP LOCKED, in its transaction): one such row
    # held up the renewal of all, up to PTC_DB_STATEMENT_TIMEOUT at each, and the reaper ended every
    # other session of this worker lost, their sandboxes killed, as it held them.
    with transaction.atomic():
        free = ExecSession.objects.select_for_update(skip_locked=True).filter(pk__in=keys, status=Status.ACTIVE)
        ExecSession.objects.filter(pk__in=free.values("pk")).update(heartbeat_at=timezone.now())
    active = {str(pk) for pk in ExecSession.objects.filter(pk__in=keys, status=Status.ACTIVE).values_list("pk", flat=True)}
    # Why each ended goes into the error of a job running in it (SessionEnded): expired, deleted or lost, and why.
    ended = {
        str(pk): f"it is {status}: {reason}" if reason and status != Status.DELETED else f"it is {status}"
        for pk, status, reason in ExecSession.objects.filter(pk__in=set(keys) - active).values_list("pk", "status", "end_reason")
    }
    for key in set(keys) - active:
        _live_kill(key=key, reason=ended.get(key, "it was deleted"))
    with _live_lock:  # a sandbox that exited between jobs: its session ends now, not at its next job
        gone = [key for key, live in _live.items() if not live.busy and live.sandbox.proc.poll() is not None]
        died = {key: _live.pop(key) for key in gone}
    for key, live in died.items():
        live.sandbox.discard()
        _session_end(session_id=key, status=Status.LOST, reason=_exited(live))


def _live_kill(*, key: str, reason: str) -> None:
    """Kill a held session's sandbox. One running a job is killed there; that job's loop sees it
    die and releases it."""
    with _live_lock:
        live = _live.get(key)
        if live is None:
            return
        live.ended = reason
        if not live.busy:
            _live.pop(key)
    if live.busy:
        live.sandbox.proc.kill()
    else:
        live.sandbox.discard()
    logger.info("session sandbox killed", extra={"session_id": key, "reason": reason})


def exec_sessions_shutdown() -> None:
    """A worker's warm shutdown (its jobs have finished): end every session it holds, ``lost``,
    and kill their sandboxes. Their next job gets 410 ``session_lost`` at once, not a hang."""
    with _live_lock:
        keys = list(_live)
    for key in keys:
        _live_kill(key=key, reason="its worker shut down")
        try:
            _session_end(session_id=key, status=Status.LOST, reason="the exec worker holding its sandbox shut down")
        except Exception:  # the database is away: the lease lapses and the reaper ends it
            logger.warning("could not end a session at shutdown", extra={"session_id": key}, exc_info=True)
