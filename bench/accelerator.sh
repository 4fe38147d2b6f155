#!/usr/bin/env bash
# The first accelerator, one command: the learner on a live syncer against its plain loop, and
# MFU, for llama-125m and llama-350m in bf16 on every device the machine has (bench/learner.py:
# the two take turns on the same devices, so a shared machine's drift hits both), printed as one
# JSON line. About four minutes on one GPU (two compiles and 2 x 3 turns of 4 s per model).
#
#   bash bench/accelerator.sh              # on the accelerator's machine
#   bash bench/accelerator.sh --dry-run    # anywhere: llama-tiny on the CPU, seconds (CI runs it)
#
# Python: $PYTHON (default python3) with JAX for the accelerator (CUDA JAX from PyPI: pip install
# 'jax[cuda12]'; TPU: 'jax[tpu]'). The package is installed from this checkout without its
# dependencies; any that the machine lacks and cannot download can wait as wheels in .whl/
# (docs/BENCHMARKS.md, "The first accelerator", says which).
set -euo pipefail
cd "$(dirname "$0")/.."
dry=false
[[ "${1:-}" == "--dry-run" ]] && dry=true
py=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if ! "$py" -c "import diloco.trainer.recipe" 2>/dev/null; then  # not installed: this checkout, offline
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$work/site" .whl/*.whl
  fi
  "$py" -m pip install -q --no-index --no-deps --no-build-isolation --target "$work/site" .
  export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
fi

if $dry; then
  models=("llama-tiny:float32:8:128"); turns=(--turns 2 --turn-seconds 3)
else
  # preset:dtype:batch:context. Batches that fill an 80 GB GPU without remat: 2048-token sequences.
  models=("llama-125m:bfloat16:16:2048" "llama-350m:bfloat16:8:2048"); turns=(--turns 3 --turn-seconds 4)
fi

results=()
for m in "${models[@]}"; do
  IFS=: read -r preset dtype batch context <<<"$m"
  cat >"$work/$preset.yaml" <<YAML
apiVersion: diloco.dev/v1alpha1
kind: DecoupledDiLoCoJob
metadata: {name: accelerator}
spec:
  learnerGroups: [{name: local, region: local, replicas: 1}]
  syncer: {fragments: 4}
  model: {preset: $preset, dtype: $dtype, context: $context}
  training: {batchSize: $batch, evalIntervalSteps: 1000, mesh: {data: -1, fsdp: 1}}
YAML
  echo "accelerator: $preset ($dtype, batch $batch x $context)" >&2
  line=$(PYTHONUNBUFFERED=1 "$py" -P bench/learner.py --config "$work/$preset.yaml" "${turns[@]}" | tee /dev/stderr | tail -n 1)
  results+=("\"$preset\": $line")
done
joined=$(IFS=,; echo "${results[*]}")
echo "{\"bench\": \"accelerator\", \"dry_run\": $dry, $joined}"
