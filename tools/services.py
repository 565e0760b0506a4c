"""Writes for toolsets and tools: builtin rows from code, staff edits, and MCP sync."""

import keyword
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import QuerySet

from execution.models import ToolCall
from ptcproject.deletion import update_in_batches
from ptcproject.errors import ApplicationError
from ptcproject.storage import unstorable
from tools.builtin import registry
from tools.errors import ToolFailure
from tools.kinds import mcp
from tools.models import Tool, Toolset
from tools.secret_refs import REDACTED
from tools.selectors import toolset_key_taken
from tools.validation import FieldError, schema_errors, toolset_errors

# The toolset fields a write may set; ``secrets`` and ``tools`` are handled on their own.
TOOLSET_FIELDS = (
    "key",
    "name",
    "description",
    "kind",
    "is_global",
    "enabled",
    "price",
    "billing_free",
    "queue",
    "requires_approval",
    "config",
)
TOOL_FIELDS = (
    "description",
    "input_schema",
    "output_schema",
    "allowed_callers",
    "read_only",
    "timeout",
    "price",
    "billing_free",
    "requires_approval",
    "enabled",
    "http",
)
TOOL_DEFAULTS: dict[str, Any] = {
    "description": "",
    "input_schema": {"type": "object", "properties": {}},
    "output_schema": None,
    "allowed_callers": [],
    "read_only": False,
    "timeout": None,
    "price": None,
    "billing_free": False,
    "requires_approval": False,
    "enabled": True,
    "http": None,
}


@transaction.atomic
def builtin_toolsets_sync() -> None:
    """Create or update the rows of every builtin toolset from the code registry.

    Tools no longer in the code are disabled, not deleted, so the calls recorded against them
    keep pointing at a row. Whether a tool in the code is enabled is the admin's call once its row
    exists, as a toolset's is: a new one is made enabled, and one the admin disabled stays so (one
    that left the code and came back too: enable it in the admin).
    """
    for spec in registry().values():
        toolset, _ = Toolset.objects.update_or_create(
            key=spec.key,
            owner=None,
            defaults={
                "name": spec.name,
                "description": spec.description,
                "kind": Toolset.Kind.BUILTIN,
                "is_global": True,
                "price": spec.price,
                "billing_free": spec.billing_free,
            },
        )
        for tool in spec.tools:
            defaults = {
                "description": tool.description,
                "input_schema": tool.input_schema,
                "output_schema": tool.output_schema,
                "allowed_callers": [Tool.Caller.CODE_EXECUTION],
                "read_only": tool.read_only,
                "price": tool.price,
                "billing_free": tool.billing_free,
            }
            # Not "enabled" on an update: every migrate (each deploy's, each web pod's init
            # container) enabled again a tool the admin had disabled, and the next jobs called it.
            Tool.objects.update_or_create(
                toolset=toolset, name=tool.name, defaults=defaults, create_defaults={**defaults, "enabled": True}
            )
        toolset.tools.exclude(name__in=[t.name for t in spec.tools]).update(enabled=False)


def _invalid(errors: list[FieldError]) -> ApplicationError:
    """Return one 400 for every problem: the first one's code, and each field's messages in details."""
    first = errors[0]
    more = f" ({len(errors) - 1} more problem{'s' if len(errors) > 2 else ''} in details)" if len(errors) > 1 else ""
    details: dict[str, list[str]] = {}
    for error in errors:
        details.setdefault(error.path, []).append(error.message)
    return ApplicationError(first.code, f"{first.path}: {first.message}.{more} Nothing was saved.", details=details)


def _owner_for(*, is_global: bool, actor: User) -> User | None:
    # A global toolset has no owner; any other belongs to the staff member who wrote it, and
    # shadows a global one with the same key for them alone.
    return None if is_global else actor


def _check_key_free(*, key: str, owner: User | None, exclude: Toolset | None = None) -> None:
    if toolset_key_taken(key=key, owner=owner, exclude=exclude):
        whose = "A global toolset" if owner is None else "Your own toolset"
        raise ApplicationError(
            "toolset_exists", f"{whose} with key '{key}' already exists. Change that one, or pick another key.", status=409
        )


def _secrets_after(current: Mapping[str, str], given: Mapping[str, str | None] | None, *, partial: bool) -> dict[str, str]:
    """Return the secrets a write leaves: a PUT replaces them, a PATCH merges (null removes one).

    Either way, a write that leaves ``secrets`` out keeps them: they can't be read back to resend.
    """
    if given is None:
        return dict(current)
    merged = dict(current) if partial else {}
    for name, value in given.items():
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = value
    return merged


def _tools_write(*, toolset: Toolset, tools: list[dict[str, Any]]) -> None:
    """Make ``tools`` the toolset's tools: create or update each by name, disable the rest.

    Disabled, not deleted: calls already recorded keep pointing at the row.
    """
    for tool in tools:
        values = {name: tool.get(name, TOOL_DEFAULTS[name]) for name in TOOL_FIELDS}
        # remote_name is left alone: it is the MCP server's name for a synced tool, which edits keep.
        Tool.objects.update_or_create(toolset=toolset, name=tool["name"], defaults=values)
    toolset.tools.exclude(name__in=[t["name"] for t in tools]).update(enabled=False)


def _builtin_guard(*, toolset: Toolset, data: Mapping[str, Any]) -> None:
    # Builtin rows are rewritten from code by `migrate`: an edit other than enabling, routing or
    # requiring approval would not last. Those three are the admin's calls: `migrate` leaves them.
    kept = ("enabled", "queue", "requires_approval")
    changed = [n for n in TOOLSET_FIELDS if n in data and n not in kept and data[n] != getattr(toolset, n)]
    if "tools" in data or "secrets" in data:
        changed.append("tools" if "tools" in data else "secrets")
    if changed:
        raise ApplicationError(
            "builtin_toolset",
            f"'{toolset.key}' is a builtin toolset, defined in code: only {', '.join(repr(n) for n in kept)} can change "
            f"here, not {', '.join(changed)}.",
            details={name: ["builtin toolsets are defined in code"] for name in changed},
        )


@transaction.atomic
def toolset_create(*, actor: User, data: Mapping[str, Any]) -> Toolset:
    """Create a toolset with its tools, all or nothing. Raise ApplicationError (400, 409) if it can't be."""
    if data["kind"] == Toolset.Kind.BUILTIN:
        raise ApplicationError(
            "builtin_toolset",
            "Builtin toolsets are defined in code and created by `migrate`; create an http or mcp toolset here.",
            details={"kind": ["builtin toolsets are defined in code"]},
        )
    secrets = _secrets_after({}, data.get("secrets"), partial=False)
    tools = list(data.get("tools") or [])
    config = data.get("config") or {}
    errors = toolset_errors(
        key=data["key"],
        kind=data["kind"],
        config=config,
        secrets=secrets,
        tools=tools,
        requires_approval=data.get("requires_approval", False),
    )
    if errors:
        raise _invalid(errors)
    owner = _owner_for(is_global=data.get("is_global", True), actor=actor)
    _check_key_free(key=data["key"], owner=owner)
    toolset = Toolset.objects.create(
        owner=owner, secrets=secrets, **{n: data[n] for n in TOOLSET_FIELDS if n in data and n != "config"}, config=config
    )
    _tools_write(toolset=toolset, tools=tools)
    return toolset


@transaction.atomic
def toolset_update(*, toolset: Toolset, actor: User, data: Mapping[str, Any], partial: bool) -> Toolset:
    """Change a toolset (PUT when not ``partial``, PATCH otherwise), all or nothing.

    With ``tools`` given, they become the toolset's tools (see ``_tools_write``). Changing
    ``is_global`` moves it between the global keys and the actor's own. Raise ApplicationError.
    """
    toolset = Toolset.objects.select_for_update().get(pk=toolset.pk)
    if toolset.kind == Toolset.Kind.BUILTIN:
        _builtin_guard(toolset=toolset, data=data)
    elif data.get("kind") == Toolset.Kind.BUILTIN:
        raise ApplicationError("builtin_toolset", "A toolset can't become builtin: builtins are defined in code.")
    if "key" in data and data["key"] != toolset.key:
        raise ApplicationError(
            "key_mismatch",
            f"The body's key '{data['key']}' differs from '{toolset.key}' in the URL; a key can't be changed.",
            details={"key": ["must match the URL"]},
        )
    values = {n: data[n] if n in data else getattr(toolset, n) for n in TOOLSET_FIELDS}
    secrets = _secrets_after(toolset.secrets or {}, data.get("secrets"), partial=partial)
    if "tools" in data:
        tools = list(data["tools"] or [])
    else:
        tools = [{"name": t.name, **{n: getattr(t, n) for n in TOOL_FIELDS}} for t in toolset.tools.filter(enabled=True)]
    if toolset.kind != Toolset.Kind.BUILTIN:
        errors = toolset_errors(
            key=toolset.key,
            kind=values["kind"],
            config=values["config"],
            secrets=secrets,
            tools=tools,
            requires_approval=values["requires_approval"],
        )
        if errors:
            raise _invalid(errors)
    owner = toolset.owner
    if values["is_global"] != toolset.is_global:
        owner = _owner_for(is_global=values["is_global"], actor=actor)
        _check_key_free(key=toolset.key, owner=owner, exclude=toolset)
    for name, value in values.items():
        setattr(toolset, name, value)
    toolset.owner = owner
    toolset.secrets = secrets
    toolset.save()
    if "tools" in data:
        _tools_write(toolset=toolset, tools=tools)
    return toolset


def toolset_delete(*, toolset: Toolset) -> None:
    """Delete a toolset and its tools. Recorded calls keep their toolset key and tool name."""
    if toolset.kind == Toolset.Kind.BUILTIN:
        raise ApplicationError(
            "builtin_toolset", f"'{toolset.key}' is a builtin toolset; `migrate` would bring it back. Disable it instead."
        )
    tool_calls_unlink(tools=toolset.tools.all())
    toolset.delete()


def tool_calls_unlink(*, tools: QuerySet[Tool]) -> int:
    """Unlink the finished calls of ``tools`` from them, as deleting the tools does (their tool set
    to null; they keep their toolset key and tool name), a batch a statement (update_in_batches);
    return how many. For a delete of ``tools`` to follow: Django's delete unlinks them all in one
    UPDATE, which for a tool of a few million calls ran past PTC_DB_STATEMENT_TIMEOUT, and the
    delete failed, every time.

    Each statement is its own transaction outside ``atomic`` (a delete interrupted part way, retried,
    goes on where it stopped: a finished call whose tool is about to go lacks only the link it would
    lose), or the caller's within it (the admin's delete page: all or nothing). A call not finished is
    left to the delete, which unlinks what is left in one short statement: its worker reads its tool."""
    ids = list(tools.values_list("pk", flat=True))
    if not ids:
        return 0
    return update_in_batches(ToolCall.objects.filter(tool_id__in=ids).exclude(status__in=ToolCall.OPEN), tool=None)


_NOT_NAME_CHARS = re.compile(r"\W", re.ASCII)
_NAME_LENGTH = Tool._meta.get_field("name").max_length or 0
_REMOTE_NAME_LENGTH = Tool._meta.get_field("remote_name").max_length or 0


def python_name(remote: str, taken: set[str]) -> str:
    """Return a Python method name for an MCP tool name: ``get-issue`` → ``get_issue``; unique in
    ``taken``, and cut to fit a Tool's name."""
    name = _NOT_NAME_CHARS.sub("_", remote).lstrip("_") or "tool"
    if name[0].isdigit():
        name = f"t_{name}"
    if keyword.iskeyword(name):
        name += "_"
    candidate, n = name[:_NAME_LENGTH], 2
    while candidate in taken:
        suffix = f"_{n}"
        candidate, n = name[: _NAME_LENGTH - len(suffix)] + suffix, n + 1
    return candidate


def _listed_tool_problem(item: mcp.ListedTool, seen: set[str]) -> str | None:
    """Return why a tool an MCP server listed can't be a Tool row as listed (``where: what``), or
    None. ``seen`` holds the names listed before it."""
    if not item.name:
        return "name: empty, so it can't be called"
    if REDACTED in item.name:
        return "name: holds one of the toolset's secrets, which would be shown to everyone it is granted to"
    if item.name in seen:
        return "name: listed twice; the first is synced"
    if len(item.name) > _REMOTE_NAME_LENGTH:
        return f"name: longer than {_REMOTE_NAME_LENGTH} characters, which can't be stored"
    listed = {
        "name": item.name,
        "description": item.description,
        "inputSchema": item.input_schema,
        "outputSchema": item.output_schema,
    }
    # PostgreSQL's text and jsonb hold no NUL: the row would fail to save, and the whole sync with it.
    if (problem := unstorable(listed)) is not None:
        return problem
    problems = schema_errors(item.input_schema, path="inputSchema", object_root=True)
    if item.output_schema is not None:
        problems += schema_errors(item.output_schema, path="outputSchema", object_root=False)
    return f"{problems[0].path}: {problems[0].message}" if problems else None


@dataclass
class McpSync:
    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    disabled: list[str] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)


def mcp_toolset_sync(*, toolset: Toolset) -> McpSync:
    """List the MCP server's tools into the toolset's Tool rows, and return what changed.

    Tools the server no longer lists are disabled, not deleted. A tool that can't be one as listed
    (its input schema is not a valid JSON Schema object, its name is too long to store, a text of it
    holds a NUL) is skipped and reported: the others are synced. Raise ApplicationError ``not_mcp`` (400), or
    the failure's own code (``mcp_start_failed``, ``mcp_init_timeout``, ...) as a 502.
    """
    if toolset.kind != Toolset.Kind.MCP:
        raise ApplicationError("not_mcp", f"'{toolset.key}' is a {toolset.kind} toolset; only mcp toolsets are synced.")
    try:
        listed = mcp.tools_list(toolset=toolset)
    except ToolFailure as failure:
        raise ApplicationError(
            failure.code,
            f"Could not list the tools of '{toolset.key}': {failure.message}. Check its config and the server, then sync again.",
            status=502,
        ) from None
    result = McpSync()
    with transaction.atomic():
        # One sync at a time per toolset: two would race on the (toolset, name) constraint.
        toolset = Toolset.objects.select_for_update().get(pk=toolset.pk)
        existing = {t.remote_name or t.name: t for t in toolset.tools.all()}
        taken = {t.name for t in existing.values()}
        kept = []
        seen: set[str] = set()
        for item in listed:
            if (problem := _listed_tool_problem(item, seen)) is not None:
                shown = item.name if len(item.name) <= 200 else f"{item.name[:200]}…"
                result.skipped.append({"name": shown, "reason": problem})
                continue
            seen.add(item.name)
            tool = existing.get(item.name)
            if tool is None:
                name = python_name(item.name, taken)
                taken.add(name)
                tool = Tool(toolset=toolset, name=name)
                result.added.append(name)
            elif not tool.enabled or (tool.description, tool.input_schema, tool.output_schema, tool.read_only) != (
                item.description,
                item.input_schema,
                item.output_schema,
                item.read_only,
            ):
                result.updated.append(tool.name)
            tool.remote_name = "" if tool.name == item.name else item.name
            tool.description = item.description
            tool.input_schema = item.input_schema
            tool.output_schema = item.output_schema
            tool.read_only = item.read_only
            tool.enabled = True
            tool.save()
            kept.append(tool.pk)
        gone = toolset.tools.filter(enabled=True).exclude(pk__in=kept)
        result.disabled = sorted(gone.values_list("name", flat=True))
        gone.update(enabled=False)
        toolset.save(update_fields=["updated_at"])
    return result
