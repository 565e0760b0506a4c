import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone


def new_exec_call_id() -> str:
    return f"exec_{uuid.uuid4().hex}"


class ExecJobQuerySet(models.QuerySet["ExecJob"]):
    def run_here(self) -> "ExecJobQuerySet":
        """The jobs whose code runs on this deployment's workers: all but managed containers'
        (their code runs in the provider's container; their job stays ``running`` for as long as
        it calls back, holding no worker, no sandbox and no lease; the reaper closes it once idle)."""
        return self.filter(container_id="")


class ExecJob(models.Model):
    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        COMPLETED = "completed"
        FAILED = "failed"
        TIMEOUT = "timeout"
        CANCELLED = "cancelled"

    FINISHED = (Status.COMPLETED, Status.FAILED, Status.TIMEOUT, Status.CANCELLED)
    MIN_TIMEOUT = 0.1  # the least timeout a job may have, s

    objects = ExecJobQuerySet.as_manager()

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    call_id = models.CharField(max_length=64, unique=True, default=new_exec_call_id, editable=False)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="exec_jobs")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED, db_index=True)
    title = models.CharField(max_length=500, blank=True)
    code = models.TextField()
    toolsets = models.JSONField(default=list)
    sdk_hash = models.CharField(max_length=64, blank=True)
    timeout_seconds = models.FloatField()
    # The limits this job runs under, fixed from the policy when it is created.
    limits = models.JSONField(default=dict)
    # The policy said sequential: the bridge ran this job's tool calls one at a time.
    sequential = models.BooleanField(default=False)
    # The most credits this job's tool calls may cost; calls past it fail with budget_exceeded.
    max_credits = models.PositiveIntegerField(null=True, blank=True)
    # Tools the job's caller runs (POST /exec ``client_tools``): ``[{name, description, input_schema,
    # output_schema, timeout}]``; in the SDK as ``ptc_tools.client.Client``.
    client_tools = models.JSONField(default=list, blank=True)
    # Set on a managed container's job: the parent of the calls a provider's own code-execution
    # container made through POST /tools/execute with this ``container_id``. Such a job runs no code
    # here; it stays ``running`` until cancelled, or closed by the reaper after PTC_CONTAINER_IDLE_SECONDS
    # without a call (container_jobs_close_idle).
    container_id = models.CharField(max_length=200, blank=True, default="")
    # What its calls made over HTTP (POST /tools/execute: with its job-scoped key, or a managed
    # container's) added to every view of it: their arguments, results and records, in bytes. Held
    # to PTC_MAX_JOB_TOOL_BYTES with what its bridge passed (which the bridge counts itself). A
    # container's call in flight holds PTC_MAX_TOOL_OUTPUT_BYTES here for its result until it comes.
    http_tool_bytes = models.BigIntegerField(default=0, editable=False)
    # Its calls over HTTP with its key may be recorded only as admitted under this, by its bridge
    # (calls._job_call_admit, under the row's lock). The bridge raises it before it stops counting
    # calls admitted and left unrecorded past two heartbeats (their web process died, or stalls):
    # one that goes on after is refused as it records the call, and asks again, so no call the
    # bridge no longer counts is made and the job's limits hold exactly.
    http_admit_epoch = models.PositiveIntegerField(default=0, editable=False)
    # A managed container's job: when a call of it was last recorded or returned, set by the
    # statement that counts that call's bytes above (calls._job_bytes_take), under the row's lock.
    # The reaper's idle close scans this, not the calls. Null on other jobs, and on containers' jobs
    # made before it was kept (their calls tell, and the reaper sets it from them). Not indexed:
    # the open containers' jobs are found by status, and an update of it stays heap-only.
    last_call_at = models.DateTimeField(null=True, blank=True, editable=False)
    # The session it ran in (its sandbox kept between jobs), or null for a sandbox of its own.
    session = models.ForeignKey("ExecSession", null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs")
    # The files under /work the code wrote or changed, ``[{"path", "size"}]``, and those left out
    # (over the quota): contents are WorkFile rows (the session's, or this job's outputs).
    output_files = models.JSONField(default=list, blank=True)
    output_files_omitted = models.JSONField(default=list, blank=True)
    stdout = models.TextField(blank=True)
    stderr = models.TextField(blank=True)
    stdout_truncated = models.BooleanField(default=False)
    stderr_truncated = models.BooleanField(default=False)
    return_value = models.JSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)
    # Timings of each phase, in milliseconds: queue wait, sandbox start, run, and so on.
    timings = models.JSONField(default=dict, blank=True)
    worker = models.CharField(max_length=200, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # Set with its final status by whoever then closes it (its calls, its key, its end announced).
    # A cancel of a running job leaves that to its worker: if the worker dies first, the reaper does.
    # Jobs that ended before it was added have it only if they were cancelled.
    closed_at = models.DateTimeField(null=True, blank=True, editable=False)
    # Set when retention emptied its code, output, return value and its calls' inputs and outputs
    # (execution/services/retention.py); the rows and their charges stay.
    purged_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["user", "-created_at"]),
            # The admin's list, newest first: without it each load read and sorted every job. Set at
            # insert and never changed, so a job's updates stay heap-only.
            models.Index(fields=["-created_at"], name="execjob_created"),
            models.Index(fields=["status", "heartbeat_at"]),
            # Retention's scan: finished jobs not purged yet, oldest first.
            models.Index(fields=["finished_at"], condition=models.Q(purged_at__isnull=True), name="execjob_unpurged_finished"),
            # The reaper's scan for ended jobs not closed yet (a handful at most: those cancelled as
            # they ran, or waiting for their calls, whose worker has not closed them yet).
            models.Index(
                fields=["finished_at"],
                condition=models.Q(finished_at__isnull=False, closed_at__isnull=True),
                name="execjob_ended_unclosed",
            ),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["user", "container_id"], condition=~models.Q(container_id=""), name="execjob_one_per_container"
            )
        ]

    def __str__(self) -> str:
        return self.call_id

    @property
    def success(self) -> bool | None:
        if self.status not in self.FINISHED:
            return None
        return self.status == self.Status.COMPLETED

    @property
    def execution_time_seconds(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return round((self.finished_at - self.started_at).total_seconds(), 4)


class ToolCall(models.Model):
    class Type(models.TextChoices):
        PTC = "ptc"
        STANDALONE = "standalone"

    class Status(models.TextChoices):
        EXECUTING = "executing"
        # Waiting on the job's caller to run a client tool and post its result (POST .../tool-results).
        AWAITING_CLIENT = "awaiting_client"
        # Waiting for staff or the job's owner to approve or deny it (POST /tool-calls/{id}/approval).
        AWAITING_APPROVAL = "awaiting_approval"
        COMPLETED = "completed"
        FAILED = "failed"

    class Decision(models.TextChoices):
        NONE = "", "none"
        APPROVED = "approved"
        DENIED = "denied"

    # A call in one of these has not finished: its code is still waiting on it.
    OPEN = (Status.EXECUTING, Status.AWAITING_CLIENT, Status.AWAITING_APPROVAL)
    AWAITING = (Status.AWAITING_CLIENT, Status.AWAITING_APPROVAL)

    # Unique by Meta's constraint: ``unique=True`` would add a second index for LIKE that nothing uses.
    call_id = models.CharField(max_length=80)
    type = models.CharField(max_length=16, choices=Type.choices)
    # No index of their own: Meta's (exec_job, started_at) and (user, -started_at) lead with them.
    exec_job = models.ForeignKey(
        ExecJob, null=True, blank=True, on_delete=models.CASCADE, related_name="tool_calls", db_index=False
    )
    ptc_call_id = models.CharField(max_length=64, blank=True)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="tool_calls", db_index=False)
    toolset_key = models.CharField(max_length=64)
    tool_name = models.CharField(max_length=128)
    # Null when the call named a toolset or tool that does not exist; kept if the tool is removed.
    tool = models.ForeignKey("tools.Tool", null=True, blank=True, on_delete=models.SET_NULL, related_name="calls")
    input = models.JSONField(default=dict)
    output = models.JSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)
    status = models.CharField(max_length=24, choices=Status.choices, default=Status.EXECUTING)
    credits = models.PositiveIntegerField(default=0)
    # Set by the tools task that took the call; a redelivered task finds it set and does not run again.
    claimed_at = models.DateTimeField(null=True, blank=True)
    # The claiming tools worker renews this while the call runs; a lapsed lease means it died.
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    # The approval of a call that needed one: who decided, when, what and why (the audit trail).
    decision = models.CharField(max_length=16, choices=Decision.choices, default=Decision.NONE, blank=True)
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="tool_call_decisions"
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    decision_reason = models.CharField(max_length=500, blank=True)
    # Who called it from code, as the caller said (POST /tools/execute ``caller``: {type, tool_id}).
    caller = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["started_at", "id"]
        # Every call writes its row twice (recorded, finished), each time into every index: only
        # what queries use. The reaper and the metrics look calls up by status.
        indexes = [
            models.Index(fields=["exec_job", "started_at"]),
            models.Index(fields=["user", "-started_at"]),
            models.Index(fields=["status"], name="toolcall_status"),
            # The admin's list by decision, newest first: only the calls decided (a tool that needs
            # approval), so a call of any other tool writes nothing to it.
            models.Index(fields=["decision", "-id"], condition=~models.Q(decision=""), name="toolcall_decided"),
        ]
        constraints = [models.UniqueConstraint(fields=["call_id"], name="toolcall_call_id_unique")]

    def __str__(self) -> str:
        return self.call_id

    @property
    def duration_ms(self) -> float | None:
        if self.finished_at is None:
            return None
        return round((self.finished_at - self.started_at).total_seconds() * 1000, 2)


class ExecSession(models.Model):
    """A sandbox kept alive between jobs: its globals, imports and ``/work`` persist. It lives on one
    exec worker (``worker``, a Celery node name: its jobs go to that worker's direct queue), which
    renews ``heartbeat_at`` while it holds it. The database is the truth: the holder kills the
    sandbox of a session that is no longer active here."""

    class Status(models.TextChoices):
        ACTIVE = "active"
        EXPIRED = "expired"  # idle_timeout or max_lifetime passed
        DELETED = "deleted"  # DELETE /sessions/{id}
        LOST = "lost"  # its worker died or shut down, or its sandbox was killed (a job's timeout, cancel, crash)

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="exec_sessions")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE, db_index=True)
    # Why it ended, for a person: shown in the 410 a job in it gets.
    end_reason = models.CharField(max_length=500, blank=True)
    toolsets = models.JSONField(default=list)
    # The limits its sandbox was started with; they hold for every job (each job keeps its own timeout).
    limits = models.JSONField(default=dict)
    idle_timeout_seconds = models.FloatField()
    max_lifetime_seconds = models.FloatField()
    # The Celery node name of the exec worker holding its sandbox; empty until its first job runs.
    worker = models.CharField(max_length=200, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    # The job queued or running in it (one at a time), or null.
    current_job = models.ForeignKey("ExecJob", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    jobs_run = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    last_used_at = models.DateTimeField()
    # When it ends if nothing uses it: min(last use + idle_timeout, max_expires_at); while a job is
    # queued or running, max_expires_at.
    expires_at = models.DateTimeField(db_index=True)
    max_expires_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["user", "status"]), models.Index(fields=["status", "heartbeat_at"])]

    def __str__(self) -> str:
        return str(self.id)

    def state(self) -> tuple[str, str]:
        """Its status and end reason as of now: one past its time but not reaped yet is expired
        now, not at the reaper's next round (which records it)."""
        if self.status == self.Status.ACTIVE and self.expires_at <= timezone.now():
            if self.expires_at >= self.max_expires_at:
                return self.Status.EXPIRED, f"it reached its max_lifetime of {self.max_lifetime_seconds:g} s"
            return self.Status.EXPIRED, f"it was idle for its idle_timeout of {self.idle_timeout_seconds:g} s"
        return self.status, self.end_reason


class WorkFile(models.Model):
    """A file of ``/work``, stored here so the web process and the worker need share no disk: a
    session's files (uploaded, or written by its code), or a job's input and output files."""

    class Kind(models.TextChoices):
        INPUT = "input"  # given by the client
        OUTPUT = "output"  # written by the code

    session = models.ForeignKey(ExecSession, null=True, blank=True, on_delete=models.CASCADE, related_name="files")
    exec_job = models.ForeignKey(ExecJob, null=True, blank=True, on_delete=models.CASCADE, related_name="files")
    kind = models.CharField(max_length=8, choices=Kind.choices)
    path = models.CharField(max_length=1024)
    content = models.BinaryField()
    size = models.PositiveBigIntegerField()
    # A session's uploaded file that its sandbox has not received yet: sent with its next job.
    pending = models.BooleanField(default=False)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["path"]
        # The admin's file list by kind and by pending, newest first: either kind may be the rare
        # one, and a pending upload is (sent with its session's next job), each found otherwise by
        # reading every file newer than the oldest of them. Only pending uploads are in the second.
        indexes = [
            models.Index(fields=["kind", "-id"], name="workfile_kind"),
            models.Index(fields=["-id"], condition=models.Q(pending=True), name="workfile_pending"),
        ]
        constraints = [
            models.UniqueConstraint(fields=["session", "path"], name="workfile_session_path"),
            models.UniqueConstraint(fields=["exec_job", "kind", "path"], name="workfile_job_kind_path"),
        ]

    def __str__(self) -> str:
        return self.path
