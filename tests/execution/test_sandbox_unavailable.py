"""A host that can't run sandboxes says so, naming what to install; the job fails clearly."""

import pytest
from django.test import override_settings

from execution.sandbox import process


def test_a_missing_bubblewrap_is_named() -> None:
    process.check.cache_clear()
    try:
        with override_settings(PTC_BWRAP="/nonexistent/bwrap"), pytest.raises(process.SandboxUnavailable) as raised:
            process.check()
        assert "bubblewrap" in str(raised.value)
    finally:
        process.check.cache_clear()
    process.check()  # and this host can
