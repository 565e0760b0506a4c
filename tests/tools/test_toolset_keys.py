"""The keys of every toolset a job may use when it names none: the user's own, the global ones they
don't shadow, enabled, as the policy's lists admit; another user's never."""

from django.contrib.auth.models import User

from tests.tools.conftest import unique_key
from tools.models import Toolset
from tools.selectors import toolset_keys_for_ptc


def test_keys_for_ptc_are_the_visible_toolsets_the_lists_admit() -> None:
    user, other = (User.objects.create(username=unique_key("keys")) for _ in range(2))
    shadowed, own, foreign, disabled, client = (unique_key(name) for name in ("shadowed", "own", "foreign", "disabled", "client"))
    Toolset.objects.create(key=shadowed, name="Global", kind="builtin", config={})
    Toolset.objects.create(key=shadowed, name="Own", kind="builtin", owner=user, is_global=False, config={})
    Toolset.objects.create(key=own, name="Own", kind="builtin", owner=user, is_global=False, config={})
    Toolset.objects.create(key=foreign, name="Theirs", kind="builtin", owner=other, is_global=False, config={})
    Toolset.objects.create(key=disabled, name="Off", kind="builtin", enabled=False, config={})
    Toolset.objects.create(key=client, name="Client", kind=Toolset.Kind.CLIENT, owner=user, is_global=False, config={})
    mine = {shadowed, own, foreign, disabled, client}

    def keys(allowlist: tuple[str, ...] = (), blocklist: tuple[str, ...] = (), **kwargs: bool) -> list[str]:
        found = toolset_keys_for_ptc(user=user, allowlist=allowlist, blocklist=blocklist, **kwargs)
        assert found == sorted(found)
        return [key for key in found if key in mine]

    assert keys() == sorted([shadowed, own, client])
    assert keys(client=False) == sorted([shadowed, own])
    assert keys(blocklist=(own,)) == sorted([shadowed, client])
    assert keys(allowlist=(own, foreign, disabled)) == [own]
    # The shadowed global one is visible to the other user; their own is not to ours.
    theirs = toolset_keys_for_ptc(user=other, allowlist=[], blocklist=[])
    assert shadowed in theirs and foreign in theirs and own not in theirs
