from django.db import migrations, models

from ptcproject.postgres.operations import AddIndexConcurrently


class Migration(migrations.Migration):
    # Built concurrently on PostgreSQL: files go on being written while they build.
    atomic = False

    dependencies = [
        ("execution", "0015_toolcall_decided"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="workfile",
            index=models.Index(fields=["kind", "-id"], name="workfile_kind"),
        ),
        AddIndexConcurrently(
            model_name="workfile",
            index=models.Index(fields=["-id"], condition=models.Q(pending=True), name="workfile_pending"),
        ),
    ]
