import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone


class ApiKey(models.Model):
    """A bearer key. Only its SHA-256 is stored; the plaintext is shown once, at creation.

    The key reads ``ptc_<prefix>_<secret>``: the prefix finds the row, the hash proves the secret.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    key_hash = models.CharField(max_length=64, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    # Set on a job-scoped key: valid only for that job's toolsets, only while it runs, and only
    # at POST /api/v1/tools/execute. Revoked when the job ends.
    exec_job = models.ForeignKey(
        "execution.ExecJob", null=True, blank=True, on_delete=models.CASCADE, related_name="keys", editable=False
    )

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"
        # Every job has a key: the admin's list, newest first, sorted them all each load without it.
        # Set once, at insert: a key's updates (last_used_at) stay heap-only.
        indexes = [
            models.Index(fields=["-created_at"], name="apikey_created"),
            # The list's filters for the rare keys among the jobs' (one that does not expire, one not
            # revoked), found otherwise by reading every key newer than the oldest of them (a user's
            # own, with no job, is found by exec_job's index). A job's key is in the second until its
            # job ends: its revoke is then not heap-only, once a job.
            models.Index(fields=["-created_at"], condition=models.Q(expires_at__isnull=True), name="apikey_unexpiring"),
            models.Index(fields=["-created_at"], condition=models.Q(revoked_at__isnull=True), name="apikey_unrevoked"),
        ]

    def __str__(self) -> str:
        return f"ptc_{self.prefix}_… ({self.user})"

    @property
    def is_active(self) -> bool:
        now = timezone.now()
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)


class ApiKeyEvent(models.Model):
    """One change to a key: who did what to it, and when. Written with the change, never edited."""

    class Action(models.TextChoices):
        CREATED = "created"
        EXPIRY_SET = "expiry_set"
        REVOKED = "revoked"

    key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="events")
    # Null when the system acted (a command, a job's end); kept when the acting user is deleted.
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    action = models.CharField(max_length=16, choices=Action.choices)
    # What changed: {"expires_at": [old, new]} for an expiry; where it came from (api, admin, cli).
    details = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key event"

    def __str__(self) -> str:
        return f"{self.action} ptc_{self.key.prefix}_… by {self.actor or 'system'} at {self.created_at:%Y-%m-%d %H:%M:%S}"


class UserSettings(models.Model):
    """What an operator sets for one user, over the deployment's defaults (admin: "User settings")."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="ptc_settings")
    retention_days = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text=(
            "Days a finished job's code, output, return value and tool-call inputs/outputs are kept. "
            "0: purged as soon as the job has finished (at the next purge round). Empty: PTC_RETENTION_DAYS."
        ),
    )

    # The user's own quotas over the policy's: empty uses the policy's, 0 means no limit.
    max_concurrent_jobs = models.PositiveIntegerField(null=True, blank=True, help_text="Empty: the policy's. 0: no limit.")
    max_concurrent_tool_calls = models.PositiveIntegerField(null=True, blank=True, help_text="Empty: the policy's. 0: no limit.")
    max_jobs_per_minute = models.PositiveIntegerField(null=True, blank=True, help_text="Empty: the policy's. 0: no limit.")

    class Meta:
        verbose_name = "user settings"
        verbose_name_plural = "user settings"

    def __str__(self) -> str:
        return f"settings of {self.user}"
