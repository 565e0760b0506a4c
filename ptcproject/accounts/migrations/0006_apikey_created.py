from django.db import migrations, models

from ptcproject.postgres.operations import AddIndexConcurrently


class Migration(migrations.Migration):
    # Built concurrently on PostgreSQL: keys go on being made (one a job) while it builds.
    atomic = False

    dependencies = [
        ("accounts", "0005_usersettings_quotas"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="apikey",
            index=models.Index(fields=["-created_at"], name="apikey_created"),
        ),
    ]
