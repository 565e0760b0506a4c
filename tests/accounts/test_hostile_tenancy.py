"""What a hostile user with their own key tried against other users' data and the limits of their
keys, kept found: each of these once let a key or a user reach further than it was given."""

from datetime import timedelta

import httpx
from django.utils import timezone

from ptcproject.accounts.models import ApiKey
from tests.conftest import Api


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
