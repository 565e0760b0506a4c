"""The admin as a staff member with a model's view permission only: they see its rows, and change
nothing through an action or a page of the admin's own (a grant of credits, a job's cancel, a key's
revoke, a session's end, a toolset's sync, an approval), nor read what they have no permission on."""

import uuid
from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission, User
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


def _account_form(user: User, **fields: Any) -> dict[str, Any]:
    """A user's change page posted as it shows, with ``fields`` changed."""
    joined = timezone.localtime(user.date_joined)
    return {
        "username": user.username,
        "first_name": user.first_name,
        "last_name": user.last_name,
        "email": user.email,
        "is_active": "on",
        "date_joined_0": joined.strftime("%Y-%m-%d"),
        "date_joined_1": joined.strftime("%H:%M:%S"),
        **fields,
    }


def test_a_staff_member_let_change_users_makes_no_one_more_than_they_are() -> None:
    """Django's user admin let anyone with "change user" tick is_superuser and is_staff, and grant
    groups and permissions, on any account, their own among them: a staff member made themselves a
    superuser. To a member who is not a superuser those fields are read-only, a crafted POST setting
    them changes nothing, and a superuser's or another staff member's account is read-only whole
    (its page, its password, its delete); a user who is neither they still manage. A superuser may
    do it all."""
    boss = get_user_model().objects.create_superuser(username=f"su-{uuid.uuid4().hex[:6]}", password="boss-pw")
    colleague = get_user_model().objects.create_user(username=f"st-{uuid.uuid4().hex[:6]}", is_staff=True, password="st-pw")
    user = get_user_model().objects.create_user(username=f"u-{uuid.uuid4().hex[:6]}", password="u-pw")
    everything = Group.objects.create(name=f"all-{uuid.uuid4().hex[:6]}")
    everything.permissions.set(Permission.objects.all())
    codenames = ("add_user", "change_user", "view_user", "delete_user")
    staff, client = _staff(*codenames)
    escalate = {
        "is_staff": "on",
        "is_superuser": "on",
        "groups": [everything.pk],
        "user_permissions": list(Permission.objects.values_list("pk", flat=True)[:20]),
    }

    for account in (staff, user):
        page = client.get(f"/admin/auth/user/{account.pk}/change/").content.decode()
        assert 'name="is_superuser"' not in page and 'name="groups"' not in page  # shown, read-only
        assert 'href="../password/"' in page  # theirs to change
        saved = client.post(f"/admin/auth/user/{account.pk}/change/", _account_form(account, first_name="Renamed", **escalate))
        assert saved.status_code == 302
        account.refresh_from_db()
        assert account.first_name == "Renamed"  # the rest of the page they change as before
        assert (account.is_superuser, account.is_staff) == (False, account is staff)
        granted = set(account.user_permissions.values_list("codename", flat=True))
        assert not account.groups.exists() and granted == (set(codenames) if account is staff else set())
    new_user = {"username": "newbie", "password1": "A-long-pw-42", "password2": "A-long-pw-42"}
    added = client.post("/admin/auth/user/add/", {**new_user, **escalate})
    assert added.status_code == 302
    newbie = get_user_model().objects.get(username="newbie")
    assert (newbie.is_superuser, newbie.is_staff, newbie.groups.exists()) == (False, False, False)

    new_password = {"password1": "Taken-over-42", "password2": "Taken-over-42"}
    for account in (boss, colleague):
        change = f"/admin/auth/user/{account.pk}/change/"
        page = client.get(change).content.decode()
        assert 'name="is_active"' not in page  # shown, read-only
        # Its password summed up, with no button to the password's page, which refuses them.
        assert "<strong>algorithm</strong>" in page and 'href="../password/"' not in page
        assert client.post(change, _account_form(account, is_active="", first_name="Gone", **escalate)).status_code == 403
        assert client.get(f"/admin/auth/user/{account.pk}/password/").status_code == 403
        assert client.post(f"/admin/auth/user/{account.pk}/password/", new_password).status_code == 403
        assert client.post(f"/admin/auth/user/{account.pk}/delete/", {"post": "yes"}).status_code == 403
        bulk = {"action": "delete_selected", "_selected_action": [account.pk, newbie.pk], "post": "yes"}
        client.post("/admin/auth/user/", bulk)
        account.refresh_from_db()
        assert (account.is_active, account.first_name) == (True, "")
        assert account.check_password("boss-pw" if account is boss else "st-pw")
    assert get_user_model().objects.filter(pk=newbie.pk).exists()  # a bulk delete with either in it deletes none
    assert client.post(f"/admin/auth/user/{user.pk}/password/", new_password).status_code == 302
    user.refresh_from_db()
    assert user.check_password("Taken-over-42")

    superuser = Client()
    superuser.force_login(boss)
    assert superuser.post(f"/admin/auth/user/{staff.pk}/change/", _account_form(staff, **escalate)).status_code == 302
    staff.refresh_from_db()
    assert staff.is_superuser and staff.groups.filter(pk=everything.pk).exists()
    assert superuser.post(f"/admin/auth/user/{colleague.pk}/password/", new_password).status_code == 302


def test_a_staff_member_let_change_groups_gives_their_group_no_permission() -> None:
    group = Group.objects.create(name=f"g-{uuid.uuid4().hex[:6]}")
    staff, client = _staff("add_group", "change_group", "view_group")
    staff.groups.add(group)
    wanted = list(Permission.objects.filter(codename__in=["change_user", "add_apikey", "change_creditaccount"]))
    assert b'name="permissions"' not in client.get(f"/admin/auth/group/{group.pk}/change/").content
    changed = client.post(f"/admin/auth/group/{group.pk}/change/", {"name": group.name, "permissions": [p.pk for p in wanted]})
    assert changed.status_code == 302
    added = client.post("/admin/auth/group/add/", {"name": "mine", "permissions": [p.pk for p in wanted]})
    assert added.status_code == 302
    assert list(group.permissions.all()) == []
    assert list(Group.objects.get(name="mine").permissions.all()) == []
    staff = get_user_model().objects.get(pk=staff.pk)  # its permissions cache anew
    assert not staff.has_perm("auth.change_user")
    boss = get_user_model().objects.create_superuser(username=f"boss-{uuid.uuid4().hex[:6]}")
    client.force_login(boss)
    client.post(f"/admin/auth/group/{group.pk}/change/", {"name": group.name, "permissions": [p.pk for p in wanted]})
    assert set(group.permissions.all()) == set(wanted)
