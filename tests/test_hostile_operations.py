"""What an operator does in the admin to a live fleet: each action leaves every job able to end."""

import time
import uuid
from datetime import timedelta

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.messages.storage.fallback import FallbackStorage
from django.db import connection
from django.test import Client, RequestFactory
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from execution.admin import ExecSessionAdmin
from execution.models import ExecJob, ExecSession, ToolCall
from tests.conftest import Api
from tests.factories import demo_call, job_calls, running_job


def test_the_admin_cancels_a_running_job_it_tells_the_operator_to_cancel(api: Api) -> None:
    """The admin deletes no job that has not ended, and says "cancel it first"; it had no way to
    cancel one (a managed container's job runs until someone does). Its action cancels the jobs
    chosen as POST /exec/{id}/cancel does, and leaves those that have ended as they are."""
    staff = get_user_model().objects.create_user(username=f"ops-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    done = api.run("1", wait=30)
    job = api.post("/api/v1/exec", json={"code": "import time\ntime.sleep(60)", "wait": 0}).json()
    deadline = time.monotonic() + 30
    while ExecJob.objects.get(pk=job["id"]).status != "running":
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.2)
    action = {"action": "cancel_jobs", "_selected_action": [job["id"], done["id"]]}
    try:
        page = client.post("/admin/execution/execjob/", action, follow=True).content.decode()
        assert f"Cancelled {job['call_id']}" in page and f"Not cancelled: {done['call_id']} had ended (completed)" in page
        deadline = time.monotonic() + 20
        while (row := ExecJob.objects.get(pk=job["id"])).closed_at is None:  # its worker kills the sandbox, closes it
            assert time.monotonic() < deadline, row.status
            time.sleep(0.2)
        seen = api.get(f"/api/v1/exec/{job['id']}").json()
        assert (seen["status"], seen["error"]["type"]) == ("cancelled", "Cancelled")
        assert api.get(f"/api/v1/exec/{done['id']}").json()["status"] == "completed"
    finally:
        api.post(f"/api/v1/exec/{job['id']}/cancel")


def test_the_admin_ends_an_active_session_rather_than_deleting_it(api: Api) -> None:
    """Deleted in the admin, an active session's row went: a job queued for it then ran outside it,
    in a fresh interpreter, and a running one ended SessionEnded rather than cancelled. The admin
    deletes no active session, from its page or by the list's action, and says why; its action ends
    the sessions chosen as DELETE /sessions/{id} does, and leaves those that have ended as they
    are (an expired one's files readable). An ended session is deleted as before."""
    staff = get_user_model().objects.create_user(username=f"ops-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    session = api.post("/api/v1/sessions", json={"toolsets": ["demo"]}).json()
    expired = api.post("/api/v1/sessions", json={"toolsets": ["demo"], "idle_timeout": 1}).json()
    assert api.post(f"/api/v1/sessions/{expired['id']}/files", files={"file": ("kept.txt", b"x")}).status_code == 201
    code = "import time\nprint('in', flush=True)\ntime.sleep(60)"
    job = api.post("/api/v1/exec", json={"code": code, "wait": 0, "session": session["id"], "timeout": 120}).json()
    try:
        assert api.until_printed(job["id"]) == "in\n"
        for url, data in (
            (f"/admin/execution/execsession/{session['id']}/delete/", {"post": "yes"}),
            ("/admin/execution/execsession/", {"action": "delete_selected", "_selected_action": [session["id"]], "post": "yes"}),
        ):
            page = client.post(url, data).content.decode()
            assert ExecSession.objects.filter(pk=session["id"], status="active").exists(), url
            assert f"session {session['id']} (active: end it first)" in page, url  # named as what keeps it
        deadline = time.monotonic() + 20
        while ExecSession.objects.get(pk=expired["id"]).status != "expired":  # recorded by the reaper
            assert time.monotonic() < deadline, "the idle session did not expire"
            time.sleep(0.2)
        action = {"action": "end_sessions", "_selected_action": [session["id"], expired["id"]]}
        page = client.post("/admin/execution/execsession/", action, follow=True).content.decode()
        assert f"Ended {session['id']}" in page and f"Not ended: {expired['id']} had ended (expired)" in page
        assert api.get(f"/api/v1/sessions/{session['id']}").json()["status"] == "deleted"
        assert api.get(f"/api/v1/sessions/{expired['id']}/files/kept.txt").content == b"x"
        deadline = time.monotonic() + 20
        while (row := ExecJob.objects.get(pk=job["id"])).status in ("queued", "running"):
            assert time.monotonic() < deadline, row.status
            time.sleep(0.2)
        assert api.get(f"/api/v1/exec/{job['id']}").json()["status"] == "cancelled"
        client.post(f"/admin/execution/execsession/{expired['id']}/delete/", {"post": "yes"})
        assert not ExecSession.objects.filter(pk=expired["id"]).exists()
    finally:
        api.http.delete(f"/api/v1/sessions/{session['id']}")


def test_a_session_that_ends_on_its_own_as_the_admin_ends_it_keeps_its_files(api: Api) -> None:
    """The admin's "End" read the session active, then ended it by the service, which deletes the
    files of a session it finds ended too (as DELETE does): one that expired in between lost its
    files, and the operator was told "not ended". It keeps them now."""
    staff = get_user_model().objects.create_user(username=f"ops-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    session = api.post("/api/v1/sessions", json={"toolsets": ["demo"]}).json()
    assert api.post(f"/api/v1/sessions/{session['id']}/files", files={"file": ("kept.txt", b"x")}).status_code == 201
    read = ExecSession.objects.get(pk=session["id"])  # as the action's list read it: active
    ExecSession.objects.filter(pk=session["id"]).update(status="expired", end_reason="idle", ended_at=timezone.now())
    request = RequestFactory().post("/admin/execution/execsession/")
    request.user, request.session = staff, {}
    request._messages = FallbackStorage(request)  # type: ignore[attr-defined]
    ExecSessionAdmin(ExecSession, admin.site).end_sessions(request, [read])  # type: ignore[arg-type]
    assert [str(m) for m in request._messages] == [f"Not ended: {session['id']} had ended (expired)."]  # type: ignore[attr-defined]
    assert api.get(f"/api/v1/sessions/{session['id']}/files/kept.txt").content == b"x"


def test_the_admin_deletes_no_user_with_a_job_or_call_not_ended() -> None:
    """Deleting a user in the admin deleted their jobs and calls with them, a running job and an
    open call too, past the job and call admins' guard: the worker then recorded into rows gone
    under it, and a call ran for free. The admin deletes no such user, from their page or by the
    list's action, and names the job or call that keeps them; a user whose work has ended is
    deleted as before."""
    staff = get_user_model().objects.create_user(username=f"ops-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    users = get_user_model().objects
    working, calling, done = (users.create_user(username=f"ops-u-{uuid.uuid4().hex[:8]}") for _ in range(3))
    job = running_job(user=working)
    call = demo_call(user=working, job=job)  # executing
    standalone = demo_call(user=calling)  # a call of no job, executing
    ended = running_job(user=done, status="completed", finished_at=timezone.now())
    demo_call(user=done, job=ended, status="completed", finished_at=timezone.now())
    kept_by_job = f"job {job.call_id} (running: cancel it first)"
    for url, data, named in (
        (f"/admin/auth/user/{working.pk}/delete/", {"post": "yes"}, [kept_by_job, call.call_id]),
        (f"/admin/auth/user/{calling.pk}/delete/", {"post": "yes"}, [standalone.call_id]),
        (
            "/admin/auth/user/",
            {"action": "delete_selected", "_selected_action": [working.pk, calling.pk], "post": "yes"},
            [kept_by_job, call.call_id, standalone.call_id],
        ),
    ):
        page = client.post(url, data).content.decode()
        assert users.filter(pk=working.pk).exists() and users.filter(pk=calling.pk).exists(), url
        assert (
            ExecJob.objects.filter(pk=job.pk).exists() and ToolCall.objects.filter(pk__in=[call.pk, standalone.pk]).count() == 2
        )
        assert all(name in page for name in named), url  # named as what keeps them
    client.post(f"/admin/auth/user/{done.pk}/delete/", {"post": "yes"})
    assert not users.filter(pk=done.pk).exists()


def test_a_users_delete_page_counts_what_goes_with_them_without_reading_it() -> None:
    """The page read every row the delete would take, whole, to link each one: a user's 10,000
    calls were 13 s and 65 MB a load, and their page grew with their history. It counts them by
    model now, each once however it is reached (a job's calls are its user's too), and the delete
    still takes them."""
    staff = get_user_model().objects.create_user(username=f"ops-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    user = get_user_model().objects.create_user(username=f"ops-u-{uuid.uuid4().hex[:8]}")
    for _ in range(3):
        job = running_job(user=user, status="completed", finished_at=timezone.now())
        job_calls(job, [{"started_at": job.created_at, "input": {"text": "x" * 1000}}] * 1000)
    demo_call(user=user, status="completed", finished_at=timezone.now())  # a call of no job
    with CaptureQueriesContext(connection) as queries:
        page = client.get(f"/admin/auth/user/{user.pk}/delete/").content.decode()
    read = [q["sql"] for q in queries.captured_queries if '"execution_toolcall"."input"' in q["sql"]]
    assert read == []  # no call read, let alone whole
    assert len(page) < 20_000
    assert "<li>Tool calls: 3001</li>" in page and "<li>Exec jobs: 3</li>" in page
    assert "3,001 tool calls" in page
    client.post(f"/admin/auth/user/{user.pk}/delete/", {"post": "yes"})
    assert not get_user_model().objects.filter(pk=user.pk).exists()
    assert not ToolCall.objects.filter(user_id=user.pk).exists()


def test_a_jobs_delete_page_counts_its_calls_without_reading_them() -> None:
    """As a user's: a job's page read each of its calls whole (a managed container's job has no
    bound on them), and the delete action did for every job chosen."""
    staff = get_user_model().objects.create_user(username=f"ops-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    user = get_user_model().objects.create_user(username=f"ops-u-{uuid.uuid4().hex[:8]}")
    jobs = [running_job(user=user, status="completed", finished_at=timezone.now()) for _ in range(2)]
    for job in jobs:
        job_calls(job, [{"started_at": job.created_at, "input": {"text": "x" * 1000}}] * 1500)
    for url, data in (
        (f"/admin/execution/execjob/{jobs[0].pk}/delete/", {}),
        ("/admin/execution/execjob/", {"action": "delete_selected", "_selected_action": [job.pk for job in jobs]}),
    ):
        with CaptureQueriesContext(connection) as queries:
            page = (client.post(url, data) if data else client.get(url)).content.decode()
        assert [q["sql"] for q in queries.captured_queries if '"execution_toolcall"."input"' in q["sql"]] == [], url
        assert f"<li>Tool calls: {1500 * (1 + bool(data))}</li>" in page, url
    client.post(
        "/admin/execution/execjob/", {"action": "delete_selected", "_selected_action": [j.pk for j in jobs], "post": "yes"}
    )
    assert not ExecJob.objects.filter(pk__in=[job.pk for job in jobs]).exists()
    assert not ToolCall.objects.filter(user=user).exists()


def test_the_admin_deletes_no_user_with_an_active_session() -> None:
    """A user's active session (with no job) did not keep them: deleted, the session went with
    them, its sandbox left to its worker's next lease round. It keeps them now, named, until it
    ends. (A user with an API key is kept by the key as well: keys are revoked, never deleted.)"""
    staff = get_user_model().objects.create_user(username=f"ops-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    user = get_user_model().objects.create_user(username=f"ops-u-{uuid.uuid4().hex[:8]}")
    now = timezone.now()
    later = now + timedelta(hours=1)
    session = ExecSession.objects.create(
        user=user, idle_timeout_seconds=3600, max_lifetime_seconds=3600, last_used_at=now, expires_at=later, max_expires_at=later
    )
    page = client.post(f"/admin/auth/user/{user.pk}/delete/", {"post": "yes"}).content.decode()
    assert f"session {session.pk} (active: end it first)" in page
    assert ExecSession.objects.filter(pk=session.pk, status="active").exists()
    ExecSession.objects.filter(pk=session.pk).update(status="expired", ended_at=now)
    client.post(f"/admin/auth/user/{user.pk}/delete/", {"post": "yes"})
    assert not get_user_model().objects.filter(pk=user.pk).exists()
