"""Waiting is visible in the admin timeline: amber "waiting for client" / "waiting for approval" bars,
and a call waiting for an approval is approved from the timeline page itself."""

import re
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.contrib.auth import get_user_model

from execution.models import ToolCall
from execution.timeline import timeline_build
from tests.conftest import Api
from tests.execution.test_approvals import finished, http_api, pending, shop, submit  # noqa: F401 - fixtures
from tests.execution.test_timeline import at, call_of, job_of
from tests.stack import ROOT, Stack
from tests.tools.http_api import HttpApi
from tools.sdk import class_name


def test_waiting_calls_are_amber_bars_that_say_what_they_wait_for() -> None:
    client = call_of(0, None, status="awaiting_client", tool="confirm", output=None)
    approval = call_of(100, None, status="awaiting_approval", tool="buy", output=None)
    approved = call_of(0, 800, tool="buy", decision="approved", decided_at=at(600))
    answered = call_of(0, 300, tool="confirm")
    client.toolset_key = answered.toolset_key = "client"
    timeline = timeline_build(
        job=job_of(None), calls=[client, approval, approved, answered], now=at(1000), decide_url=lambda c: f"/decide/{c.call_id}"
    )
    bars = {bar["call_id"]: bar for row in timeline["rows"] for bar in row["bars"]}
    assert bars[client.call_id]["status"] == "awaiting_client"
    assert bars[client.call_id]["label"] == "waiting for client: client.confirm"
    assert bars[approval.call_id]["label"] == "waiting for approval: demo.buy"
    assert bars[approval.call_id]["title"].startswith("waiting for approval · ")
    # An approved call waited 600 of its 800 ms; an answered client call waited all of its span.
    assert bars[approved.call_id]["wait_width"] == 75.0
    assert bars[answered.call_id]["wait_width"] == 100.0
    assert timeline["counts"]["awaiting_client"] == 1 and timeline["counts"]["awaiting_approval"] == 1
    details = {d["heading"]: d for d in timeline["details"] if "decide_url" in d}
    assert list(details) == ["demo.buy"] and details["demo.buy"]["decide_url"] == f"/decide/{approval.call_id}"
    table = {row["call_id"]: row for row in timeline["table"]}
    assert table[client.call_id]["duration"] == "waiting for client"


def _admin_signed_in(stack: Stack) -> tuple[Any, httpx.Client]:
    """A new staff member, and a browser of theirs signed in to the stack's admin."""
    password = uuid.uuid4().hex
    admin_user = get_user_model().objects.create_user(
        username=f"tl-{uuid.uuid4().hex[:6]}", password=password, is_staff=True, is_superuser=True
    )
    browser = httpx.Client(base_url=stack.base_url, timeout=30)
    browser.get("/admin/login/")
    login = browser.post(
        "/admin/login/?next=/admin/",
        data={"username": admin_user.username, "password": password, "csrfmiddlewaretoken": browser.cookies["csrftoken"]},
        headers={"Referer": f"{stack.base_url}/admin/login/"},
    )
    assert login.status_code == 302, login.text
    return admin_user, browser


def _decide_form(page: str, call_id: str) -> tuple[str, str]:
    """The Approve/Deny form's URL for ``call_id`` on a job's timeline page, and its CSRF token."""
    token = re.search(r'id="ptc-tl-csrf" hidden><input type="hidden" name="csrfmiddlewaretoken" value="([^"]+)"', page)
    assert token is not None
    url = re.search(r'"decide_url": "([^"]+)"', page)
    assert url is not None and call_id in url.group(1)
    return url.group(1).replace("\\u0026", "&"), token.group(1)


def test_the_timeline_shows_waiting_and_approves_a_call(
    stack: Stack,
    make_api: Callable[..., Api],
    staff: Api,
    http_api: HttpApi,  # noqa: F811
) -> None:
    key = shop(staff, http_api)
    api = make_api()
    confirm = {"name": "confirm", "input_schema": {"type": "object", "properties": {}}}
    code = f"""
from concurrent.futures import ThreadPoolExecutor
from ptc_tools.client import Client
from ptc_tools.{key} import {class_name(key)} as S
with ThreadPoolExecutor(2) as pool:
    ok = pool.submit(Client.confirm)
    bought = pool.submit(S.buy, city="rome")
    bought.result()["method"]
"""
    job = submit(api, code, [key], client_tools=[confirm])
    blocks = pending(api, job["id"], count=2)
    # The admin, through the real web process (its approval queues the call like the API's does).
    admin_user, browser = _admin_signed_in(stack)
    change = f"/admin/execution/execjob/{job['id']}/change/"
    page = browser.get(change).text
    assert 'data-waiting="waiting for client"' in page and 'data-waiting="waiting for approval"' in page
    assert "1 waiting for client</strong>" in page and "1 waiting for approval</strong>" in page
    buy = next(b for b in blocks if b["awaiting"] == "approval")
    decide, token = _decide_form(page, buy["id"])
    form = {"approve": "1", "reason": "from the timeline", "csrfmiddlewaretoken": token}
    response = browser.post(decide, data=form, headers={"Referer": f"{stack.base_url}{change}"})
    assert response.status_code == 302, response.text
    call = ToolCall.objects.get(call_id=buy["id"])
    assert (call.decision, call.decided_by, call.decision_reason) == ("approved", admin_user, "from the timeline")
    again = browser.post(
        decide, data={**form, "approve": "0"}, headers={"Referer": f"{stack.base_url}{change}"}, follow_redirects=True
    )
    assert "already approved" in again.text
    confirm_call = next(b for b in blocks if b["awaiting"] == "client")  # the two wait side by side, in either order
    answer = api.post(f"/api/v1/exec/{job['id']}/tool-results", json=[{"tool_use_id": confirm_call["id"], "content": True}])
    assert answer.status_code == 200, answer.text
    final = finished(api, job["id"])
    assert final["status"] == "completed", final["error"]
    page = browser.get(change).text
    assert "data-waiting=" not in page and 'class="ptc-tl-wait"' in page
    assert f"by {admin_user.username} at" in page


@pytest.mark.parametrize("approve", ["1", "0"])
def test_a_decision_from_the_timeline_with_a_nul_in_its_reason_is_recorded(
    stack: Stack,
    api: Api,
    staff: Api,
    http_api: HttpApi,  # noqa: F811
    approve: str,
) -> None:
    # The form posts its reason as typed: a NUL in it (the API's serializer refuses one) reached the
    # call's row as it was, PostgreSQL refused the statement, and the staff member got a 500, the
    # call still waiting.
    key = shop(staff, http_api)
    job = submit(api, f"from ptc_tools.{key} import {class_name(key)} as S\nS.buy(city='x')['method']", [key])
    [block] = pending(api, job["id"])
    _, browser = _admin_signed_in(stack)
    change = f"/admin/execution/execjob/{job['id']}/change/"
    decide, token = _decide_form(browser.get(change).text, block["id"])
    form = {"approve": approve, "reason": "ok\x00then", "csrfmiddlewaretoken": token}
    response = browser.post(decide, data=form, headers={"Referer": f"{stack.base_url}{change}"})
    assert response.status_code == 302, response.status_code
    call = ToolCall.objects.get(call_id=block["id"])
    assert (call.decision, call.decision_reason) == ("approved" if approve == "1" else "denied", "ok\ufffdthen")
    final = finished(api, job["id"])
    if approve == "1":
        assert (final["status"], final["return_value"]) == ("completed", "POST"), final["error"]
    else:
        assert (final["status"], final["error"]["code"]) == ("failed", "denied")


CLIENT_MODULE = '''
"""Client tools for the CLI test: run by ptc_exec, in its own process."""


def ask(question: str, default: bool = False) -> dict:
    """Ask the person at the terminal (here: answer from the question)."""
    return {"question": question, "yes": "ship" in question}


def explode(reason: str) -> None:
    raise RuntimeError(reason)
'''


def test_the_cli_answers_client_tools_from_a_module_and_shows_waiting(
    api: Api,
    staff: Api,
    http_api: HttpApi,  # noqa: F811
    stack_env: dict[str, str],
    tmp_path: Path,
) -> None:
    """A server tool, client tools answered by a local module, and an approval-gated tool, from a terminal."""
    key = shop(staff, http_api)
    module = tmp_path / "my_client_tools.py"
    module.write_text(CLIENT_MODULE)
    script = tmp_path / "job.py"
    script.write_text(
        """
from concurrent.futures import ThreadPoolExecutor
from ptc_tools import ToolError
from ptc_tools.client import Client
from ptc_tools.demo import Demo
from ptc_tools.KEY import CLS as S
with ThreadPoolExecutor(2) as pool:
    answers = list(pool.map(lambda q: Client.ask(question=q), ["ship it?", "stop?"]))
try:
    Client.explode(reason="on purpose")
except ToolError as e:
    print("caught", e.code, e.message)
bought = S.buy(city="oslo")
Demo.add(a=1, b=2), [a["yes"] for a in answers], bought["method"]
""".replace("KEY", key).replace("CLS", class_name(key))
    )
    done = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "ptc_exec",
            str(script),
            "--user",
            api.username,
            "--toolsets",
            f"demo,{key}",
            "--client-tools",
            str(module),
            "--approvals",
            "approve",
        ],
        cwd=ROOT,
        env={**stack_env, "PTC_LOG_LEVEL": "WARNING"},
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert sum(line.startswith("⏸ waiting for client: client.ask(question=") for line in lines) == 2
    assert any(line.startswith("✓ client.ask(question='ship it?')") for line in lines)
    assert any(line.startswith("✗ client.explode(reason='on purpose')") for line in lines)
    assert "caught client_error RuntimeError: on purpose" in lines
    assert any(line.startswith(f"⏸ waiting for approval: {key}.buy(city='oslo')") for line in lines)
    assert any(line.startswith(f"▶ approved: {key}.buy(city='oslo')") for line in lines)
    assert "return value: [3, [True, False], 'POST']" in lines
    job = api.get("/api/v1/exec", params={"status": "completed"}).json()["results"][0]
    names = {tool["name"]: tool for tool in job["client_tools"]}
    assert names["ask"]["input_schema"] == {
        "type": "object",
        "properties": {"question": {"type": "string"}, "default": {"type": "boolean"}},
        "required": ["question"],
    }
    assert names["ask"]["description"].startswith("Ask the person")
    [buy] = [call for call in job["tool_calls"] if call["tool"] == "buy"]
    assert (buy["decision"], buy["decided_by"], buy["status"]) == ("approved", api.username, "completed")
