"""The policy's first values, from the PTC_* environment variables.

Read by settings at start-up, so a bad value stops every process at once, naming the variable.
The row they seed is created once; after that the admin owns it and these are not read again.
"""

from typing import Any

import environ
from django.core.exceptions import ImproperlyConfigured

from ptcproject.envvars import parse_bool, parse_choice, parse_int

MODES = ("off", "on", "partial")
DEBUG_VALUES = {"": "", "false": "", "off": "", "opt-in": "opt-in", "true": "opt-in", "opt-out": "opt-out"}
DEFAULT_DIRECT_ONLY_TOOLS = ["complete", "fail", "onboarding_handoff"]
# The least and most each whole-number policy field may be, here and in PATCH /api/v1/policy.
# The timeouts' most is PTC_TIMEOUT_CEILING. The others are far above any real use and far below
# the columns' range, and each is something a worker can hold: a count of calls in its memory,
# output it keeps, memory it asks the kernel for.
BOUNDS = {
    "rollout_percent": (0, 100),
    "max_tool_calls": (1, 1_000_000),
    "max_parallel_tool_calls": (1, 1024),
    "max_output_bytes": (1, 64 * 1024 * 1024),
    "memory_limit_mb": (32, 64 * 1024),
    "max_concurrent_jobs": (0, 1_000_000),
    "max_concurrent_tool_calls": (0, 1_000_000),
    "max_jobs_per_minute": (0, 1_000_000),
    "max_client_wait": (0, 7 * 24 * 3600),
}


def _list(env: environ.Env, name: str, default: list[str] | None = None) -> list[str]:
    raw = env.str(name, default=None)
    if raw is None:
        return list(default or [])
    return [item.strip() for item in raw.split(",") if item.strip()]


def policy_seed(env: environ.Env, *, timeout_ceiling: int) -> dict[str, Any]:
    """Return the policy's initial field values. Raise ImproperlyConfigured naming a bad variable."""
    mode = parse_choice("PTC_MODE", "on", MODES)
    debug = env.str("PTC_DEBUG", default="").strip().lower()
    if debug not in DEBUG_VALUES:
        raise ImproperlyConfigured(f"PTC_DEBUG must be one of '', opt-in, opt-out (or legacy true); got {debug!r}.")
    max_timeout = parse_int("PTC_MAX_TIMEOUT", min(600, timeout_ceiling), 1, timeout_ceiling)
    return {
        "mode": mode,
        "user_allowlist": _list(env, "PTC_USER_ALLOWLIST"),
        "toolset_allowlist": _list(env, "PTC_TOOLSET_ALLOWLIST"),
        "toolset_blocklist": _list(env, "PTC_TOOLSET_BLOCKLIST"),
        "rollout_percent": parse_int("PTC_ROLLOUT_PERCENT", 100, *BOUNDS["rollout_percent"]),
        "debug": DEBUG_VALUES[debug],
        "sequential": parse_bool("PTC_SEQUENTIAL"),
        "default_timeout": parse_int("PTC_TIMEOUT", min(120, max_timeout), 1, max_timeout),
        "max_timeout": max_timeout,
        "direct_only_tools": _list(env, "PTC_DIRECT_ONLY_TOOLS", DEFAULT_DIRECT_ONLY_TOOLS),
        "max_tool_calls": parse_int("PTC_MAX_TOOL_CALLS", 1000, *BOUNDS["max_tool_calls"]),
        "max_parallel_tool_calls": parse_int("PTC_MAX_PARALLEL_TOOL_CALLS", 16, *BOUNDS["max_parallel_tool_calls"]),
        "max_output_bytes": parse_int("PTC_MAX_OUTPUT_BYTES", 1_000_000, *BOUNDS["max_output_bytes"]),
        "memory_limit_mb": parse_int("PTC_MEMORY_LIMIT_MB", 512, *BOUNDS["memory_limit_mb"]),
        "max_concurrent_jobs": parse_int("PTC_MAX_CONCURRENT_JOBS", 0, *BOUNDS["max_concurrent_jobs"]),
        "max_concurrent_tool_calls": parse_int("PTC_MAX_CONCURRENT_TOOL_CALLS", 0, *BOUNDS["max_concurrent_tool_calls"]),
        "max_jobs_per_minute": parse_int("PTC_MAX_JOBS_PER_MINUTE", 0, *BOUNDS["max_jobs_per_minute"]),
        "max_client_wait": parse_int("PTC_MAX_CLIENT_WAIT", 600, *BOUNDS["max_client_wait"]),
        "approval_for_writes": parse_bool("PTC_APPROVAL_FOR_WRITES"),
    }
