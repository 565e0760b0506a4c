"""An exec job's tool calls as a timeline: lanes, bars and a time axis, all computed here.

The admin template only places what this module returns: every position is a percentage of the
job's span, so the page needs no JavaScript to lay anything out. Past a threshold (too many bars or
too many lanes to read one by one) the bars are aggregated into time buckets per group of lanes.
"""

import heapq
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.utils import timezone

from execution.models import ExecJob, ToolCall
from execution.selectors import tool_call_is_client

# Past this many calls, bars are too thin to hover; aggregate.
MAX_BARS = 300
# Past this many lanes (peak concurrency), the lanes no longer fit a screen; aggregate.
MAX_LANES = 40
# Aggregated: at most this many rows (groups of adjacent lanes) and this many time buckets per row.
AGGREGATE_ROWS = 20
AGGREGATE_BUCKETS = 100
# An aggregated cell names at most this many of its calls, failed ones first; the rest are counted.
CELL_SAMPLE = 5
# The call table under the timeline lists at most this many calls; the full list is one link away.
TABLE_LIMIT = 200
TICK_TARGET = 8
PREVIEW_CHARS = 1500
TITLE_PREVIEW_CHARS = 160
COMPLETED, FAILED, EXECUTING = ToolCall.Status.COMPLETED.value, ToolCall.Status.FAILED.value, ToolCall.Status.EXECUTING.value
AWAITING_CLIENT, AWAITING_APPROVAL = ToolCall.Status.AWAITING_CLIENT.value, ToolCall.Status.AWAITING_APPROVAL.value
STATUSES = (COMPLETED, FAILED, EXECUTING, AWAITING_CLIENT, AWAITING_APPROVAL)
# A bucket's colour is its worst status; its stacked segments go from the bottom in this order.
SEVERITY = (FAILED, AWAITING_APPROVAL, AWAITING_CLIENT, EXECUTING, COMPLETED)
# What a waiting call's amber bar says.
WAITING = {AWAITING_CLIENT: "waiting for client", AWAITING_APPROVAL: "waiting for approval"}


def _ms(later: datetime, earlier: datetime) -> float:
    return (later - earlier).total_seconds() * 1000


def _pct(value_ms: float, span_ms: float) -> float:
    return round(min(max(value_ms / span_ms * 100, 0.0), 100.0), 4)


def _fmt_ms(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f} ms"
    if value >= 1:
        return f"{value:.3g} ms"
    return f"{value:.2f} ms" if value else "0 ms"


@dataclass(frozen=True)
class Clipped:
    """The head of a call's input or output too long to read whole for its preview: ``text``, the
    first characters of the value as stored, of ``length`` in all (``clipped`` makes one)."""

    text: str
    length: int


def clipped(head: str | None, length: int | None) -> Any:
    """Return what a preview shows of a JSON value of which the database gave the ``head`` (at least
    PREVIEW_CHARS + 1 characters of its text, or all of it) and the ``length``: the value itself
    when that is all of it, else a Clipped. None for SQL NULL."""
    if head is None or length is None:
        return None
    return json.loads(head) if len(head) >= length else Clipped(text=head, length=length)


def _json_preview(value: Any, limit: int) -> str:
    if isinstance(value, Clipped):
        return value.text[:limit] + f"… ({value.length - limit:,} more characters)"
    text = value if isinstance(value, str) else json.dumps(value, indent=1, sort_keys=True, default=str)
    return text if len(text) <= limit else text[:limit] + f"… ({len(text) - limit:,} more characters)"


def _status(call: ToolCall) -> str:
    # A plain string (a TextChoices member's str() is its value): it goes into JSON and CSS classes.
    return str(call.status)


def _waited_ms(call: ToolCall, start_ms: float, end_ms: float, origin: datetime) -> tuple[str, float]:
    """Return what ``call`` waited on (``client``, ``approval`` or ``""``) and for how many ms from its
    start: a client call waits its whole span; an approved or denied one until its decision."""
    if call.status == AWAITING_APPROVAL or call.decision:
        until = _ms(call.decided_at, origin) if call.decided_at is not None else end_ms
        return "approval", max(0.0, min(until, end_ms) - start_ms)
    if call.status == AWAITING_CLIENT or tool_call_is_client(call):
        return "client", end_ms - start_ms
    return "", 0.0


def _one_line(value: Any, limit: int) -> str:
    if isinstance(value, Clipped):
        return value.text[:limit] + "…"
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[:limit] + "…"


def lanes_assign(intervals: list[tuple[float, float]]) -> list[int]:
    """Return a lane index per ``(start, end)`` interval, given in start order.

    Greedy: each interval takes the lowest lane whose last interval ended at or before it starts, or
    opens a new lane. Sequential intervals share lane 0; the number of lanes is the peak concurrency.
    """
    busy: list[tuple[float, int]] = []  # (end, lane) of the last interval on each busy lane
    free: list[int] = []
    lanes: list[int] = []
    opened = 0
    for start, end in intervals:
        while busy and busy[0][0] <= start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            lane = heapq.heappop(free)
        else:
            lane, opened = opened, opened + 1
        heapq.heappush(busy, (end, lane))
        lanes.append(lane)
    return lanes


def ticks_build(span_ms: float, target: int = TICK_TARGET) -> list[dict[str, Any]]:
    """Return axis ticks at a round step (1, 2 or 5 times a power of ten ms) from 0 to ``span_ms``."""
    raw = span_ms / target
    base = 10 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 5, 10) if m * base >= raw)
    decimals = max(0, -math.floor(math.log10(step)))
    ticks = []
    for i in range(int(span_ms / step + 1e-9) + 1):
        value = i * step
        left = _pct(value, span_ms)
        ticks.append({"ms": round(value, decimals), "left": left, "label": f"{value:,.{decimals}f} ms", "end": left > 90})
    return ticks


def timeline_build(
    *,
    job: ExecJob,
    calls: Iterable[ToolCall],
    now: datetime | None = None,
    call_url: Callable[[ToolCall], str] | None = None,
    decide_url: Callable[[ToolCall], str] | None = None,
    max_bars: int = MAX_BARS,
    max_lanes: int = MAX_LANES,
) -> dict[str, Any]:
    """Return the timeline of ``job`` from its ``calls``, ready for the admin template.

    Times are milliseconds from the job's start (or its first call, if earlier). A call still
    executing runs to the job's end, or to ``now`` while the job runs. ``left`` and ``width`` are
    percentages of the span. ``aggregated`` is true past ``max_bars`` calls or ``max_lanes`` lanes:
    then ``rows`` hold time-bucket ``cells`` per group of lanes instead of one ``bars`` per call.
    ``details`` is what a click on a bar or cell shows, indexed by each item's ``detail``; for a
    call awaiting approval it carries ``decide_url`` (``decide_url(call)``), where the admin approves
    or denies it. A call that waited on its client or an approval has an amber ``wait_width`` (in
    percent of its bar) and a ``waiting`` label while it still waits.
    """
    ordered = sorted(enumerate(calls), key=lambda pair: (pair[1].started_at, pair[0]))
    calls = [call for _, call in ordered]
    now = now or timezone.now()
    origin = job.started_at
    if calls and (origin is None or calls[0].started_at < origin):
        origin = calls[0].started_at
    counts = dict.fromkeys((COMPLETED, FAILED, EXECUTING), 0)  # waiting ones are counted only when there are some
    for call in calls:
        counts[_status(call)] = counts.get(_status(call), 0) + 1
    result: dict[str, Any] = {
        "count": len(calls),
        "counts": counts,
        "credits": sum(call.credits for call in calls),
        "span_ms": 0.0,
        "lanes": 0,
        "aggregated": False,
        "ticks": [],
        "rows": [],
        "details": [],
        "table": [],
        "table_more": 0,
    }
    if origin is None:  # not started, no calls: nothing to draw
        return result

    end = job.finished_at or now
    open_end_ms = _ms(end, origin)
    spans: list[tuple[float, float]] = []
    for call in calls:
        start_ms = _ms(call.started_at, origin)
        end_ms = _ms(call.finished_at, origin) if call.finished_at is not None else max(open_end_ms, start_ms)
        spans.append((start_ms, max(end_ms, start_ms)))
    span_ms = max([open_end_ms, 1.0] + [e for _, e in spans])
    lanes = lanes_assign(spans)
    lane_count = max(lanes, default=-1) + 1
    aggregated = len(calls) > max_bars or lane_count > max_lanes
    result.update(span_ms=round(span_ms, 3), lanes=lane_count, aggregated=aggregated, ticks=ticks_build(span_ms))

    for call, lane, (start_ms, end_ms) in list(zip(calls, lanes, spans, strict=True))[:TABLE_LIMIT]:
        result["table"].append(
            {
                "call_id": call.call_id,
                "tool": f"{call.toolset_key}.{call.tool_name}",
                "status": _status(call),
                "lane": lane + 1,
                "start": _fmt_ms(start_ms),
                "duration": _fmt_ms(end_ms - start_ms)
                if call.finished_at is not None
                else WAITING.get(_status(call), "executing"),
                "credits": call.credits,
                "url": call_url(call) if call_url else "",
            }
        )
    result["table_more"] = max(0, len(calls) - TABLE_LIMIT)

    if aggregated:
        result["rows"] = _cells_build(calls, lanes, spans, lane_count, span_ms, result["details"])
    else:
        result["rows"] = _bars_build(calls, lanes, spans, lane_count, span_ms, result["details"], call_url, origin, decide_url)
    return result


def _bars_build(
    calls: list[ToolCall],
    lanes: list[int],
    spans: list[tuple[float, float]],
    lane_count: int,
    span_ms: float,
    details: list[dict[str, Any]],
    call_url: Callable[[ToolCall], str] | None,
    origin: datetime,
    decide_url: Callable[[ToolCall], str] | None,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [{"label": str(i + 1), "bars": [], "cells": []} for i in range(lane_count)]
    for call, lane, (start_ms, end_ms) in zip(calls, lanes, spans, strict=True):
        tool = f"{call.toolset_key}.{call.tool_name}"
        status = _status(call)
        executing = call.finished_at is None
        waiting = WAITING.get(status, "")
        duration = f"still {waiting or 'executing'}" if executing else _fmt_ms(end_ms - start_ms)
        waited_on, waited_ms = _waited_ms(call, start_ms, end_ms, origin)
        credits = f"{call.credits} credit{'' if call.credits == 1 else 's'}"
        outcome = ("error", call.error) if status == FAILED else ("output", call.output)
        title = f"{tool} · {status} · {duration} · {credits}\ninput: {_one_line(call.input, TITLE_PREVIEW_CHARS)}"
        if not executing:
            title += f"\n{outcome[0]}: {_one_line(outcome[1], TITLE_PREVIEW_CHARS)}"
        fields: list[list[Any]] = [
            ["call", call.call_id, False],
            ["status", status, False],
            ["lane", str(lane + 1), False],
            ["start", f"+{_fmt_ms(start_ms)}", False],
            ["duration", duration, False],
            ["credits", str(call.credits), False],
            ["input", _json_preview(call.input, PREVIEW_CHARS), True],
        ]
        if waited_on:
            fields.append([f"waited for {waited_on}", _fmt_ms(waited_ms) + (" so far" if executing else ""), False])
        if call.decision:
            who = call.decided_by.get_username() if call.decided_by else "someone"
            at = call.decided_at.isoformat(timespec="seconds") if call.decided_at else ""
            fields.append(
                [call.decision, f"by {who} at {at}" + (f": {call.decision_reason}" if call.decision_reason else ""), False]
            )
        if not executing:
            fields.append([outcome[0], _json_preview(outcome[1], PREVIEW_CHARS), True])
        detail = {"heading": tool, "status": status, "url": call_url(call) if call_url else "", "fields": fields}
        if status == AWAITING_APPROVAL and decide_url is not None:
            detail["decide_url"] = decide_url(call)
        details.append(detail)
        rows[lane]["bars"].append(
            {
                "detail": len(details) - 1,
                "call_id": call.call_id,
                "tool": tool,
                "status": status,
                "start_ms": round(start_ms, 3),
                "end_ms": round(end_ms, 3),
                "left": _pct(start_ms, span_ms),
                "width": _pct(end_ms - start_ms, span_ms),
                "title": f"{waiting} · {title}" if waiting else title,
                "label": f"{waiting}: {tool}" if waiting else tool,
                "waiting": waiting,
                # The share of the bar spent waiting on the client or an approval, drawn amber.
                "wait_width": round(waited_ms / (end_ms - start_ms) * 100, 2) if end_ms > start_ms and waited_ms else 0,
            }
        )
    return rows


def _cells_build(
    calls: list[ToolCall],
    lanes: list[int],
    spans: list[tuple[float, float]],
    lane_count: int,
    span_ms: float,
    details: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Aggregate: rows of adjacent lanes, each cut into time buckets counting the calls active in it."""
    group = max(1, math.ceil(lane_count / AGGREGATE_ROWS))
    row_count = math.ceil(lane_count / group)
    bucket_ms = span_ms / AGGREGATE_BUCKETS
    # cells[row][bucket] = (counts by status, {status: the first few calls of that status})
    cells: list[dict[int, tuple[dict[str, int], dict[str, list[str]]]]] = [{} for _ in range(row_count)]
    for call, lane, (start_ms, end_ms) in zip(calls, lanes, spans, strict=True):
        first = min(int(start_ms / bucket_ms), AGGREGATE_BUCKETS - 1)
        # A call ending exactly on a bucket's edge is not active in the next one.
        last = min(max(math.ceil(end_ms / bucket_ms) - 1, first), AGGREGATE_BUCKETS - 1)
        row = cells[lane // group]
        for bucket in range(first, last + 1):
            counts, samples = row.setdefault(bucket, (dict.fromkeys(STATUSES, 0), {}))
            status = _status(call)
            counts[status] = counts.get(status, 0) + 1
            named = samples.setdefault(status, [])
            if len(named) < CELL_SAMPLE:
                named.append(f"{call.call_id} {call.toolset_key}.{call.tool_name} {status}")
    peak = max((sum(c.values()) for row in cells for c, _ in row.values()), default=1)
    rows = []
    for index, row in enumerate(cells):
        low, high = index * group + 1, min((index + 1) * group, lane_count)
        label = str(low) if low == high else f"{low}–{high}"
        lanes_label = f"lane {label}" if low == high else f"lanes {label}"
        row_cells = []
        for bucket in sorted(row):
            counts, samples = row[bucket]
            sample = [line for status in SEVERITY for line in samples.get(status, [])][:CELL_SAMPLE]
            total = sum(counts.values())
            start_ms, end_ms = bucket * bucket_ms, (bucket + 1) * bucket_ms
            mix = ", ".join(f"{n} {status}" for status, n in counts.items() if n)
            plural = "" if total == 1 else "s"
            summary = f"{lanes_label} · {_fmt_ms(start_ms)} to {_fmt_ms(end_ms)}: {total} call{plural} ({mix})"
            fields: list[list[Any]] = [
                ["lanes", label, False],
                ["time", f"+{_fmt_ms(start_ms)} to +{_fmt_ms(end_ms)}", False],
                ["calls active", str(total), False],
                *[[status, str(n), False] for status, n in counts.items() if n],
                ["calls" if total <= len(sample) else f"{len(sample)} of them", "\n".join(sample), True],
            ]
            worst = next((s for s in SEVERITY if counts.get(s)), COMPLETED)
            details.append({"heading": f"{total} call{plural}, {lanes_label}", "status": worst, "url": "", "fields": fields})
            row_cells.append(
                {
                    "detail": len(details) - 1,
                    "left": _pct(start_ms, span_ms),
                    "width": _pct(bucket_ms, span_ms),
                    "total": total,
                    "status": worst,
                    # Heights in percent of the cell, stacked in SEVERITY order.
                    "segments": [{"status": s, "height": round(counts[s] / total * 100, 2)} for s in SEVERITY if counts.get(s)],
                    "opacity": round(0.35 + 0.65 * total / peak, 3),
                    "title": summary,
                }
            )
        rows.append({"label": label, "bars": [], "cells": row_cells})
    return rows
