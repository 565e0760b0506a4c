from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("execution", "0012_execjob_ended_unclosed"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddIndex(
            model_name="execjob",
            index=models.Index(fields=["-created_at"], name="execjob_created"),
        ),
    ]
