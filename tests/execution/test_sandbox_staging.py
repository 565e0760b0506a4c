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
