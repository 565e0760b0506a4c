import time
from collections.abc import Iterable
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection
from django.db.models import Prefetch, Q, QuerySet

from ptcproject import rows
from ptcproject.errors import ApplicationError
from ptcproject.kept import Kept
from tools.models import Tool, Toolset


def tool_timeout_or_default(timeout: float | None) -> float:
    """Return how long a call of a tool whose own timeout is ``timeout`` (Tool.timeout; None when it
    has none, or the call no tool) runs at most: it, else PTC_DEFAULT_TOOL_TIMEOUT. The one rule
    for how long a tools worker lets a call run (execution.services.calls.tool_run_timeout) and when
    a call is overdue (execution.selectors.calls_overdue_at), here so that they cannot drift apart."""
    return float(timeout or settings.PTC_DEFAULT_TOOL_TIMEOUT)


def toolset_key_taken(*, key: str, owner: User | None, exclude: Toolset | None = None) -> bool:
    """Return True if a toolset other than ``exclude`` has ``key`` for ``owner`` (None: the global keys)."""
    taken = Toolset.objects.filter(key=key, owner=owner)
    if exclude is not None and exclude.pk is not None:
        taken = taken.exclude(pk=exclude.pk)
    return taken.exists()


def _toolsets_of(*, user: User, include_disabled: bool = False) -> QuerySet[Toolset]:
    """The toolsets ``user`` may use, without their tools: their own, plus global ones they don't shadow.

    Global is ``is_global`` with no owner: a toolset with neither is nobody's, not everybody's
    (the admin can write one), and would otherwise be used by all and never billed."""
    own_keys = Toolset.objects.filter(owner=user).values("key")
    toolsets = Toolset.objects.all() if include_disabled else Toolset.objects.filter(enabled=True)
    shared = Q(owner__isnull=True, is_global=True) & ~Q(key__in=own_keys)
    return toolsets.filter(Q(owner=user) | shared).order_by("key")


def toolsets_visible(*, user: User, include_disabled: bool = False) -> QuerySet[Toolset]:
    """Return the enabled toolsets ``user`` may use, with their enabled tools: their own, plus
    global ones they don't shadow.

    With ``include_disabled`` (staff, who manage them), disabled toolsets are in it too.
    """
    tools = Prefetch("tools", queryset=Tool.objects.filter(enabled=True).order_by("name"))
    return _toolsets_of(user=user, include_disabled=include_disabled).prefetch_related(tools)


def toolsets_listed(*, user: User) -> QuerySet[Toolset]:
    """Return the toolsets ``GET /toolsets`` shows ``user``: the visible ones; for staff, disabled ones too."""
    return toolsets_visible(user=user, include_disabled=bool(getattr(user, "is_staff", False)))


def toolset_listed(*, user: User, key: str) -> Toolset | None:
    """Return the toolset ``key`` as ``user`` sees it (their own shadows a global one), or None."""
    if not key.isidentifier():  # no toolset has such a key; and PostgreSQL refuses one with a NUL
        return None
    return toolsets_listed(user=user).filter(key=key).first()


def toolsets_resolve(*, user: User, keys: Iterable[str]) -> tuple[list[Toolset], list[str]]:
    """Return the visible toolsets named by ``keys`` in that order, with their enabled tools (as
    ``toolsets_visible`` prefetches them), and the keys that matched none."""
    wanted = list(dict.fromkeys(keys))
    found = {ts.key: ts for ts in _toolsets_with_tools(user_id=user.pk, keys=wanted)} if wanted else {}
    return [found[k] for k in wanted if k in found], [k for k in wanted if k not in found]


def _toolsets_with_tools(*, user_id: int, keys: list[str]) -> list[Toolset]:
    """``toolsets_visible(...).filter(key__in=keys)``, kept by the content of their rows: one
    statement asks PostgreSQL for a digest of the rows, and rows already built with that digest
    are given again. Every job reads its toolsets, and building a large one each time (GitHub's
    114 tools: 122 KB of rows, a model and its JSON schemas each) took 9-11 ms; any change to a row
    changes the digest. The rows are shared: callers only read them.

    Not inside a transaction: a row changed twice in one keeps the version (``xmin``) it had after
    the first change."""
    if connection.vendor != "postgresql" or connection.in_atomic_block:
        return _toolsets_built(user_id=user_id, keys=keys)
    digest = _digest(user_id=user_id, keys=keys)
    hit = _BUILT.get(digest)
    if hit is not None:
        return hit
    # Rows changed since the digest are newer versions: that digest is never asked for again.
    found = _toolsets_built(user_id=user_id, keys=keys)
    _BUILT.put(digest, found)
    return found


# Toolsets with their tools as built, by the digest of which rows they are (_digest): users who
# see the same rows share them.
_BUILT: Kept[str, list[Toolset]] = Kept(64)


def _digest(*, user_id: int, keys: list[str]) -> str:
    """A digest of which rows the visible toolsets named by ``keys`` and their enabled tools are,
    and of which version of each (``xmin``, the transaction that wrote it: any change to a row
    writes a new version), made by PostgreSQL in 32 characters rather than read as rows."""
    toolsets, tools = rows.table(Toolset), rows.table(Tool)
    where, params = _visible(user_id, keys)
    sql = (
        f"WITH ts AS (SELECT id, xmin FROM {toolsets} WHERE {where}) "  # noqa: S608 - names from the models
        "SELECT md5(coalesce((SELECT string_agg(id::text || ':' || xmin::text, ',' ORDER BY id) FROM ts), '') || '/' || "
        f"coalesce((SELECT string_agg(t.id::text || ':' || t.xmin::text, ',' ORDER BY t.id) FROM {tools} t "
        "WHERE t.enabled AND t.toolset_id IN (SELECT id FROM ts)), ''))"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return str(cursor.fetchone()[0])


def _toolsets_built(*, user_id: int, keys: list[str]) -> list[Toolset]:
    """The toolsets and their tools, read and built: two fixed statements (ptcproject/rows.py), as
    the queryset and its prefetch cost ~2 ms of CPU to compile."""
    toolsets, tools = rows.table(Toolset), rows.table(Tool)
    with connection.cursor() as cursor:
        where, params = _visible(user_id, keys)
        cursor.execute(f"SELECT {rows.columns(Toolset)} FROM {toolsets} WHERE {where} ORDER BY key", params)  # noqa: S608
        found = [rows.from_row(Toolset, row) for row in cursor.fetchall()]
        if not found:
            return []
        ids = [Toolset._meta.pk.get_db_prep_value(toolset.pk, connection) for toolset in found]
        cursor.execute(
            f"SELECT {rows.columns(Tool)} FROM {tools} WHERE enabled AND toolset_id IN ({', '.join(['%s'] * len(ids))}) "  # noqa: S608
            "ORDER BY name",
            ids,
        )
        loaded = [rows.from_row(Tool, row) for row in cursor.fetchall()]
    by_id = {toolset.pk: toolset for toolset in found}
    tools_of: dict[Any, list[Tool]] = {pk: [] for pk in by_id}
    for tool in loaded:
        tool.toolset = by_id[tool.toolset_id]
        tools_of[tool.toolset_id].append(tool)
    for toolset in found:
        rows.prefetched(toolset, "tools", tools_of[toolset.pk])
    return found


def toolsets_named(*, user: User, keys: Iterable[str] | None) -> list[Toolset]:
    """Return the visible toolsets named by ``keys`` (every visible one if None).

    Raise ApplicationError ``unknown_toolset`` (400) naming the keys that matched none.
    """
    if keys is None:
        return list(toolsets_visible(user=user))
    found, missing = toolsets_resolve(user=user, keys=keys)
    if missing:
        raise _unknown_toolsets(missing)
    return found


def _unknown_toolsets(missing: list[str]) -> ApplicationError:
    return ApplicationError(
        "unknown_toolset",
        f"Unknown toolset(s): {', '.join(missing)}. GET /api/v1/toolsets lists the ones you can use.",
        details={"toolsets": missing},
    )


def toolset_keys_named(*, user: User, keys: Iterable[str]) -> list[str]:
    """Return ``keys`` without repeats, each a toolset ``user`` may use, in one query that reads
    no tools (a job needs their names here, not their definitions).

    Raise ApplicationError ``unknown_toolset`` (400) naming the keys that matched none.
    """
    wanted = list(dict.fromkeys(keys))
    return toolset_keys_known(keys=wanted, visible=toolset_keys_read(user=user, keys=wanted).run())


def toolset_keys_known(*, keys: Iterable[str], visible: Iterable[str]) -> list[str]:
    """Return ``keys`` without repeats, each one of ``visible`` (``toolset_keys_read``'s).

    Raise ApplicationError ``unknown_toolset`` (400) naming the keys that are not.
    """
    wanted, found = list(dict.fromkeys(keys)), set(visible)
    missing = [k for k in wanted if k not in found]
    if missing:
        raise _unknown_toolsets(missing)
    return wanted


def toolset_keys_read(*, user: User, keys: Iterable[str] | None, client: bool = True) -> rows.Statement[list[str]]:
    """The keys of the toolsets ``user`` may use, in order: of ``keys`` (of every one if None; of
    none, and nothing asked, if empty); with ``client`` False, but client toolsets.

    ``_toolsets_of`` as one fixed statement (ptcproject/rows.py), to run alone or with others in one
    round trip (``rows.together``): every POST /exec asks, and the queryset took 1.5 ms to build
    and compile, five times its query."""
    wanted = None if keys is None else list(dict.fromkeys(keys))
    if wanted == []:
        return rows.Statement("", [], lambda found: [])
    where, params = _visible(user.pk, wanted)
    if not client:
        where, params = f"{where} AND kind <> %s", [*params, Toolset.Kind.CLIENT.value]
    sql = f"SELECT key FROM {rows.table(Toolset)} WHERE {where} ORDER BY key"  # noqa: S608 - names from the model
    return rows.Statement(sql, params, lambda found: [key for (key,) in found])


def _visible(user_id: int, keys: list[str] | None) -> tuple[str, list[Any]]:
    """``_toolsets_of`` as a WHERE clause for the fixed statements, and its parameters: enabled, one
    of ``keys`` (any if None), and the user's own or a global one (no owner, ``is_global``) the user does not shadow."""
    toolsets = rows.table(Toolset)
    named = "" if keys is None else f"key IN ({', '.join(['%s'] * len(keys))}) AND "
    where = (
        f"enabled AND {named}(owner_id = %s OR "  # noqa: S608 - placeholders only
        f"(owner_id IS NULL AND is_global AND key NOT IN (SELECT key FROM {toolsets} WHERE owner_id = %s)))"
    )
    return where, [*(keys or []), user_id, user_id]


def toolset_keys_for_ptc(*, user: User, allowlist: Iterable[str], blocklist: Iterable[str], client: bool = True) -> list[str]:
    """Return the keys of every toolset ``user`` may use with PTC: the visible ones the policy's
    lists admit, in order; with ``client`` False, but client toolsets."""
    visible = toolset_keys_read(user=user, keys=None, client=client).run()
    return toolset_keys_admitted(visible=visible, allowlist=allowlist, blocklist=blocklist)


def toolset_keys_admitted(*, visible: Iterable[str], allowlist: Iterable[str], blocklist: Iterable[str]) -> list[str]:
    """Return the keys of ``visible`` (``toolset_keys_read``'s) that the policy's lists admit, in order."""
    allowed, blocked = set(allowlist), set(blocklist)
    return [key for key in visible if key not in blocked and (not allowed or key in allowed)]


# Tool definitions change rarely and every call needs one: a tools worker keeps each for a moment
# rather than join it into every claim. An edit reaches the workers within this many seconds.
TOOL_CACHE_SECONDS = 2.0
# Past this many tools kept, those whose moment has passed are dropped: every tool ever called was
# kept, for the life of the worker, each with its toolset (its config and schemas).
TOOL_CACHE_MOST = 256
_tool_cache: dict[Any, tuple[float, Tool | None]] = {}


def tool_for_call(*, tool_id: Any) -> Tool | None:
    """Return the tool (with its toolset) to run a call with, or None if it was deleted."""
    now = time.monotonic()
    hit = _tool_cache.get(tool_id)
    if hit is not None and hit[0] > now:
        return hit[1]
    tool = Tool.objects.select_related("toolset").filter(pk=tool_id).first()
    if len(_tool_cache) >= TOOL_CACHE_MOST:
        # A snapshot (list() copies under the GIL): the pool's other threads add entries meanwhile.
        for key, (until, _) in list(_tool_cache.items()):
            if until <= now:
                _tool_cache.pop(key, None)
    _tool_cache[tool_id] = (now + TOOL_CACHE_SECONDS, tool)
    return tool
