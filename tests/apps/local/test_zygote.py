"""The learners' zygote (apps/local/zygote.py): forked commands behave as started ones do:
their own output and exit code, their own process group, our children (the runner reaps and
signals them), and a zygote that dies leaves the runner starting learners without it."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from diloco.apps.local.procs import Child, Supervisor
from diloco.apps.local.zygote import Forked, Zygote, become_subreaper
from diloco.contract import Exit, diloco_argv

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER is Linux's")


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    assert become_subreaper()
    env = dict(os.environ, PYTHONUNBUFFERED="1", DILOCO_TOKEN="0123456789abcdef0123")
    z = Zygote(env, tmp_path_factory.mktemp("zygote") / "zygote.log")
    yield z
    z.close()


def spawn(zygote: Zygote, args: list[str], tmp_path: Path) -> tuple[Forked, Path, Path]:
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "wb") as o, open(err, "wb") as e:
        return zygote.spawn(diloco_argv(args[0], args[1:]), o.fileno(), e.fileno()), out, err


@pytest.mark.slow
def test_a_forked_command_has_its_own_output_and_exit_code(zygote: Zygote, tmp_path: Path) -> None:
    good, out, _ = spawn(zygote, ["validate", str(ROOT / "examples" / "chaos.yaml")], tmp_path)
    assert good.wait(60) == 0
    assert "valid DecoupledDiLoCoJob 'chaos'" in out.read_text()
    assert zygote.ready is not None and zygote.ready["ready"] is True  # preloaded, no JAX backend started
    bad_file = tmp_path / "bad.yaml"
    bad_file.write_text("kind: x\n")
    bad, _, err = spawn(zygote, ["validate", str(bad_file)], tmp_path)
    assert bad.wait(60) == Exit.CONFIG
    assert "spec: Field required" in err.read_text()
    with pytest.raises(ValueError, match="not a diloco command line"):
        zygote.spawn(["sleep", "1"], 1, 2)


def test_a_forked_learner_is_our_child_in_its_own_session_and_dies_by_signal(zygote: Zygote, tmp_path: Path) -> None:
    # A learner with no syncer to join keeps retrying: alive until we kill its process group.
    config = tmp_path / "job.yaml"
    config.write_text((ROOT / "examples" / "chaos.yaml").read_text())
    learner, _, _ = spawn(zygote, ["learner", "--config", str(config), "--group", "local", "--index", "0",
                                   "--syncer", "127.0.0.1:9"], tmp_path)
    assert learner.poll() is None
    stat = Path(f"/proc/{learner.pid}/stat").read_text().rsplit(")", 1)[1].split()
    assert int(stat[1]) == os.getpid()  # reparented to us, the subreaper
    assert int(stat[3]) == learner.pid  # its own session and process group
    os.killpg(learner.pid, signal.SIGKILL)
    assert learner.wait(30) == -signal.SIGKILL


@pytest.mark.slow
def test_the_supervisor_starts_learners_without_a_zygote_that_died(tmp_path: Path) -> None:
    sup = Supervisor(dict(os.environ), zygote_log=tmp_path / "zygote.log")
    assert sup.zygote_log is not None
    sup.add(Child("local-0", "learner", diloco_argv("validate", [str(ROOT / "examples" / "chaos.yaml")]),
                  tmp_path / "local-0.log"))
    sup.start("local-0")  # forked
    forked = sup.children["local-0"].proc
    assert isinstance(forked, Forked) and forked.wait(60) == 0
    (zygote,) = sup.zygotes.values()
    zygote.proc.kill()
    zygote.proc.wait()
    time.sleep(0.1)
    sup.start("local-0")  # the zygote is gone: reported, then a plain start
    proc = sup.children["local-0"].proc
    assert proc is not None and not isinstance(proc, Forked) and proc.wait(60) == 0
    assert sup.zygote_log is None and not sup.zygotes
    sup.close()
