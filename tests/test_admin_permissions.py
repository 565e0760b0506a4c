"""The admin as a staff member with a model's view permission only: they see its rows, and change
nothing through an action or a page of the admin's own (a grant of credits, a job's cancel, a key's
revoke, a session's end, a toolset's sync, an approval), nor read what they have no permission on."""

import uuid
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.utils import timezone

from billing.models import CreditAccount
from billing.services import credits_adjust
from execution.models import ExecJob, ExecSession, ToolCall
from ptcproject.accounts.models import ApiKey
from ptcproject.accounts.services import api_key_create
from tests.factories import demo_call, running_job


def _staff(*codenames: str) -> tuple[User, Client]:
    """A staff member (not a superuser) with only these model permissions, signed in to the admin."""
    staff = get_user_model().objects.create_user(username=f"staff-{uuid.uuid4().hex[:6]}", is_staff=True)
    staff.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(staff)
    return staff, client


def _user() -> User:
    return get_user_model().objects.create_user(username=f"u-{uuid.uuid4().hex[:6]}")


def test_a_viewer_of_credit_accounts_grants_no_credits() -> None:
    user = _user()
    credits_adjust(user=user, amount=5, reason="start")
    account = CreditAccount.objects.get(user=user)
    _, client = _staff("view_creditaccount")
    assert client.get("/admin/billing/creditaccount/").status_code == 200  # they may see the accounts
    client.post(
        "/admin/billing/creditaccount/",
        {
            "action": "adjust_credits",
            "_selected_action": [account.pk],
            "apply": "1",
            "amount": "1000000",
            "reason": "mine",
            "token": uuid.uuid4(),
        },
    )
    account.refresh_from_db()
    assert account.balance == 5
    assert account.ledger.count() == 1


def test_a_viewer_of_jobs_cancels_none() -> None:
    job = running_job(user=_user())
    _, client = _staff("view_execjob")
    client.post("/admin/execution/execjob/", {"action": "cancel_jobs", "_selected_action": [job.pk]})
    job.refresh_from_db()
    assert job.status == ExecJob.Status.RUNNING
    _, operator = _staff("view_execjob", "change_execjob")  # the permission a cancel asks for
    operator.post("/admin/execution/execjob/", {"action": "cancel_jobs", "_selected_action": [job.pk]})
    job.refresh_from_db()
    assert job.status == ExecJob.Status.CANCELLED


def test_a_viewer_of_keys_revokes_none() -> None:
    key, _ = api_key_create(user=_user(), name="k")
    _, client = _staff("view_apikey")
    client.post("/admin/accounts/apikey/", {"action": "revoke", "_selected_action": [key.pk]})
    assert ApiKey.objects.get(pk=key.pk).revoked_at is None


def test_staff_without_the_permission_read_no_spend_chart() -> None:
    _, client = _staff()
    assert client.get("/admin/billing/creditusage/chart/").status_code == 403
    _, viewer = _staff("view_creditusage")
    assert viewer.get("/admin/billing/creditusage/chart/").status_code == 200


def test_a_viewer_of_sessions_ends_none() -> None:
    now = timezone.now()
    later = now + timedelta(hours=1)
    session = ExecSession.objects.create(
        user=_user(),
        idle_timeout_seconds=3600,
        max_lifetime_seconds=3600,
        last_used_at=now,
        expires_at=later,
        max_expires_at=later,
    )
    _, client = _staff("view_execsession")
    client.post("/admin/execution/execsession/", {"action": "end_sessions", "_selected_action": [session.pk]})
    session.refresh_from_db()
    assert session.status == ExecSession.Status.ACTIVE


def test_a_viewer_of_jobs_and_calls_decides_no_call() -> None:
    job = running_job(user=_user())
    call = demo_call(user=job.user, job=job, status=ToolCall.Status.AWAITING_APPROVAL)
    _, client = _staff("view_execjob", "view_toolcall")
    response = client.post(f"/admin/execution/execjob/{job.pk}/decide/?call_id={call.call_id}", {"approve": "1"})
    assert response.status_code == 403
    call.refresh_from_db()
    assert (call.status, call.decision) == (ToolCall.Status.AWAITING_APPROVAL, ToolCall.Decision.NONE)


def test_staff_without_the_permission_try_no_policy_decision() -> None:
    user = _user()
    _, client = _staff()
    assert client.get(f"/admin/policy/policy/try/?user={user.pk}").status_code == 403
    _, viewer = _staff("view_policy")
    assert viewer.get(f"/admin/policy/policy/try/?user={user.pk}").status_code == 200


def test_a_viewer_of_jobs_but_not_of_calls_reads_no_call_on_the_timeline() -> None:
    job = running_job(user=_user())
    call = demo_call(user=job.user, job=job, input={"secret_plan": "buy"})
    _, client = _staff("view_execjob")
    page = client.get(f"/admin/execution/execjob/{job.pk}/change/").content.decode()
    assert job.call_id in page  # the job is theirs to see
    assert call.call_id not in page and "secret_plan" not in page
    _, viewer = _staff("view_execjob", "view_toolcall")
    page = viewer.get(f"/admin/execution/execjob/{job.pk}/change/").content.decode()
    assert call.call_id in page and "secret_plan" in page


def test_a_staff_member_let_add_keys_makes_none_for_staff_or_superusers() -> None:
    """A key acts as its owner, and a staff owner's key may do all over the API: a staff member let
    only add keys made one for a superuser in the admin, and with it was one. They may make keys for
    themselves and for users who are not staff; a superuser's or another staff member's is refused
    in the form's choices, in the owner's search and in a crafted POST, and those keys stay as they
    are to them (no revoke, no new expiry)."""
    boss = get_user_model().objects.create_superuser(username=f"su-{uuid.uuid4().hex[:6]}", password="x")
    colleague = get_user_model().objects.create_user(username=f"st-{uuid.uuid4().hex[:6]}", is_staff=True)
    user = _user()
    staff, client = _staff("add_apikey", "change_apikey", "view_apikey", "view_user")
    for owner in (boss, colleague):
        refused = client.post("/admin/accounts/apikey/add/", {"user": owner.pk, "name": "escalate"})
        assert refused.status_code == 200 and "Select a valid choice" in refused.content.decode()
        assert not ApiKey.objects.filter(user=owner).exists()
    for owner in (user, staff):
        client.post("/admin/accounts/apikey/add/", {"user": owner.pk, "name": "fine"})
        assert ApiKey.objects.filter(user=owner, name="fine").exists()
    search = {"app_label": "accounts", "model_name": "apikey", "field_name": "user"}
    for owner, offered in ((user, True), (staff, True), (boss, False), (colleague, False)):
        found = client.get("/admin/autocomplete/", {**search, "term": owner.username}).json()["results"]
        assert (str(owner.pk) in {row["id"] for row in found}) is offered, owner

    theirs, _ = api_key_create(user=boss, name="the boss's")
    client.post("/admin/accounts/apikey/", {"action": "revoke", "_selected_action": [theirs.pk]})
    change = f"/admin/accounts/apikey/{theirs.pk}/change/"
    assert 'name="expires_at_0"' not in client.get(change).content.decode()  # shown, read-only
    expiry = {"name": "x", "expires_at_0": "2000-01-01", "expires_at_1": "00:00:00", "events-TOTAL_FORMS": 0}
    assert client.post(change, {**expiry, "events-INITIAL_FORMS": 0}).status_code == 403
    theirs.refresh_from_db()
    assert (theirs.revoked_at, theirs.expires_at, theirs.name) == (None, None, "the boss's")


def test_a_staff_key_makes_no_key_for_another_user_over_the_api() -> None:
    """POST /api/v1/keys makes the caller's own key: a staff key naming another user is refused."""
    boss = get_user_model().objects.create_superuser(username=f"su-{uuid.uuid4().hex[:6]}", password="x")
    staff = get_user_model().objects.create_user(username=f"st-{uuid.uuid4().hex[:6]}", is_staff=True)
    _, plaintext = api_key_create(user=staff, name="staff")
    body = {"name": "escalate", "user": boss.pk, "user_id": boss.pk, "username": boss.username}
    response = Client().post("/api/v1/keys", body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert response.status_code == 400
    assert not ApiKey.objects.filter(user=boss).exists()
