"""End to end, issue 12's learners: every new example trains under `diloco run` (shortened), and
a learner of two hosts survives losing one of them.

Each run is 30-70 s on two cores. The text and tokens examples read files these tests write.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from diloco.trainer import data

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def example(name: str, steps: int, **training: Any) -> dict[str, Any]:
    m = yaml.safe_load((ROOT / "examples" / name).read_text())
    tr = m["spec"]["training"]
    tr.pop("durationSeconds", None)
    tr.update(steps=steps, evalIntervalSteps=steps, **training)
    m["spec"]["syncer"]["checkpointIntervalSeconds"] = 5
    return m


def start(tmp_path: Path, m: dict[str, Any]) -> tuple[subprocess.Popen[str], Path]:
    path, out = tmp_path / "job.yaml", tmp_path / "out"
    path.write_text(yaml.safe_dump(m))
    proc = subprocess.Popen([sys.executable, "-P", "-m", "diloco.apps.cli", "run", str(path), "--out", str(out), "--no-live"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    return proc, out


def finish(proc: subprocess.Popen[str], out: Path, timeout: float = 240) -> dict[str, Any]:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    assert summary.get("failure") is None, summary
    return summary


def events(out: Path) -> list[dict[str, Any]]:
    path = out / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def write_text_data(where: Path) -> None:
    """Twelve plays of the built-in corpus as text files (the data the text example expects)."""
    where.mkdir(parents=True)
    corpus = bytes(data.corpus_bytes())
    plays = corpus.split(b"\n# ")[:12]
    for i, play in enumerate(plays):
        (where / f"play-{i:02d}.txt").write_bytes(play)


@pytest.mark.parametrize("name", ["llama.yaml", "text.yaml", "tokens.yaml"])
def test_an_example_trains(tmp_path: Path, name: str) -> None:
    if name != "llama.yaml":
        write_text_data(tmp_path / "runs" / "data" / "text")
    if name == "tokens.yaml":
        subprocess.run([sys.executable, "-P", "-m", "diloco.apps.cli", "prepare-tokens", "runs/data/text/*.txt",
                        "--out", "runs/data/tokens"], cwd=tmp_path, check=True, capture_output=True, timeout=120)
    summary = finish(*start(tmp_path, example(name, steps=120)))
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 1.5, summary  # ~5.5 -> below 4
    assert summary["tokens_trained"] == summary["tokens_merged"] > 0, summary


def test_a_learner_of_two_hosts_trains_and_restarts_whole_when_one_host_is_killed(tmp_path: Path) -> None:
    m = example("multihost.yaml", steps=160)
    m["spec"]["learnerGroups"][0]["replicas"] = 1  # one learner of two hosts: two processes on two cores
    m["spec"]["chaos"] = {"restartDelaySeconds": 1}
    proc, out = start(tmp_path, m)
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:  # wait until it trains, then kill host 1 only
            seen = events(out)
            spawned = [e for e in seen if e["event"] == "spawned"]
            steps = [e["step"] for e in seen if e["event"] == "progress"]
            if spawned and steps and max(steps) >= 30:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the two-host learner did not train: {[e['event'] for e in events(out)][-20:]}")
        host1 = spawned[0]["pids"][1]
        os.kill(host1, signal.SIGKILL)
        summary = finish(proc, out)
    finally:
        if proc.poll() is None:
            proc.kill()
    seen = events(out)
    exited = [e for e in seen if e["event"] == "exited" and e["target"] == "local-0"]
    assert exited and exited[0]["returncode"] != 0, exited  # host 0 did not go on alone: the learner ended
    joins = [e for e in seen if e["event"] == "joined" and e.get("source") == "local-0"]
    assert [j["restart"] for j in joins][:2] == [0, 1], joins  # re-admitted as a whole
    assert joins[1]["batch"] > 0, joins[1]  # its data resumed after what the syncer had merged
    assert summary["readmissions"] >= 1, summary
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 1.5, summary
