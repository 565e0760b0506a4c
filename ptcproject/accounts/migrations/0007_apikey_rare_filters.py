from django.db import migrations, models

from ptcproject.postgres.operations import AddIndexConcurrently


class Migration(migrations.Migration):
    # Built concurrently on PostgreSQL: keys go on being made while they build.
    atomic = False

    dependencies = [
        ("accounts", "0006_apikey_created"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="apikey",
            index=models.Index(fields=["-created_at"], condition=models.Q(expires_at__isnull=True), name="apikey_unexpiring"),
        ),
        AddIndexConcurrently(
            model_name="apikey",
            index=models.Index(fields=["-created_at"], condition=models.Q(revoked_at__isnull=True), name="apikey_unrevoked"),
        ),
    ]
