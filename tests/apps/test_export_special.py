"""An hf export's special tokens and model card (apps/export_hf.py): the byte-level model's
end-of-text token is id 255 (a byte UTF-8 never holds), named in its tokenizer, config.json and
generation_config.json, so transformers' generate and `diloco sample` both stop at it by
themselves; a continued Hugging Face model keeps its own special tokens; README.md names the
figures the checkpoint holds, and the held-out loss `diloco run` measured on these very
checkpoints."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from diloco import hf
from diloco.apps import cli
from diloco.apps.export import TrainedModel, export, job_for, read_checkpoint
from diloco.apps.sample import ByteTokenizer, generate, sample_text, tokenizer_for
from diloco.spec import DataSource, TransformerModel, parse_job
from diloco.trainer import model
from diloco.trainer.models import pretrained
from tests.apps.test_export import write_job

torch = pytest.importorskip("torch", reason="the `hf` extra (make test installs it)")
transformers = pytest.importorskip("transformers", reason="the `hf` extra (make test installs it)")

EOT = hf.BYTE_END_OF_TEXT
STOP_AT = 8  # the crafted model emits "a" at positions before this one, end-of-text from it on


def stopping_model() -> tuple[TransformerModel, dict[str, np.ndarray]]:
    """A gpt whose blocks add nothing and whose output depends only on the position: "a" at
    positions before STOP_AT, the end-of-text id from there on, so a generation that stops at it
    stops after a known number of bytes."""
    cfg = TransformerModel(layers=1, d_model=16, heads=2, context=32)
    params = {k: np.zeros_like(np.asarray(v)) for k, v in model.init_params(cfg, 0).items()}
    early, late = np.zeros(16, np.float32), np.zeros(16, np.float32)
    early[:2], late[2:4] = (1.0, -1.0), (1.0, -1.0)  # zero-mean: LayerNorm keeps their direction
    params["pos_embed/embedding"][:STOP_AT] = early
    params["pos_embed/embedding"][STOP_AT:] = late
    for name in ("ln_f/scale", "layers_0/ln1/scale", "layers_0/ln2/scale"):
        params[name][:] = 1.0
    params["head/kernel"][:, ord("a")] = early
    params["head/kernel"][:, EOT] = late
    return cfg, params


@pytest.mark.slow
def test_generation_stops_at_the_byte_level_end_of_text_by_itself(tmp_path: Path) -> None:
    cfg, params = stopping_model()
    out = tmp_path / "hf"
    export(TrainedModel(cfg, DataSource(), params, {"job": "stop"}), out, "hf")
    config, generation = (json.loads((out / name).read_text()) for name in ("config.json", "generation_config.json"))
    assert (config["bos_token_id"], config["eos_token_id"]) == (EOT, EOT) == (generation["bos_token_id"], generation["eos_token_id"])
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id, len(tok)) == ("<|endoftext|>", EOT, EOT, 256)
    assert tok("ROM").input_ids == list(b"ROM")  # no special token added: ids are the bytes, as trained
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = loaded.generate(**tok("ROM", return_tensors="pt"), max_new_tokens=20, do_sample=False)[0].tolist()
    assert ids == [*b"ROM", *b"a" * (STOP_AT - 2), EOT]  # no eos passed: the generation config's
    assert tok.decode(ids, skip_special_tokens=True) == "ROMaaaaaa"
    # Ours stops at the same token, from the checkpoint's parameters and from the export alike.
    assert generate(cfg, params, list(b"ROM"), 20, stop=EOT) == list(b"a" * (STOP_AT - 2))
    assert sample_text(TrainedModel(cfg, DataSource(), params, {}), ByteTokenizer(), "ROM", 20) == "ROMaaaaaa"
    from diloco.apps.export import load_export

    again = load_export(out)
    assert sample_text(again, tokenizer_for(again.model, again.source), "ROM", 20) == "ROMaaaaaa"
    assert len(generate(cfg, params, list(b"ROM"), 20)) == 20  # without `stop`, as many as asked


def test_the_byte_tokenizer_keeps_255_for_end_of_text() -> None:
    from diloco.apps.export_hf import byte_tokenizer

    tok = byte_tokenizer()
    assert tok.get_vocab_size() == 256 and tok.token_to_id("<|endoftext|>") == EOT
    text = "naïve café, ÿ <|endoftext|>x"  # ÿ is U+00FF: the bytes C3 BF, never 0xFF
    assert tok.encode(text).ids == [*"naïve café, ÿ ".encode(), EOT, ord("x")]
    assert tok.decode([*b"ab", EOT, *b"c"], skip_special_tokens=False) == "ab<|endoftext|>c"
    assert tok.decode([*b"ab", EOT, *b"c"]) == "abc"
    assert ByteTokenizer().decode([*b"ab", EOT, *b"c"]) == "abc"


@pytest.mark.slow
def test_a_continued_model_keeps_its_own_special_tokens(tmp_path: Path) -> None:
    from tests.diloco.test_hf import job_doc, make_llama

    src = tmp_path / "src"
    make_llama(src, kv_heads=2, tied=False)
    own = json.loads((src / "config.json").read_text())
    own |= {"eos_token_id": [1, 2], "pad_token_id": 2}  # as chat models name several
    (src / "config.json").write_text(json.dumps(own))
    (src / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 2],
                                                            "temperature": 0.7, "do_sample": True}))
    job = hf.resolve(parse_job(job_doc({"pretrained": str(src), "context": 32})))
    out = tmp_path / "out"
    export(TrainedModel(job.spec.model, job.spec.data.source, pretrained.initial_params(job.spec.model), {"job": "c"}),
           out, "hf")
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, [1, 2], 2)
    assert json.loads((out / "generation_config.json").read_text()) == json.loads((src / "generation_config.json").read_text())
    assert transformers.AutoTokenizer.from_pretrained(out).eos_token == "</s>"  # the tokenizer's own name
    card = (out / "README.md").read_text()
    assert f"started from | `{src}` (spec.model.pretrained)" in card and "eos [1, 2]" in card


@pytest.mark.slow
def test_the_model_card_names_what_the_checkpoint_holds(tmp_path: Path) -> None:
    _, root, params = write_job(tmp_path)  # versions [3, 5], 4 outer steps, 4,096 tokens merged
    out = tmp_path / "hf"
    assert cli.main(["export", str(root), str(out), "--format", "hf"]) == 0
    card = (out / "README.md").read_text()
    n = sum(v.size for v in params.values())
    for figure in ("# tiny", "| job | `tiny` |", "GPT2LMHeadModel (family `gpt`): 1 layer, d_model 16, 2 heads, MLP 64, "
                   "context 16, vocabulary 256", f"| parameters | {n:,} (float32) |", "| tokens merged | 4,096 |",
                   "| outer steps | 4 |", "| outer versions | [3, 5] (one per fragment; 8 in all) |",
                   "| data | builtin: 38 Shakespeare plays", "| held-out loss | not known for this checkpoint",
                   "ckpt-", "| special tokens | bos 255, eos 255 |",
                   f'AutoModelForCausalLM.from_pretrained("{out}")',
                   f"lm_eval --model hf --model_args pretrained={out} --tasks TASK --device cpu"):
        assert figure in card, figure
    assert transformers.AutoModelForCausalLM.from_pretrained(out) is not None  # the card is no obstacle

    # The held-out loss `diloco run` measured on these very checkpoints (its summary.json names them).
    trained = read_checkpoint(job_for(root, None), root)
    rel = [str(Path(p).relative_to(tmp_path)) for p in trained.info["checkpoints"]]
    (tmp_path / "summary.json").write_text(json.dumps({"final_eval_loss": 2.0794, "final_checkpoints": rel}))
    assert cli.main(["export", str(root), str(out), "--format", "hf", "--force"]) == 0
    card = (out / "README.md").read_text()
    assert f"| held-out loss | 2.0794 nats per token ({2.0794 / math.log(2):.3f} bits per byte)" in card
    # ... and not for other checkpoints than those.
    (tmp_path / "summary.json").write_text(json.dumps({"final_eval_loss": 2.0794, "final_checkpoints": ["checkpoints/x"]}))
    assert "held_out_loss" not in read_checkpoint(job_for(root, None), root).info
