import hashlib
import subprocess
import sys
import uuid
from datetime import timedelta

import httpx
from django.utils import timezone

from ptcproject.accounts.models import ApiKey
from tests.conftest import Api
from tests.stack import ROOT, Stack


def test_no_key_or_a_bad_key_is_401(stack: Stack) -> None:
    for headers in ({}, {"Authorization": "Bearer ptc_nope_nope"}, {"Authorization": "Bearer"}):
        response = httpx.get(f"{stack.base_url}/api/v1/exec", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] in ("not_authenticated", "authentication_failed")


def test_keys_are_stored_as_sha256_and_can_expire_or_be_revoked(api: Api) -> None:
    key = ApiKey.objects.get(user__username=api.username)
    assert key.key_hash == hashlib.sha256(api.key.encode()).hexdigest()
    assert api.key not in str(ApiKey.objects.filter(pk=key.pk).values().first())
    assert api.get("/api/v1/exec").status_code == 200
    key.refresh_from_db()
    assert key.last_used_at is not None
    ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert api.get("/api/v1/exec").status_code == 401
    ApiKey.objects.filter(pk=key.pk).update(expires_at=None, revoked_at=timezone.now())
    assert api.get("/api/v1/exec").status_code == 401


def test_create_api_key_command_prints_the_key_last(stack: Stack, stack_env: dict[str, str]) -> None:
    username = f"cli-{uuid.uuid4().hex[:6]}"
    result = subprocess.run(
        [sys.executable, "manage.py", "create_api_key", username, "--create-user", "--staff"],
        cwd=ROOT,
        env=stack_env,
        capture_output=True,
        text=True,
        check=True,
    )
    key = result.stdout.strip().splitlines()[-1]
    assert key.startswith("ptc_")
    response = httpx.get(f"{stack.base_url}/api/v1/exec", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200
    missing = subprocess.run(
        [sys.executable, "manage.py", "create_api_key", f"ghost-{uuid.uuid4().hex[:6]}"],
        cwd=ROOT,
        env=stack_env,
        capture_output=True,
        text=True,
    )
    assert missing.returncode != 0
    assert "--create-user" in missing.stderr
