"""Credits: quote a call, reserve before it runs, settle on success, release otherwise; grants.

Every balance change happens inside ``transaction.atomic()`` with the account row locked, and
writes a ledger entry in the same transaction: the balance always equals the sum of the ledger.
"""

import logging
import math
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib.auth.models import User
from django.db import connection, transaction
from django.db.models import F, Max, Q, Sum
from django.utils import timezone

from billing.ledger import Hold, ledger
from billing.models import CreditAccount, Discount, LedgerEntry, Reservation
from ptcproject.errors import ApplicationError
from ptcproject.storage import BIGINT_MAX, BIGINT_MIN
from tools.models import Tool, Toolset

logger = logging.getLogger("ptc.billing")


class CreditsRefused(ApplicationError):
    """A call can't be paid for: ``code`` is ``insufficient_credits`` or ``budget_exceeded``."""


@dataclass(frozen=True)
class Quote:
    amount: int  # what the call will cost
    due_amount: int  # its list price
    meta: dict[str, str]
    account_id: int  # whose credits pay for it
    until: datetime | None = None  # when the plan it was priced by ends: a later call is priced anew

    def holds_at(self, now: datetime) -> bool:
        return self.until is None or now < self.until


def account_get(*, user: User) -> CreditAccount:
    account, _ = CreditAccount.objects.get_or_create(user=user)
    return account


def billable(*, toolset: Toolset, tool: Tool) -> bool:
    """Return True if a successful call of ``tool`` is billed: a global toolset, neither of them free."""
    return toolset.is_global and not toolset.billing_free and not tool.billing_free


def price_quote(*, user: User, toolset: Toolset, tool: Tool) -> Quote | None:
    """Return what a successful call costs ``user``, or None when it is never billed.

    Billed only for global toolsets that are not free and whose tool is not free. The tool's
    price overrides the toolset's. A plan with free tool access makes it 0 (the list price is still
    recorded); otherwise the largest discount for the user's plan or the toolset applies, rounded
    up, and a price above zero costs at least 1 unless the discount is 100%.
    """
    if not billable(toolset=toolset, tool=tool):
        return None
    due = tool.price if tool.price is not None else toolset.price
    meta = {"toolName": tool.name, "toolsetKey": toolset.key}
    account = account_get(user=user)
    now = timezone.now()
    plan = account.plan
    if plan is not None and account.plan_expires_at is not None and account.plan_expires_at <= now:
        plan = None  # expired: neither free access nor the plan's discounts
    until = account.plan_expires_at if plan is not None else None
    if plan is not None and plan.free_tool_access:
        return Quote(amount=0, due_amount=due, meta=meta, account_id=account.pk, until=until)
    # A discount names a plan, a toolset, or both (that plan's users on that toolset): each one it
    # names must be the call's. Either alone matched before, so a plan's discount on one toolset
    # went to everyone on it, and to the plan's users on every toolset.
    discounts = Discount.objects.filter(Q(toolset=toolset) | Q(toolset__isnull=True), Q(plan=plan) | Q(plan__isnull=True))
    percent = discounts.aggregate(best=Max("percent"))["best"] or 0
    amount = math.ceil(due * (100 - percent) / 100)
    if due > 0 and percent < 100:  # rounding never makes a priced call free; 100% off does
        amount = max(amount, 1)
    return Quote(amount=amount, due_amount=due, meta=meta, account_id=account.pk, until=until)


def credits_reserve(
    *, user: User, holds: list[tuple[str, Quote]], exec_job: Any = None, max_credits: int | None = None
) -> dict[str, CreditsRefused]:
    """Hold each call's quote ``(tool_call_id, quote)`` before it runs, in order; return the calls
    refused, by id. The quotes are ``user``'s.

    One statement holds a whole burst when the account (and the job's budget, ``max_credits``) has
    its total; otherwise each call is held or refused on its own, in order. The account row is
    locked by each hold, so parallel calls are serialised: the held total can never exceed the
    balance, and a job's calls can never exceed its budget.
    """
    if len(holds) > 1 and _hold_all(holds, exec_job=exec_job, max_credits=max_credits, refuse=False):
        return {}
    refused = {}
    for call_id, quote in holds:
        try:
            _hold_all([(call_id, quote)], exec_job=exec_job, max_credits=max_credits, refuse=True)
        except CreditsRefused as exc:
            refused[call_id] = exc
    return refused


def _hold_all(holds: list[tuple[str, Quote]], *, exec_job: Any, max_credits: int | None, refuse: bool) -> bool:
    """Hold all of ``holds`` or none. Return whether they were held; with ``refuse``, raise
    CreditsRefused rather than return False."""
    amount = sum(quote.amount for _, quote in holds)
    account_id = holds[0][1].account_id
    rows = [Hold(tool_call_id=call_id, amount=q.amount, due_amount=q.due_amount, meta=q.meta) for call_id, q in holds]
    job_id = getattr(exec_job, "pk", None)
    with transaction.atomic() if max_credits is not None and exec_job is not None else nullcontext():
        if max_credits is not None and exec_job is not None:
            CreditAccount.objects.select_for_update().filter(pk=account_id).first()  # one budget check at a time
            spent = (
                Reservation.objects.filter(exec_job=exec_job)
                .exclude(status=Reservation.Status.RELEASED)
                .aggregate(total=Sum("amount"))["total"]
                or 0
            )
            if spent + amount > max_credits:
                if not refuse:
                    return False
                raise CreditsRefused(
                    "budget_exceeded",
                    f"this call costs {_credits(amount)} and the job has {max_credits - spent} of its "
                    f"{max_credits}-credit budget (max_credits) left: no more priced calls can run in this job",
                )
        if ledger().reserve(account_id=account_id, holds=rows, exec_job_id=job_id):
            return True
    if not refuse:
        return False
    available = CreditAccount.objects.filter(pk=account_id).values_list(F("balance") - F("reserved"), flat=True)[0]
    raise CreditsRefused(
        "insufficient_credits",
        f"this call costs {_credits(amount)} and {max(available, 0)} are available: "
        "ask an operator for credits (POST /api/v1/billing/credits), then call again",
    )


def _credits(amount: int) -> str:
    return f"{amount} credit{'' if amount == 1 else 's'}"


def credits_settle(*, tool_call_id: str) -> int:
    """Turn the call's held reservation into a charge. Return the amount charged (0 when nothing
    was held). Call it inside the transaction that marks the call completed, after that UPDATE; a
    second settle charges nothing."""
    return ledger().settle(tool_call_id=tool_call_id)


def credits_settle_many(*, tool_call_ids: list[str]) -> dict[str, int]:
    """``credits_settle`` for calls of one user at once, in one statement on PostgreSQL. Return the
    amount charged for each call that had a hold. Lock order is the caller's: one user per call."""
    return ledger().settle_many(tool_call_ids=tool_call_ids)


def credits_close_many(*, settle: list[str], release: list[str]) -> dict[str, int]:
    """``credits_settle_many`` for the calls ``settle`` (completed) and ``credits_release`` for those
    of ``release`` (failed), all of one user, in one statement on PostgreSQL. Return what
    ``credits_settle_many`` returns. Lock order is the caller's, as there."""
    return ledger().close_many(settle=settle, release=release)


def credits_release(*, tool_call_id: str) -> None:
    """Give back what was held for a call that did not succeed. A second release does nothing."""
    ledger().release(tool_call_id=tool_call_id)


def credits_adjust(
    *, user: User, amount: int, reason: str, created_by: User | None = None, idempotency_key: uuid.UUID | None = None
) -> LedgerEntry:
    """Add (or with a negative amount, remove) credits, with a ledger entry. Return the entry.

    Raise ApplicationError ``validation_error`` (400), and change nothing, if the balance would leave
    the range its column holds; ``conflict`` (409), and change nothing, if the account already has an
    entry made with ``idempotency_key`` (the same form posted twice).
    """
    kind = LedgerEntry.Kind.GRANT if created_by is None and amount >= 0 else LedgerEntry.Kind.ADJUSTMENT
    with transaction.atomic():
        account = CreditAccount.objects.select_for_update().get(pk=account_get(user=user).pk)
        # Under the account's lock: two posts of one form at once are checked one after the other
        # (the unique constraint stands behind it).
        done = account.ledger.filter(idempotency_key=idempotency_key).first() if idempotency_key else None
        if done is not None:
            raise ApplicationError(
                "conflict",
                f"This form was applied already: {done.delta:+d} credits ({done.reason}) at "
                f"{done.created_at.isoformat()}; nothing was changed again. To change the balance once more, open the form anew.",
                status=409,
            )
        if not BIGINT_MIN <= account.balance + amount <= BIGINT_MAX:
            raise ApplicationError(
                "validation_error",
                f"Invalid input. amount: the balance ({account.balance}) would leave the range "
                f"{BIGINT_MIN}..{BIGINT_MAX}; send a smaller amount.",
                details={"amount": [f"The balance would leave the range {BIGINT_MIN}..{BIGINT_MAX}."]},
            )
        account.balance += amount
        account.save(update_fields=["balance", "updated_at"])
        return LedgerEntry.objects.create(
            account=account,
            kind=kind,
            delta=amount,
            reason=reason,
            created_by=created_by,
            idempotency_key=idempotency_key,
            balance_after=account.balance,
        )


# The class of the advisory locks credits_adjust_once takes, one per idempotency key (the two-key
# form: apart from the one-key locks, migrate's among them). "cred" in ASCII.
IDEMPOTENCY_LOCK_CLASS = 0x63726564


def credits_adjust_once(*, user: User, amount: int, reason: str, created_by: User, idempotency_key: uuid.UUID) -> LedgerEntry:
    """Add (or remove) credits as credits_adjust does, once for ``idempotency_key`` (a client's
    retry of one grant). Return the entry made; or, if the key made a grant of the same ``amount``
    and ``reason`` to ``user`` already, that entry, nothing changed.

    Raise ApplicationError ``conflict`` (409), and change nothing, if the key was used for a
    different grant (another user, amount or reason); and what credits_adjust raises.
    """
    with transaction.atomic():
        if connection.vendor == "postgresql":
            # The key's unique constraint is per account, and credits_adjust locks only the user's:
            # two posts with one key at once are put one after the other here, so that a retry sent
            # while its first post is being answered finds that post's entry, and one key sent for
            # two users grants one of them.
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_advisory_xact_lock(%s, %s)",
                    [IDEMPOTENCY_LOCK_CLASS, int.from_bytes(idempotency_key.bytes[:4], "big", signed=True)],
                )
        # Through the partial unique index (keyed entries only: grants, not charges).
        used = LedgerEntry.objects.filter(idempotency_key=idempotency_key).select_related("account__user")
        earlier = list(used[:2])
        if not earlier:
            return credits_adjust(user=user, amount=amount, reason=reason, created_by=created_by, idempotency_key=idempotency_key)
        same = [entry for entry in earlier if (entry.account.user_id, entry.delta, entry.reason) == (user.pk, amount, reason)]
        if len(earlier) == 1 and same:
            return same[0]
        # Two entries: the key is an admin form's token, that form applied to several accounts (one
        # entry each; the key's constraint is per account).
        other = next(entry for entry in earlier if entry not in same)
        raise ApplicationError(
            "conflict",
            f"This idempotency_key was used already for a different grant: {other.delta:+d} credits to "
            f"'{other.account.user.username}' ({other.reason}) at {other.created_at.isoformat()}; nothing was "
            "changed. To repeat that grant, send it as it was; for a new grant, send a new key.",
            status=409,
        )
