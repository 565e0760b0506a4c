"""Reading the policy, and the PTC decision it makes."""

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User

from ptcproject import rows
from ptcproject.policy.models import Policy

POLICY_PK = 1


@functools.cache
def _policy_sql() -> str:
    return f"SELECT {rows.columns(Policy)} FROM {rows.table(Policy)} WHERE id = %s"  # noqa: S608 - names from the model


def policy_get() -> Policy:
    """Return the policy row. Before it exists (``migrate`` creates it from the PTC_* seed), the
    seed's values, unsaved. Never writes.

    It is read fresh on every call: one primary-key lookup buys a change that every process sees
    on its very next request, with no cache to invalidate. Every POST /exec and every job reads
    it, so the statement is a fixed one (ptcproject/rows.py), not a queryset compiled each time.
    """
    return policy_read().run()


def policy_read() -> rows.Statement[Policy]:
    """``policy_get`` as a statement, to run with others in one round trip (``rows.together``)."""
    return rows.Statement(_policy_sql(), [POLICY_PK], _policy_made)


def _policy_made(found: list[tuple[Any, ...]]) -> Policy:
    return rows.from_row(Policy, found[0]) if found else Policy(pk=POLICY_PK, **settings.PTC_POLICY_SEED)


@dataclass(frozen=True)
class Decision:
    enabled: bool
    reason: str


def rollout_bucket(*, user_id: int, salt: str) -> int:
    """Return the user's bucket, 0..99: the same in every process and on every host."""
    return int(hashlib.sha256(f"{user_id}{salt}".encode()).hexdigest(), 16) % 100


def ptc_decision(*, policy: Policy, user: User, toolsets: Sequence[str], title: str = "") -> Decision:
    """Decide whether PTC is on for this user, toolsets and node title, and say which rule decided.

    The rules apply in the order of PRODUCT.md: mode, rollout percent, toolsets, then debug.
    """
    username = user.get_username()
    if policy.mode == Policy.Mode.OFF:
        return Decision(False, "mode is off: PTC is disabled for everyone")
    if policy.mode == Policy.Mode.PARTIAL and username not in policy.user_allowlist:
        return Decision(False, f"mode is partial and user '{username}' is not on the user allowlist")
    notes = [f"mode {policy.mode}" + (f" with user '{username}' on the allowlist" if policy.mode == Policy.Mode.PARTIAL else "")]
    if policy.rollout_percent < 100:
        bucket = rollout_bucket(user_id=user.pk, salt=policy.rollout_salt)
        if bucket >= policy.rollout_percent:
            return Decision(False, f"user '{username}' is in bucket {bucket}, outside the {policy.rollout_percent}% rollout")
        notes.append(f"bucket {bucket} is inside the {policy.rollout_percent}% rollout")
    for key in toolsets:
        if key in policy.toolset_blocklist:
            return Decision(False, f"toolset '{key}' is on the blocklist")
    if policy.toolset_allowlist:
        for key in toolsets:
            if key not in policy.toolset_allowlist:
                return Decision(False, f"toolset '{key}' is not on the toolset allowlist")
    notes.append("all toolsets allowed")
    lowered = title.lower()
    if policy.debug == Policy.Debug.OPT_IN:
        if "useptc" not in lowered:
            return Decision(False, "debug is opt-in and the title does not contain 'useptc'")
        notes.append("the title opts in with 'useptc'")
    elif policy.debug == Policy.Debug.OPT_OUT:
        if "nonptc" in lowered:
            return Decision(False, "debug is opt-out and the title contains 'nonptc'")
    return Decision(True, "; ".join(notes))


@dataclass(frozen=True)
class Quotas:
    """A user's tenant quotas in force; 0 means no limit."""

    concurrent_jobs: int
    concurrent_tool_calls: int
    jobs_per_minute: int

    @property
    def any(self) -> bool:
        return bool(self.concurrent_jobs or self.concurrent_tool_calls or self.jobs_per_minute)

    def parallel_cap(self) -> int:
        """The most parallel calls one job of this user may make so that all of its jobs at once stay
        within concurrent_tool_calls (0: no cap from the quotas)."""
        if not self.concurrent_tool_calls:
            return 0
        return max(1, self.concurrent_tool_calls // (self.concurrent_jobs or 1))


# A user's own quota settings (admin, "User settings"), each None where the policy's applies; None
# without settings of their own.
OwnQuotas = tuple[int | None, int | None, int | None] | None


def quotas_for(*, policy: Policy, user: User) -> Quotas:
    """Return ``user``'s quotas: their own settings where set (admin, "User settings"), else the policy's."""
    return quotas_of(policy=policy, own=quotas_read(user=user).run())


def quotas_read(*, user: User) -> rows.Statement[OwnQuotas]:
    """The read of ``user``'s own quota settings, to run with others in one round trip
    (``rows.together``); ``quotas_of`` makes the quotas in force of them."""
    # Every POST /exec reads it: a fixed statement (ptcproject/rows.py), not a queryset compiled each time.
    return rows.Statement(_quotas_sql(), [user.pk], lambda found: found[0] if found else None)


def quotas_of(*, policy: Policy, own: OwnQuotas) -> Quotas:
    """Return the quotas in force for a user whose own settings are ``own`` (``quotas_read``):
    each of theirs where set, else the policy's."""

    def pick(index: int, name: str) -> int:
        value = own[index] if own is not None else None
        return int(value if value is not None else getattr(policy, name))

    return Quotas(
        concurrent_jobs=pick(0, "max_concurrent_jobs"),
        concurrent_tool_calls=pick(1, "max_concurrent_tool_calls"),
        jobs_per_minute=pick(2, "max_jobs_per_minute"),
    )


@functools.cache
def _quotas_sql() -> str:
    from ptcproject.accounts.models import UserSettings

    return (
        "SELECT max_concurrent_jobs, max_concurrent_tool_calls, max_jobs_per_minute "  # noqa: S608 - names from the model
        f"FROM {rows.table(UserSettings)} WHERE user_id = %s"
    )
