"""`diloco export` and `diloco sample`: the exported model is the checkpoint's, bit for bit (its
held-out loss is equal), sampling is deterministic, and every refusal names its fix."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from diloco.apps import cli
from diloco.apps.export import ExportError, TrainedModel, export, job_for, load_export, read_checkpoint
from diloco.apps.sample import ByteTokenizer, generate, sample_text, summary_sample, tokenizer_for
from diloco.checkpoint import CheckpointStore
from diloco.core.fragments import owned_by
from diloco.spec import DataSource, DecoupledDiLoCoJob, TransformerModel
from diloco.syncer.global_model import GlobalModel
from diloco.trainer.data import eval_batches
from diloco.trainer.model import init_params, loss_fn

MODEL = {"layers": 1, "dModel": 16, "heads": 2, "context": 16}


def manifest(shards: int = 1, **model: Any) -> dict[str, Any]:
    return {"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "tiny"},
            "spec": {"learnerGroups": [{"name": "g", "region": "r", "replicas": 2}],
                     "syncer": {"fragments": 2, "shards": shards}, "model": {**MODEL, **model}}}


@functools.lru_cache(maxsize=4)
def initial(cfg: TransformerModel) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in init_params(cfg, 0).items()}


def trained_params(cfg: TransformerModel) -> dict[str, np.ndarray]:
    """The init plus noise: not what a fresh syncer would hold."""
    rng = np.random.default_rng(1)
    return {k: v + rng.normal(0, 0.3, v.shape).astype(np.float32) for k, v in initial(cfg).items()}


def write_job(tmp_path: Path, shards: int = 1, **model: Any) -> tuple[DecoupledDiLoCoJob, Path, dict[str, np.ndarray]]:
    """A job's manifest and its syncer checkpoints (one per shard), written as the syncer writes them."""
    doc = manifest(shards, **model)
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    job = DecoupledDiLoCoJob.model_validate(doc)
    params, root = trained_params(job.spec.model), tmp_path / "checkpoints"
    for s in range(shards):
        plan_size = job.spec.syncer.plan_size  # 2 fragments a shard
        model_s = GlobalModel.fresh(job.spec.syncer, params, owned_by(s, plan_size, shards) if shards > 1 else None)
        model_s.versions[:] = [3 + 2 * p for p in range(plan_size)]
        model_s.tokens_merged, model_s.outer_steps = 4096, 4
        CheckpointStore(root if shards == 1 else root / f"shard-{s}").save(*model_s.state())
    return job, root, params


LOSS = jax.jit(loss_fn, static_argnums=0)  # compiled once per model config


def held_out_loss(cfg: TransformerModel, params: dict[str, np.ndarray]) -> float:
    held_out = np.frombuffer(b"ROMEO: But soft, what light through yonder window breaks? " * 8, np.uint8)
    p = {k: jnp.asarray(v) for k, v in params.items()}
    return float(np.mean([float(LOSS(cfg, p, jnp.asarray(b))) for b in eval_batches(held_out, batches=3, batch=4, length=cfg.context + 1)]))


@pytest.mark.parametrize("fmt", ["safetensors", "orbax"])
@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.slow
def test_export_round_trips(tmp_path: Path, fmt: str, shards: int) -> None:
    job, root, params = write_job(tmp_path, shards)
    trained = read_checkpoint(job_for(root, None), root)  # the job.yaml beside the checkpoints
    export(trained, tmp_path / "out", fmt)
    loaded = load_export(tmp_path / "out")
    assert loaded.model == job.spec.model and loaded.source == job.spec.data.source
    assert set(loaded.params) == set(params)
    assert all(loaded.params[k].dtype == np.float32 and np.array_equal(loaded.params[k], params[k]) for k in params)
    assert held_out_loss(loaded.model, loaded.params) == held_out_loss(job.spec.model, trained.params)
    assert held_out_loss(job.spec.model, params) != held_out_loss(job.spec.model, initial(job.spec.model))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["format_version"] == 1 and config["model"]["dModel"] == 16
    assert (config["versions"], config["tokens_merged"], config["outer_steps"]) == ([3 + 2 * p for p in range(2 * shards)], 4096, 4 * shards)


def test_safetensors_loads_with_the_reference_library(tmp_path: Path) -> None:
    import safetensors.numpy as numpy_loader
    job, root, params = write_job(tmp_path)
    export(read_checkpoint(job, root), tmp_path / "out", "safetensors")
    got = numpy_loader.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(got) == set(params) and all(np.array_equal(got[k], params[k]) for k in params)


def test_cli_export_then_sample(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_job(tmp_path)
    out = tmp_path / "out"
    assert cli.main(["export", str(tmp_path / "checkpoints"), str(out), "--config", str(tmp_path / "job.yaml")]) == 0
    assert "exported tiny" in capsys.readouterr().out
    assert cli.main(["sample", str(out), "--prompt", "ROMEO:", "--tokens", "12"]) == 0
    from_export = capsys.readouterr().out
    assert cli.main(["sample", "--checkpoint", str(tmp_path / "checkpoints"), "--prompt", "ROMEO:", "--tokens", "12"]) == 0
    assert capsys.readouterr().out == from_export and from_export.startswith("ROMEO:")


def test_refusals_name_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    job, root, _ = write_job(tmp_path / "job")
    with pytest.raises(ExportError, match=r"no valid syncer checkpoint in .*`diloco run` writes OUT/checkpoints"):
        read_checkpoint(job, empty)
    with pytest.raises(ExportError, match=r"record no model config .* pass --config JOB.yaml"):
        job_for(empty, None)
    assert cli.main(["export", str(empty), str(tmp_path / "o"), "--config", str(tmp_path / "job" / "job.yaml")]) == 2
    assert "no valid syncer checkpoint" in capsys.readouterr().err

    newest = sorted(root.glob("ckpt-*.ddck"))[-1]
    newest.write_bytes(newest.read_bytes()[:-1] + b"x")
    with pytest.raises(ExportError, match=r"1 corrupt skipped: .*checksum"):
        read_checkpoint(job, root)

    bigger = tmp_path / "bigger.yaml"
    bigger.write_text(yaml.safe_dump(manifest(dModel=32)))
    job2, root2, _ = write_job(tmp_path / "job2")
    with pytest.raises(ExportError, match=r"do not match spec.model \(shape: embed/embedding"):
        read_checkpoint(job_for(root2, str(bigger)), root2)

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"not empty: choose a new directory, or pass --force"):
        export(read_checkpoint(job2, root2), out, "safetensors")
    export(read_checkpoint(job2, root2), out, "orbax", force=True)
    export(read_checkpoint(job2, root2), out, "safetensors", force=True)  # replaces the orbax export
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    (out / "model.safetensors").unlink()
    with pytest.raises(ExportError, match=r"lacks its weights"):
        load_export(out)
    with pytest.raises(ExportError, match=r"no config.json: not a finished `diloco export`"):
        load_export(empty)


def test_incomplete_or_mismatched_shards_are_refused(tmp_path: Path) -> None:
    job, root, _ = write_job(tmp_path, shards=2)
    unsharded = DecoupledDiLoCoJob.model_validate(manifest(shards=1))
    with pytest.raises(ExportError, match=r"no valid syncer checkpoint"):
        read_checkpoint(unsharded, root)  # an unsharded job reads the root itself
    with pytest.raises(ExportError, match=r"holds fragments \[0, 2\], but the job's shard 0 of 1 owns all"):
        read_checkpoint(unsharded, root / "shard-0")
    sharded = DecoupledDiLoCoJob.model_validate(manifest(shards=2))
    with pytest.raises(ExportError, match=r"holds an unsharded syncer's checkpoints and the job has 2 syncer shards"):
        read_checkpoint(sharded, write_job(tmp_path / "one")[1])
    for f in (root / "shard-1").iterdir():
        f.unlink()
    with pytest.raises(ExportError, match=r"shard 1 of 2 has no valid checkpoint .* shards are incomplete"):
        read_checkpoint(job, root)


def test_sampling_is_deterministic_and_as_long_as_asked(tmp_path: Path) -> None:
    job, root, params = write_job(tmp_path)
    cfg, prompt = job.spec.model, list(b"ROMEO:")
    greedy = generate(cfg, params, prompt, 40)
    assert len(greedy) == 40 and greedy == generate(cfg, params, prompt, 40)
    hot = generate(cfg, params, prompt, 40, temperature=1.5, seed=7)
    assert len(hot) == 40 and hot == generate(cfg, params, prompt, 40, temperature=1.5, seed=7)
    assert hot != generate(cfg, params, prompt, 40, temperature=1.5, seed=8) and hot != greedy
    # Past the context the window slides: still one token per call.
    assert len(generate(cfg, params, prompt, 3 * cfg.context)) == 3 * cfg.context
    text = sample_text(read_checkpoint(job, root), ByteTokenizer(), "ROMEO:", 20)
    assert text.startswith("ROMEO:") and text == ByteTokenizer().decode(prompt + greedy[:20])
    with pytest.raises(ExportError, match=r"non-empty --prompt"):
        generate(cfg, params, [], 5)
    with pytest.raises(ExportError, match=r"outside the model's vocabulary of 256: .* pass --tokenizer"):
        generate(cfg, params, [300], 5)


def test_summary_sample_never_fails(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    job, _, params = write_job(tmp_path)
    cfg, source = job.spec.model, job.spec.data.source
    text = summary_sample(cfg, source, params)
    assert text is not None and text.startswith("ROMEO:") and len(text.encode()) >= 200
    assert summary_sample(cfg, source, {k: v for k, v in params.items() if k != "head/kernel"}) is None
    assert "no sample in the summary" in caplog.text


@pytest.mark.slow
def test_tokenizers(tmp_path: Path) -> None:
    import tokenizers
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(["but soft what light through yonder window breaks"] * 4,
                            tokenizers.trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = TransformerModel.model_validate({**MODEL, "vocabSize": 64})
    source = DataSource(kind="text", path=str(tmp_path / "*.txt"), tokenizer=str(tmp_path / "tokenizer.json"))
    trained = TrainedModel(cfg, source, trained_params(cfg), {})
    words = sample_text(trained, tokenizer_for(cfg, source), "soft light", 8)
    assert words.startswith("soft light") and words == sample_text(trained, tokenizer_for(cfg, source), "soft light", 8)
    with pytest.raises(ExportError, match=r"pass --tokenizer tokenizer.json"):
        tokenizer_for(cfg.model_copy(update={"vocab_size": 1000}), DataSource(kind="tokens", path="/data/*.bin"))
