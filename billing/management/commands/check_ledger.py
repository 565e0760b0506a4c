from typing import Any

from django.core.management.base import BaseCommand, CommandError

from billing.selectors import ledger_mismatches
from ptcproject.db import statement_timeout_off


class Command(BaseCommand):
    help = "Check that every balance equals the sum of its ledger, and every hold its reservations."

    def handle(self, *args: Any, **options: Any) -> None:
        with statement_timeout_off():  # the whole ledger summed: on a large one, past PTC_DB_STATEMENT_TIMEOUT
            bad = ledger_mismatches()
        for account, stored, expected in bad:
            self.stderr.write(f"{account.user}: stored {stored}, the records say {expected}")
        if bad:
            raise CommandError(f"{len(bad)} account(s) do not match their ledger.")
        self.stdout.write("Every balance equals the sum of its ledger.")
