"""/api/v1/keys: a user creates, lists, expires and revokes their own keys, over the real API."""

from collections.abc import Callable
from datetime import timedelta

import httpx
from django.utils import timezone

from ptcproject.accounts.models import ApiKey, ApiKeyEvent
from ptcproject.accounts.services import api_key_create, api_key_revoke
from tests.conftest import Api
from tests.execution.test_tools_execute import JOB, _job_key


def _client(api: Api, key: str) -> httpx.Client:
    return httpx.Client(base_url=api.http.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def test_a_key_is_shown_once_then_listed_without_its_secret(api: Api) -> None:
    expires = (timezone.now() + timedelta(days=30)).replace(microsecond=0)
    created = api.post("/api/v1/keys", json={"name": "ci runner", "expires_at": expires.isoformat()})
    assert created.status_code == 201, created.text
    body = created.json()
    secret = body["key"]
    assert secret.startswith(f"ptc_{body['prefix']}_")
    assert (body["name"], body["active"], body["revoked_at"]) == ("ci runner", True, None)
    # The new key works at once.
    new = _client(api, secret)
    assert new.get("/api/v1/exec").status_code == 200

    listed = api.get("/api/v1/keys")
    assert listed.status_code == 200
    rows = listed.json()["results"]
    first = ApiKey.objects.get(user__username=api.username, name="")  # the fixture's key
    assert {row["prefix"] for row in rows} == {body["prefix"], first.prefix}
    assert secret not in listed.text
    assert "key_hash" not in listed.text
    mine = next(row for row in rows if row["id"] == body["id"])
    assert set(mine) == {"id", "prefix", "name", "created_at", "expires_at", "last_used_at", "revoked_at", "active"}
    assert mine["last_used_at"] is not None  # it was used just above
    detail = api.get(f"/api/v1/keys/{body['id']}").json()
    assert detail == {**mine, "last_used_at": detail["last_used_at"]}
    assert "key" not in detail

    event = ApiKeyEvent.objects.get(key_id=body["id"])
    assert (event.action, event.actor.username, event.details["source"]) == ("created", api.username, "api")


def test_expire_and_revoke_stop_the_key_and_are_audited(api: Api) -> None:
    body = api.post("/api/v1/keys", json={"name": "short-lived"}).json()
    other = _client(api, body["key"])
    assert other.get("/api/v1/billing/balance").status_code == 200

    later = timezone.now() + timedelta(hours=1)
    patched = api.http.patch(f"/api/v1/keys/{body['id']}", json={"expires_at": later.isoformat()})
    assert patched.status_code == 200, patched.text
    assert patched.json()["active"] is True
    assert other.get("/api/v1/billing/balance").status_code == 200

    now = api.http.patch(f"/api/v1/keys/{body['id']}", json={"expires_at": timezone.now().isoformat()})
    assert now.json()["active"] is False
    assert other.get("/api/v1/billing/balance").status_code == 401
    unexpired = api.http.patch(f"/api/v1/keys/{body['id']}", json={"expires_at": None})
    assert unexpired.json()["active"] is True
    assert other.get("/api/v1/billing/balance").status_code == 200

    revoked = api.post(f"/api/v1/keys/{body['id']}/revoke")
    assert revoked.status_code == 200
    assert revoked.json()["revoked_at"] is not None and revoked.json()["active"] is False
    assert other.get("/api/v1/billing/balance").status_code == 401
    again = api.post(f"/api/v1/keys/{body['id']}/revoke")
    assert again.status_code == 200 and again.json()["revoked_at"] == revoked.json()["revoked_at"]
    refused = api.http.patch(f"/api/v1/keys/{body['id']}", json={"expires_at": None})
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "conflict"
    assert other.get("/api/v1/billing/balance").status_code == 401

    actions = list(ApiKeyEvent.objects.filter(key_id=body["id"]).order_by("created_at").values_list("action", flat=True))
    assert actions == ["created", "expiry_set", "expiry_set", "expiry_set", "revoked"]  # the refused one and the repeat left none
    assert all(e.actor is not None and e.actor.username == api.username for e in ApiKeyEvent.objects.filter(key_id=body["id"]))

    bad = api.http.patch(f"/api/v1/keys/{body['id']}", json={"expires_at": "tomorrow"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "validation_error"


def test_another_users_key_is_404(api: Api, make_api: Callable[..., Api]) -> None:
    mine = api.post("/api/v1/keys", json={"name": "mine"}).json()
    intruder = make_api()
    for response in (
        intruder.get(f"/api/v1/keys/{mine['id']}"),
        intruder.http.patch(f"/api/v1/keys/{mine['id']}", json={"expires_at": timezone.now().isoformat()}),
        intruder.post(f"/api/v1/keys/{mine['id']}/revoke"),
    ):
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"
    assert mine["id"] not in intruder.get("/api/v1/keys").text
    assert _client(api, mine["key"]).get("/api/v1/exec").status_code == 200  # untouched


def test_a_job_scoped_key_is_not_listed_and_cannot_use_the_keys_api(api: Api) -> None:
    job = api.run(JOB, toolsets=["demo"], wait=0)
    job_key = _job_key(api, job["id"])
    stored = ApiKey.objects.get(exec_job_id=job["id"])
    assert str(stored.pk) not in api.get("/api/v1/keys").text
    assert api.get(f"/api/v1/keys/{stored.pk}").status_code == 404
    scoped = _client(api, job_key)
    for response in (scoped.get("/api/v1/keys"), scoped.post("/api/v1/keys", json={"name": "escape"})):
        assert response.status_code == 403
        assert response.json()["error"]["code"] == "permission_denied"
    assert not ApiKey.objects.filter(user=stored.user, name="escape").exists()


def test_the_admin_audits_what_it_does_to_keys(api: Api) -> None:
    from django.contrib.auth import get_user_model
    from django.test import Client

    staff = get_user_model().objects.create_user(username=f"admin-{api.username}", is_staff=True, is_superuser=True)
    owner = get_user_model().objects.get(username=api.username)
    client = Client()
    client.force_login(staff)
    inline = {"events-TOTAL_FORMS": 0, "events-INITIAL_FORMS": 0}  # the read-only events inline's formset
    added = client.post("/admin/accounts/apikey/add/", {"user": owner.pk, "name": "from admin"})
    assert 'id="new-key"' in added.content.decode(), added.content[:2000]  # the page that shows the new key
    key = ApiKey.objects.get(user=owner, name="from admin")
    change = f"/admin/accounts/apikey/{key.pk}/change/"
    assert client.get(change).status_code == 200
    expiry = {"user": owner.pk, "name": "from admin", "expires_at_0": "2030-01-01", "expires_at_1": "00:00:00"}
    assert client.post(change, {**expiry, **inline}).status_code == 302
    client.post("/admin/accounts/apikey/", {"action": "revoke", "_selected_action": [str(key.pk)]})
    events = ApiKeyEvent.objects.filter(key=key).order_by("created_at")
    assert [(e.action, e.actor, e.details["source"]) for e in events] == [
        ("created", staff, "admin"),
        ("expiry_set", staff, "admin"),
        ("revoked", staff, "admin"),
    ]


def test_a_revoked_keys_expiry_is_not_offered_in_the_admin_nor_recorded_as_changed(api: Api) -> None:
    """Its service refuses it (conflict): the admin offered the field, showed that error, and then
    said the key was changed, its history recording "Changed Expires at" for nothing changed."""
    from django.contrib.admin.models import LogEntry
    from django.contrib.auth import get_user_model
    from django.test import Client

    staff = get_user_model().objects.create_user(username=f"admin-r-{api.username}", is_staff=True, is_superuser=True)
    owner = get_user_model().objects.get(username=api.username)
    key, _ = api_key_create(user=owner, name="old")
    api_key_revoke(key=key)
    client = Client()
    client.force_login(staff)
    change = f"/admin/accounts/apikey/{key.pk}/change/"
    assert 'name="expires_at_0"' not in client.get(change).content.decode()
    form = {"name": "renamed", "expires_at_0": "2030-01-01", "expires_at_1": "00:00:00"}
    client.post(change, {**form, "events-TOTAL_FORMS": 0, "events-INITIAL_FORMS": 0})
    key.refresh_from_db()
    assert (key.name, key.expires_at) == ("renamed", None)
    assert "Expires at" not in LogEntry.objects.get(object_id=str(key.pk)).get_change_message()


def test_a_page_that_is_not_a_positive_number_is_a_400(api: Api) -> None:
    for page in ("0", "-1", "abc", "1.5"):
        response = api.get("/api/v1/keys", params={"page": page})
        assert response.status_code == 400, (page, response.text)
        assert response.json()["error"]["code"] == "validation_error"
        assert "page" in response.json()["error"]["message"]
    assert api.get("/api/v1/keys", params={"page": "1"}).json()["count"] == 1
    assert api.get("/api/v1/keys", params={"page": "last"}).status_code == 200
    # A page past the last exists in form: DRF's 404, as before; one of more digits than Python
    # turns into an int (4,300) too, not a 500.
    for page in ("9", "9" * 5000):
        assert api.get("/api/v1/keys", params={"page": page}).json()["error"]["code"] == "not_found"
    assert api.get("/api/v1/keys", params={"page": "0" * 5000}).status_code == 400


def test_a_user_with_the_most_keys_that_work_must_revoke_one_to_make_another(api: Api) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from django.contrib.auth.models import User

    from ptcproject.accounts.services import api_key_create

    user = User.objects.get(username=api.username)
    # Keys that don't work are not counted: a revoked one, an expired one, and a job's.
    expired = timezone.now() - timedelta(minutes=1)
    api_key_create(user=user, name="expired", expires_at=expired)
    revoked, _ = api_key_create(user=user, name="revoked")
    ApiKey.objects.filter(pk=revoked.pk).update(revoked_at=timezone.now())
    limit = 100  # PTC_MAX_KEYS_PER_USER's default, which the stack runs with
    for n in range(limit - 2):  # with the fixture's own key: one short of the limit
        api_key_create(user=user, name=f"k{n}")
    # Two requests at once for the last place: one gets it.
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda n: api.post("/api/v1/keys", json={"name": f"last {n}"}), range(2)))
    assert sorted(a.status_code for a in answers) == [201, 409], [a.text for a in answers]
    refused = next(a for a in answers if a.status_code == 409).json()["error"]
    assert refused["code"] == "too_many_keys"
    assert refused["details"] == {"active": limit, "limit": limit}
    assert "Revoke one" in refused["message"]
    assert ApiKey.objects.filter(user=user, exec_job__isnull=True).count() == limit + 2  # nothing made by the refusal
    # Revoked, one makes room.
    one = ApiKey.objects.get(user=user, name="k0")
    assert api.post(f"/api/v1/keys/{one.pk}/revoke").status_code == 200
    assert api.post("/api/v1/keys", json={"name": "again"}).status_code == 201
    assert api.post("/api/v1/keys", json={"name": "over"}).json()["error"]["code"] == "too_many_keys"
    # The operator's ways are not bound.
    api_key_create(user=user, name="by the admin")


def test_an_expired_key_given_a_new_expiry_counts_against_the_limit(api: Api) -> None:
    """Expired keys don't count, so a new expiry that makes one work again is a key made: past
    PTC_MAX_KEYS_PER_USER it is refused as a new key is. Else keys made, left to expire and given
    a new expiry kept any number working."""
    from django.contrib.auth.models import User

    from ptcproject.accounts.services import api_key_create

    user = User.objects.get(username=api.username)
    expired, _ = api_key_create(user=user, name="expired", expires_at=timezone.now() - timedelta(minutes=1))
    limit = 100  # PTC_MAX_KEYS_PER_USER's default, which the stack runs with
    for n in range(limit - 1):  # with the fixture's own key: at the limit
        api_key_create(user=user, name=f"k{n}")
    later = (timezone.now() + timedelta(days=1)).isoformat()
    for expires_at in (None, later):
        revived = api.http.patch(f"/api/v1/keys/{expired.pk}", json={"expires_at": expires_at})
        assert revived.status_code == 409, revived.text
        assert revived.json()["error"]["code"] == "too_many_keys"
        assert revived.json()["error"]["details"] == {"active": limit, "limit": limit}
        assert revived.json()["error"]["message"].endswith("then give this expired key its new expiry."), revived.text
    expired.refresh_from_db()
    assert not expired.is_active
    # A key that works may still change its expiry at the limit (it adds none), and an expired one
    # may be given another time past; with room made, it may work again.
    working = ApiKey.objects.get(user=user, name="k0")
    assert api.http.patch(f"/api/v1/keys/{working.pk}", json={"expires_at": later}).status_code == 200
    past = (timezone.now() - timedelta(hours=1)).isoformat()
    assert api.http.patch(f"/api/v1/keys/{expired.pk}", json={"expires_at": past}).status_code == 200
    assert api.post(f"/api/v1/keys/{working.pk}/revoke").status_code == 200
    assert api.http.patch(f"/api/v1/keys/{expired.pk}", json={"expires_at": None}).status_code == 200
    assert ApiKey.objects.get(pk=expired.pk).is_active
