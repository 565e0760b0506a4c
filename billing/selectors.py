from datetime import datetime, time, timedelta

from django.contrib.auth.models import User
from django.db.models import F, OuterRef, QuerySet, Subquery, Sum
from django.db.models.functions import Coalesce, TruncDate
from django.utils import timezone

from billing.models import CreditAccount, CreditUsage, LedgerEntry, Reservation


def usage_for(*, user: User) -> QuerySet[CreditUsage]:
    """Return the usage rows ``user`` may see: their own, all of them for staff."""
    rows = CreditUsage.objects.all()
    return rows if user.is_staff else rows.filter(user=user)


def ledger_mismatches() -> list[tuple[CreditAccount, int, int]]:
    """Return every account whose balance is not the sum of its ledger: (account, balance, ledger sum).

    Also every account whose ``reserved`` is not the sum of its held reservations, as (account,
    reserved, held sum).
    """
    # One statement, so one snapshot: calls that hold and settle credits while it reads (a live
    # fleet) change an account and its rows in one transaction, and are seen whole or not at all.
    # Read in two, an account's `reserved` and its reservations came from two moments.
    ledger = LedgerEntry.objects.filter(account=OuterRef("pk")).values("account").annotate(total=Sum("delta")).values("total")
    held = (
        Reservation.objects.filter(account=OuterRef("pk"), status=Reservation.Status.HELD)
        .values("account")
        .annotate(total=Sum("amount"))
        .values("total")
    )
    bad: list[tuple[CreditAccount, int, int]] = []
    for account in CreditAccount.objects.annotate(
        ledger_sum=Coalesce(Subquery(ledger), 0), held_sum=Coalesce(Subquery(held), 0)
    ).order_by("pk"):
        if account.balance != account.ledger_sum:
            bad.append((account, account.balance, account.ledger_sum))
        if account.reserved != account.held_sum:
            bad.append((account, account.reserved, account.held_sum))
    return bad


def usage_by_day(*, days: int = 30, group: str = "toolset") -> tuple[list[str], dict[str, list[int]]]:
    """Return the last ``days`` dates and, per toolset (or per user), the credits spent each day."""
    start = (timezone.now() - timedelta(days=days - 1)).date()
    dates = [(start + timedelta(days=i)).isoformat() for i in range(days)]
    key = F("tool_call_meta__toolsetKey") if group == "toolset" else F("user__username")
    # Its days by this clock, the rows' times by the database's (the settle's now()): one ahead of
    # this one dated a row after today, and dates.index() failed the page. It waits for its day.
    end = start + timedelta(days=days - 1)
    # By the times themselves, which created_at's index serves: by their dates (created_at__date,
    # a cast of each row's time) every row of the table was read, a row a call ever charged.
    since = timezone.make_aware(datetime.combine(start, time.min))
    until = timezone.make_aware(datetime.combine(end + timedelta(days=1), time.min))
    rows = (
        CreditUsage.objects.filter(created_at__gte=since, created_at__lt=until)
        .annotate(day=TruncDate("created_at"), series=key)
        .values("day", "series")
        .annotate(total=Sum("amount"))
    )
    series: dict[str, list[int]] = {}
    for row in rows:
        values = series.setdefault(str(row["series"]), [0] * days)
        values[dates.index(row["day"].isoformat())] += row["total"]
    return dates, series


def credits_held(*, tool_call_ids: list[str]) -> set[str]:
    """Return which of the calls have credits held. A call's price is held as it is made, and is
    settled or released as it ends, whatever its tool's billing says by then (a toolset turned free
    or private while its calls waited)."""
    if not tool_call_ids:
        return set()
    held = Reservation.objects.filter(tool_call_id__in=tool_call_ids, status=Reservation.Status.HELD)
    return set(held.values_list("tool_call_id", flat=True))


def reservations_held(*, older_than_seconds: int) -> list[str]:
    """Return the calls whose credits have been held longer than ``older_than_seconds``: the
    reaper asks execution how each ended, and settles or releases them."""
    cutoff = timezone.now() - timedelta(seconds=older_than_seconds)
    return list(
        Reservation.objects.filter(status=Reservation.Status.HELD, created_at__lt=cutoff).values_list("tool_call_id", flat=True)
    )
