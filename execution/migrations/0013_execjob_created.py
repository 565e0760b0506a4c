from django.conf import settings
from django.db import migrations, models

from ptcproject.postgres.operations import AddIndexConcurrently


class Migration(migrations.Migration):
    # Built concurrently on PostgreSQL: jobs go on being written while it builds.
    atomic = False

    dependencies = [
        ("execution", "0012_execjob_ended_unclosed"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="execjob",
            index=models.Index(fields=["-created_at"], name="execjob_created"),
        ),
    ]
