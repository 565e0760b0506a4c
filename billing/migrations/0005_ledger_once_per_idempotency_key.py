from django.db import migrations, models

from ptcproject.postgres.operations import AddConstraintConcurrently


class Migration(migrations.Migration):
    # Built concurrently on PostgreSQL: entries go on being written while it builds. A migration of
    # its own, so that a build cut off is built again alone (0004's column stays added and recorded).
    atomic = False

    dependencies = [
        ("billing", "0004_ledger_entry_idempotency_key"),
    ]

    operations = [
        AddConstraintConcurrently(
            model_name="ledgerentry",
            constraint=models.UniqueConstraint(
                condition=models.Q(("idempotency_key__isnull", False)),
                fields=("account", "idempotency_key"),
                name="ledger_once_per_idempotency_key",
            ),
        ),
    ]
