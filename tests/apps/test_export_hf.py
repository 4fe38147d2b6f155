"""Continued pre-training as users run it: examples/continue-pretraining.yaml, unchanged, run the
way docs/CHECKPOINTS.md says. A Llama that transformers made, trained a little and saved stands
in for the model it names; it is the Θ₀ of the job (two learners, the syncer, real processes),
which trains it on the built-in corpus tokenized with the model's own tokenizer; `diloco export
--format hf` hands it back, and transformers' logits match ours. About a minute on two cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from diloco import hf
from diloco.apps.export import read_checkpoint
from diloco.spec import load_job
from diloco.trainer import data, model
from tests.diloco.test_hf import assert_close, hf_logits, make_llama, our_logits

torch = pytest.importorskip("torch", reason="the `hf` extra (make test installs it)")
transformers = pytest.importorskip("transformers", reason="the `hf` extra (make test installs it)")

pytestmark = pytest.mark.e2e


ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "continue-pretraining.yaml"


def pretrain(hf_model: Any, directory: Path, steps: int = 80) -> None:
    """A few AdamW steps in torch on the first play, saved again: a model that has learned
    something (a loss far below a fresh init's), as a real starting point has."""
    from tokenizers import Tokenizer

    from diloco.trainer.data import corpus_plays

    ids = np.array(Tokenizer.from_file(str(directory / "tokenizer.json")).encode(corpus_plays()[0].decode()).ids)
    rng = np.random.default_rng(0)
    opt = torch.optim.AdamW(hf_model.parameters(), lr=1e-2)
    hf_model.train()
    for _ in range(steps):
        starts = rng.integers(0, len(ids) - 33, 8)
        batch = torch.tensor(np.stack([ids[s : s + 33] for s in starts]), dtype=torch.long)
        opt.zero_grad()
        hf_model(batch, labels=batch).loss.backward()
        opt.step()
    hf_model.eval()
    hf_model.save_pretrained(directory)


def torch_loss(hf_model: Any, windows: list[np.ndarray]) -> float:
    """transformers' own next-token loss, averaged over the batches as our eval averages them."""
    with torch.no_grad():
        return float(np.mean([hf_model(torch.tensor(w, dtype=torch.long), labels=torch.tensor(w, dtype=torch.long)).loss
                              for w in windows]))


@pytest.mark.parametrize(("kv_heads", "tied"), [(2, False), (4, True)], ids=["gqa-untied", "tied"])
def test_a_transformers_llama_trains_under_diloco_and_goes_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              kv_heads: int, tied: bool) -> None:
    monkeypatch.chdir(tmp_path)  # the example's paths are relative to where it runs
    src = tmp_path / yaml.safe_load(EXAMPLE.read_text())["spec"]["model"]["pretrained"]
    theirs = make_llama(src, kv_heads=kv_heads, tied=tied, positions=2048)
    pretrain(theirs, src)
    out = tmp_path / "runs" / "continue"
    res = subprocess.run([sys.executable, "-P", "-m", "diloco.apps.cli", "run", str(EXAMPLE), "--no-live"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())

    # The learners' first evaluation is of the Hugging Face model, on windows of its tokenizer's ids.
    job = hf.resolve(load_job(str(out / "job.yaml")))
    spec = job.spec
    window = spec.model.context + 1
    held_out = data.load(spec.data, spec.model.vocab_size, window).held_out
    windows = data.eval_batches(held_out, batches=spec.training.eval_batches, batch=spec.training.batch_size, length=window)
    expected = torch_loss(theirs, windows)
    first = min((e for e in events if e["event"] == "joined"), key=lambda e: e["t"])
    assert first["eval_loss"] == pytest.approx(expected, rel=1e-4), (first, expected)
    fresh = model.init_params(spec.model, spec.data.seed)
    fresh_loss = float(np.mean([model.loss_fn(spec.model, fresh, jnp.asarray(w, jnp.int32)) for w in windows]))
    assert fresh_loss > expected + 1.0  # a fresh init would not have passed
    assert summary["initial_eval_loss"] == pytest.approx(expected, rel=1e-4)
    assert summary["final_eval_loss"] < expected - 0.05, summary  # it trained on

    hf_out = tmp_path / "runs" / "continue-hf"  # the commands docs/CHECKPOINTS.md gives
    res = subprocess.run([sys.executable, "-P", "-m", "diloco.apps.cli", "export", "runs/continue/checkpoints",
                          "runs/continue-hf", "--format", "hf"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    trained = read_checkpoint(job, out / "checkpoints")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(hf_out).eval()
    for w in windows:
        assert_close(our_logits(spec.model, trained.params, w[:, :-1]), hf_logits(loaded, w[:, :-1]))
    assert torch_loss(loaded, windows) == pytest.approx(summary["final_eval_loss"], abs=0.05)
    # The model's own tokenizer went with it, and text generation runs.
    tok = transformers.AutoTokenizer.from_pretrained(hf_out)
    ids = loaded.generate(**tok("ROMEO:", return_tensors="pt"), max_new_tokens=8, do_sample=False)
    assert ids.shape[1] > len(tok("ROMEO:").input_ids)
