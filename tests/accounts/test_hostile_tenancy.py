"""What a hostile user with their own key tried against other users' data and the limits of their
keys, kept found: each of these once let a key or a user reach further than it was given."""

import json
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

import httpx
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from ptcproject.accounts.models import ApiKey
from tests.conftest import Api
from tests.tools.test_admin_tools import _form
from tools.models import Toolset


def _client(api: Api, key: str) -> httpx.Client:
    return httpx.Client(base_url=api.http.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def test_a_key_that_expires_cannot_make_or_keep_a_key_alive_past_its_own_end(api: Api) -> None:
    """A key handed out for an hour (to CI, a contractor) that leaks must stop working within the
    hour: it may not mint a key that never expires, nor lift or push back any key's expiry past
    its own. What it may still do: keys and expiries within its own life."""
    ends = (timezone.now() + timedelta(hours=1)).replace(microsecond=0)
    short = api.post("/api/v1/keys", json={"name": "ci, one hour", "expires_at": ends.isoformat()}).json()
    leaked = _client(api, short["key"])
    later = (ends + timedelta(days=365)).isoformat()

    for body in ({"name": "forever"}, {"name": "forever", "expires_at": None}, {"name": "a year", "expires_at": later}):
        minted = leaked.post("/api/v1/keys", json=body)
        assert minted.status_code == 403, (body, minted.text)
        assert minted.json()["error"]["code"] == "permission_denied"
        assert ends.isoformat()[:16] in minted.json()["error"]["message"]
    assert not ApiKey.objects.filter(user__username=api.username, name__in=["forever", "a year"]).exists()

    for expiry in (None, later):
        lifted = leaked.patch(f"/api/v1/keys/{short['id']}", json={"expires_at": expiry})
        assert lifted.status_code == 403, (expiry, lifted.text)
        assert lifted.json()["error"]["code"] == "permission_denied"
    assert ApiKey.objects.get(pk=short["id"]).expires_at == ends

    # An expired key of the same user is not brought back for longer than the leaked key lives either.
    old = api.post("/api/v1/keys", json={"name": "old", "expires_at": timezone.now().isoformat()}).json()
    revived = leaked.patch(f"/api/v1/keys/{old['id']}", json={"expires_at": None})
    assert revived.status_code == 403, revived.text
    assert _client(api, old["key"]).get("/api/v1/exec").status_code == 401

    # Within its own life it may do as any key does.
    sooner = (ends - timedelta(minutes=30)).isoformat()
    within = leaked.post("/api/v1/keys", json={"name": "half an hour", "expires_at": sooner})
    assert within.status_code == 201, within.text
    shortened = leaked.patch(f"/api/v1/keys/{short['id']}", json={"expires_at": sooner})
    assert shortened.status_code == 200, shortened.text
    # A key that never expires (the fixture's) still sets any expiry, or none.
    assert api.http.patch(f"/api/v1/keys/{old['id']}", json={"expires_at": None}).status_code == 200
    assert api.post("/api/v1/keys", json={"name": "forever"}).status_code == 201


def test_a_toolset_that_is_not_global_and_has_no_owner_is_nobodys(api: Api) -> None:
    """The admin's "is global" says global toolsets are visible to all and billed. One unticked with
    no owner (the admin's form allows it) was visible to every user all the same, and free: any
    user could list it, run it, and have its calls unbilled."""
    staff = get_user_model().objects.create_user(username=f"admin-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    admin = Client()
    admin.force_login(staff)
    key = f"internal_{uuid.uuid4().hex[:6]}"
    form = {**_form(key, "forecast", json.dumps({"KEY": f"v-{uuid.uuid4().hex}"})), "price": "5"}
    del form["is_global"]  # unticked; no owner chosen
    added = admin.post("/admin/tools/toolset/add/", form)
    assert added.status_code == 200, added.status_code  # the form again, saying why
    assert "needs an owner" in added.content.decode()
    assert not Toolset.objects.filter(key=key).exists()

    # A row written so all the same (before the form refused it, or from a shell) is nobody's.
    internal = Toolset.objects.create(
        key=key, name="Internal", kind="http", owner=None, is_global=False, price=5, config={"base_url": "http://127.0.0.1:9"}
    )
    internal.tools.create(name="forecast", input_schema={"type": "object"}, http={"method": "GET", "path": "/", "query": []})
    assert api.get(f"/api/v1/toolsets/{key}").status_code == 404
    assert key not in api.get("/api/v1/toolsets").text
    for path, body in (
        ("/api/v1/exec", {"code": "1", "toolsets": [key]}),
        ("/api/v1/tools/execute", {"toolset": key, "tool": "forecast", "arguments": {"city": "x"}}),
    ):
        refused = api.post(path, json=body)
        assert refused.status_code == 400, (path, refused.text)
        assert refused.json()["error"]["code"] == "unknown_toolset"
    assert key not in api.run("1", wait=30)["toolsets"]  # nor among every toolset a job is given by default


def test_a_stream_ends_when_its_key_is_revoked(api: Api) -> None:
    """A job's event stream was authorised once, at connect: a key revoked (or its user
    deactivated) while it was open kept reading the job until it ended. Now the stream checks at
    each heartbeat, closes, and the client's reconnect is told why."""
    minted = api.post("/api/v1/keys", json={"name": "watcher"}).json()
    watcher = _client(api, minted["key"])

    def revoke() -> bool:
        return api.post(f"/api/v1/keys/{minted['id']}/revoke").status_code == 200

    assert _stream_closed_by(api, watcher, revoke) == (401, "authentication_failed")


def _stream_closed_by(api: Api, watcher: httpx.Client, act: Callable[[], bool]) -> tuple[int, str]:
    """Open ``watcher``'s stream of a job of ``api``'s that runs on, ``act`` (True if it was done),
    check the stream closes within a few heartbeats; return the status and code of its reconnect."""
    job = api.post("/api/v1/exec", json={"code": "import time\ntime.sleep(30)", "wait": 0}).json()
    try:
        with watcher.stream("GET", f"/api/v1/exec/{job['id']}/events", timeout=30) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("retry:")
            assert act()
            began = time.monotonic()
            rest = list(lines)  # until the server closes it
        assert time.monotonic() - began < 10, rest
        again = watcher.get(f"/api/v1/exec/{job['id']}/events")
        return again.status_code, again.json()["error"]["code"]
    finally:
        api.post(f"/api/v1/exec/{job['id']}/cancel")


def test_a_stream_of_another_users_job_ends_when_its_reader_is_no_longer_staff(api: Api, make_api: Callable[..., Api]) -> None:
    """Staff read every user's jobs. One whose staff status the admin took away while reading
    another user's job's stream read on, the job's output and tool I/O, until the job ended: the
    job's visibility was checked once, at connect. It is checked again at each heartbeat."""
    watcher = make_api(staff=True)

    def demote() -> bool:  # as the user's admin page does it
        return bool(get_user_model().objects.filter(username=watcher.username).update(is_staff=False))

    assert _stream_closed_by(api, watcher.http, demote) == (404, "not_found")


def test_a_keys_user_is_fixed_once_it_is_made_in_the_admin(api: Api) -> None:
    """A key moved to another user in the admin let whoever held it act as that user, and the move
    wrote no audit event. A key is its user's for life; its name may still change."""
    staff = get_user_model().objects.create_user(username=f"su-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    other = get_user_model().objects.create_user(username=f"other-{uuid.uuid4().hex[:6]}")
    admin = Client()
    admin.force_login(staff)
    minted = api.post("/api/v1/keys", json={"name": "mine"}).json()
    form = {"user": other.pk, "name": "renamed", "expires_at_0": "", "expires_at_1": ""}
    form.update(
        {"events-TOTAL_FORMS": "0", "events-INITIAL_FORMS": "0", "events-MIN_NUM_FORMS": "0", "events-MAX_NUM_FORMS": "0"}
    )
    saved = admin.post(f"/admin/accounts/apikey/{minted['id']}/change/", form)
    assert saved.status_code == 302, [line for line in saved.content.decode().splitlines() if "errornote" in line]
    key = ApiKey.objects.get(pk=minted["id"])
    assert (key.user.username, key.name) == (api.username, "renamed")
    assert _client(api, minted["key"]).get("/api/v1/keys").json()["count"] >= 1  # still the same user's key


def test_another_users_object_and_no_object_get_the_same_404_which_names_no_model(api: Api, make_api: Callable[..., Api]) -> None:
    """get_object_or_404's words reached the client: "No ExecJob matches the given query." named the
    model behind the endpoint. Another user's job and no job at all answer alike, in the API's words."""
    theirs = make_api().run("1", wait=0)["id"]
    answers = [api.get(f"/api/v1/exec/{job_id}") for job_id in (theirs, str(uuid.uuid4()))]
    for answer, job_id in zip(answers, (theirs, None), strict=True):
        assert answer.status_code == 404, answer.text
        error = answer.json()["error"]
        assert error["code"] == "not_found" and "ExecJob" not in error["message"], error
        if job_id:
            assert error["message"] == f"Nothing found at /api/v1/exec/{job_id}: no such object, or not one this key may see."
    session_files = api.get(f"/api/v1/sessions/{uuid.uuid4()}/files")
    assert session_files.status_code == 404 and "matches the given query" not in session_files.text, session_files.text
