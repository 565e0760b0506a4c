"""Staging the sandbox's runner under hostile conditions: threads at once, a stage removed."""

import shutil
import tempfile
import threading

import pytest
from django.conf import settings

from execution.sandbox import process


def test_concurrent_first_staging_of_the_runner_succeeds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads that stage the runner at once into a fresh directory all succeed (a worker booting with jobs queued)."""
    failures: list[str] = []
    for _ in range(15):  # bounded; each round is four threads staging into a fresh directory
        stage_dir = tempfile.mkdtemp(prefix="ptc-hostile-stage-")
        monkeypatch.setattr(settings, "PTC_SANDBOX_DIR", stage_dir)
        barrier = threading.Barrier(4)

        def stage(barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                process._guest_dir()
            except OSError as exc:
                failures.append(repr(exc))

        threads = [threading.Thread(target=stage) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        shutil.rmtree(stage_dir, ignore_errors=True)
    assert not failures, f"{len(failures)} concurrent stagings failed, e.g. {failures[0]}"


def test_a_sandbox_starts_after_its_staged_runner_was_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage removed under the worker (a /tmp cleaner) is staged again at the next start."""
    import time

    from execution.sandbox.pool import sandbox_start

    monkeypatch.setattr(settings, "PTC_SANDBOX_DIR", tempfile.mkdtemp(prefix="ptc-hostile-clean-"))
    try:
        first = sandbox_start()
        first.discard()
        shutil.rmtree(settings.PTC_SANDBOX_DIR)  # what a /tmp cleaner does
        later = sandbox_start()
        try:
            time.sleep(0.5)
            alive = later.proc.poll() is None
            stderr = b"" if alive or later.proc.stderr is None else later.proc.stderr.read()
        finally:
            later.discard()
        assert alive, f"no sandbox can start after the stage was removed: {stderr!r}"
    finally:
        shutil.rmtree(settings.PTC_SANDBOX_DIR, ignore_errors=True)


def test_the_staged_runner_loads_from_bytecode_the_sandbox_can_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandbox writes nothing beside its runner: the stage brings the bytecode, made by the
    sandbox's own interpreter, so no start compiles the runner or the SDK's base package again."""
    import subprocess

    monkeypatch.setattr(settings, "PTC_SANDBOX_DIR", tempfile.mkdtemp(prefix="ptc-stage-bytecode-"))
    try:
        target = process._guest_dir()
        launch = f"import sys; sys.path.insert(0, {str(target)!r}); import guest, ptc_tools._runtime"
        imports = subprocess.run(
            [settings.PTC_SANDBOX_PYTHON, "-I", "-S", "-B", "-v", "-c", launch], capture_output=True, text=True, check=True
        ).stderr
        for module in ("guest", "_runtime"):
            loaded = [line for line in imports.splitlines() if line.startswith("# code object from") and f"{module}." in line]
            assert loaded and loaded[0].endswith(".pyc'"), f"{module} was compiled from source: {loaded}"
        modes = {path.stat().st_mode & 0o777 for path in target.rglob("*.pyc")}
        assert modes == {0o644}
    finally:
        shutil.rmtree(settings.PTC_SANDBOX_DIR, ignore_errors=True)


def test_a_warm_sandbox_does_not_import_ast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sandbox's start pays for what its runner imports before the job: ``ast`` (5 ms of it)
    is not among them, ``_ast`` does its work; what reports an error is (tests/execution/test_bad_input.py)."""
    import subprocess

    monkeypatch.setattr(settings, "PTC_SANDBOX_DIR", tempfile.mkdtemp(prefix="ptc-stage-imports-"))
    try:
        target = process._guest_dir()
        launch = (
            f"import sys; sys.path.insert(0, {str(target)!r}); import guest, ptc_tools; "
            "print(sorted(m for m in ('ast', '_ast', 'traceback', 'json') if m in sys.modules))"
        )
        out = subprocess.run(
            [settings.PTC_SANDBOX_PYTHON, "-I", "-S", "-B", "-c", launch], capture_output=True, text=True, check=True
        ).stdout
        assert out.strip() == "['_ast', 'json', 'traceback']"
    finally:
        shutil.rmtree(settings.PTC_SANDBOX_DIR, ignore_errors=True)


def test_the_runner_reports_memory_filled_a_little_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The code's error is reported while its data still fills the memory limit: what the report
    needs was imported before the code ran (importing it then failed, and the job ended with an
    unreported Exception instead of ResourceLimit)."""
    import json
    import subprocess

    monkeypatch.setattr(settings, "PTC_SANDBOX_DIR", tempfile.mkdtemp(prefix="ptc-stage-memory-"))
    try:
        target = process._guest_dir()
        script = f"""
import json, resource, sys
sys.path.insert(0, {str(target)!r})
import builtins, guest, ptc_tools
size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize")) * 1024
limit = size + (48 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
code = "a = []\\nwhile True:\\n    a.append(bytearray(10000))"
limits = {{"memory_bytes": 48 << 20, "max_file_bytes": 1, "max_processes": 1}}
done = guest._run({{"code": code, "max_depth": 100, "max_frame": 1 << 20}}, {{"__builtins__": builtins}}, limits)
print(json.dumps(done["error"]))
"""
        out = subprocess.run(
            [settings.PTC_SANDBOX_PYTHON, "-I", "-S", "-B", "-c", script], capture_output=True, text=True, check=True
        ).stdout
        error = json.loads(out)
        assert error["type"] == "ResourceLimit" and "memory" in error["message"], error
    finally:
        shutil.rmtree(settings.PTC_SANDBOX_DIR, ignore_errors=True)
