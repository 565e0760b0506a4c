"""Credits: accounts, plans, discounts, reservations, usage rows and the append-only ledger.

Prices live on the toolset and the tool rows (``Toolset.price``, ``Tool.price``, ``billing_free``),
where the toolset API writes them; this app decides what a call costs and keeps the books.
"""

from django.conf import settings
from django.db import models
from django.db.models import Q


class Plan(models.Model):
    key = models.SlugField(max_length=32, unique=True)
    name = models.CharField(max_length=100)
    free_tool_access = models.BooleanField(default=False, help_text="Tool calls cost 0 while the plan lasts.")

    def __str__(self) -> str:
        return self.key


class CreditAccount(models.Model):
    """A user's credits. ``balance`` always equals the sum of the ledger; ``reserved`` is the sum
    of held reservations. What a new call may spend is ``balance - reserved``."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="credit_account")
    balance = models.BigIntegerField(default=0)
    reserved = models.BigIntegerField(default=0)
    plan = models.ForeignKey(Plan, null=True, blank=True, on_delete=models.SET_NULL)
    plan_expires_at = models.DateTimeField(null=True, blank=True, help_text="Empty: the plan does not expire.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.CheckConstraint(condition=Q(reserved__gte=0), name="account_reserved_not_negative")]

    def __str__(self) -> str:
        return f"{self.user}: {self.balance}"


class Discount(models.Model):
    """A percentage off the list price: for a plan's users, for a toolset, or for a plan's users on
    a toolset (both set). The largest that applies to a call applies."""

    plan = models.ForeignKey(Plan, null=True, blank=True, on_delete=models.CASCADE, related_name="discounts")
    toolset = models.ForeignKey("tools.Toolset", null=True, blank=True, on_delete=models.CASCADE, related_name="discounts")
    percent = models.PositiveSmallIntegerField()
    note = models.CharField(max_length=200, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(percent__lte=100), name="discount_percent_at_most_100"),
            models.CheckConstraint(
                condition=Q(plan__isnull=False) | Q(toolset__isnull=False), name="discount_has_plan_or_toolset"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.percent}% off for {self.plan or self.toolset}"


class Reservation(models.Model):
    """Credits held for one call while it runs: settled into a charge on success, released otherwise."""

    class Status(models.TextChoices):
        HELD = "held"
        SETTLED = "settled"
        RELEASED = "released"

    account = models.ForeignKey(CreditAccount, on_delete=models.CASCADE, related_name="reservations")
    tool_call_id = models.CharField(max_length=80, unique=True)
    # Kept when its job is deleted (the admin's delete): deleted with it, a held one took its
    # credits out of what the account may spend for good (``reserved`` counts it, and nothing was
    # left to release), and check_ledger failed. Kept, the reaper releases it (tool_calls_close_held:
    # a call with no record whose job is not running can never run), as usage rows are kept.
    exec_job = models.ForeignKey("execution.ExecJob", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    amount = models.PositiveIntegerField()
    due_amount = models.PositiveIntegerField()
    meta = models.JSONField(default=dict)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.HELD, db_index=True)
    created_at = models.DateTimeField(auto_now_add=True)
    closed_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.tool_call_id}: {self.amount} {self.status}"


class CreditUsage(models.Model):
    class UsageType(models.TextChoices):
        TOOL_CALL = "tool_call"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="credit_usage")
    exec_job = models.ForeignKey("execution.ExecJob", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    tool_call_id = models.CharField(max_length=80)
    usage_type = models.CharField(max_length=16, choices=UsageType.choices, default=UsageType.TOOL_CALL)
    tool_call_meta = models.JSONField(default=dict)
    amount = models.PositiveIntegerField(help_text="Charged, after discounts and plans.")
    due_amount = models.PositiveIntegerField(help_text="The list price.")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [models.UniqueConstraint(fields=["tool_call_id", "usage_type"], name="usage_once_per_call")]

    def __str__(self) -> str:
        return f"{self.tool_call_id}: {self.amount}"


class LedgerEntry(models.Model):
    """One change of a balance, never edited or deleted. The balance is the sum of these."""

    class Kind(models.TextChoices):
        GRANT = "grant"
        CHARGE = "charge"
        REFUND = "refund"
        ADJUSTMENT = "adjustment"

    account = models.ForeignKey(CreditAccount, on_delete=models.PROTECT, related_name="ledger")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    delta = models.BigIntegerField()
    reason = models.CharField(max_length=300)
    tool_call_id = models.CharField(max_length=80, blank=True, db_index=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    # The one-time token of the form that made it (the admin's grant): the same form posted again (a
    # resubmit, a double click) is refused for an account it already changed, not granted twice.
    idempotency_key = models.UUIDField(null=True, blank=True)
    # The balance this entry left, for a grant or adjustment (credits_adjust): a repeat of a grant
    # over the API is answered with it, as the first post was. Not derivable from the ledger: a
    # call's charge may draw its id before its account's row is locked, so ids need not follow the
    # order the balance moved in.
    balance_after = models.BigIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "ledger entries"
        # The admin's list by kind, newest first, for the kinds other than a call's charge (grants,
        # refunds, adjustments: a few among millions of charges, found by reading every entry newer
        # than them). A charge, the bulk, is found at the top of the primary key and not indexed here.
        indexes = [models.Index(fields=["kind", "-id"], condition=~Q(kind="charge"), name="ledger_not_charge")]
        constraints = [
            # A call is charged at most once, however often its task is delivered.
            models.UniqueConstraint(fields=["tool_call_id"], condition=Q(kind="charge"), name="ledger_one_charge_per_call"),
            # A form's token changes an account once, however often it is posted.
            models.UniqueConstraint(
                fields=["account", "idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                name="ledger_once_per_idempotency_key",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.delta:+d} {self.reason}"
