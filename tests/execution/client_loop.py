"""A real client loop for tests: follows a job's SSE stream and answers its client tool calls
through POST /api/v1/exec/{id}/tool-results, as an agent runtime would."""

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import Any

from tests.conftest import Api

# (name, input) -> the tool_result block's fields {content, is_error}, or None to leave it unanswered.
Handler = Callable[[str, dict[str, Any]], dict[str, Any] | None]


def sse_events(api: Api, job_id: str, timeout: float = 60) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(event, data)`` from the job's stream until ``exec_end``."""
    with api.http.stream("GET", f"/api/v1/exec/{job_id}/events", timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        event = ""
        for line in response.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                yield event, json.loads(line[6:])
                if event == "exec_end":
                    return


class ClientLoop:
    """Answers client tool calls of one job on a thread. ``pending`` holds every tool_call_pending
    block seen; ``events`` every event name; ``answers`` the HTTP answers to its posts.
    ``batch``: wait for that many pending client calls, then answer them in one POST."""

    def __init__(
        self,
        api: Api,
        job_id: str,
        handler: Handler,
        batch: int = 1,
        approver: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        self.api, self.job_id, self.handler, self.batch, self.approver = api, job_id, handler, batch, approver
        self.pending: list[dict[str, Any]] = []
        self.events: list[str] = []
        self.answers: list[Any] = []
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "ClientLoop":
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.thread.join(90)

    def _run(self) -> None:
        try:
            waiting: list[dict[str, Any]] = []
            with closing(sse_events(self.api, self.job_id)) as events:  # closed here, not when collected
                for event, data in events:
                    self.events.append(event)
                    if event == "tool_call_pending" and data["awaiting"] == "approval" and self.approver is not None:
                        self.pending.append(data)
                        decided = self.api.post(f"/api/v1/tool-calls/{data['id']}/approval", json=self.approver(data))
                        self.answers.append((decided.status_code, decided.json()))
                    if event != "tool_call_pending" or data["awaiting"] != "client":
                        continue
                    self.pending.append(data)
                    waiting.append(data)
                    if len(waiting) < self.batch:
                        continue
                    results = []
                    for block in waiting:
                        answer = self.handler(block["name"], block["input"])
                        if answer is not None:
                            results.append({"type": "tool_result", "tool_use_id": block["id"], **answer})
                    waiting = []
                    if results:
                        response = self.api.post(f"/api/v1/exec/{self.job_id}/tool-results", json=results)
                        self.answers.append((response.status_code, response.json()))
        except BaseException as exc:  # reported by the test, not lost on the thread
            self.errors.append(exc)
