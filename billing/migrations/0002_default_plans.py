from django.db import migrations


def create_plans(apps, schema_editor):
    Plan = apps.get_model("billing", "Plan")
    Plan.objects.get_or_create(key="free", defaults={"name": "Free", "free_tool_access": False})
    Plan.objects.get_or_create(key="plus", defaults={"name": "Plus", "free_tool_access": True})


class Migration(migrations.Migration):
    dependencies = [("billing", "0001_initial")]
    operations = [migrations.RunPython(create_plans, migrations.RunPython.noop)]
