import time
from collections.abc import Iterable
from typing import Any

from django.contrib.auth.models import User
from django.db.models import Prefetch, Q, QuerySet

from ptcproject.errors import ApplicationError
from ptcproject.policy.selectors import policy_get, ptc_decision
from tools.builtin import builtin_callable_from_code
from tools.models import Tool, Toolset


def direct_only_tools() -> frozenset[str]:
    """Return the tool names that are always direct: the policy's ``direct_only_tools``, read fresh."""
    return frozenset(policy_get().direct_only_tools)


def tool_is_ptc(*, tool: Tool, toolset: Toolset, direct_only: frozenset[str]) -> bool:
    """Return True if ``tool`` is callable from code (PRODUCT.md, "Tool classification").

    MCP tools are always PTC. Otherwise a tool is direct when its name is direct-only, or when
    its ``allowed_callers`` is set and lacks ``code_execution``. A builtin may declare in code that
    a direct-only name of its own is not the lifecycle tool (``demo.fail``).
    """
    if toolset.kind == Toolset.Kind.MCP:
        return True
    if tool.name in direct_only and not (
        toolset.kind == Toolset.Kind.BUILTIN and builtin_callable_from_code(toolset.key, tool.name)
    ):
        return False
    callers = tool.allowed_callers or [Tool.Caller.CODE_EXECUTION]
    return Tool.Caller.CODE_EXECUTION in callers


def toolsets_visible(*, user: User, include_disabled: bool = False) -> QuerySet[Toolset]:
    """Return the enabled toolsets ``user`` may use: their own, plus global ones they don't shadow.

    With ``include_disabled`` (staff, who manage them), disabled toolsets are in it too.
    """
    own_keys = Toolset.objects.filter(owner=user).values("key")
    toolsets = Toolset.objects.all() if include_disabled else Toolset.objects.filter(enabled=True)
    return (
        toolsets.filter(Q(owner=user) | (Q(owner__isnull=True) & ~Q(key__in=own_keys)))
        .prefetch_related(Prefetch("tools", queryset=Tool.objects.filter(enabled=True).order_by("name")))
        .order_by("key")
    )


def toolsets_listed(*, user: User) -> QuerySet[Toolset]:
    """Return the toolsets ``GET /toolsets`` shows ``user``: the visible ones; for staff, disabled ones too."""
    return toolsets_visible(user=user, include_disabled=bool(getattr(user, "is_staff", False)))


def toolset_listed(*, user: User, key: str) -> Toolset | None:
    """Return the toolset ``key`` as ``user`` sees it (their own shadows a global one), or None."""
    if not key.isidentifier():  # no toolset has such a key; and PostgreSQL refuses one with a NUL
        return None
    return toolsets_listed(user=user).filter(key=key).first()


def tools_split(
    *, toolsets: list[Toolset], direct_only: frozenset[str]
) -> tuple[list[tuple[Toolset, Tool]], list[tuple[Toolset, list[Tool]]]]:
    """Return the toolsets' enabled direct tools, and their PTC tools per toolset (``ptc_tools_of``)."""
    from tools.sdk import ptc_tools_of

    per_toolset = ptc_tools_of(toolsets, direct_only)
    ptc = {t.pk for _, tools in per_toolset for t in tools}
    direct = [(ts, t) for ts in sorted(toolsets, key=lambda t: t.key) for t in ts.tools.all() if t.enabled and t.pk not in ptc]
    return direct, per_toolset


def toolsets_resolve(*, user: User, keys: Iterable[str]) -> tuple[list[Toolset], list[str]]:
    """Return the visible toolsets named by ``keys`` in that order, and the keys that matched none."""
    wanted = list(dict.fromkeys(keys))
    found = {ts.key: ts for ts in toolsets_visible(user=user).filter(key__in=wanted)}
    return [found[k] for k in wanted if k in found], [k for k in wanted if k not in found]


def toolsets_named(*, user: User, keys: Iterable[str] | None) -> list[Toolset]:
    """Return the visible toolsets named by ``keys`` (every visible one if None).

    Raise ApplicationError ``unknown_toolset`` (400) naming the keys that matched none.
    """
    if keys is None:
        return list(toolsets_visible(user=user))
    found, missing = toolsets_resolve(user=user, keys=keys)
    if missing:
        raise ApplicationError(
            "unknown_toolset",
            f"Unknown toolset(s): {', '.join(missing)}. GET /api/v1/toolsets lists the ones you can use.",
            details={"toolsets": missing},
        )
    return found


def toolset_keys_for_ptc(*, user: User, allowlist: Iterable[str], blocklist: Iterable[str]) -> list[str]:
    """Return the keys of every toolset ``user`` may use with PTC: the visible ones the policy's lists admit."""
    allowed, blocked = set(allowlist), set(blocklist)
    return [ts.key for ts in toolsets_visible(user=user) if ts.key not in blocked and (not allowed or ts.key in allowed)]


def ptc_context(*, user: User, keys: list[str] | None, title: str, fmt: str, discovery: bool) -> dict[str, Any]:
    """Return the prompt context of a turn (API.md): the policy's decision, the tools, the prompt, stats.

    ``keys`` None means every toolset the user may use with PTC. Raise ApplicationError for unknown keys.
    """
    from tools.context import ptc_context_build  # tools.context needs tools.sdk, which needs this module
    from tools.sdk import sdk_hash_of

    policy = policy_get()
    if keys is None:
        keys = toolset_keys_for_ptc(user=user, allowlist=policy.toolset_allowlist, blocklist=policy.toolset_blocklist)
    toolsets = toolsets_named(user=user, keys=keys)
    decision = ptc_decision(policy=policy, user=user, toolsets=[ts.key for ts in toolsets], title=title)
    direct, per_toolset = tools_split(toolsets=toolsets, direct_only=frozenset(policy.direct_only_tools))
    built = ptc_context_build(
        fmt=fmt,
        enabled=decision.enabled,
        sequential=policy.sequential,
        discovery=discovery,
        direct=direct,
        per_toolset=per_toolset,
    )
    return {
        "ptc_enabled": decision.enabled,
        "reason": decision.reason,
        "sequential": policy.sequential,
        "sdk_hash": sdk_hash_of(per_toolset),
        **built,
    }


# Tool definitions change rarely and every call needs one: a tools worker keeps each for a moment
# rather than join it into every claim. An edit reaches the workers within this many seconds.
TOOL_CACHE_SECONDS = 2.0
_tool_cache: dict[Any, tuple[float, Tool | None]] = {}


def tool_for_call(*, tool_id: Any) -> Tool | None:
    """Return the tool (with its toolset) to run a call with, or None if it was deleted."""
    now = time.monotonic()
    hit = _tool_cache.get(tool_id)
    if hit is not None and hit[0] > now:
        return hit[1]
    tool = Tool.objects.select_related("toolset").filter(pk=tool_id).first()
    _tool_cache[tool_id] = (now + TOOL_CACHE_SECONDS, tool)
    return tool
