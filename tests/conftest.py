"""Property tests draw the same examples on every run (derandomized), so a random draw cannot
fail a landing and a failure reproduces on the next run; `HYPOTHESIS_PROFILE=explore` draws
afresh, to look for new counterexamples."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("fixed", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """The run's order (pytest-randomly) under `-q` too, which hides the header that names it."""
    if config.pluginmanager.hasplugin("randomly"):
        seed = config.getoption("randomly_seed")
        terminalreporter.write_line(f"random order: rerun it with --randomly-seed={seed} (docs/DEVELOPMENT.md)")
