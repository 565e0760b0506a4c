from datetime import timedelta

from django.contrib.auth.models import User
from django.db.models import F, QuerySet, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from billing.models import CreditAccount, CreditUsage


def usage_for(*, user: User) -> QuerySet[CreditUsage]:
    """Return the usage rows ``user`` may see: their own, all of them for staff."""
    rows = CreditUsage.objects.all()
    return rows if user.is_staff else rows.filter(user=user)


def ledger_mismatches() -> list[tuple[CreditAccount, int, int]]:
    """Return every account whose balance is not the sum of its ledger: (account, balance, ledger sum).

    Also every account whose ``reserved`` is not the sum of its held reservations, as (account,
    reserved, held sum).
    """
    bad: list[tuple[CreditAccount, int, int]] = []
    for summed in CreditAccount.objects.annotate(ledger_sum=Sum("ledger__delta")):
        if summed.balance != (summed.ledger_sum or 0):
            bad.append((summed, summed.balance, summed.ledger_sum or 0))
    for account in CreditAccount.objects.all():
        held = account.reservations.filter(status="held").aggregate(total=Sum("amount"))["total"] or 0
        if account.reserved != held:
            bad.append((account, account.reserved, held))
    return bad


def usage_by_day(*, days: int = 30, group: str = "toolset") -> tuple[list[str], dict[str, list[int]]]:
    """Return the last ``days`` dates and, per toolset (or per user), the credits spent each day."""
    start = (timezone.now() - timedelta(days=days - 1)).date()
    dates = [(start + timedelta(days=i)).isoformat() for i in range(days)]
    key = F("tool_call_meta__toolsetKey") if group == "toolset" else F("user__username")
    rows = (
        CreditUsage.objects.filter(created_at__date__gte=start)
        .annotate(day=TruncDate("created_at"), series=key)
        .values("day", "series")
        .annotate(total=Sum("amount"))
    )
    series: dict[str, list[int]] = {}
    for row in rows:
        values = series.setdefault(str(row["series"]), [0] * days)
        values[dates.index(row["day"].isoformat())] += row["total"]
    return dates, series
