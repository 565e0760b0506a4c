"""The PTC decision: each rule, in order, with the sentence that names it."""

import subprocess
import sys
import uuid

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model

from ptcproject.policy.models import Policy
from ptcproject.policy.selectors import ptc_decision, rollout_bucket
from tests.stack import ROOT


@pytest.fixture
def user():  # type: ignore[no-untyped-def]
    return get_user_model().objects.create_user(username=f"dec-{uuid.uuid4().hex[:6]}")


def _policy(**fields: object) -> Policy:
    return Policy(**{**settings.PTC_POLICY_SEED, **fields})


def test_mode_off_disables_for_everyone(user) -> None:  # type: ignore[no-untyped-def]
    decision = ptc_decision(policy=_policy(mode="off"), user=user, toolsets=["demo"])
    assert not decision.enabled
    assert decision.reason == "mode is off: PTC is disabled for everyone"


def test_mode_on_enables_with_a_reason(user) -> None:  # type: ignore[no-untyped-def]
    decision = ptc_decision(policy=_policy(mode="on"), user=user, toolsets=["demo"])
    assert decision.enabled
    assert decision.reason == "mode on; all toolsets allowed"


def test_partial_admits_only_the_user_allowlist(user) -> None:  # type: ignore[no-untyped-def]
    listed = ptc_decision(policy=_policy(mode="partial", user_allowlist=[user.username]), user=user, toolsets=[])
    assert listed.enabled
    assert f"user '{user.username}' on the allowlist" in listed.reason
    unlisted = ptc_decision(policy=_policy(mode="partial", user_allowlist=["someone-else"]), user=user, toolsets=[])
    assert not unlisted.enabled
    assert unlisted.reason == f"mode is partial and user '{user.username}' is not on the user allowlist"


def test_rollout_percent_uses_a_deterministic_bucket(user) -> None:  # type: ignore[no-untyped-def]
    # A salt that puts this user below bucket 99: a 100% rollout is everyone, and says so instead.
    salt = next(f"s{n}" for n in range(100) if rollout_bucket(user_id=user.pk, salt=f"s{n}") < 99)
    bucket = rollout_bucket(user_id=user.pk, salt=salt)
    inside = ptc_decision(policy=_policy(rollout_percent=bucket + 1, rollout_salt=salt), user=user, toolsets=[])
    outside = ptc_decision(policy=_policy(rollout_percent=bucket, rollout_salt=salt), user=user, toolsets=[])
    assert inside.enabled and f"bucket {bucket} is inside the {bucket + 1}% rollout" in inside.reason
    assert not outside.enabled
    assert outside.reason == f"user '{user.username}' is in bucket {bucket}, outside the {bucket}% rollout"
    assert not ptc_decision(policy=_policy(rollout_percent=0), user=user, toolsets=[]).enabled


def test_the_bucket_is_the_same_in_another_process(user) -> None:  # type: ignore[no-untyped-def]
    code = f"import hashlib; print(int(hashlib.sha256(b'{user.pk}pepper').hexdigest(), 16) % 100)"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert int(other.stdout) == rollout_bucket(user_id=user.pk, salt="pepper")


def test_every_toolset_must_be_allowed_and_the_blocklist_wins(user) -> None:  # type: ignore[no-untyped-def]
    both = _policy(toolset_allowlist=["demo", "github"], toolset_blocklist=["github"])
    blocked = ptc_decision(policy=both, user=user, toolsets=["demo", "github"])
    assert not blocked.enabled
    assert blocked.reason == "toolset 'github' is on the blocklist"
    not_listed = ptc_decision(policy=_policy(toolset_allowlist=["demo"]), user=user, toolsets=["demo", "web"])
    assert not not_listed.enabled
    assert not_listed.reason == "toolset 'web' is not on the toolset allowlist"
    assert ptc_decision(policy=_policy(toolset_allowlist=["demo"]), user=user, toolsets=["demo"]).enabled


@pytest.mark.parametrize(
    ("debug", "title", "enabled", "reason"),
    [
        ("opt-in", "Plan the trip", False, "debug is opt-in and the title does not contain 'useptc'"),
        ("opt-in", "Plan the trip [UsePTC]", True, "mode on; all toolsets allowed; the title opts in with 'useptc'"),
        ("opt-out", "Plan the trip NONPTC", False, "debug is opt-out and the title contains 'nonptc'"),
        ("opt-out", "Plan the trip", True, "mode on; all toolsets allowed"),
        ("", "nonptc useptc", True, "mode on; all toolsets allowed"),
    ],
)
def test_debug_opt_in_and_opt_out_by_title(user, debug: str, title: str, enabled: bool, reason: str) -> None:  # type: ignore[no-untyped-def]
    decision = ptc_decision(policy=_policy(debug=debug), user=user, toolsets=["demo"], title=title)
    assert (decision.enabled, decision.reason) == (enabled, reason)


def test_debug_applies_only_after_the_other_rules_said_yes(user) -> None:  # type: ignore[no-untyped-def]
    decision = ptc_decision(policy=_policy(mode="off", debug="opt-in"), user=user, toolsets=[], title="useptc")
    assert decision.reason == "mode is off: PTC is disabled for everyone"
