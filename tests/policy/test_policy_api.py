"""The policy through the API, live: every process sees a change on its next request."""

import itertools
import re
import uuid
from typing import Any

import httpx
import pytest

from ptcproject.policy.models import PolicyChange
from tests.conftest import Api, calls_most_at_once


def patch(staff: Api, **values: Any) -> httpx.Response:
    return staff.http.patch("/api/v1/policy", json=values)


def test_only_staff_read_or_change_the_policy(api: Api) -> None:
    assert api.get("/api/v1/policy").status_code == 403
    assert api.http.patch("/api/v1/policy", json={"mode": "off"}).status_code == 403


def test_a_change_is_recorded_who_when_old_to_new(staff: Api) -> None:
    old = staff.get("/api/v1/policy").json()["rollout_percent"]
    response = patch(staff, rollout_percent=37)
    assert response.status_code == 200
    assert response.json()["rollout_percent"] == 37
    change = PolicyChange.objects.select_related("changed_by").first()
    assert change.changed_by.username == staff.username
    assert change.changes == {"rollout_percent": [old, 37]}


def test_a_policy_read_can_be_sent_back_as_it_is(staff: Api) -> None:
    shown = staff.get("/api/v1/policy").json()
    response = staff.http.patch("/api/v1/policy", json={**shown, "rollout_percent": 41})  # updated_at with it
    assert response.status_code == 200, response.text
    assert response.json()["rollout_percent"] == 41


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"user_allowlist": ["no-such-user-x"]}, "user_allowlist"),
        ({"toolset_blocklist": ["no-such-toolset"]}, "toolset_blocklist"),
        ({"toolset_allowlist": ["demo", "nope"]}, "toolset_allowlist"),
        ({"rollout_percent": 101}, "rollout_percent"),
        ({"rollout_percent": -1}, "rollout_percent"),
        ({"debug": "sometimes"}, "debug"),
        ({"mode": "maybe"}, "mode"),
        ({"max_tool_calls": -5}, "max_tool_calls"),
        ({"max_parallel_tool_calls": 0}, "max_parallel_tool_calls"),
        ({"memory_limit_mb": -1}, "memory_limit_mb"),
        ({"default_timeout": 10**6}, "default_timeout"),
        # Past the columns' range: each was a 500 from PostgreSQL before it had a bound.
        ({"max_output_bytes": 2**63}, "max_output_bytes"),
        ({"max_tool_calls": 2**31}, "max_tool_calls"),
        ({"max_parallel_tool_calls": 2**63}, "max_parallel_tool_calls"),
        ({"memory_limit_mb": 10**30}, "memory_limit_mb"),
        ({"default_timeout": 2**63}, "default_timeout"),
        ({"max_timeout": 2**63}, "max_timeout"),
        ({"rollout_percent": 2**63}, "rollout_percent"),
        # Within the columns' range but past what a worker can hold.
        ({"max_output_bytes": 64 * 1024 * 1024 + 1}, "max_output_bytes"),
        ({"max_tool_calls": 1_000_001}, "max_tool_calls"),
        ({"max_parallel_tool_calls": 1025}, "max_parallel_tool_calls"),
        ({"memory_limit_mb": 64 * 1024 + 1}, "memory_limit_mb"),
        ({"max_tool_calls": True}, "max_tool_calls"),
        # Past PostgreSQL's parameters of one statement, its lookup said the database was down (503).
        ({"toolset_allowlist": [f"t{i}" for i in range(70_000)]}, "toolset_allowlist"),
        ({"user_allowlist": [f"u{i}" for i in range(10_001)]}, "user_allowlist"),
        # A setting misspelt: it was ignored with a 200, and the change it meant was never made.
        ({"rollout_percnt": 0, "mode": "off"}, "rollout_percnt"),
    ],
)
def test_bad_values_get_a_field_error_and_change_nothing(staff: Api, values: dict, field: str) -> None:
    before = staff.get("/api/v1/policy").json()
    changes = PolicyChange.objects.count()
    response = patch(staff, **values)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "validation_error"
    assert field in error["details"]
    assert staff.get("/api/v1/policy").json() == before
    assert PolicyChange.objects.count() == changes


def test_exec_is_403_with_the_reason_when_the_policy_says_no(staff: Api, api: Api) -> None:
    assert patch(staff, toolset_blocklist=["demo"]).status_code == 200
    response = api.post("/api/v1/exec", json={"code": "1", "toolsets": ["demo"]})
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["code"] == "ptc_disabled"
    assert "toolset 'demo' is on the blocklist" in error["message"]


def test_a_running_worker_sees_a_change_without_a_restart(staff: Api, api: Api) -> None:
    code = "from ptc_tools.demo import Demo\n[Demo.add(a=i, b=1) for i in range(5)]"
    assert api.run(code, toolsets=["demo"])["return_value"] == [1, 2, 3, 4, 5]
    assert patch(staff, max_tool_calls=3).status_code == 200
    limited = api.run(code, toolsets=["demo"])
    assert limited["status"] == "failed"
    assert limited["error"]["type"] == "ResourceLimit"
    assert "tool-call limit of 3" in limited["error"]["message"]
    assert patch(staff, direct_only_tools=["complete", "fail", "onboarding_handoff", "add"]).status_code == 200
    direct = api.run("from ptc_tools.demo import Demo\nDemo.add(a=1, b=1)", toolsets=["demo"])
    assert direct["status"] == "failed"
    assert direct["error"]["type"] == "AttributeError"  # a direct tool is not in the SDK at all


def _threaded_sleeps(api: Api) -> tuple[dict, float]:
    code = """
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from ptc_tools.demo import Demo
start = time.monotonic()
with ThreadPoolExecutor(8) as pool:
    list(pool.map(lambda _: Demo.sleep(ms=200), range(8)))
time.monotonic() - start
"""
    job = api.run(code, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    return job, job["return_value"]


def test_sequential_is_enforced_even_with_threads(staff: Api, api: Api) -> None:
    parallel_job, _ = _threaded_sleeps(api)
    assert calls_most_at_once(parallel_job["tool_calls"]) > 2, parallel_job["tool_calls"]
    assert parallel_job["sequential"] is False
    assert patch(staff, sequential=True).status_code == 200
    sequential_job, sequential = _threaded_sleeps(api)
    assert sequential >= 1.6, sequential
    assert sequential_job["sequential"] is True
    calls = sorted(sequential_job["tool_calls"], key=lambda c: c["started_at"])
    for before, after in itertools.pairwise(calls):
        assert before["finished_at"] <= after["started_at"]


def test_max_parallel_tool_calls_makes_extra_calls_wait_not_fail(staff: Api, api: Api) -> None:
    assert patch(staff, max_parallel_tool_calls=2).status_code == 200
    job, seconds = _threaded_sleeps(api)
    assert all(c["status"] == "completed" for c in job["tool_calls"])
    assert calls_most_at_once(job["tool_calls"]) == 2, job["tool_calls"]
    assert seconds >= 0.8, seconds  # 4 rounds of 200 ms


def test_a_timeout_above_the_policy_maximum_is_refused(staff: Api, api: Api) -> None:
    assert patch(staff, max_timeout=30, default_timeout=20).status_code == 200
    response = api.post("/api/v1/exec", json={"code": "1", "timeout": 31})
    assert response.status_code == 400
    assert "30" in response.json()["error"]["message"]
    assert api.run("1", toolsets=["demo"])["timeout_limit_seconds"] == 20


def test_memory_and_output_limits_come_from_the_policy(staff: Api, api: Api) -> None:
    assert patch(staff, memory_limit_mb=64, max_output_bytes=1000).status_code == 200
    job = api.run("print('x' * 5000)\nb = bytearray(100 * 1024 * 1024)", toolsets=["demo"])
    assert job["error"]["type"] == "ResourceLimit"
    assert "64 MiB" in job["error"]["message"]
    assert job["stdout_truncated"] is True
    assert len(job["stdout"]) < 1100


def test_the_admin_try_a_decision_form(staff: Api) -> None:
    from django.contrib.auth import get_user_model
    from django.test import Client

    superuser = get_user_model().objects.create_user(username=f"su-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(superuser)
    assert patch(staff, toolset_blocklist=["demo"]).status_code == 200
    page = client.get("/admin/policy/policy/try/", {"user": superuser.pk, "toolsets": ["demo"], "title": "x"})
    assert page.status_code == 200
    assert "toolset &#x27;demo&#x27; is on the blocklist" in page.content.decode()
    assert client.get("/admin/policy/policy/1/change/").status_code == 200
    assert "toolset_blocklist" in client.get("/admin/policy/policy/1/change/").content.decode()


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("PTC_MODE", "sometimes"),
        ("PTC_ROLLOUT_PERCENT", "150"),
        ("PTC_DEBUG", "maybe"),
        ("PTC_MAX_TOOL_CALLS", "-1"),
        ("PTC_SEQUENTIAL", "perhaps"),
        ("PTC_TIMEOUT", "ten"),
        ("PTC_MAX_OUTPUT_BYTES", str(2**63)),  # the same bounds as PATCH /api/v1/policy
    ],
)
def test_a_bad_seed_value_stops_start_up_naming_the_variable(stack_env: dict[str, str], variable: str, value: str) -> None:
    import subprocess
    import sys

    from tests.stack import ROOT

    result = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, env={**stack_env, variable: value}, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert variable in result.stderr.splitlines()[-1]


def test_the_admin_creates_a_key_and_shows_it_once(staff: Api) -> None:
    """In the answer to the POST that made it, and nowhere else: shown as a message, the key sat in
    the messages cookie (signed, not encrypted) till the next page and went out with its request;
    with session storage it would have sat in the database."""
    import hashlib

    from django.contrib.admin.models import LogEntry
    from django.contrib.auth import get_user_model
    from django.contrib.messages.storage.cookie import CookieStorage
    from django.contrib.sessions.models import Session
    from django.test import Client

    from ptcproject.accounts.models import ApiKey

    superuser = get_user_model().objects.create_user(username=f"su-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    owner = get_user_model().objects.get(username=staff.username)
    client = Client()
    client.force_login(superuser)
    page = client.post(
        "/admin/accounts/apikey/add/", {"user": owner.pk, "name": "from the admin", "expires_at_0": "", "expires_at_1": ""}
    )
    key = ApiKey.objects.get(user=owner, name="from the admin")
    secret = re.compile(rf"ptc_{key.prefix}_[\w-]{{40,}}")  # the whole key, not its prefix (which pages show)
    # Nothing keeps it: no cookie set, no message waiting, no session, no history entry.
    assert not any(secret.search(morsel.OutputString()) for morsel in page.cookies.values())
    messages = client.cookies.get("messages")
    assert messages is None or not secret.search(str(CookieStorage(page.wsgi_request)._decode(messages.value)))
    assert not any(secret.search(str(session.get_decoded())) for session in Session.objects.all())
    assert not any(secret.search(f"{e.object_repr} {e.change_message}") for e in LogEntry.objects.filter(object_id=str(key.pk)))
    # Shown once, in this answer, with the way on to the key's page.
    assert page.status_code == 200 and "no-store" in page["Cache-Control"]
    text = page.content.decode()
    shown = secret.findall(text)
    assert len(shown) == 1
    plaintext = shown[0]
    assert key.key_hash == hashlib.sha256(plaintext.encode()).hexdigest()
    assert f"/admin/accounts/apikey/{key.pk}/change/" in text
    after = client.get(f"/admin/accounts/apikey/{key.pk}/change/").content.decode()
    assert plaintext not in after and "shown only this once" not in after
    # The key works on the API.
    used = httpx.get(f"{staff.http.base_url}/api/v1/keys", headers={"Authorization": f"Bearer {plaintext}"}, timeout=30)
    assert used.status_code == 200 and str(key.pk) in used.text
    client.post("/admin/accounts/apikey/", {"action": "revoke", "_selected_action": [key.pk]})
    key.refresh_from_db()
    assert key.revoked_at is not None
