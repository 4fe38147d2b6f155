"""`diloco export`: the syncer's global model Θ as files anyone can load.

Syncer checkpoints hold Θ with the outer optimizer's momentum in our own checksummed format,
one directory per syncer shard, and record no model config. An export is what leaves the job:
`--format hf` writes a Hugging Face directory (apps/export_hf.py) that transformers, vLLM and
lm-eval-harness load; `safetensors` (or `orbax`) writes the flat fp32 tensors named as in the
checkpoint with OUT/config.json holding `spec.model`, `spec.data.source` (the tokenizer) and the
checkpoint's versions, so `diloco sample` needs nothing else (it reads HF directories too).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from diloco.apps import export_hf
from diloco.checkpoint import CheckpointStore, Loaded, params_of
from diloco.core.fragments import owned_by, owner
from diloco.hf import resolve
from diloco.shards import checkpoint_dir
from diloco.spec import DataSource, DecoupledDiLoCoJob, SpecError, TransformerModel, load_job

FORMAT_VERSION = 1
WEIGHTS = {"safetensors": "model.safetensors", "orbax": "orbax"}  # format -> its file or folder under OUT
FORMATS = (*WEIGHTS, "hf")
CONFIG = "config.json"
INFO = ("job", "versions", "outer_steps", "tokens_merged", "checkpoints", "held_out_loss")  # where the model came from
SUMMARY = "summary.json"  # what `diloco run` writes beside OUT/checkpoints (apps/local/report.py)


class ExportError(ValueError):
    """Why nothing was exported or loaded; the message names the fix."""


@dataclass(frozen=True)
class TrainedModel:
    """The global model and what it takes to use it: its config, its tokenizer's source, provenance."""

    model: TransformerModel
    source: DataSource
    params: dict[str, np.ndarray]
    info: dict[str, Any]  # INFO: job, versions, outer_steps, tokens_merged, checkpoints, held_out_loss when known


def job_for(checkpoints: Path, config: str | None) -> DecoupledDiLoCoJob:
    """The job that wrote the checkpoints: the manifest given, else the job.yaml `diloco run`
    writes beside OUT/checkpoints (the checkpoints themselves record no model config)."""
    if config is None:
        beside = checkpoints.parent / "job.yaml"
        if not beside.is_file():
            raise ExportError(f"syncer checkpoints record no model config and there is no {beside}: "
                              "pass --config JOB.yaml, the manifest of the job that wrote them")
        config = str(beside)
    try:
        return resolve(load_job(config))
    except SpecError as exc:
        raise ExportError(f"--config {config}: " + "; ".join(exc.problems)) from None


def check_shapes(cfg: TransformerModel, params: Mapping[str, np.ndarray], where: str) -> None:
    """Refuse tensors that are not exactly spec.model's (another model, or a partial set)."""
    from diloco.trainer.model import parameter_shapes

    expect, got = parameter_shapes(cfg), {k: tuple(v.shape) for k, v in params.items()}
    if got == expect:
        return
    missing, extra = sorted(expect.keys() - got.keys()), sorted(got.keys() - expect.keys())
    wrong = [f"{k} {got[k]} != {expect[k]}" for k in sorted(expect.keys() & got.keys()) if got[k] != expect[k]]
    problems = [f"{label}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                for label, names in (("missing", missing), ("unexpected", extra), ("shape", wrong)) if names]
    raise ExportError(f"{where}: the tensors do not match spec.model ({'; '.join(problems)}); "
                      "give the manifest of the job that trained this model")


def read_checkpoint(job: DecoupledDiLoCoJob, root: Path) -> TrainedModel:
    """Θ from the newest valid checkpoint of every syncer shard under `root` (`root` itself when
    unsharded, `root/shard-<i>` otherwise: how `diloco run` lays them out)."""
    shards, fragments = job.spec.syncer.shards, job.spec.syncer.plan_size
    loads: list[Loaded] = []
    for s in range(shards):
        store = CheckpointStore(checkpoint_dir(str(root), s, shards))
        loaded, skipped = store.load_latest()
        if loaded is None:
            raise _no_checkpoint(root, s, shards, skipped)
        expect = None if shards == 1 else list(owned_by(s, fragments, shards))
        if loaded.meta.get("owned") != expect:
            raise ExportError(f"{loaded.path} holds fragments {loaded.meta.get('owned') or 'all'}, but the job's "
                              f"shard {s} of {shards} owns {expect or 'all'}: spec.syncer.shards differs from the "
                              "job that wrote it; give that job's manifest")
        loads.append(loaded)
    params: dict[str, np.ndarray] = {}
    for loaded in loads:
        params.update(params_of(loaded.arrays))
    check_shapes(job.spec.model, params, str(root))
    versions = [_versions(loaded, fragments) for loaded in loads]
    info = {"job": job.metadata.name, "versions": [versions[owner(p, shards)][p] for p in range(fragments)],
            "outer_steps": sum(_count(loaded, "outer_steps") for loaded in loads),
            # Every learner pushes to every shard, so each shard counts every merged token once.
            "tokens_merged": max(_count(loaded, "tokens_merged") for loaded in loads),
            "checkpoints": [str(loaded.path) for loaded in loads]}
    info |= _held_out_loss(root, loads)
    return TrainedModel(job.spec.model, job.spec.data.source, params, info)


def _held_out_loss(root: Path, loads: list[Loaded]) -> dict[str, Any]:
    """The final held-out loss `diloco run` measured, if it measured it on these very checkpoints
    (its summary.json beside OUT/checkpoints names them): {} when not known."""
    summary = root.parent / SUMMARY
    try:
        found = json.loads(summary.read_text())
        named = sorted((root.parent / p).resolve() for p in found["final_checkpoints"])  # relative to OUT, or absolute
        loss = float(found["final_eval_loss"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if named != sorted(Path(loaded.path).resolve() for loaded in loads) or not np.isfinite(loss):
        return {}
    return {"held_out_loss": loss, "held_out_loss_from": str(summary)}


def _no_checkpoint(root: Path, shard: int, shards: int, skipped: list[str]) -> ExportError:
    corrupt = f" ({len(skipped)} corrupt skipped: {skipped[0]})" if skipped else ""
    if shards == 1:
        return ExportError(f"no valid syncer checkpoint in {root}{corrupt}: pass the directory the syncer checkpoints "
                           "to (`diloco run` writes OUT/checkpoints)")
    where = checkpoint_dir(str(root), shard, shards)
    if CheckpointStore(root).load_latest()[0] is not None:
        return ExportError(f"{root} holds an unsharded syncer's checkpoints and the job has {shards} syncer shards: "
                           "spec.syncer.shards differs from the job that wrote them; give that job's manifest")
    return ExportError(f"shard {shard} of {shards} has no valid checkpoint in {where}{corrupt}: the job's shards are "
                       f"incomplete; put every shard's checkpoints under {root}/shard-<i>, i = 0..{shards - 1}")


def _versions(loaded: Loaded, fragments: int) -> list[int]:
    versions = loaded.meta.get("versions")
    if not isinstance(versions, list) or len(versions) != fragments or not all(isinstance(v, int) for v in versions):
        raise ExportError(f"{loaded.path} does not hold {fragments} fragment versions: spec.syncer.fragments or shards differ "
                          "from the job that wrote it; give that job's manifest")
    return versions


def _count(loaded: Loaded, key: str) -> int:
    value = loaded.meta.get(key, 0)
    if not isinstance(value, int) or value < 0:
        raise ExportError(f"{loaded.path}: its {key} is not a count, so this diloco cannot read it; export it with "
                          "the diloco that wrote it")
    return value


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    try:
        tensors = safetensors.numpy.load_file(path)
    except (OSError, safetensors.SafetensorError) as exc:
        raise ExportError(f"{path} is not a readable safetensors file ({exc}): export the model again") from None
    if any(v.dtype != np.float32 for v in tensors.values()):
        raise ExportError(f"{path} holds tensors that are not fp32, which our exports never write: export the model again")
    return tensors


def _orbax() -> Any:
    """orbax.checkpoint, imported for the orbax format only (its import takes seconds)."""
    import orbax.checkpoint as ocp  # type: ignore[import-untyped]  # orbax ships no type information

    return ocp


def export(trained: TrainedModel, out: Path, fmt: str, force: bool = False, dtype: str = "float32") -> list[str]:
    """Write the weights, then config.json (last: a torn export has none and is refused on load).
    Returns notes for the user."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if dtype != "float32" and fmt != "hf":
        raise ExportError(f"--dtype {dtype}: only --format hf writes another dtype than float32")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory: choose another OUT")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ExportError(f"{out} exists and is not empty: choose a new directory, or pass --force to replace "
                              "the export in it")
        for name in {CONFIG, *WEIGHTS.values(), *export_hf.FILES}:  # only what an export writes: never the user's other files
            target = out / name
            if target.is_dir():
                shutil.rmtree(target)
            else:
                target.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "hf":
        return export_hf.write_hf(trained.model, trained.source, trained.params, out, dtype, trained.info)
    weights = out / WEIGHTS[fmt]
    if fmt == "safetensors":
        safetensors.numpy.save_file({k: np.asarray(v, np.float32) for k, v in trained.params.items()}, weights,
                                    metadata={"format": "diloco", "format_version": str(FORMAT_VERSION)})
    else:
        from flax.traverse_util import unflatten_dict

        tree = unflatten_dict({tuple(k.split("/")): np.asarray(v, np.float32) for k, v in trained.params.items()})
        with _orbax().StandardCheckpointer() as ckpt:
            ckpt.save(weights.absolute(), tree)
    config = {"format": "diloco-export", "format_version": FORMAT_VERSION, "weights": WEIGHTS[fmt],
              **{k: trained.info[k] for k in INFO if k in trained.info},
              "model": trained.model.model_dump(mode="json", by_alias=True),
              "data": {"source": trained.source.model_dump(mode="json", by_alias=True)},
              "parameters": sum(int(v.size) for v in trained.params.values())}
    tmp = out / f".{CONFIG}.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, out / CONFIG)
    return []


def load_export(directory: Path) -> TrainedModel:
    """An exported model, checked against its own config: ours, or a Hugging Face directory of a
    family we train (`--format hf`, or a model from the Hub)."""
    if export_hf.is_hf(directory):
        try:
            cfg, source, params = export_hf.load_hf(directory)
        except ValueError as exc:
            raise ExportError(str(exc)) from None
        return TrainedModel(cfg, source, params, {"job": directory.name})
    try:
        config = json.loads((directory / CONFIG).read_text())
    except FileNotFoundError:
        raise ExportError(f"{directory} has no {CONFIG}: not a finished `diloco export` (export it again, or sample "
                          "a checkpoint with --checkpoint DIR --config JOB.yaml)") from None
    except ValueError as exc:
        raise ExportError(f"{directory / CONFIG} is not JSON ({exc}): export the model again") from None
    if not isinstance(config, dict) or config.get("format") != "diloco-export":
        raise ExportError(f"{directory / CONFIG} is not a diloco export's config: export the model again")
    if config.get("format_version") != FORMAT_VERSION:
        raise ExportError(f"{directory} is export format {config.get('format_version')}, this diloco reads "
                          f"{FORMAT_VERSION}: use the diloco that wrote it, or export again")
    try:
        cfg = TransformerModel.model_validate(config["model"])
        source = DataSource.model_validate(config["data"]["source"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ExportError(f"{directory / CONFIG}: bad model or data config ({exc}): export the model again") from None
    weights = directory / str(config.get("weights"))
    if config.get("weights") == WEIGHTS["orbax"] and weights.is_dir():
        from flax.traverse_util import flatten_dict

        with _orbax().StandardCheckpointer() as ckpt:
            tree = ckpt.restore(weights.absolute())
        params = {k: np.asarray(v, np.float32) for k, v in flatten_dict(tree, sep="/").items()}
    elif config.get("weights") == WEIGHTS["safetensors"] and weights.is_file():
        params = read_safetensors(weights)
    else:
        raise ExportError(f"{directory} lacks its weights ({weights.name}): export the model again")
    check_shapes(cfg, params, str(weights))
    info = {k: config[k] for k in INFO if k in config}
    return TrainedModel(cfg, source, params, info)


def main(args: argparse.Namespace) -> int:
    root = Path(args.checkpoint_dir)
    try:
        trained = read_checkpoint(job_for(root, args.config), root)
        notes = export(trained, Path(args.out), args.format, args.force, args.dtype)
    except ExportError as exc:
        print(f"diloco export: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    info = trained.info
    print(f"exported {info['job']} ({sum(v.size for v in trained.params.values()):,} parameters, outer versions "
          f"{info['versions']}, {info['tokens_merged']:,} tokens merged) to {args.out} as {args.format}")
    return 0
