"""Deleting a user in the admin: their history a batch a statement (users_history_delete), under
PTC_DB_STATEMENT_TIMEOUT; and a user with a ledger, which is kept for good, not deleted, the page
saying why and what to do instead.

Django's delete of a user unlinked the calls of their own toolsets' tools in one UPDATE and deleted
their calls in one DELETE: 200,000 calls against a statement timeout of 1 s stand for a user of
millions against 30 s (the UPDATE alone took 3 s here)."""

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.db import connection, transaction
from django.test import Client
from django.utils import timezone

from billing.models import CreditAccount, CreditUsage, LedgerEntry, Reservation
from billing.services import account_get, credits_adjust, credits_settle
from execution.models import ExecJob, ToolCall
from ptcproject.deletion import delete_in_batches
from tests.execution.rival import _a_statement_waits_for_a_lock
from tests.factories import demo_call, running_job
from tests.tools.conftest import unique_key
from tests.tools.test_toolset_delete_at_scale import CALLS, _calls_made, _statement_timeout
from tools.models import Tool, Toolset


def _staff_client() -> Client:
    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    return client


def _call(*, user: User, tool: Tool) -> ToolCall:
    now = timezone.now()
    return ToolCall.objects.create(
        **{"call_id": f"standalone_{uuid.uuid4().hex}", "type": "standalone", "user": user, "tool": tool},
        **{"toolset_key": tool.toolset.key, "tool_name": tool.name, "status": "completed", "started_at": now, "finished_at": now},
    )


def _owner_of_a_toolset_of_many_calls() -> tuple[User, User, Tool]:
    """A user, the owner of a toolset whose tool others called CALLS times (and once still
    executing; it was global before it was given to them), with calls and a job of their own."""
    owner = get_user_model().objects.create_user(username=f"owner-{uuid.uuid4().hex[:6]}")
    other = get_user_model().objects.create_user(username=f"other-{uuid.uuid4().hex[:6]}")
    toolset = Toolset.objects.create(
        key=unique_key("mine"), name="Mine", kind="http", owner=owner, is_global=False, config={"base_url": "http://127.0.0.1:9"}
    )
    tool = Tool.objects.create(toolset=toolset, name="lookup", input_schema={"type": "object"})
    with connection.cursor() as cursor:
        _calls_made(cursor, tool_id=tool.pk, user_id=other.pk, toolset_key=toolset.key)
    for _ in range(3):
        _call(user=owner, tool=tool)
    running_job(user=owner, status="completed")
    return owner, other, tool


def _gone_and_kept(owner: User, other: User) -> None:
    assert not get_user_model().objects.filter(pk=owner.pk).exists()
    assert not ToolCall.objects.filter(user_id=owner.pk).exists() and not ExecJob.objects.filter(user_id=owner.pk).exists()
    kept = ToolCall.objects.filter(user=other)
    # Every call of the other user kept, none linked to the tool gone, the open one as it was.
    assert (kept.count(), kept.filter(tool__isnull=False).count(), kept.filter(status="executing").count()) == (CALLS + 1, 0, 1)
    kept.delete()


def test_a_user_whose_toolset_has_many_calls_is_deleted_in_the_admin() -> None:
    owner, other, _ = _owner_of_a_toolset_of_many_calls()
    client = _staff_client()
    with _statement_timeout(1):
        answer = client.post(f"/admin/auth/user/{owner.pk}/delete/", {"post": "yes"})
    assert answer.status_code == 302, answer.content.decode()[-2000:]  # before: QueryCanceled, the one UPDATE
    _gone_and_kept(owner, other)


def test_users_whose_toolsets_have_many_calls_are_deleted_by_the_admins_action() -> None:
    owner, other, _ = _owner_of_a_toolset_of_many_calls()
    client = _staff_client()
    data = {"action": "delete_selected", "_selected_action": [owner.pk], "post": "yes"}
    with _statement_timeout(1):
        answer = client.post("/admin/auth/user/", data)
    assert answer.status_code == 302, answer.content.decode()[-2000:]
    _gone_and_kept(owner, other)


def test_a_user_who_decided_many_calls_is_deleted_in_the_admin_and_the_calls_are_kept() -> None:
    """An approver's decisions are kept, unlinked from them (decided_by sets null), as Django's
    delete did in one UPDATE of every call they decided."""
    owner, other, _ = _owner_of_a_toolset_of_many_calls()
    approver = get_user_model().objects.create_user(username=f"approver-{uuid.uuid4().hex[:6]}")
    ToolCall.objects.filter(user=other).update(decision="approved", decided_by=approver)
    client = _staff_client()
    with _statement_timeout(1):
        answer = client.post(f"/admin/auth/user/{approver.pk}/delete/", {"post": "yes"})
    assert answer.status_code == 302, answer.content.decode()[-2000:]  # before: QueryCanceled, the one UPDATE
    decided = ToolCall.objects.filter(user=other)
    assert (decided.filter(decision="approved").count(), decided.filter(decided_by__isnull=False).count()) == (CALLS + 1, 0)
    decided.delete()
    owner.delete()


def test_a_user_with_a_ledger_is_not_deleted_and_the_page_says_to_deactivate_them() -> None:
    user = get_user_model().objects.create_user(username=f"paid-{uuid.uuid4().hex[:6]}")
    credits_adjust(user=user, amount=10, reason="welcome")
    client = _staff_client()
    for answer in (
        client.get(f"/admin/auth/user/{user.pk}/delete/"),
        client.post(f"/admin/auth/user/{user.pk}/delete/", {"post": "yes"}),
        client.post("/admin/auth/user/", {"action": "delete_selected", "_selected_action": [user.pk], "post": "yes"}),
    ):
        page = answer.content.decode()
        assert answer.status_code == 200, page[-2000:]
        assert "1 ledger entries (protected: credits were granted to or charged to this user" in page
        assert "Deactivate the user instead: untick Active on their page" in page  # before: only "(protected)"
    assert get_user_model().objects.filter(pk=user.pk, is_active=True).exists()


def _user_with_a_job_and_a_call(name: str) -> tuple[User, ToolCall]:
    """A user (``name``, made unique) with a completed job and its completed call: what a delete
    of the user takes with it, or keeps when it is refused."""
    user = get_user_model().objects.create_user(username=f"{name}-{uuid.uuid4().hex[:6]}")
    job = running_job(user=user, status="completed", finished_at=timezone.now())
    return user, demo_call(user=user, job=job, status="completed", finished_at=timezone.now())


def _delete_confirmed(how: str, user: User) -> tuple[str, dict[str, Any]]:
    """The admin's confirmed delete of ``user``, by its ``page`` or by the list's ``action``: the URL and the form."""
    if how == "page":
        return f"/admin/auth/user/{user.pk}/delete/", {"post": "yes"}
    return "/admin/auth/user/", {"action": "delete_selected", "_selected_action": [user.pk], "post": "yes"}


@pytest.mark.parametrize("how", ["page", "action"])
def test_a_ledger_entry_written_as_the_user_is_deleted_refuses_the_delete_and_deletes_nothing(how: str) -> None:
    """A grant to a user confirmed for deletion, its entry written as the delete runs (its account
    locked, not yet committed) and committed while the delete waits on that lock: the delete is
    refused as it is for an entry written before (the page says to deactivate the user), and the
    user is kept whole, their history with them."""
    user, _ = _user_with_a_job_and_a_call("granted")
    account_get(user=user)
    client = _staff_client()
    url, data = _delete_confirmed(how, user)
    with ThreadPoolExecutor(1) as pool:
        with transaction.atomic():
            credits_adjust(user=user, amount=10, reason="granted as the user is deleted")
            answer = pool.submit(client.post, url, data)
            deadline = time.monotonic() + 15
            while not _a_statement_waits_for_a_lock():
                assert not answer.done(), answer.result().content.decode()[-2000:]
                assert time.monotonic() < deadline, "the delete never waited for the grant's account"
                time.sleep(0.02)
        # Before: IntegrityError (the account deleted from under its entry, at the commit): a 500;
        # by the action, the user's job and calls deleted already, the user kept.
        page = answer.result().content.decode()
    assert answer.result().status_code == 200, page[-2000:]
    assert "Deactivate the user instead: untick Active on their page" in page
    assert get_user_model().objects.filter(pk=user.pk).exists()
    assert (ExecJob.objects.filter(user=user).count(), ToolCall.objects.filter(user=user).count()) == (1, 1)
    assert LedgerEntry.objects.filter(account__user=user).count() == 1


@pytest.mark.parametrize("how", ["page", "action"])
def test_a_delete_that_deadlocks_with_a_charge_says_to_try_again_and_deletes_nothing(how: str) -> None:
    """A charge locks the user's account, then writes a usage row naming the user; the delete locks
    the user, then the account. Met half way, each waits on the other, and PostgreSQL cancels one:
    the delete here (it waited first, so its check for a deadlock ran first). The page says what
    happened and to try again; nothing is deleted, and the charge goes through."""
    user, call = _user_with_a_job_and_a_call("charged")
    account = account_get(user=user)
    # Held at no cost (a plan's free tool access): its charge writes a usage row, no ledger entry.
    Reservation.objects.create(account=account, tool_call_id=call.call_id, amount=0, due_amount=5, meta={"toolName": "add"})
    client = _staff_client()
    url, data = _delete_confirmed(how, user)
    with ThreadPoolExecutor(1) as pool:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL deadlock_timeout = '10s'")  # the delete's check for one runs first
            list(CreditAccount.objects.select_for_update().filter(pk=account.pk))  # as the charge's UPDATE of it
            answer = pool.submit(client.post, url, data)
            deadline = time.monotonic() + 15
            while not _a_statement_waits_for_a_lock():
                assert not answer.done(), answer.result().content.decode()[-2000:]
                assert time.monotonic() < deadline, "the delete never waited for the charge's account"
                time.sleep(0.02)
            assert credits_settle(tool_call_id=call.call_id) == 0  # its usage row names the user: waits on the delete
        # Before: OperationalError (deadlock detected), a 500.
        done = answer.result()
    assert done.status_code == 302, done.content.decode()[-2000:]
    page = client.get(done["Location"]).content.decode()
    assert "Nothing was deleted: try again." in page, page[-3000:]
    assert get_user_model().objects.filter(pk=user.pk).exists()
    assert (ExecJob.objects.filter(user=user).count(), ToolCall.objects.filter(user=user).count()) == (1, 1)
    assert CreditUsage.objects.filter(user=user, tool_call_id=call.call_id).exists()


def test_a_delete_in_one_transaction_reads_each_row_once() -> None:
    """A user's 200,000 calls deleted a batch a statement in one transaction, as the admin deletes
    them. Each batch found its rows by a scan of the whole table, sorted (the model's ordering):
    the table read 200 times over, the delete quadratic in the rows. Unsorted, each batch's scan
    of the user's calls by its index still went over the entries of every call the batches before
    it took (dead only as the transaction ends): the 200th batch 9 times as long as the first.
    Counted in the rows and index entries the transaction's scans read, not timed."""
    owner, other, _ = _owner_of_a_toolset_of_many_calls()
    calls = ToolCall.objects.filter(user=other).exclude(status__in=ToolCall.OPEN)

    def rows_read() -> int:  # of the calls' table, by this transaction's scans
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT seq_tup_read + coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables WHERE relname = 'execution_toolcall'"
            )
            return int(cursor.fetchone()[0])

    def entries_read() -> int:  # of the calls' indexes, by every scan (this connection's counted as it went idle)
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_stat_force_next_flush()")
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute("SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes WHERE relname = 'execution_toolcall'")
            return int(cursor.fetchone()[0])

    entries = entries_read()
    with transaction.atomic():
        with connection.cursor() as cursor:
            # The plan a user's calls get among a large deployment's (by the index on the user),
            # not this table's, which holds little else.
            cursor.execute("SET LOCAL enable_seqscan = off")
        rows = rows_read()
        assert delete_in_batches(calls) == CALLS
        rows = rows_read() - rows
        transaction.set_rollback(True)
    entries = entries_read() - entries
    assert rows < 3 * CALLS, rows  # before: 20 million, sorted
    assert entries < 3 * CALLS, entries  # unsorted, a scan a batch by the user's index: 20 million
    ToolCall.objects.filter(user=other).delete()
    owner.delete()


@pytest.mark.parametrize("timeout", ["statement_timeout", "lock_timeout"])
@pytest.mark.parametrize("how", ["page", "action"])
def test_a_delete_cut_short_by_a_timeout_says_to_try_again_and_deletes_nothing(
    how: str, timeout: str, django_db_setup: str
) -> None:
    """A transaction that does not end (a stuck one) holds the user's row locked: the delete waits
    on it past PTC_DB_STATEMENT_TIMEOUT (its statement or its lock timeout), and PostgreSQL cancels
    its statement. The page says what happened and to try again, as for a deadlock; nothing is
    deleted."""
    user, _ = _user_with_a_job_and_a_call("held")
    client = _staff_client()
    url, data = _delete_confirmed(how, user)
    with psycopg.connect(django_db_setup) as stuck:  # its transaction open till the block ends
        stuck.execute("SELECT 1 FROM auth_user WHERE id = %s FOR UPDATE", [user.pk])
        with _statement_timeout(1, setting=timeout):
            done = client.post(url, data)  # before: OperationalError (canceling statement due to ...), a 500
        stuck.rollback()
    assert done.status_code == 302, done.content.decode()[-2000:]
    page = client.get(done["Location"]).content.decode()
    assert "longer than the database allows a statement" in page and "Nothing was deleted: try again." in page, page[-3000:]
    assert get_user_model().objects.filter(pk=user.pk).exists()
    assert (ExecJob.objects.filter(user=user).count(), ToolCall.objects.filter(user=user).count()) == (1, 1)
