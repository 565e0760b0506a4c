"""The admin timeline in a real browser: Debian's headless Chromium, driven by Playwright.

Chromium comes from apt (scripts/browser-deps.sh), never from `playwright install`. The pages come
from the running stack; a job with parallel and failing calls is made through the real API.
Screenshots go to the run's folder under test-artifacts/ (test-artifacts/latest/).
"""

import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.utils import timezone

from tests.conftest import Api
from tests.factories import job_calls, running_job
from tests.stack import ARTIFACTS, Stack

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
# --no-sandbox: we run as root in a container. The rest keep Chromium off the network it would
# otherwise try (updates, sync, field trials) and stall on, on a closed machine.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PARALLEL_AND_FAILING = """
import threading
from ptc_tools import ToolError
from ptc_tools.demo import Demo

def fail():
    try:
        Demo.fail(message="planned failure")
    except ToolError as e:
        print("caught", e.code)

Demo.sleep(ms=150)
threads = [threading.Thread(target=Demo.sleep, kwargs={"ms": 400}) for _ in range(3)]
threads.append(threading.Thread(target=fail))
for t in threads:
    t.start()
for t in threads:
    t.join()
Demo.sleep(ms=100)
"done"
"""


def _staff_login(username: str) -> str:
    """Give ``username`` a password and the admin's view permissions on jobs and calls; return the password."""
    user = get_user_model().objects.get(username=username)
    password = uuid.uuid4().hex
    user.set_password(password)
    user.save(update_fields=["password"])
    user.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="execution", codename__in=["view_execjob", "view_toolcall"])
    )
    return password


@contextmanager
def _browser_page() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run scripts/browser-deps.sh (as root it installs Debian's chromium).")
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs an event loop in this thread: no Django ORM calls inside this block.
    with sync_playwright() as playwright, tempfile.TemporaryDirectory(prefix="ptc-chromium-") as profile:
        context = playwright.chromium.launch_persistent_context(
            profile,
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 900},
        )
        context.set_default_timeout(30_000)
        try:
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()


def _log_in(page: Any, base_url: str, username: str, password: str, next_path: str) -> None:
    """Log in through the admin's own login form, as a person would."""
    page.goto(f"{base_url}/admin/login/?next={next_path}")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("input[type=submit]")
    page.wait_for_url(f"{base_url}{next_path}")


def _bars(page: Any) -> list[dict[str, Any]]:
    """Every bar as the browser laid it out: its call, lane, status, colour and box, and its track's box."""
    return page.eval_on_selector_all(
        ".ptc-tl-bar",
        """bars => bars.map(bar => {
            const box = bar.getBoundingClientRect();
            const track = bar.parentElement.getBoundingClientRect();
            return {
                callId: bar.dataset.callId, status: bar.dataset.status, startMs: Number(bar.dataset.startMs),
                lane: bar.closest('.ptc-tl-lane').dataset.lane, title: bar.title,
                colour: getComputedStyle(bar).backgroundColor,
                x: box.x, y: box.y, right: box.right, width: box.width, trackX: track.x, trackWidth: track.width,
                left: parseFloat(bar.style.left), widthPct: parseFloat(bar.style.width),
            };
        })""",
    )


def test_timeline_of_parallel_and_failing_calls_in_chromium(stack: Stack, make_api: Callable[..., Api]) -> None:
    owner = make_api()
    job = owner.run(PARALLEL_AND_FAILING, toolsets=["demo"])
    assert job["status"] == "completed", job["error"]
    assert job["stdout"] == "caught tool_failed\n"
    calls = {c["call_id"]: c for c in job["tool_calls"]}
    assert len(calls) == 6
    staff = make_api(staff=True)
    password = _staff_login(staff.username)
    path = f"/admin/execution/execjob/{job['id']}/change/"

    with _browser_page() as page:
        _log_in(page, stack.base_url, staff.username, password, path)
        assert page.locator("#ptc-tl-heading").inner_text() == "Timeline of tool calls"
        lanes = page.eval_on_selector_all(".ptc-tl-lane", "lanes => lanes.map(l => l.dataset.lane)")
        bars = sorted(_bars(page), key=lambda bar: bar["startMs"])
        ticks = page.eval_on_selector_all(".ptc-tl-tick", "ticks => ticks.map(t => t.textContent)")

        # The failed call's hover text and its details, opened by a click.
        failed = next(bar for bar in bars if bar["status"] == "failed")
        page.click(f".ptc-tl-bar[data-call-id='{failed['callId']}']")
        panel = page.locator("#ptc-tl-detail")
        panel.wait_for(state="visible")
        panel_text = panel.inner_text()
        code_visible = page.locator(".field-code_pre .ptc-code").is_visible()
        page.screenshot(path=str(ARTIFACTS / "timeline.png"), full_page=True)

    # Four calls at once on four lanes; the lone calls before and after them on lane 1.
    assert lanes == ["1", "2", "3", "4"]
    assert [bar["callId"] for bar in bars] == sorted(calls, key=lambda c: calls[c]["started_at"])
    first, *parallel, last = bars
    assert (first["lane"], last["lane"]) == ("1", "1")
    assert sorted(bar["lane"] for bar in parallel) == ["1", "2", "3", "4"]
    assert len({bar["y"] for bar in parallel}) == 4
    assert sorted(bar["status"] for bar in parallel) == ["completed", "completed", "completed", "failed"]
    # Placed by start: left edges in start order; the parallel bars overlap in time, not the lone ones.
    assert [bar["x"] for bar in bars] == sorted(bar["x"] for bar in bars)
    assert first["right"] <= min(bar["x"] for bar in parallel) + 1
    assert max(bar["right"] for bar in parallel) <= last["x"] + 1
    sleeps = [bar for bar in parallel if bar["status"] == "completed"]
    assert max(bar["x"] for bar in sleeps) < min(bar["right"] for bar in sleeps)
    # The browser put each bar where the server said: left edge at its percentage of the track.
    for bar in bars:
        assert abs((bar["x"] - bar["trackX"]) / bar["trackWidth"] * 100 - bar["left"]) < 0.5, bar
    # A 400 ms sleep is drawn wider than the 150 ms one, which is wider than the 100 ms one.
    assert min(bar["width"] for bar in sleeps) > first["width"] > last["width"]
    # Colours by status.
    assert failed["colour"] == "rgb(214, 69, 69)"
    assert {bar["colour"] for bar in bars if bar["status"] == "completed"} == {"rgb(47, 158, 90)"}
    # Hover text and the click-open panel say tool, input, outcome, duration and credits.
    assert failed["title"].startswith("demo.fail · failed · ")
    assert "planned failure" in failed["title"]
    for expected in ("demo.fail", "error", "planned failure", "duration", "credits", "input"):
        assert expected in panel_text, expected
    assert ticks[0] == "0 ms" and all(tick.endswith(" ms") for tick in ticks)
    assert code_visible
    assert (ARTIFACTS / "timeline.png").stat().st_size > 10_000


def test_a_thousand_calls_stay_readable_in_chromium(stack: Stack, make_api: Callable[..., Api]) -> None:
    staff = make_api(staff=True)
    password = _staff_login(staff.username)
    user = get_user_model().objects.get(username=staff.username)
    start = timezone.now() - timedelta(minutes=1)
    code = "from ptc_tools.demo import Demo\n# a thousand calls, sixteen at a time"
    job = running_job(user=user, code=code, status="completed", started_at=start, finished_at=start + timedelta(seconds=3))
    # Waves of 16 parallel calls of varying length; every 37th fails.
    job_calls(
        job,
        (
            {
                "tool_name": "fail" if i % 37 == 0 else "sleep",
                "input": {"ms": 10 + i % 7 * 5},
                "status": "failed" if i % 37 == 0 else "completed",
                "error": {"code": "tool_failed", "message": "boom"} if i % 37 == 0 else None,
                "output": None if i % 37 == 0 else {"slept_ms": 10},
                "started_at": start + timedelta(milliseconds=i // 16 * 45 + i % 3),
                "finished_at": start + timedelta(milliseconds=i // 16 * 45 + 12 + i % 7 * 5),
            }
            for i in range(1000)
        ),
    )
    path = f"/admin/execution/execjob/{job.pk}/change/"

    with _browser_page() as page:
        _log_in(page, stack.base_url, staff.username, password, path)
        assert page.locator("#ptc-timeline").get_attribute("data-aggregated") == "true"
        assert page.locator(".ptc-tl-bar").count() == 0
        rows = page.locator(".ptc-tl-lane").count()
        totals = page.eval_on_selector_all(".ptc-tl-cell", "cells => cells.map(c => Number(c.dataset.total))")
        statuses = page.eval_on_selector_all(".ptc-tl-cell", "cells => cells.map(c => c.dataset.status)")
        page.locator(".ptc-tl-cell[data-status=failed]").first.click()
        panel_text = page.locator("#ptc-tl-detail").inner_text()
        chart_height = page.locator(".ptc-tl-chart").bounding_box()["height"]
        page.screenshot(path=str(ARTIFACTS / "timeline-1000.png"), full_page=True)

    assert rows == 16
    assert 0 < len(totals) <= 16 * 100
    assert "failed" in statuses
    assert "calls active" in panel_text and "failed" in panel_text
    assert chart_height < 900  # fits a screen
