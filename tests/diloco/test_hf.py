"""Hugging Face in and out (diloco/hf.py, apps/export_hf.py, trainer/models/pretrained.py), checked
against transformers itself: a model transformers made is our Θ₀ with the same logits, and our
export is a model transformers loads with the same logits. Logits agree when their largest
difference is within 1e-4 of their largest magnitude (fp32; measured: about 2e-6).

Models are made here (LlamaConfig + save_pretrained, a BPE tokenizer trained on the built-in
corpus): nothing downloads from a hub.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from diloco import hf
from diloco.apps.export import ExportError, TrainedModel, export, load_export
from diloco.apps.export_hf import byte_tokenizer
from diloco.spec import DataSource, DecoupledDiLoCoJob, SpecError, TransformerModel, parse_job
from diloco.trainer import model
from diloco.trainer.models import pretrained

torch = pytest.importorskip("torch", reason="the `hf` extra (make test installs it)")
transformers = pytest.importorskip("transformers", reason="the `hf` extra (make test installs it)")

VOCAB = 384
RELATIVE = 1e-4


def job_doc(model_fields: dict[str, Any], **source: Any) -> dict[str, Any]:
    return {"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "hf"},
            "spec": {"learnerGroups": [{"name": "a", "replicas": 1}], "model": model_fields,
                     "data": {"source": source}}}


def make_tokenizer(path: Path) -> None:
    """A byte-level BPE of VOCAB ids trained on a few of the built-in corpus's plays."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from diloco.trainer.data import corpus_plays

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([p.decode() for p in corpus_plays()[:3]], trainer)
    tok.save(str(path))


def make_llama(directory: Path, kv_heads: int, tied: bool, seed: int = 0, positions: int = 64) -> Any:
    """A tiny random LlamaForCausalLM, saved as transformers saves it. Its init is wide (0.2) so
    its loss is far from a fresh init's."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, vocab_size=VOCAB, max_position_embeddings=positions, rms_norm_eps=1e-5,
        rope_theta=5000.0, tie_word_embeddings=tied, initializer_range=0.2, bos_token_id=0, eos_token_id=1)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    hf_model.save_pretrained(directory)
    make_tokenizer(directory / "tokenizer.json")
    return hf_model


def hf_logits(hf_model: Any, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return np.asarray(hf_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy())


def our_logits(cfg: TransformerModel, params: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    return np.asarray(model.apply(cfg, {k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(tokens, jnp.int32)))


def assert_close(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= RELATIVE * np.abs(theirs).max(), np.abs(ours - theirs).max()


def batches(vocab: int, n: int = 4, length: int = 32) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, vocab, (2, length)) for _ in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize(("kv_heads", "tied"), [(2, False), (4, True)], ids=["gqa-untied", "tied"])
def test_a_transformers_llama_is_our_theta0_and_our_export_is_it_again(tmp_path: Path, kv_heads: int,
                                                                      tied: bool) -> None:
    src = tmp_path / "src"
    theirs = make_llama(src, kv_heads, tied)
    job = hf.resolve(parse_job(job_doc({"pretrained": str(src), "context": 32})))
    cfg = job.spec.model
    assert (cfg.family, cfg.layers, cfg.d_model, cfg.heads, cfg.kv_heads, cfg.hidden, cfg.tie_embeddings,
            cfg.rope_theta, cfg.epsilon) == ("llama", 2, 32, 4, kv_heads, 64, tied, 5000.0, 1e-5)
    assert job.spec.data.source.encoding == f"{src}/tokenizer.json"  # the model's tokenizer is the job's
    params = pretrained.initial_params(cfg)
    assert ("head/kernel" in params) is not tied
    for tokens in batches(VOCAB):
        assert_close(our_logits(cfg, params, tokens), hf_logits(theirs, tokens))
    # Back to Hugging Face's tensors: exactly the ones transformers saved.
    saved = {k: v.numpy() for k, v in theirs.state_dict().items() if not (tied and k == "lm_head.weight")}
    back = hf.to_hf(cfg, params)
    assert back.keys() == saved.keys()
    for k in saved:
        np.testing.assert_array_equal(back[k], saved[k], err_msg=k)

    trained = {k: v + np.float32(0.01) for k, v in params.items()}  # not Θ₀ any more
    out = tmp_path / "out"
    export(TrainedModel(cfg, job.spec.data.source, trained, {"job": "hf"}), out, "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__ == "LlamaForCausalLM"
    for tokens in batches(VOCAB):
        assert_close(our_logits(cfg, trained, tokens), hf_logits(loaded, tokens))
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "ROMEO: But soft, what light"
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 1  # "</s>" of our tokenizer
    # `diloco sample` reads the HF directory back as the same model.
    again = load_export(out)
    assert again.model.tie_embeddings is tied and again.source.encoding == str(out / "tokenizer.json")
    for k in trained:
        np.testing.assert_array_equal(again.params[k], trained[k], err_msg=k)


@pytest.mark.slow
def test_the_byte_level_gpt_exports_as_gpt2_with_bytes_for_ids(tmp_path: Path) -> None:
    cfg = TransformerModel(layers=2, d_model=32, heads=4, context=32)
    rng = np.random.default_rng(1)
    params = {k: np.asarray(v) + rng.normal(0, 0.3, v.shape).astype(np.float32)
              for k, v in model.init_params(cfg, 0).items()}
    out = tmp_path / "gpt"
    export(TrainedModel(cfg, DataSource(), params, {"job": "gpt"}), out, "hf", dtype="float32")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    for tokens in batches(256):
        assert_close(our_logits(cfg, params, tokens), hf_logits(loaded, tokens))
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("héllo\n").input_ids == list("héllo\n".encode())  # ids are the bytes, as our learners saw them
    again = load_export(out)  # zero biases read back; the model is ours again
    for k in params:
        np.testing.assert_array_equal(again.params[k], params[k], err_msg=k)


@pytest.mark.slow
def test_bfloat16_export_halves_the_weights(tmp_path: Path) -> None:
    cfg = TransformerModel(family="llama", layers=1, d_model=32, heads=4, context=16)
    params = {k: np.asarray(v) for k, v in model.init_params(cfg, 0).items()}
    for dtype in ("float32", "bfloat16"):
        export(TrainedModel(cfg, DataSource(), params, {}), tmp_path / dtype, "hf", dtype=dtype)
    sizes = {d: (tmp_path / d / "model.safetensors").stat().st_size for d in ("float32", "bfloat16")}
    assert sizes["bfloat16"] < 0.51 * sizes["float32"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bfloat16")
    assert loaded.dtype == torch.bfloat16
    with pytest.raises(ExportError, match="only --format hf"):
        export(TrainedModel(cfg, DataSource(), params, {}), tmp_path / "x", "safetensors", dtype="bfloat16")


def test_manifest_fields_that_disagree_with_config_json_are_named(tmp_path: Path) -> None:
    make_llama(tmp_path, kv_heads=2, tied=False)
    with pytest.raises(SpecError) as info:
        hf.resolve(parse_job(job_doc({"pretrained": str(tmp_path), "layers": 3, "kvHeads": 2, "context": 128})))
    problems = info.value.problems
    assert any(p.startswith("spec.model.layers: the manifest says 3") and "num_hidden_layers = 2" in p for p in problems)
    assert any(p.startswith("spec.model.context: 128 is longer than the 64 positions") for p in problems)
    assert not any("kvHeads" in p for p in problems)  # agreeing fields are fine
    # A manifest naming the tokenizer keeps its own.
    own = hf.resolve(parse_job(job_doc({"pretrained": str(tmp_path), "context": 32}, tokenizer="bytes")))
    assert own.spec.data.source.encoding == "bytes"


@pytest.mark.parametrize(("change", "message"), [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope type 'llama3'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "attention_bias true"),
    ({"rope_interleaved": True}, "rope_interleaved true"),
    ({"head_dim": 64}, "head_dim 64"),
    ({"model_type": "mistral"}, "model_type 'mistral' is not a family"),
    ({"hidden_size": "wide"}, "hidden_size is 'wide', not a positive integer"),
])
def test_architectures_we_do_not_compute_are_refused_by_name(change: dict[str, Any], message: str) -> None:
    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "vocab_size": 300, **change}
    with pytest.raises(hf.HFError, match=message):
        hf.architecture(config, "m/config.json")


def test_missing_or_mismatched_weights_are_refused_with_the_tensor_named(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"no config\.json in"):
        hf.resolve(parse_job(job_doc({"pretrained": str(tmp_path / "nowhere")})))
    make_llama(tmp_path, kv_heads=2, tied=False)
    job = hf.resolve(parse_job(job_doc({"pretrained": str(tmp_path), "context": 32})))
    import safetensors.numpy

    tensors = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    good = dict(tensors)
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:, :16]
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(hf.HFError, match=r"model.layers.1.mlp.up_proj.weight' has shape \(64, 16\)"):
        pretrained.initial_params(job.spec.model)
    tensors = {k: v for k, v in good.items() if k != "model.norm.weight"}
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(hf.HFError, match=r"no tensor 'model\.norm\.weight'"):
        pretrained.initial_params(job.spec.model)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(hf.HFError, match=r"has no model\.safetensors"):
        pretrained.initial_params(job.spec.model)


def test_an_unresolved_pretrained_model_has_no_shapes_for_the_operator(tmp_path: Path) -> None:
    from diloco.shapes import parameter_shapes
    from diloco.spec import dump_job

    job = parse_job(job_doc({"pretrained": "gs://bucket/llama", "context": 64}))
    assert parameter_shapes(job.spec.model) is None  # the operator cannot read gs://: checkpointStorage is needed
    # The ConfigMap keeps the manifest's own fields only: the learners read the rest from config.json.
    assert dump_job(job)["spec"]["model"] == {"pretrained": "gs://bucket/llama", "context": 64}
    make_llama(tmp_path, kv_heads=2, tied=False)
    resolved = hf.resolve(parse_job(job_doc({"pretrained": str(tmp_path), "context": 32})))
    again = DecoupledDiLoCoJob.model_validate(dump_job(resolved))
    assert parameter_shapes(again.spec.model) == model.parameter_shapes(resolved.spec.model)
    assert hf.resolve(again) == again.model_copy()  # resolving twice changes nothing


def test_the_byte_tokenizer_maps_every_byte_to_itself() -> None:
    tok = byte_tokenizer()
    every = bytes(range(256)).decode("latin-1")
    assert tok.encode(every).ids == list(every.encode())
    assert tok.decode(list(range(97, 100))) == "abc"


def test_the_operator_carries_a_pretrained_model_through_without_reading_it() -> None:
    """On Kubernetes the model is a volume the learners mount (or a URL they read): the operator
    renders it through without reading config.json, and its ConfigMap leaves the architecture
    for the learners to read."""
    import yaml

    from diloco.operator.admission.checks import problems
    from diloco.operator.render import job as render

    doc = job_doc({"pretrained": "/models/llama", "context": 512})
    doc["spec"]["learnerGroups"][0]["pod"] = {
        "volumes": [{"name": "model", "persistentVolumeClaim": {"claimName": "llama-weights", "readOnly": True}}],
        "volumeMounts": [{"name": "model", "mountPath": "/models/llama", "readOnly": True}]}
    job = parse_job(doc)
    assert any("spec.syncer.checkpointStorage" in p for p in problems(job, gateway_api=False, kueue_enabled=False))
    doc["spec"]["syncer"] = {"checkpointStorage": "20Gi"}
    job = parse_job(doc)
    assert problems(job, gateway_api=False, kueue_enabled=False) == []
    owner = render.Owner("hf", "research", "0f5a1f4e-0000-4000-8000-000000000000")
    children = {(c["kind"], c["metadata"]["name"]): c for c in render.children(job, owner, "t" * 43, started=True,
                                                                                 finished=False)}
    config = next(c for (kind, _), c in children.items() if kind == "ConfigMap")
    shipped = yaml.safe_load(next(iter(config["data"].values())))
    assert shipped["spec"]["model"] == {"pretrained": "/models/llama", "context": 512}
    learners = children[("StatefulSet", "hf-a")]  # group a
    container = learners["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "model", "mountPath": "/models/llama", "readOnly": True} in container["volumeMounts"]
    claim = next(c for (kind, _), c in children.items() if kind == "PersistentVolumeClaim")
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
