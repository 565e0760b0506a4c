"""What a large toolset costs a job: GitHub's 114 tools (the MCP server's real list) granted beside
the demo, against the demo alone, by turns in one stack.

Run it with `make bench`, or `python bench/toolsets.py` with TEST_DATABASE_URL and REDIS_URL set.
"""

from collections.abc import Callable

import httpx
from harness import print_table, row, run_job, running_stack
from spine import apart, interleaved

from tests.servers import api_key
from tests.tools.github import github_toolset

IMPORTS = "from ptc_tools.github import Github\n1"


def submits(client: httpx.Client, toolsets: list[str], code: str) -> Callable[[], list[float]]:
    """Six submits of ``code`` with ``toolsets``, 0.15 s apart: ms each."""
    return lambda: apart(lambda: run_job(client, code, toolsets=toolsets, wait=30), 6)


def main() -> None:
    with running_stack() as (stack, client):
        # The benchmark's user, made staff to create the toolset.
        staff = httpx.Client(
            base_url=stack.base_url, headers={"Authorization": f"Bearer {api_key(stack.env, 'bench', staff=True)}"}
        )
        staff.post("/api/v1/toolsets", json=github_toolset("github")).raise_for_status()
        both = ["demo", "github"]
        for toolsets, code in ((["demo"], "1"), (both, "1"), (both, IMPORTS)):  # each path warm
            run_job(client, code, toolsets=toolsets)
        demo, granted = interleaved(5, submits(client, ["demo"], "1"), submits(client, both, "1"))
        demo_again, imported = interleaved(5, submits(client, ["demo"], "1"), submits(client, both, IMPORTS))
    print_table(
        "A large toolset (GitHub's 114 tools) granted: submit → result, 0.15 s apart",
        [
            row("`1`, GitHub granted beside the demo", granted, "ms", demo),
            row("  baseline: `1`, the demo only, by turns with it", demo, "ms"),
            row("`from ptc_tools.github import Github`, GitHub granted", imported, "ms", demo_again),
            row("  baseline: `1`, the demo only, by turns with it", demo_again, "ms"),
        ],
    )


if __name__ == "__main__":
    main()
