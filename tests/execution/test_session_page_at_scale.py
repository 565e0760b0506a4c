"""A session's admin page lists the first of its files, not all of them: a session may hold any
number (its code writes them), and its page drew each as a row, read with its bytes."""

import uuid
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from execution.models import ExecSession, WorkFile

FILES_SHOWN = 100  # execution.admin's (named here, so that the test runs without it)


def test_a_sessions_page_lists_its_first_files_and_links_to_them_all() -> None:
    now = timezone.now()
    user = get_user_model().objects.create_user(username=f"files-{uuid.uuid4().hex[:6]}")
    session = ExecSession.objects.create(
        user=user,
        status="expired",
        idle_timeout_seconds=60,
        max_lifetime_seconds=60,
        last_used_at=now,
        expires_at=now + timedelta(minutes=1),
        max_expires_at=now + timedelta(minutes=1),
    )
    made = FILES_SHOWN + 50
    WorkFile.objects.bulk_create(
        WorkFile(session=session, kind="output", path=f"out/{i:04d}.txt", content=b"x" * 100, size=100) for i in range(made)
    )
    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    with CaptureQueriesContext(connection) as queries:
        page = client.get(f"/admin/execution/execsession/{session.pk}/change/")
    assert page.status_code == 200
    (files,) = page.context["inline_admin_formsets"]
    shown = [form.instance.path for form in files.formset.forms]
    assert shown == [f"out/{i:04d}.txt" for i in range(FILES_SHOWN)]  # before: all 150
    read = [q["sql"] for q in queries.captured_queries if '"execution_workfile"' in q["sql"]]
    assert read and not any('"execution_workfile"."content"' in sql for sql in read)  # the bytes unread
    link = f"/admin/execution/workfile/?session__id__exact={session.pk}"
    assert f'href="{link}"' in page.content.decode()
    listed = client.get(link)
    assert listed.status_code == 200 and listed.context["cl"].result_count == made
    WorkFile.objects.filter(session=session).delete()
