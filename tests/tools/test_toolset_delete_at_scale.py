"""Deleting a toolset or tool of many calls, under PTC_DB_STATEMENT_TIMEOUT: its calls are kept,
unlinked from the tool (as the tool's SET_NULL says), a batch a statement (tools.services
tool_calls_unlink). Django's delete reads none of them (Django 4.2+ unlinks them with one UPDATE,
never loading their ids), but that one UPDATE of every call of the tool took 3 s for 200,000 calls
here, and ran past the timeout; the delete failed, every time.

200,000 calls against a statement timeout of 1 s stand for a tool of millions against 30 s."""

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.test import Client

from tests.conftest import Api, own_deployment
from tests.servers import api_key
from tests.stack import Stack
from tests.tools.conftest import private_http_toolset, unique_key
from tools.models import Tool, Toolset

CALLS = 200_000


def _calls_made(conn: Any, *, tool_id: str, user_id: int, toolset_key: str) -> None:
    """CALLS finished calls of ``tool_id`` and one still executing, as the workers record them."""
    conn.execute(
        """
        INSERT INTO execution_toolcall (call_id, type, ptc_call_id, user_id, toolset_key, tool_name, tool_id,
                                        input, status, credits, started_at, finished_at, decision, decision_reason)
        SELECT 'standalone_' || md5(random()::text || g), 'standalone', '', %(user)s, %(key)s, 'lookup', %(tool)s,
               '{"q": 1}'::jsonb, CASE WHEN g = 0 THEN 'executing' ELSE 'completed' END, 0, now(),
               CASE WHEN g = 0 THEN NULL ELSE now() END, '', ''
        FROM generate_series(0, %(calls)s) g
        """,
        {"user": user_id, "key": toolset_key, "tool": tool_id, "calls": CALLS},
    )
    conn.execute("ANALYZE execution_toolcall")


@pytest.fixture(scope="module")
def cut(stack_env: dict[str, str]) -> Iterator[Stack]:
    with own_deployment(stack_env, "delete-at-scale", PTC_DB_STATEMENT_TIMEOUT="1") as stack:
        yield stack


def test_a_toolset_of_many_calls_is_deleted_over_the_api_and_its_calls_are_kept(cut: Stack) -> None:
    username = f"staff-{uuid.uuid4().hex[:8]}"
    staff = Api(cut.base_url, api_key(cut.env, username, staff=True), username)
    key = unique_key("many")
    made = staff.post(
        "/api/v1/toolsets",
        json=private_http_toolset(
            key,
            "Many",
            [{"name": "lookup", "input_schema": {"type": "object"}, "http": {"method": "GET", "path": "/lookup", "query": []}}],
        ),
    )
    assert made.status_code == 201, made.text
    with psycopg.connect(cut.env["DATABASE_URL"], autocommit=True) as conn:
        ((tool_id, user_id),) = conn.execute(
            "SELECT t.id, s.owner_id FROM tools_tool t JOIN tools_toolset s ON s.id = t.toolset_id WHERE s.key = %s", [key]
        ).fetchall()
        _calls_made(conn, tool_id=tool_id, user_id=user_id, toolset_key=key)

        deleted = staff.http.delete(f"/api/v1/toolsets/{key}")
        assert deleted.status_code == 204, deleted.text  # before: 503 database_unavailable, the UPDATE cancelled
        assert staff.get(f"/api/v1/toolsets/{key}").status_code == 404
        kept = conn.execute(
            "SELECT count(*), count(tool_id), count(*) FILTER (WHERE status = 'executing') FROM execution_toolcall "
            "WHERE toolset_key = %s AND tool_name = 'lookup'",
            [key],
        ).fetchone()
        assert kept == (CALLS + 1, 0, 1)  # every call kept, none linked to the tool gone, the open one as it was


@contextmanager
def _statement_timeout(seconds: float, *, setting: str = "statement_timeout") -> Iterator[None]:
    """Run this thread's statements, in the block, each cancelled past ``seconds``, as
    PTC_DB_STATEMENT_TIMEOUT has PostgreSQL cancel them (set for the statement's transaction only,
    so nothing is left on a pooled connection): ``setting`` is statement_timeout, or lock_timeout
    (a wait on a lock alone), which PTC_DB_STATEMENT_TIMEOUT sets too."""

    def timed(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict[str, Any]) -> Any:
        database = context["connection"]

        def limited() -> Any:
            with database.wrap_database_errors:  # on psycopg's cursor: not through this wrapper again
                context["cursor"].cursor.execute("SELECT set_config(%s, %s, true)", [setting, f"{int(seconds * 1000)}ms"])
            return execute(sql, params, many, context)

        if not database.get_autocommit():  # in a transaction already (the admin's delete page): for its rest
            return limited()
        with transaction.atomic(using=database.alias):
            return limited()

    with connection.execute_wrapper(timed):
        yield


@pytest.mark.parametrize("what", ["toolset", "tool"])
def test_a_toolset_or_tool_of_many_calls_is_deleted_in_the_admin_and_its_calls_are_kept(what: str) -> None:
    owner = get_user_model().objects.create_user(username=f"owner-{uuid.uuid4().hex[:6]}")
    toolset = Toolset.objects.create(
        key=unique_key("many"), name="Many", kind="http", owner=owner, is_global=False, config={"base_url": "http://127.0.0.1:9"}
    )
    tool = Tool.objects.create(toolset=toolset, name="lookup", input_schema={"type": "object"})
    with connection.cursor() as cursor:
        _calls_made(cursor, tool_id=tool.pk, user_id=owner.pk, toolset_key=toolset.key)
    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    url = f"/admin/tools/{what}/{(toolset if what == 'toolset' else tool).pk}/delete/"
    with _statement_timeout(1):
        answer = client.post(url, {"post": "yes"})
    assert answer.status_code == 302, answer.content.decode()[-2000:]
    assert not Tool.objects.filter(pk=tool.pk).exists()
    from execution.models import ToolCall

    kept = ToolCall.objects.filter(toolset_key=toolset.key, tool_name="lookup")
    assert (kept.count(), kept.filter(tool__isnull=False).count(), kept.filter(status="executing").count()) == (CALLS + 1, 0, 1)
    kept.delete()


def _form_posted(page: Any) -> dict[str, Any]:
    """What the browser posts of the change page ``page`` (its main form and its inlines) as drawn."""
    forms = [page.context["adminform"].form]
    for inline in page.context["inline_admin_formsets"]:
        forms += [inline.formset.management_form, *inline.formset.forms]
    data: dict[str, Any] = {}
    for form in forms:
        for name in form.fields:
            value = form[name].value()  # prepared, as the widget draws it
            if value is None or value is False:
                continue
            data[form.add_prefix(name)] = "on" if value is True else value
    return data


def test_a_tool_of_many_calls_deleted_on_its_toolsets_page_keeps_its_calls() -> None:
    owner = get_user_model().objects.create_user(username=f"owner-{uuid.uuid4().hex[:6]}")
    toolset = Toolset.objects.create(
        key=unique_key("many"), name="Many", kind="http", owner=owner, is_global=False, config={"base_url": "http://127.0.0.1:9"}
    )
    tool = Tool.objects.create(
        toolset=toolset, name="lookup", input_schema={"type": "object"}, http={"method": "GET", "path": "/x", "query": []}
    )
    with connection.cursor() as cursor:
        _calls_made(cursor, tool_id=tool.pk, user_id=owner.pk, toolset_key=toolset.key)
    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    url = f"/admin/tools/toolset/{toolset.pk}/change/"
    data = _form_posted(client.get(url)) | {"tools-0-DELETE": "on"}
    with _statement_timeout(1):
        answer = client.post(url, data)
    assert answer.status_code == 302, answer.context and answer.context["adminform"].form.errors
    assert Toolset.objects.filter(pk=toolset.pk).exists() and not Tool.objects.filter(pk=tool.pk).exists()
    from execution.models import ToolCall

    kept = ToolCall.objects.filter(toolset_key=toolset.key, tool_name="lookup")
    assert (kept.count(), kept.filter(tool__isnull=False).count(), kept.filter(status="executing").count()) == (CALLS + 1, 0, 1)
    kept.delete()
