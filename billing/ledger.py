"""The ledger's three moves on a call's credits: reserve before it runs, settle when it completed,
release when it did not. They touch billing's tables only, and run inside the caller's
transaction: execution flips its call's row, then settles (a batch's failed calls released with
them: ``close_many``), in one ``atomic()`` (or, for one account's calls on PostgreSQL, in its own
statement: ``PostgresLedger.settling``).

Two backends behind one interface, chosen once by the database:
- ``PostgresLedger``: each move is one statement (data-modifying CTEs), and a reserve holds a
  whole burst of calls at once. Every call of a user updates that user's account row; as one
  statement, the row's lock lasts as long as PostgreSQL takes to run it, never a client round trip
  (a busy worker's GIL must not hold every other call of the user). Settle runs last in its
  transaction, so the lock is held from it to the COMMIT only.
- ``OrmLedger``: the same moves through the ORM, for SQLite (no data-modifying CTEs; it takes a
  database-wide lock anyway).
"""

import functools
import json
from dataclasses import dataclass
from typing import Any

from django.db import connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from billing.models import CreditAccount, CreditUsage, LedgerEntry, Reservation

_TABLES = {
    "account": CreditAccount._meta.db_table,
    "reservation": Reservation._meta.db_table,
    "usage": CreditUsage._meta.db_table,
    "ledger": LedgerEntry._meta.db_table,
}


@dataclass(frozen=True)
class Hold:
    """What to hold for one call: ``amount``, of its list price ``due_amount``."""

    tool_call_id: str
    amount: int
    due_amount: int
    meta: dict[str, Any]


class Ledger:
    def reserve(self, *, account_id: int, holds: list[Hold], exec_job_id: Any) -> bool:
        """Hold every one of ``holds`` if the account has their total available, or none of them.
        Return whether they were held. A total of 0 (calls free by a discount) is always held: it
        takes nothing, even from an account staff took below what it holds."""
        raise NotImplementedError

    def settle(self, *, tool_call_id: str) -> int:
        """Turn the call's held reservation into a charge: usage row, ledger row, balance. Return
        the amount charged (0 when nothing was held). A second settle charges nothing."""
        return self.settle_many(tool_call_ids=[tool_call_id]).get(tool_call_id, 0)

    def settle_many(self, *, tool_call_ids: list[str]) -> dict[str, int]:
        """``settle`` for calls of one account at once. Return the amount charged for each call
        that had a hold (the others had none, or were settled already)."""
        raise NotImplementedError

    def release(self, *, tool_call_id: str) -> None:
        """Give back what was held for the call. A second release does nothing."""
        raise NotImplementedError

    def close_many(self, *, settle: list[str], release: list[str]) -> dict[str, int]:
        """``settle_many`` for the calls ``settle`` and ``release`` for those of ``release``, all of
        one account, at once. Return what ``settle_many`` returns."""
        charged = self.settle_many(tool_call_ids=settle)
        for tool_call_id in release:
            self.release(tool_call_id=tool_call_id)
        return charged


class PostgresLedger(Ledger):
    RESERVE = """
    WITH held AS (
        UPDATE {account} SET reserved = reserved + %(total)s, updated_at = now()
        WHERE id = %(account_id)s AND (%(total)s = 0 OR balance >= reserved + %(total)s)
        RETURNING id
    )
    INSERT INTO {reservation} (account_id, tool_call_id, exec_job_id, amount, due_amount, meta, status, created_at)
    SELECT held.id, c.call, %(job)s, c.amount, c.due, c.meta, 'held', now()
    FROM held, jsonb_to_recordset(%(holds)s::jsonb) AS c(call text, amount bigint, due bigint, meta jsonb)
    """.format(**_TABLES)  # noqa: S608 - table names from the models, values as parameters
    # One statement for a batch of one account's calls (a fan-out finishing together): the account's
    # row is updated once, with the batch's total; each call settled gets its usage and ledger row,
    # each released (a failed call) gives back its hold. The calls are those the queries {calls} and
    # {released} name: settling() gives these CTEs to a caller's statement. One UPDATE of the account
    # for both: a row updated twice in one statement is updated once, by either (PostgreSQL's WITH).
    _SETTLED = """
    settled AS (
        UPDATE {reservation} SET status = 'settled', closed_at = now()
        WHERE tool_call_id = ANY(ARRAY({{calls}})) AND status = 'held'
        RETURNING tool_call_id, account_id, exec_job_id, amount, due_amount, meta
    ), usage AS (
        INSERT INTO {usage} (user_id, exec_job_id, tool_call_id, usage_type, tool_call_meta, amount, due_amount, created_at)
        SELECT a.user_id, s.exec_job_id, s.tool_call_id, 'tool_call', s.meta, s.amount, s.due_amount, now()
        FROM settled s JOIN {account} a ON a.id = s.account_id
    ), ledger AS (
        INSERT INTO {ledger} (account_id, kind, delta, reason, tool_call_id, created_by_id, created_at)
        SELECT s.account_id, 'charge', -s.amount,
               (s.meta ->> 'toolsetKey') || '.' || (s.meta ->> 'toolName') || ' call ' || s.tool_call_id,
               s.tool_call_id, NULL, now()
        FROM settled s WHERE s.amount > 0
    )""".format(**_TABLES)  # noqa: S608 - table names from the models, values as parameters
    _CHARGED = """, charged AS (
        UPDATE {account} a SET reserved = a.reserved - t.total, balance = a.balance - t.total, updated_at = now()
        FROM (SELECT account_id, sum(amount) AS total FROM settled GROUP BY account_id) t WHERE a.id = t.account_id
    )
    """.format(**_TABLES)  # noqa: S608
    _RELEASED_CHARGED = """, released AS (
        UPDATE {reservation} SET status = 'released', closed_at = now()
        WHERE tool_call_id = ANY(ARRAY({{released}})) AND status = 'held'
        RETURNING account_id, amount
    ), charged AS (
        UPDATE {account} a SET reserved = a.reserved - t.held, balance = a.balance - t.spent, updated_at = now()
        FROM (
            SELECT account_id, sum(amount) AS held, sum(spent) AS spent
            FROM (SELECT account_id, amount, amount AS spent FROM settled UNION ALL SELECT account_id, amount, 0 FROM released) c
            GROUP BY account_id
        ) t WHERE a.id = t.account_id
    )
    """.format(**_TABLES)  # noqa: S608

    @classmethod
    def settling(cls, calls: str, released: str = "") -> str:
        """The CTEs (``settled``, ``usage``, ``ledger``, ``charged``) that settle the calls of one
        account that the query ``calls`` names, and release those ``released`` names (if given): a
        caller's statement that ends calls closes their holds with its own, in one round trip (each
        call settled or released, as settle and release do, only if held)."""
        return (cls._SETTLED + (cls._RELEASED_CHARGED if released else cls._CHARGED)).format(calls=calls, released=released)

    _GIVEN = {"calls": "SELECT unnest(%(calls)s::text[])", "released": "SELECT unnest(%(released)s::text[])"}
    SETTLE = "WITH " + (_SETTLED + _CHARGED).format(**_GIVEN) + "SELECT tool_call_id, amount FROM settled"  # noqa: S608
    CLOSE = "WITH " + (_SETTLED + _RELEASED_CHARGED).format(**_GIVEN) + "SELECT tool_call_id, amount FROM settled"  # noqa: S608
    RELEASE = """
    WITH released AS (
        UPDATE {reservation} SET status = 'released', closed_at = now()
        WHERE tool_call_id = %(call)s AND status = 'held'
        RETURNING account_id, amount
    )
    UPDATE {account} a SET reserved = a.reserved - r.amount, updated_at = now()
    FROM released r WHERE a.id = r.account_id
    """.format(**_TABLES)  # noqa: S608

    def reserve(self, *, account_id: int, holds: list[Hold], exec_job_id: Any) -> bool:
        params = {
            "account_id": account_id,
            "total": sum(hold.amount for hold in holds),
            "job": exec_job_id,
            # One JSON parameter, not four arrays: 0.07 ms less a hold (as the finish of calls).
            "holds": json.dumps(
                [{"call": h.tool_call_id, "amount": h.amount, "due": h.due_amount, "meta": h.meta} for h in holds]
            ),
        }
        with connection.cursor() as cursor:
            cursor.execute(self.RESERVE, params)
            return cursor.rowcount == len(holds)

    def settle_many(self, *, tool_call_ids: list[str]) -> dict[str, int]:
        return self.close_many(settle=tool_call_ids, release=[])

    def close_many(self, *, settle: list[str], release: list[str]) -> dict[str, int]:
        # One statement, the account's row updated once (the hold given back and the charge), where
        # a settle and a release a call were a statement each, the row's lock held from the first.
        with connection.cursor() as cursor:
            if release:
                cursor.execute(self.CLOSE, {"calls": settle, "released": release})
            else:
                cursor.execute(self.SETTLE, {"calls": settle})
            return {call_id: int(amount) for call_id, amount in cursor.fetchall()}

    def release(self, *, tool_call_id: str) -> None:
        with connection.cursor() as cursor:
            cursor.execute(self.RELEASE, {"call": tool_call_id})


class OrmLedger(Ledger):
    def settle_many(self, *, tool_call_ids: list[str]) -> dict[str, int]:
        charged = {}
        for call_id in tool_call_ids:
            amount = self._settle_one(call_id)
            if amount is not None:
                charged[call_id] = amount
        return charged

    def reserve(self, *, account_id: int, holds: list[Hold], exec_job_id: Any) -> bool:
        total = sum(hold.amount for hold in holds)
        with transaction.atomic():
            affords = Q() if total == 0 else Q(balance__gte=F("reserved") + total)
            held = CreditAccount.objects.filter(affords, pk=account_id).update(
                reserved=F("reserved") + total, updated_at=timezone.now()
            )
            if held:
                Reservation.objects.bulk_create(
                    Reservation(
                        account_id=account_id,
                        tool_call_id=hold.tool_call_id,
                        exec_job_id=exec_job_id,
                        amount=hold.amount,
                        due_amount=hold.due_amount,
                        meta=hold.meta,
                    )
                    for hold in holds
                )
        return bool(held)

    def _settle_one(self, tool_call_id: str) -> int | None:
        reservation = (
            Reservation.objects.select_related("account")
            .filter(tool_call_id=tool_call_id, status=Reservation.Status.HELD)
            .first()
        )
        if reservation is None:
            return None
        if not Reservation.objects.filter(pk=reservation.pk, status=Reservation.Status.HELD).update(
            status=Reservation.Status.SETTLED, closed_at=timezone.now()
        ):
            return None
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
        # Last, so the account's row lock (which every call of this user queues on) is held only
        # to the commit: one UPDATE moves the hold into the charge.
        CreditAccount.objects.filter(pk=reservation.account_id).update(
            reserved=F("reserved") - reservation.amount, balance=F("balance") - reservation.amount, updated_at=timezone.now()
        )
        return reservation.amount

    def release(self, *, tool_call_id: str) -> None:
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


@functools.cache
def ledger() -> Ledger:
    """The ledger of this deployment's database, chosen once."""
    return PostgresLedger() if connection.vendor == "postgresql" else OrmLedger()
