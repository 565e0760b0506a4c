"""Toolset secrets are encrypted at rest: the database and its dumps hold Fernet tokens, the tools
worker still sends the value, keys rotate with ``ptc_rotate_secrets``, and a token no configured key
opens is an error naming PTC_SECRETS_KEYS, never an empty or garbled value."""

import io
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import connection

from ptcproject.crypto import SecretsUndecryptable, secrets_keys
from tests.conftest import Api
from tests.tools.conftest import unique_key
from tests.tools.http_api import HttpApi
from tools.models import Toolset
from tools.sdk import class_name

SECRET = f"key-{uuid.uuid4().hex}"
MANAGE = str(django_settings.BASE_DIR / "manage.py")


def raw_secrets(where: str, params: list[Any]) -> str:
    """Return the secrets column as stored, read past the model."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT secrets FROM tools_toolset WHERE {where}", params)
        (value,) = cursor.fetchone()
    return value


def new_key() -> str:
    return Fernet.generate_key().decode()


@pytest.fixture
def made_here() -> Iterator[list[Toolset]]:
    """Toolsets this test writes in its own process; deleted at the end without reading their secrets
    (some are under keys the rest of the suite doesn't have)."""
    made: list[Toolset] = []
    yield made
    Toolset.objects.filter(pk__in=[t.pk for t in made]).defer("secrets").delete()


def toolset_made_here(made: list[Toolset], secrets: dict[str, str]) -> Toolset:
    toolset = Toolset.objects.create(key=unique_key("vault"), name="Vault", kind=Toolset.Kind.HTTP, secrets=secrets)
    made.append(toolset)
    return toolset


def test_a_secret_set_through_the_api_is_only_a_token_in_the_database_and_still_reaches_the_call(
    api: Api, staff: Api, create_toolset: Callable[..., dict[str, Any]]
) -> None:
    key = unique_key("vault")
    other = f"other-{uuid.uuid4().hex}"
    with HttpApi(expected_key=SECRET) as http_api:
        create_toolset(
            {
                "key": key,
                "name": "Vault",
                "kind": "http",
                "config": {"base_url": http_api.url, "headers": {"X-Key": "{{secrets.WEATHER_KEY}}"}, "timeout": 10},
                "secrets": {"WEATHER_KEY": SECRET},
                "tools": [
                    {
                        "name": "forecast",
                        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                        "http": {"method": "GET", "path": "/forecast/{city}", "query": []},
                    }
                ],
            }
        )
        patched = staff.http.patch(f"/api/v1/toolsets/{key}", json={"secrets": {"OTHER": other}})
        assert patched.status_code == 200, patched.text
        # A name no {{secrets.NAME}} can name is refused, and nothing of the request is kept.
        for name in ("bad key!", "9LIVES", "a-b", "X\n"):
            refused = staff.http.patch(f"/api/v1/toolsets/{key}", json={"secrets": {name: "x", "KEPT": "y"}})
            assert refused.status_code == 400, (name, refused.text)
            assert refused.json()["error"]["code"] == "validation_error"
            assert "secret's name" in refused.json()["error"]["message"]

        stored = raw_secrets("key = %s AND owner_id IS NULL", [key])
        assert stored.startswith("gAAAAA")  # a Fernet token (version byte 0x80)
        assert SECRET not in stored and other not in stored and "WEATHER_KEY" not in stored
        # Nor anywhere in the row, nor in a dump of the table.
        with connection.cursor() as cursor:
            cursor.execute("SELECT t::text FROM tools_toolset t WHERE key = %s AND owner_id IS NULL", [key])
            (row,) = cursor.fetchone()
        assert SECRET not in row and other not in row
        dump = io.StringIO()
        call_command("dumpdata", "tools.toolset", stdout=dump)
        assert SECRET not in dump.getvalue() and other not in dump.getvalue()

        # The tools worker decrypts it and sends it: the local API says the key was right.
        code = f"from ptc_tools.{key} import {class_name(key)} as V\nprint(V.forecast(city='Oslo'))"
        job = api.run(code, toolsets=[key])
    assert job["status"] == "completed", job["error"]
    assert eval(job["stdout"]) == {"city": "Oslo", "query": {}, "authorized": True}
    assert Toolset.objects.get(key=key, owner=None).secrets == {"WEATHER_KEY": SECRET, "OTHER": other}


@pytest.fixture
def rotated_back(settings: Any) -> Iterator[list[str]]:
    """The suite's own keys. ptc_rotate_secrets rewrites every toolset, the live stack's too: at the
    end they are rotated back under the suite's first key, which the web and workers hold."""
    original = list(settings.PTC_SECRETS_KEYS)
    extra: list[str] = []
    yield extra
    settings.PTC_SECRETS_KEYS = [*original, *extra]
    call_command("ptc_rotate_secrets", stdout=io.StringIO())


def test_rotation_reads_under_old_keys_and_rewrites_every_row_under_the_first(
    settings: Any, made_here: list[Toolset], rotated_back: list[str]
) -> None:
    suite_keys = list(settings.PTC_SECRETS_KEYS)
    old, new = new_key(), new_key()
    rotated_back.extend([old, new])
    value = f"v-{uuid.uuid4().hex}"

    settings.PTC_SECRETS_KEYS = [old]
    toolset = toolset_made_here(made_here, {"TOKEN": value})
    written_under_old = raw_secrets("id = %s", [toolset.pk])

    # [new, old]: new writes, old still reads.
    settings.PTC_SECRETS_KEYS = [new, old, *suite_keys]
    assert Toolset.objects.get(pk=toolset.pk).secrets == {"TOKEN": value}
    settings.PTC_SECRETS_KEYS = [new]
    with pytest.raises(SecretsUndecryptable):
        Toolset.objects.get(pk=toolset.pk)

    settings.PTC_SECRETS_KEYS = [new, old, *suite_keys]
    out = io.StringIO()
    call_command("ptc_rotate_secrets", stdout=out)
    assert out.getvalue().strip() == (
        f"Re-encrypted the secrets of {Toolset.objects.count()} toolset(s) with the first key in PTC_SECRETS_KEYS."
    )

    # Only [new] now: every row opens, this one with its value.
    settings.PTC_SECRETS_KEYS = [new]
    assert raw_secrets("id = %s", [toolset.pk]) != written_under_old
    assert Toolset.objects.get(pk=toolset.pk).secrets == {"TOKEN": value}
    assert all(isinstance(t.secrets, dict) for t in Toolset.objects.all())


def test_a_token_no_configured_key_opens_is_an_error_naming_the_setting(settings: Any, made_here: list[Toolset]) -> None:
    suite_keys = list(settings.PTC_SECRETS_KEYS)
    settings.PTC_SECRETS_KEYS = [new_key()]
    toolset = toolset_made_here(made_here, {"TOKEN": "lost"})
    settings.PTC_SECRETS_KEYS = suite_keys
    demo_before = raw_secrets("key = 'demo' AND owner_id IS NULL", [])

    with pytest.raises(SecretsUndecryptable, match="PTC_SECRETS_KEYS"):
        Toolset.objects.get(pk=toolset.pk)
    # Rotation refuses too, naming the toolset, and leaves every row as it was.
    with pytest.raises(CommandError, match=rf"{toolset.key}.*PTC_SECRETS_KEYS.*Nothing was rewritten"):
        call_command("ptc_rotate_secrets", stdout=io.StringIO())
    assert raw_secrets("key = 'demo' AND owner_id IS NULL", []) == demo_before


def test_a_bad_key_stops_start_up_naming_the_variable_and_not_the_value() -> None:
    bad = "not-a-fernet-key"
    env = {**os.environ, "PTC_SECRETS_KEYS": f"{new_key()}, {bad}"}
    result = subprocess.run([sys.executable, MANAGE, "check"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "PTC_SECRETS_KEYS: key 2 of 2 is not a Fernet key" in result.stderr
    assert bad not in result.stderr


def test_unset_keys_derive_one_from_the_secret_key() -> None:
    derived = secrets_keys("", secret_key="one")
    assert derived == secrets_keys("  ", secret_key="one") != secrets_keys("", secret_key="two")
    Fernet(derived[0])  # a usable key
    with pytest.raises(ImproperlyConfigured, match="PTC_SECRETS_KEYS lists no key"):
        secrets_keys(" , ", secret_key="one")
