from django.db import migrations, models

from ptcproject.postgres.operations import AddIndexConcurrently


class Migration(migrations.Migration):
    # Built concurrently on PostgreSQL: calls go on being charged while it builds.
    atomic = False

    dependencies = [
        ("billing", "0006_ledger_entry_balance_after"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="ledgerentry",
            index=models.Index(fields=["kind", "-id"], condition=~models.Q(kind="charge"), name="ledger_not_charge"),
        ),
    ]
