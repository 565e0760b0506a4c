"""The admin shows a tool call as its workers recorded it, and writes none of it."""

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from django.contrib.admin.models import LogEntry
from django.contrib.auth import get_user_model
from django.contrib.contenttypes.models import ContentType
from django.db import connection, transaction
from django.test import Client

from execution.models import ToolCall
from tests.factories import demo_call, running_job


def test_saving_a_tool_calls_page_writes_nothing_over_what_its_worker_records() -> None:
    """The call's page had a Save button; its save wrote every column back as the page's request had
    read it, so a worker's finish committed in between (the call completed, charged) was undone:
    the call executing again, its credits 0, while the ledger had charged it."""
    user = get_user_model().objects.create_user(username=f"rec-{uuid.uuid4().hex[:6]}")
    call = demo_call(user=user, job=running_job(user=user))
    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    url = f"/admin/execution/toolcall/{call.pk}/change/"
    assert client.get(url).status_code == 200  # shown
    finishing, finish = threading.Event(), threading.Event()

    def worker_finishes() -> None:
        # As a tools worker does: the call's row locked and written, committed a moment later.
        try:
            with transaction.atomic():
                ToolCall.objects.filter(pk=call.pk).update(status=ToolCall.Status.COMPLETED, credits=3, output={"result": 3})
                finishing.set()
                finish.wait(10)
        finally:
            connection.close()

    def admin_saves() -> int:
        try:
            finishing.wait(10)
            return client.post(url, {"_save": "Save"}).status_code
        finally:
            connection.close()

    with ThreadPoolExecutor(2) as pool:
        worker = pool.submit(worker_finishes)
        saved = pool.submit(admin_saves)
        time.sleep(1)  # the admin's request has read the row as it was, and waits on the worker's lock
        finish.set()
        worker.result()
        status = saved.result()
    call.refresh_from_db()
    assert (call.status, call.credits, call.output) == (ToolCall.Status.COMPLETED, 3, {"result": 3})
    assert status == 403
    # Of this call: another model's row with the same id (a plan, a user) has entries of its own.
    assert not LogEntry.objects.filter(content_type=ContentType.objects.get_for_model(ToolCall), object_id=str(call.pk)).exists()
