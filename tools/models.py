import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q

from ptcproject.encrypted_field import EncryptedJSONField


class Toolset(models.Model):
    class Kind(models.TextChoices):
        BUILTIN = "builtin"
        HTTP = "http"
        MCP = "mcp"
        # Tools the job's caller runs: no runner here; a call waits for its result (POST .../tool-results).
        CLIENT = "client"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    key = models.CharField(max_length=64, help_text="A Python identifier; the SDK module is ptc_tools.<key>.")
    name = models.CharField(max_length=200)
    description = models.TextField(blank=True)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    # A toolset with an owner is that user's own, and shadows a global one with the same key.
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="toolsets")
    is_global = models.BooleanField(default=True, help_text="Global toolsets are visible to all and billed.")
    enabled = models.BooleanField(default=True)
    price = models.PositiveIntegerField(default=0, help_text="Credits per successful call.")
    billing_free = models.BooleanField(default=False)
    # The Celery queue its calls go to; one of PTC_TOOLS_QUEUES, checked where it is written (the
    # API's serializer, the admin's form), so a deployment can add queues without a migration.
    queue = models.CharField(
        max_length=64, default="tools", help_text="The tools queue its calls run on, e.g. tools.slow (PTC_TOOLS_QUEUES)."
    )
    requires_approval = models.BooleanField(default=False, help_text="Every call of its tools waits for an approval.")
    config = models.JSONField(default=dict, blank=True)
    # Write-only: never serialised, exported, sent to a sandbox or logged. Encrypted at rest
    # (PTC_SECRETS_KEYS); a dict in Python.
    secrets = EncryptedJSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["key"]
        constraints = [
            models.UniqueConstraint(fields=["key"], condition=Q(owner__isnull=True), name="toolset_global_key"),
            models.UniqueConstraint(fields=["key", "owner"], name="toolset_owner_key"),
        ]

    def __str__(self) -> str:
        return self.key


class Tool(models.Model):
    class Caller(models.TextChoices):
        DIRECT = "direct"
        CODE_EXECUTION = "code_execution"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    toolset = models.ForeignKey(Toolset, on_delete=models.CASCADE, related_name="tools")
    name = models.CharField(max_length=128, help_text="A Python identifier: the SDK method's name.")
    # The server's own name for an MCP tool whose name Python can't spell (``get-issue`` → ``get_issue``).
    remote_name = models.CharField(max_length=256, blank=True, help_text="The MCP server's name, when it differs.")
    description = models.TextField(blank=True)
    input_schema = models.JSONField(default=dict)
    output_schema = models.JSONField(null=True, blank=True)
    allowed_callers = models.JSONField(default=list, blank=True)
    read_only = models.BooleanField(default=False)
    timeout = models.FloatField(null=True, blank=True, help_text="Seconds; the default applies when empty.")
    price = models.PositiveIntegerField(null=True, blank=True, help_text="Overrides the toolset's price.")
    billing_free = models.BooleanField(default=False)
    requires_approval = models.BooleanField(default=False, help_text="Each call waits for an approval before it runs.")
    enabled = models.BooleanField(default=True)
    # Kind-specific call spec, e.g. for http: {"method", "path", "query"}.
    http = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["toolset__key", "name"]
        constraints = [models.UniqueConstraint(fields=["toolset", "name"], name="tool_unique_name")]

    def __str__(self) -> str:
        return f"{self.toolset.key}.{self.name}"
