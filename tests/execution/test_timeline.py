"""The admin timeline: lanes, positions and aggregation (execution/timeline.py), and its admin page's queries."""

import re
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from execution.models import ExecJob, ToolCall
from execution.timeline import MAX_BARS, MAX_LANES, lanes_assign, ticks_build, timeline_build
from tests.factories import job_calls, running_job

T0 = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)


def at(ms: float) -> datetime:
    return T0 + timedelta(milliseconds=ms)


def job_of(span_ms: float | None = 1000, **fields: Any) -> ExecJob:
    finished = at(span_ms) if span_ms is not None else None
    return ExecJob(started_at=T0, finished_at=finished, code="", timeout_seconds=30, **fields)


def call_of(start_ms: float, end_ms: float | None, status: str = "completed", tool: str = "sleep", **fields: Any) -> ToolCall:
    fields.setdefault("input", {"ms": 100})
    fields.setdefault("credits", 1)
    fields.setdefault("output", {"slept_ms": 100} if status == "completed" else None)
    return ToolCall(
        call_id=f"ptc_{uuid.uuid4().hex[:12]}",
        type="ptc",
        toolset_key="demo",
        tool_name=tool,
        status=status,
        started_at=at(start_ms),
        finished_at=at(end_ms) if end_ms is not None else None,
        **fields,
    )


def bars(timeline: dict[str, Any]) -> dict[str, tuple[int, dict[str, Any]]]:
    """Return each bar by call id, with its lane number (1-based)."""
    return {bar["call_id"]: (lane, bar) for lane, row in enumerate(timeline["rows"], 1) for bar in row["bars"]}


def test_sequential_calls_line_up_on_one_lane() -> None:
    calls = [call_of(0, 100), call_of(100, 250), call_of(400, 900)]
    timeline = timeline_build(job=job_of(1000), calls=calls)
    assert timeline["lanes"] == 1
    assert [b["call_id"] for b in timeline["rows"][0]["bars"]] == [c.call_id for c in calls]
    # Positions and widths are percentages of the job's span (1000 ms here).
    assert [(b["left"], b["width"]) for b in timeline["rows"][0]["bars"]] == [(0, 10), (10, 15), (40, 50)]


def test_parallel_calls_stack_on_lanes_and_a_freed_lane_is_reused() -> None:
    a, b, c = call_of(0, 500), call_of(10, 300), call_of(20, 800)
    d = call_of(350, 600)  # b's lane (2) is free again; a's and c's are not
    e = call_of(900, 950)  # everything has ended: back on lane 1
    placed = bars(timeline_build(job=job_of(1000), calls=[e, d, c, b, a]))  # order given does not matter
    assert {call.call_id: placed[call.call_id][0] for call in (a, b, c, d, e)} == {
        a.call_id: 1,
        b.call_id: 2,
        c.call_id: 3,
        d.call_id: 2,
        e.call_id: 1,
    }


def test_lanes_assign_counts_peak_concurrency() -> None:
    assert lanes_assign([(0, 10), (0, 10), (0, 10), (10, 20), (10, 20)]) == [0, 1, 2, 0, 1]
    assert lanes_assign([(i, i + 1) for i in range(50)]) == [0] * 50
    assert lanes_assign([]) == []


def test_bar_title_and_details_say_tool_input_outcome_duration_and_credits() -> None:
    ok = call_of(0, 120.4, input={"ms": 120})
    failed = call_of(0, 30, status="failed", tool="fail", error={"code": "tool_failed", "message": "boom"}, credits=0)
    timeline = timeline_build(job=job_of(200), calls=[ok, failed])
    placed = bars(timeline)
    _, ok_bar = placed[ok.call_id]
    assert ok_bar["status"] == "completed"
    assert ok_bar["title"].splitlines() == [
        "demo.sleep · completed · 120 ms · 1 credit",
        'input: {"ms": 120}',
        'output: {"slept_ms": 100}',
    ]
    _, failed_bar = placed[failed.call_id]
    assert failed_bar["status"] == "failed"
    assert "error: " in failed_bar["title"] and "boom" in failed_bar["title"]
    detail = timeline["details"][failed_bar["detail"]]
    fields = {label: value for label, value, _ in detail["fields"]}
    assert fields["duration"] == "30 ms"
    assert fields["credits"] == "0"
    assert '"message": "boom"' in fields["error"]
    assert "output" not in fields
    assert timeline["counts"] == {"completed": 1, "failed": 1, "executing": 0}


def test_an_executing_call_runs_to_now_while_the_job_runs() -> None:
    running = call_of(200, None, status="executing")
    timeline = timeline_build(job=job_of(None, status="running"), calls=[running], now=at(400))
    [(lane, bar)] = bars(timeline).values()
    assert (lane, bar["left"], bar["width"], bar["status"]) == (1, 50, 50, "executing")
    assert "still executing" in bar["title"]


def test_axis_ticks_are_round_milliseconds() -> None:
    assert [(t["label"], t["left"]) for t in ticks_build(1000)] == [
        ("0 ms", 0),
        ("200 ms", 20),
        ("400 ms", 40),
        ("600 ms", 60),
        ("800 ms", 80),
        ("1,000 ms", 100),
    ]
    assert [t["label"] for t in ticks_build(7)][:3] == ["0 ms", "1 ms", "2 ms"]
    assert [t["label"] for t in ticks_build(3)][:3] == ["0.0 ms", "0.5 ms", "1.0 ms"]
    assert ticks_build(12_345)[-1]["label"] == "12,000 ms"


def test_aggregates_past_the_bar_threshold() -> None:
    job = job_of(10_000)
    sequential = [call_of(i * 10, i * 10 + 5) for i in range(MAX_BARS)]
    assert timeline_build(job=job, calls=sequential)["aggregated"] is False
    more = [*sequential, call_of(9_000, 9_005, status="failed")]
    timeline = timeline_build(job=job, calls=more)
    assert timeline["aggregated"] is True
    assert all(not row["bars"] for row in timeline["rows"])
    [row] = timeline["rows"]  # one lane, one row
    cells = row["cells"]
    # 100 buckets of 100 ms: the calls 0..3000 ms fill the first 30; each holds ten 5 ms calls.
    assert len(cells) == 31
    assert sum(cell["total"] for cell in cells) == MAX_BARS + 1
    assert cells[0]["total"] == 10 and cells[0]["left"] == 0 and cells[0]["width"] == 1
    failed_cell = cells[-1]
    assert failed_cell["left"] == 90 and failed_cell["status"] == "failed"
    assert failed_cell["segments"] == [{"status": "failed", "height": 100}]


def test_aggregates_past_the_lane_threshold_into_groups_of_lanes() -> None:
    parallel = [call_of(0, 500, status="failed" if i % 10 == 0 else "completed") for i in range(MAX_LANES + 1)]
    timeline = timeline_build(job=job_of(1000), calls=parallel)
    assert timeline["lanes"] == MAX_LANES + 1
    assert timeline["aggregated"] is True
    labels = [row["label"] for row in timeline["rows"]]
    assert labels[0] == "1–3" and labels[-1] == "40–41"
    assert len(labels) <= 20
    first = timeline["rows"][0]["cells"]
    # Lanes 1-3 hold one failed and two completed calls in each of the 50 buckets up to 500 ms.
    assert len(first) == 50 and {c["total"] for c in first} == {3}
    assert first[0]["segments"] == [{"status": "failed", "height": 33.33}, {"status": "completed", "height": 66.67}]


def test_a_job_not_started_has_nothing_to_draw() -> None:
    timeline = timeline_build(job=ExecJob(code="", timeout_seconds=30), calls=[])
    assert timeline["rows"] == [] and timeline["count"] == 0


def _job_with_calls(count: int, parallel: int) -> ExecJob:
    """A finished job with ``count`` calls, ``parallel`` at a time, some failed, made by bulk_create."""
    user = get_user_model().objects.create_user(username=f"tl-{uuid.uuid4().hex[:8]}")
    start = timezone.now() - timedelta(minutes=1)
    end = start + timedelta(milliseconds=count // parallel * 20 + 50)
    job = running_job(user=user, code="print('many')", status="completed", started_at=start, finished_at=end)
    job_calls(
        job,
        (
            {
                "tool_name": "fail" if i % 50 == 7 else "sleep",
                "input": {"ms": 15},
                "output": None if i % 50 == 7 else {"slept_ms": 15},
                "error": {"code": "tool_failed", "message": "boom"} if i % 50 == 7 else None,
                "status": "failed" if i % 50 == 7 else "completed",
                "started_at": start + timedelta(milliseconds=i // parallel * 20 + 1),
                "finished_at": start + timedelta(milliseconds=i // parallel * 20 + 16),
            }
            for i in range(count)
        ),
    )
    return job


def _admin_client() -> Client:
    staff = get_user_model().objects.create_user(username=f"tl-admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    return client


def _render(client: Client, job: ExecJob) -> tuple[str, list[str]]:
    with CaptureQueriesContext(connection) as queries:
        response = client.get(f"/admin/execution/execjob/{job.pk}/change/")
    assert response.status_code == 200
    return response.content.decode(), [q["sql"] for q in queries.captured_queries]


def test_admin_page_of_a_thousand_calls_is_aggregated_and_takes_one_query_for_them() -> None:
    client = _admin_client()
    _render(client, _job_with_calls(3, 3))  # warm-up: the session, content types, caches
    small_html, small_queries = _render(client, _job_with_calls(3, 3))
    big_html, big_queries = _render(client, _job_with_calls(1000, 8))

    call_queries = [sql for sql in big_queries if 'FROM "execution_toolcall"' in sql]
    assert len(call_queries) == 1, call_queries
    # The page's queries do not grow with the calls: same count for 3 calls and for 1,000.
    assert len(big_queries) == len(small_queries), big_queries

    assert small_html.count('class="ptc-tl-bar ') == 3
    assert 'data-aggregated="true"' in big_html
    assert 'class="ptc-tl-bar ' not in big_html
    cells = re.findall(r'class="ptc-tl-cell"[^>]*data-total="(\d+)" data-status="(\w+)"', big_html)
    assert 0 < len(cells) <= 8 * 100
    assert any(status == "failed" for _, status in cells)
    # 20 failed calls: the summary counts them and links to them.
    assert "980 completed, 20 failed" in big_html
    assert "status__exact=failed" in big_html
    # A readable page, not a 1,000-row table: the call table stops at 200 rows.
    assert big_html.count('class="ptc-call-row"') == 200
    assert len(big_html) < 1_500_000


def test_admin_page_lays_out_code_result_and_job_fields() -> None:
    client = _admin_client()
    job = _job_with_calls(4, 2)
    html, _ = _render(client, job)
    for heading in ("Timeline of tool calls", "Code", "Result", "Job", "Timings"):
        assert f">{heading}</h2>" in html, heading
    assert '<div class="ptc-code"><span>print(&#x27;many&#x27;)</span></div>' in html
    lanes = re.findall(r'<div class="ptc-tl-lane" data-lane="(\d+)">', html)
    assert lanes == ["1", "2"]
    assert 'id="ptc-tl-details" type="application/json"' in html
    # No external assets beyond Django's own admin static files.
    assert not re.search(r'(src|href)="https?://', html)
