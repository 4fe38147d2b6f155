#!/usr/bin/env bash
# Regenerates every benchmark in docs/BENCHMARKS.md, one after another (about four hours on a
# 2-core machine with no GPU, two of them the quality bench at its default 1,200 steps; the soak,
# `python bench/soak.py`, runs on its own: 30 minutes). Each script prints a table and, as its
# last line, one JSON object;
# the full output goes to runs/bench/logs/NAME.log, the JSON lines to runs/bench/results.jsonl,
# and the plots to docs/img/bench_*.png.
#
#   bash bench/run_all.sh            # everything
#   bash bench/run_all.sh --smoke    # each side-by-side bench in its seconds-long smoke mode
#   ONLY="quality scavenging" bash bench/run_all.sh   # a subset
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
SMOKE=""
if [[ "${1:-}" == "--smoke" ]]; then SMOKE="--smoke"; fi

LOGS=runs/bench/logs${SMOKE:+-smoke}
mkdir -p "$LOGS"
RESULTS=runs/bench/results${SMOKE:+-smoke}.jsonl
: > "$RESULTS"
T0=$(date +%s)

run() {
  local name=$1
  shift
  if [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]]; then return 0; fi
  echo "== $name: $PY $*"
  local start
  start=$(date +%s)
  "$PY" "$@" 2>&1 | tee "$LOGS/$name.log"
  echo "-- $name: $(( $(date +%s) - start )) s (load average $(cut -d' ' -f1-3 /proc/loadavg))"
  tail -n 1 "$LOGS/$name.log" >> "$RESULTS"
}

# Side by side on the same model, corpus and token budget (docs/BENCHMARKS.md, sections 1-5).
run quality bench/quality.py $SMOKE
run replay bench/replay.py --arms all $SMOKE
run repeatability bench/repeatability.py $SMOKE
run bandwidth_measured bench/bandwidth_measured.py $SMOKE
run heterogeneous bench/heterogeneous.py $SMOKE
run scavenging bench/scavenging.py $SMOKE
run syncer_scale bench/syncer_scale.py $SMOKE
run multihost_push bench/multihost_push.py $SMOKE
run multihost_share bench/multihost_share.py $SMOKE
run broadcast_quality bench/broadcast_quality.py $SMOKE

if [[ -z "$SMOKE" ]]; then
  # Component benchmarks (section 6).
  run codec bench/codec.py
  run merge bench/merge.py
  run checkpoint bench/checkpoint.py
  run learner bench/learner.py --turns 6
  run push_rpc bench/push_rpc.py
  run simulate bench/simulate.py
  run restart bench/restart.py  # section 12
  run prepare_tokens bench/prepare_tokens.py  # section 11
fi

echo "all benchmarks: $(( $(date +%s) - T0 )) s; JSON lines in $RESULTS"
