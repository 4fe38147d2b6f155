"""Helpers every test module may use: one tiny model, one condition wait, spec-derived policies."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from diloco.core.rounds import RoundPolicy
from diloco.spec import Syncer
from diloco.syncer.global_model import round_policy

T = TypeVar("T")

# Well under 1M parameters (~0.1M): a CPU learner steps in ~15 ms and compiles in seconds.
TINY_MODEL: dict[str, int] = {"layers": 2, "dModel": 64, "heads": 4, "context": 64}


def wait_for(predicate: Callable[[], T], timeout: float = 15.0, period: float = 0.1, what: str = "condition") -> T:
    """Poll until `predicate()` is truthy and return its value; fail naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def policy(num_fragments: int = 1, **changes: Any) -> RoundPolicy:
    """The default spec's round policy, with `changes` (RoundPolicy field names)."""
    return dataclasses.replace(round_policy(Syncer(), num_fragments), **changes)


def learner_extra_blocked() -> str:
    """Python source that makes every module of the `learner` extra, and jaxlib, unimportable,
    as in an image without the extra."""
    from diloco import extras

    blocked = (*extras.modules(extras.LEARNER), "jaxlib")
    assert "jax" in blocked, blocked  # the package's metadata is installed and lists the extra
    return f"import sys\nfor m in {blocked!r}: sys.modules[m] = None\n"


def without_learner_extra() -> str:
    """A `python -c` program that runs the `diloco` command line (argv after -c) without the
    `learner` extra."""
    return learner_extra_blocked() + "from diloco.apps.cli import main\nsys.argv = ['diloco', *sys.argv[1:]]\nsys.exit(main())\n"


def diloco_run(manifest: dict[str, Any], folder: Path, timeout: float = 240) -> list[dict[str, Any]]:
    """`diloco run` of `manifest` (written to folder/job.yaml), as a user runs it, into folder/out;
    asserts it exited 0 and returns its events."""
    import yaml

    (folder / "job.yaml").write_text(yaml.safe_dump(manifest))
    out = folder / "out"
    res = subprocess.run([sys.executable, "-P", "-m", "diloco.apps.cli", "run", str(folder / "job.yaml"), "--out", str(out),
                          "--no-live"], capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
