"""lm-eval-harness on a fresh `diloco export --format hf`, as docs/CHECKPOINTS.md runs it: the
`lm_eval` command with `--model hf --model_args pretrained=EXPORT` and nothing else, three local
tasks of each kind lm-eval has (multiple choice, rolling log-likelihood, generation) written here
with their data (JSON Lines; no hub: HF_HUB_OFFLINE, HF_DATASETS_OFFLINE). Every log-likelihood it
reports is our own model's on the same ids (JAX, the checkpoint's parameters), and every greedy
generation ours, stopped at the same end-of-text token. About 20 s on two cores, most of it
lm-eval's start-up."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco import hf
from diloco.apps import cli
from diloco.apps.export import job_for, read_checkpoint
from diloco.apps.sample import generate
from diloco.spec import TransformerModel
from diloco.trainer import model
from tests.apps.test_export import write_job

pytest.importorskip("lm_eval", reason="lm-eval-harness (the dev extra installs lm-eval[hf])")
transformers = pytest.importorskip("transformers", reason="the `hf` extra (make test installs it)")

pytestmark = pytest.mark.slow

EOT = hf.BYTE_END_OF_TEXT
MC = [{"question": "ROMEO: But soft, what light through yonder", "choices": ["window breaks?", "door opens?", "sky falls?"],
       "answer": 0},
      {"question": "To be, or not to be, that is the", "choices": ["question", "answer", "problem"], "answer": 0},
      {"question": "", "choices": ["Now is the winter", "Xq zzv kkp"], "answer": 0}]  # no context: lm-eval's prefix
PPL = [{"text": "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him. "
                "The evil that men do lives after them; the good is oft interred with their bones."},  # > 2 windows
       {"text": "Shall I compare thee to a summer's day?"}]
GEN = [{"prompt": "KING HENRY:\n", "target": "Once more unto the breach"},
       {"prompt": "JULIET:\nO Romeo, ", "target": "Romeo"}]
UNTIL, MAX_GEN = "\n\n", 24


def write_tasks(folder: Path) -> None:
    """A task YAML of each kind and its data, as docs/CHECKPOINTS.md writes them."""
    folder.mkdir()
    for name, rows in (("mc", MC), ("ppl", PPL), ("gen", GEN)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def head(name: str) -> str:
        return (f"task: diloco_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                f"    test: {folder / (name + '.jsonl')}\ntest_split: test\n")

    (folder / "mc.yaml").write_text(head("mc") + 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
                                    'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
                                    "metric_list:\n  - metric: acc\n")
    (folder / "ppl.yaml").write_text(head("ppl") + 'output_type: loglikelihood_rolling\ndoc_to_text: ""\n'
                                     'doc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n'
                                     "  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    (folder / "gen.yaml").write_text(head("gen") + 'output_type: generate_until\ndoc_to_text: "{{prompt}}"\n'
                                     f'doc_to_target: "{{{{target}}}}"\ngeneration_kwargs:\n  until: [{json.dumps(UNTIL)}]\n'
                                     f"  max_gen_toks: {MAX_GEN}\n  do_sample: false\n"
                                     "metric_list:\n  - metric: exact_match\n")


class Ours:
    """Our model's log-probabilities of byte ids (JAX, fp32)."""

    def __init__(self, cfg: TransformerModel, params: dict[str, np.ndarray]) -> None:
        self.cfg, self.params = cfg, {k: jnp.asarray(v) for k, v in params.items()}
        self.logp = jax.jit(lambda p, t: jax.nn.log_softmax(model.apply(cfg, p, t).astype(jnp.float32), axis=-1))

    def score(self, inputs: list[int], targets: list[int]) -> float:
        """Σ log p(targets) where the targets are the ids after the last len(targets) inputs."""
        logp = np.asarray(self.logp(self.params, jnp.asarray([inputs], jnp.int32)))[0]
        return float(sum(logp[len(inputs) - len(targets) + i, t] for i, t in enumerate(targets)))

    def loglikelihood(self, context: str, continuation: str) -> float:
        ctx, cont = list(context.encode()) or [EOT], list(continuation.encode())  # no context: the prefix, 255
        return self.score((ctx + cont)[:-1], cont)

    def rolling(self, text: str) -> float:
        """Every byte scored once, with as much before it as the context holds (the first after the
        prefix): lm-eval's disjoint rolling windows, written out."""
        ids, n, total = list(text.encode()), self.cfg.context, 0.0
        first = min(n, len(ids))
        total += self.score([EOT] + ids[: first - 1], ids[:first])
        done = first
        while done < len(ids):
            k = min(len(ids) - done, n)
            end = done + k
            total += self.score(ids[end - n - 1 : end - 1], ids[end - k : end])
            done = end
        return total


def test_lm_eval_runs_each_kind_of_task_on_a_fresh_export_with_our_log_likelihoods(tmp_path: Path) -> None:
    _, root, _ = write_job(tmp_path / "job", context=64)
    export = tmp_path / "export"
    assert cli.main(["export", str(root), str(export), "--format", "hf"]) == 0
    trained = read_checkpoint(job_for(root, None), root)
    write_tasks(tmp_path / "tasks")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"),
           "TOKENIZERS_PARALLELISM": "false"}
    lm_eval = Path(sys.executable).parent / "lm_eval"
    done = subprocess.run([str(lm_eval), "--model", "hf", "--model_args", f"pretrained={export}", "--tasks",
                           "diloco_mc,diloco_ppl,diloco_gen", "--include_path", str(tmp_path / "tasks"), "--device", "cpu",
                           "--log_samples", "--output_path", str(tmp_path / "results")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (results,) = (tmp_path / "results").rglob("results_*.json")
    metrics = json.loads(results.read_text())["results"]

    def samples(task: str) -> list[dict[str, Any]]:
        (path,) = (tmp_path / "results").rglob(f"samples_{task}_*.jsonl")
        return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])

    ours = Ours(trained.model, trained.params)
    right = 0
    for doc, sample in zip(MC, samples("diloco_mc")):
        theirs = [float(r[0][0]) for r in sample["resps"]]
        mine = [ours.loglikelihood(doc["question"], " " + choice) for choice in doc["choices"]]
        assert theirs == pytest.approx(mine, rel=1e-4, abs=1e-3), (doc, theirs, mine)
        right += int(np.argmax(mine) == doc["answer"])
    assert metrics["diloco_mc"]["acc,none"] == pytest.approx(right / len(MC))

    theirs = [float(s["resps"][0][0]) for s in samples("diloco_ppl")]
    mine = [ours.rolling(doc["text"]) for doc in PPL]
    assert theirs == pytest.approx(mine, rel=1e-4, abs=1e-3), (theirs, mine)
    bits = -sum(mine) / sum(len(d["text"].encode()) for d in PPL) / math.log(2)
    assert metrics["diloco_ppl"]["bits_per_byte,none"] == pytest.approx(bits, rel=1e-4)

    tok = transformers.AutoTokenizer.from_pretrained(export)
    for doc, sample in zip(GEN, samples("diloco_gen")):
        made = generate(trained.model, trained.params, list(doc["prompt"].encode()), MAX_GEN, stop=EOT)
        assert sample["resps"][0][0] == tok.decode(made, skip_special_tokens=True).split(UNTIL)[0], (doc, made)
