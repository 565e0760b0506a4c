"""Queue names live here and nowhere else (STYLE.md §8)."""

EXEC = "exec"
TOOLS = "tools"
MAINTENANCE = "exec"  # the reaper runs beside the jobs it watches

TASK_ROUTES = {
    "execution.tasks.run_exec": {"queue": EXEC},
    "execution.tasks.reap_jobs": {"queue": MAINTENANCE},
    "execution.tasks.purge_jobs": {"queue": MAINTENANCE},
    "execution.tasks.execute_tool": {"queue": TOOLS},
}
