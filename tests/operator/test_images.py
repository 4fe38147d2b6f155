"""The two images: non-root, stubs generated at build, and each entry point answers --help.

No Docker here, so the entry point is run the way the image runs it: the ENTRYPOINT's own
argv with `--help`, found on PATH where `pip install .` put it (our venv's bin)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


@pytest.mark.parametrize("name, command", [("Dockerfile.learner", "learner"), ("Dockerfile.syncer", "syncer")])
def test_entrypoint_answers_help(name: str, command: str) -> None:
    steps = instructions(ROOT / name)
    entrypoint = json.loads(next(arg for op, arg in steps if op == "ENTRYPOINT"))
    assert entrypoint == ["diloco", command]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run([*entrypoint, "--help"], capture_output=True, text=True, env=env, timeout=120,
                          cwd=ROOT / "tests")
    assert done.returncode == 0, done.stderr
    assert f"usage: diloco {command}" in done.stdout and "--config" in done.stdout


@pytest.mark.parametrize("name", ["Dockerfile.learner", "Dockerfile.syncer"])
def test_image_is_slim_non_root_and_generates_stubs_at_build(name: str) -> None:
    steps = instructions(ROOT / name)
    assert ("ARG", "PYTHON_IMAGE=python:3.11-slim") in steps
    users = [arg for op, arg in steps if op == "USER"]
    assert users and not users[-1].startswith(("root", "0"))
    run = " ".join(arg for op, arg in steps if op == "RUN")
    assert "python -m diloco.wire" in run
    if name == "Dockerfile.learner":
        assert 'pip install ".[learner,cloud]"' in run  # JAX and the rest of training; gs:// and s3:// data
        assert any(op == "ARG" and arg.startswith("JAX_EXTRA") for op, arg in steps)  # CUDA or TPU wheels
    else:
        # The base install and the cloud extra (checkpoints and the standby's lease in object storage): no JAX.
        assert 'pip install ".[cloud]"' in run and "learner" not in run


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests"} <= set(ignored) and "README.md" not in ignored


def test_the_cloud_extra_reads_the_examples_buckets_and_stays_out_of_dev() -> None:
    """gs:// and s3:// (the k8s-gpu and k8s-tpu examples read gs:// data) need gcsfs and s3fs: a
    documented extra both images install, kept out of the test lanes' `dev` install but for s3fs
    (the checkpoint tests reach moto's S3 server with it; gcsfs would pull google-auth for nothing)."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=!~ \[]", req, maxsplit=1)[0] for req in extras["cloud"]}
    assert names == {"gcsfs", "s3fs"}
    assert not [req for req in extras["dev"] if "cloud" in req or req.startswith("gcsfs")]
    assert "gs://" in (ROOT / "examples" / "k8s-tpu.yaml").read_text()
    assert "decoupled-diloco[learner,cloud]" in (ROOT / "docs" / "DATA.md").read_text()
