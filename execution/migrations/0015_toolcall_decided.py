from django.db import migrations, models

from ptcproject.postgres.operations import AddIndexConcurrently


class Migration(migrations.Migration):
    # Built concurrently on PostgreSQL: calls go on being written while it builds.
    atomic = False

    dependencies = [
        ("execution", "0014_execjob_last_call_at"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="toolcall",
            index=models.Index(fields=["decision", "-id"], condition=~models.Q(decision=""), name="toolcall_decided"),
        ),
    ]
