from django.conf import settings
from django.db import models


class Policy(models.Model):
    """The one rollout policy row (pk 1). Seeded from the PTC_* variables; the admin owns it after."""

    class Mode(models.TextChoices):
        OFF = "off"
        ON = "on"
        PARTIAL = "partial"

    class Debug(models.TextChoices):
        NONE = "", "none"
        OPT_IN = "opt-in"
        OPT_OUT = "opt-out"

    mode = models.CharField(max_length=16, choices=Mode.choices, default=Mode.ON)
    user_allowlist = models.JSONField(default=list, blank=True, help_text="Usernames; used when mode is partial.")
    toolset_allowlist = models.JSONField(default=list, blank=True, help_text="When not empty, only these toolsets.")
    toolset_blocklist = models.JSONField(default=list, blank=True, help_text="Never these toolsets; beats the allowlist.")
    rollout_percent = models.PositiveSmallIntegerField(default=100)
    rollout_salt = models.CharField(max_length=64, blank=True)
    debug = models.CharField(max_length=16, choices=Debug.choices, default=Debug.NONE, blank=True)
    sequential = models.BooleanField(default=False)
    default_timeout = models.PositiveIntegerField()
    max_timeout = models.PositiveIntegerField()
    direct_only_tools = models.JSONField(default=list, blank=True)
    max_tool_calls = models.PositiveIntegerField()
    max_parallel_tool_calls = models.PositiveIntegerField()
    max_output_bytes = models.PositiveIntegerField()
    memory_limit_mb = models.PositiveIntegerField()
    # Tenant quotas: each user's default (a user's own settings override it); 0 means no limit.
    # Past one, POST /exec answers 429 rate_limited with Retry-After.
    max_concurrent_jobs = models.PositiveIntegerField(
        default=0, help_text="Jobs one user may have queued or running; 0: no limit."
    )
    max_concurrent_tool_calls = models.PositiveIntegerField(
        default=0, help_text="Tool calls one user may have in flight; 0: no limit. Also caps each job's parallel calls."
    )
    max_jobs_per_minute = models.PositiveIntegerField(default=0, help_text="Jobs one user may submit in any 60 s; 0: no limit.")
    # Seconds a job may spend waiting on its client (client tools, approvals) without it counting
    # against its timeout; past that, waiting counts.
    max_client_wait = models.PositiveIntegerField(default=600)
    approval_for_writes = models.BooleanField(
        default=False, help_text="Every call of a tool not read_only waits for an approval."
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "policy"

    def __str__(self) -> str:
        return f"PTC policy (mode {self.mode})"


class PolicyChange(models.Model):
    """One edit of the policy: who, when, and each field's old and new value."""

    policy = models.ForeignKey(Policy, on_delete=models.CASCADE, related_name="changes")
    changed_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    changed_at = models.DateTimeField(auto_now_add=True)
    changes = models.JSONField(help_text='{"field": [old, new], ...}')

    class Meta:
        ordering = ["-changed_at"]

    def __str__(self) -> str:
        return f"{', '.join(self.changes)} by {self.changed_by or 'system'} at {self.changed_at:%Y-%m-%d %H:%M:%S}"
