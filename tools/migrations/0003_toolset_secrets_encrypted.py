"""Toolset secrets encrypted at rest (PTC_SECRETS_KEYS; ptcproject/crypto.py).

A new encrypted column takes a copy of each row's plaintext secrets, the plaintext column is
dropped, and the new one takes its name. Reversing decrypts them back into a JSON column, which
needs a key that opens them.
"""

from django.db import migrations

import ptcproject.encrypted_field


def encrypt_secrets(apps, schema_editor):
    Toolset = apps.get_model("tools", "Toolset")
    for pk, secrets in Toolset.objects.values_list("pk", "secrets").iterator():
        # The field encrypts on write, update() included.
        Toolset.objects.filter(pk=pk).update(secrets_encrypted=secrets or {})


def decrypt_secrets(apps, schema_editor):
    Toolset = apps.get_model("tools", "Toolset")
    for pk, secrets in Toolset.objects.values_list("pk", "secrets_encrypted").iterator():
        Toolset.objects.filter(pk=pk).update(secrets=secrets or {})


class Migration(migrations.Migration):

    dependencies = [
        ("tools", "0002_tool_remote_name"),
    ]

    operations = [
        migrations.AddField(
            model_name="toolset",
            name="secrets_encrypted",
            field=ptcproject.encrypted_field.EncryptedJSONField(blank=True, default=dict),
        ),
        migrations.RunPython(encrypt_secrets, decrypt_secrets, elidable=False),
        migrations.RemoveField(
            model_name="toolset",
            name="secrets",
        ),
        migrations.RenameField(
            model_name="toolset",
            old_name="secrets_encrypted",
            new_name="secrets",
        ),
    ]
