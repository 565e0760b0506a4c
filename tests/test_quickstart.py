"""The README's run command, on the embedded default: SQLite and a server-less broker."""

import os
import subprocess
from pathlib import Path

from tests.stack import ROOT, free_port


def test_quickstart_runs_a_demo_job_embedded(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "REDIS_URL")}
    env.update(PTC_DATA_DIR=str(tmp_path / "var"), PORT=str(free_port()), PTC_QUICKSTART_ONCE="1")
    result = subprocess.run(["scripts/run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    key = lines[lines.index("== the demo user's API key (shown once):") + 1]
    assert key.startswith("ptc_")
    assert "embedded: SQLite" in result.stdout
    assert "status: completed   return value: 16   tool calls: 5" in result.stdout
    assert (tmp_path / "var" / "db.sqlite3").exists()
