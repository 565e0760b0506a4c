"""Credits: quote a call, reserve before it runs, settle on success, release otherwise; grants.

Every balance change happens inside ``transaction.atomic()`` with the account row locked, and
writes a ledger entry in the same transaction: the balance always equals the sum of the ledger.
"""

import json
import logging
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.contrib.auth.models import User
from django.db import connection, transaction
from django.db.models import F, Max, Sum
from django.utils import timezone

from billing.models import CreditAccount, CreditUsage, Discount, LedgerEntry, Reservation
from ptcproject.errors import ApplicationError
from ptcproject.storage import BIGINT_MAX, BIGINT_MIN
from tools.models import Tool, Toolset

logger = logging.getLogger("ptc.billing")


class CreditsRefused(Exception):
    """A call can't be paid for: ``code`` is ``insufficient_credits`` or ``budget_exceeded``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Quote:
    amount: int  # what the call will cost
    due_amount: int  # its list price
    meta: dict[str, str]
    account_id: int  # whose credits pay for it


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
    up, and a price above zero costs at least 1.
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
    if plan is not None and plan.free_tool_access:
        return Quote(amount=0, due_amount=due, meta=meta, account_id=account.pk)
    discounts = Discount.objects.filter(toolset=toolset)
    if plan is not None:
        discounts = discounts | Discount.objects.filter(plan=plan)
    percent = discounts.aggregate(best=Max("percent"))["best"] or 0
    amount = math.ceil(due * (100 - percent) / 100)
    if due > 0:
        amount = max(amount, 1)
    return Quote(amount=amount, due_amount=due, meta=meta, account_id=account.pk)


def credits_reserve(*, user: User, tool_call_id: str, quote: Quote, exec_job: Any = None, max_credits: int | None = None) -> None:
    """Hold ``quote.amount`` for the call before it runs, or raise CreditsRefused.

    The account row is locked, so parallel calls are serialised here: the held total can never
    exceed the balance, and a job's calls can never exceed its budget.
    """
    account_id = quote.account_id
    if max_credits is None or exec_job is None:
        _hold(account_id=account_id, tool_call_id=tool_call_id, quote=quote, exec_job=exec_job)
        return
    with transaction.atomic():
        CreditAccount.objects.select_for_update().filter(pk=account_id).first()  # one budget check at a time
        spent = (
            Reservation.objects.filter(exec_job=exec_job)
            .exclude(status=Reservation.Status.RELEASED)
            .aggregate(total=Sum("amount"))["total"]
            or 0
        )
        if spent + quote.amount > max_credits:
            raise CreditsRefused(
                "budget_exceeded",
                f"this call costs {quote.amount} credits and the job has {max_credits - spent} of its "
                f"{max_credits}-credit budget left",
            )
        _hold(account_id=account_id, tool_call_id=tool_call_id, quote=quote, exec_job=exec_job)


def _hold(*, account_id: int, tool_call_id: str, quote: Quote, exec_job: Any) -> None:
    if connection.vendor == "postgresql":
        held = _reserve_in_one_statement(account_id=account_id, tool_call_id=tool_call_id, quote=quote, exec_job=exec_job)
    else:
        with transaction.atomic():
            held = _reserve_in_two(account_id=account_id, tool_call_id=tool_call_id, quote=quote, exec_job=exec_job)
    if not held:
        available = CreditAccount.objects.filter(pk=account_id).values_list(F("balance") - F("reserved"), flat=True)[0]
        raise CreditsRefused(
            "insufficient_credits", f"this call costs {quote.amount} credits and {max(available, 0)} are available"
        )


# The account's row lock is the one every call of a user queues on, from the bridge (reserve) and
# from the tools workers (settle). On PostgreSQL the hold and the reservation are one statement, so
# the lock lasts microseconds, never a client round trip; elsewhere (SQLite, which has no
# data-modifying CTE and takes a database lock anyway) they are two, in the caller's transaction.
_RESERVE_SQL = """
WITH held AS (
    UPDATE billing_creditaccount SET reserved = reserved + %(amount)s, updated_at = now()
    WHERE id = %(account)s AND balance >= reserved + %(amount)s
    RETURNING id
)
INSERT INTO billing_reservation (account_id, tool_call_id, exec_job_id, amount, due_amount, meta, status, created_at)
SELECT id, %(call)s, %(job)s, %(amount)s, %(due)s, %(meta)s, 'held', now() FROM held
RETURNING id
"""


def _reserve_in_one_statement(*, account_id: int, tool_call_id: str, quote: Quote, exec_job: Any) -> bool:
    params = {
        "account": account_id,
        "amount": quote.amount,
        "call": tool_call_id,
        "due": quote.due_amount,
        "job": getattr(exec_job, "pk", None),
        "meta": json.dumps(quote.meta),
    }
    with connection.cursor() as cursor:
        cursor.execute(_RESERVE_SQL, params)
        return cursor.fetchone() is not None


def _reserve_in_two(*, account_id: int, tool_call_id: str, quote: Quote, exec_job: Any) -> bool:
    held = CreditAccount.objects.filter(pk=account_id, balance__gte=F("reserved") + quote.amount).update(
        reserved=F("reserved") + quote.amount, updated_at=timezone.now()
    )
    if held:
        Reservation.objects.create(
            account_id=account_id,
            tool_call_id=tool_call_id,
            exec_job=exec_job,
            amount=quote.amount,
            due_amount=quote.due_amount,
            meta=quote.meta,
        )
    return bool(held)


def credits_settle(*, tool_call_id: str) -> int:
    """Turn the call's held reservation into a charge: usage row, ledger row, balance. Return the
    amount charged (0 when nothing was held). Call it inside the transaction that marks the call
    completed; a second call for the same call charges nothing."""
    reservation = (
        Reservation.objects.select_related("account").filter(tool_call_id=tool_call_id, status=Reservation.Status.HELD).first()
    )
    if reservation is None:
        return 0
    if not Reservation.objects.filter(pk=reservation.pk, status=Reservation.Status.HELD).update(
        status=Reservation.Status.SETTLED, closed_at=timezone.now()
    ):
        return 0
    account = reservation.account
    CreditUsage.objects.create(
        user_id=account.user_id,
        exec_job_id=reservation.exec_job_id,
        tool_call_id=tool_call_id,
        tool_call_meta=reservation.meta,
        amount=reservation.amount,
        due_amount=reservation.due_amount,
    )
    if reservation.amount:
        LedgerEntry.objects.create(
            account=account,
            kind=LedgerEntry.Kind.CHARGE,
            delta=-reservation.amount,
            tool_call_id=tool_call_id,
            reason=f"{reservation.meta.get('toolsetKey')}.{reservation.meta.get('toolName')} call {tool_call_id}",
        )
    # Last, so the account's row lock (which every call of this user queues on) is held only to the
    # commit: one UPDATE moves the hold into the charge.
    CreditAccount.objects.filter(pk=reservation.account_id).update(
        reserved=F("reserved") - reservation.amount, balance=F("balance") - reservation.amount, updated_at=timezone.now()
    )
    return reservation.amount


def credits_release(*, tool_call_id: str) -> None:
    """Give back what was held for a call that did not succeed. A second release does nothing."""
    with transaction.atomic():
        reservation = Reservation.objects.filter(tool_call_id=tool_call_id, status=Reservation.Status.HELD).first()
        if reservation is None:
            return
        account = CreditAccount.objects.select_for_update().get(pk=reservation.account_id)
        if Reservation.objects.filter(pk=reservation.pk, status=Reservation.Status.HELD).update(
            status=Reservation.Status.RELEASED, closed_at=timezone.now()
        ):
            account.reserved -= reservation.amount
            account.save(update_fields=["reserved", "updated_at"])


def credits_adjust(*, user: User, amount: int, reason: str, created_by: User | None = None) -> LedgerEntry:
    """Add (or with a negative amount, remove) credits, with a ledger entry. Return the entry.

    Raise ApplicationError ``validation_error`` (400), and change nothing, if the balance would leave
    the range its column holds.
    """
    kind = LedgerEntry.Kind.GRANT if created_by is None and amount >= 0 else LedgerEntry.Kind.ADJUSTMENT
    with transaction.atomic():
        account = CreditAccount.objects.select_for_update().get(pk=account_get(user=user).pk)
        if not BIGINT_MIN <= account.balance + amount <= BIGINT_MAX:
            raise ApplicationError(
                "validation_error",
                f"Invalid input. amount: the balance ({account.balance}) would leave the range "
                f"{BIGINT_MIN}..{BIGINT_MAX}; send a smaller amount.",
                details={"amount": [f"The balance would leave the range {BIGINT_MIN}..{BIGINT_MAX}."]},
            )
        account.balance += amount
        account.save(update_fields=["balance", "updated_at"])
        return LedgerEntry.objects.create(account=account, kind=kind, delta=amount, reason=reason, created_by=created_by)


def reservations_repair(*, older_than_seconds: int) -> int:
    """Close reservations whose call has ended but whose worker died between running and settling:
    settled if the record says completed, released otherwise. Return how many were closed."""
    from execution.models import ToolCall

    cutoff = timezone.now() - timedelta(seconds=older_than_seconds)
    repaired = 0
    for reservation in Reservation.objects.filter(status=Reservation.Status.HELD, created_at__lt=cutoff):
        status = ToolCall.objects.filter(call_id=reservation.tool_call_id).values_list("status", flat=True).first()
        if status == ToolCall.Status.COMPLETED:
            with transaction.atomic():
                amount = credits_settle(tool_call_id=reservation.tool_call_id)
                ToolCall.objects.filter(call_id=reservation.tool_call_id).update(credits=amount)
        elif status != ToolCall.Status.EXECUTING:
            credits_release(tool_call_id=reservation.tool_call_id)
        else:
            continue
        repaired += 1
    return repaired


def call_complete_and_settle(*, tool_call_id: str, output: Any, finished_at: Any) -> int | None:
    """PostgreSQL only: mark the call completed and settle what was held for it, in one statement.

    Every settlement of a user updates that user's account row. Done as separate statements, each
    transaction holds the row's lock from its UPDATE to its COMMIT, and under load the client's
    COMMIT waits for a busy worker's GIL while every other call of the user waits for the lock.
    Done as one statement, the lock lasts as long as PostgreSQL takes to run it. Return the credits
    charged, or None if the call had already finished (a redelivery: nothing changes).
    """
    from execution.models import ToolCall

    tables = {
        "call": ToolCall._meta.db_table,
        "reservation": Reservation._meta.db_table,
        "usage": CreditUsage._meta.db_table,
        "ledger": LedgerEntry._meta.db_table,
        "account": CreditAccount._meta.db_table,
    }
    sql = """
    WITH held AS (
        SELECT id, account_id, exec_job_id, amount, due_amount, meta FROM {reservation}
        WHERE tool_call_id = %(call)s AND status = 'held'
    ), done AS (
        UPDATE {call} SET status = 'completed', output = %(output)s::jsonb, error = NULL, finished_at = %(now)s,
               credits = COALESCE((SELECT amount FROM held), 0)
        WHERE call_id = %(call)s AND status = 'executing'
        RETURNING call_id
    ), settled AS (
        UPDATE {reservation} r SET status = 'settled', closed_at = %(now)s
        FROM held WHERE r.id = held.id AND EXISTS (SELECT 1 FROM done)
        RETURNING r.account_id, r.exec_job_id, r.amount, r.due_amount, r.meta
    ), usage AS (
        INSERT INTO {usage} (user_id, exec_job_id, tool_call_id, usage_type, tool_call_meta, amount, due_amount, created_at)
        SELECT a.user_id, s.exec_job_id, %(call)s, 'tool_call', s.meta, s.amount, s.due_amount, %(now)s
        FROM settled s JOIN {account} a ON a.id = s.account_id
    ), ledger AS (
        INSERT INTO {ledger} (account_id, kind, delta, reason, tool_call_id, created_by_id, created_at)
        SELECT s.account_id, 'charge', -s.amount,
               (s.meta ->> 'toolsetKey') || '.' || (s.meta ->> 'toolName') || ' call ' || %(call)s, %(call)s, NULL, %(now)s
        FROM settled s WHERE s.amount > 0
    ), charged AS (
        UPDATE {account} a SET reserved = a.reserved - s.amount, balance = a.balance - s.amount, updated_at = %(now)s
        FROM settled s WHERE a.id = s.account_id
    )
    SELECT (SELECT count(*) FROM done), COALESCE((SELECT amount FROM held), 0)
    """.format(**tables)  # noqa: S608 - table names from the models, values as parameters
    params = {"call": tool_call_id, "output": json.dumps(output), "now": finished_at}
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        finished, credits = cursor.fetchone()
    return credits if finished else None
