"""Queue names live here and nowhere else (STYLE.md §8)."""

EXEC = "exec"
TOOLS = "tools"
# Beat's rounds (the reaper, retention). Every worker consumes it, whatever its -Q (ptcproject/celery.py):
# on the exec queue, a fleet without an exec worker up (all down, or tools workers only) reaped
# nothing, its dead tools workers' calls left executing and their prices held.
MAINTENANCE = "maintenance"

# A toolset may name its own tools queue (Toolset.queue), e.g. "tools.slow" for slow MCP servers,
# served by `celery -A ptcproject worker -Q tools.slow`. Which names are allowed is a setting,
# PTC_TOOLS_QUEUES; TOOLS is always one of them.


def tools_queues() -> list[str]:
    """The queues a toolset may name (PTC_TOOLS_QUEUES)."""
    from django.conf import settings

    return list(settings.PTC_TOOLS_QUEUES)


def tools_queue_problem(name: str) -> str | None:
    """Return why a toolset can't be routed to ``name``, or None if it can."""
    allowed = tools_queues()
    if name not in allowed:
        return f"'{name}' is not a tools queue of this deployment; use one of {', '.join(allowed)} (PTC_TOOLS_QUEUES)."
    return None


TASK_ROUTES = {
    "execution.tasks.run_exec": {"queue": EXEC},
    "execution.tasks.reap_jobs": {"queue": MAINTENANCE},
    "execution.tasks.purge_jobs": {"queue": MAINTENANCE},
    "execution.tasks.execute_tool": {"queue": TOOLS},
}
