#!/usr/bin/env bash
# The peer: the same Llama as benchmarks/train_step.py trains (same dims, vocabulary, sequence,
# global batch, remat, dtype, AdamW, synthetic data), trained by MaxText on this machine.
# Nothing of MaxText is in this repository or in meshtron's dependencies: this script sets the
# model and mesh and hands over to the shared peer runner (../shared/peers/maxtext/run.sh, or
# $MAXTEXT_RUNNER), which installs the PyPI `maxtext` wheel into its own venv under
# ~/.cache/meshtron-peers (Python >= 3.12) on first use.
#
# Usage: benchmarks/peers/maxtext.sh MODEL LAYOUT [maxtext key=value ...]
#   MODEL  tiny | 100m  (dims below; keep them equal to MODELS in benchmarks/train_step.py,
#                        tests/test_benchmarks.py checks it)
#   LAYOUT single | data=8 | fsdp=8 | fsdp=4,tensor=2 (any data/fsdp/tensor product)
#   Env: BATCH (global sequences, default 8) SEQ (256) REMAT (full | selective; meshtron names)
#        DTYPE (float32 | bfloat16 activations; weights float32) STEPS (20) WARMUP (5)
# Prints the runner's last line, then one JSON line: {"trainer": "maxtext", "tokens_per_s": ...}
set -euo pipefail

MODEL="${1:?usage: maxtext.sh MODEL LAYOUT}"
LAYOUT="${2:?usage: maxtext.sh MODEL LAYOUT}"
shift 2
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUNNER="${MAXTEXT_RUNNER:-$HERE/../../../shared/peers/maxtext/run.sh}"
[ -x "$RUNNER" ] || [ -f "$RUNNER" ] || { echo "maxtext.sh: no peer runner at $RUNNER (set MAXTEXT_RUNNER)" >&2; exit 2; }

case "$MODEL" in
  tiny) export EMB=256 LAYERS=4 HEADS=4 KV_HEADS=4 HEAD_DIM=64 MLP=1024 VOCAB=32000 ;;
  100m) export EMB=768 LAYERS=8 HEADS=12 KV_HEADS=12 HEAD_DIM=64 MLP=2048 VOCAB=32000 ;;
  *) echo "maxtext.sh: unknown model $MODEL (tiny | 100m)" >&2; exit 2 ;;
esac

DP=1 FSDP=1 TP=1
if [ "$LAYOUT" != "single" ]; then
  IFS=, read -ra parts <<< "$LAYOUT"
  for kv in "${parts[@]}"; do
    case "${kv%%=*}" in
      data) DP="${kv#*=}" ;; fsdp) FSDP="${kv#*=}" ;; tensor) TP="${kv#*=}" ;;
      *) echo "maxtext.sh: layout key ${kv%%=*} has no MaxText equivalent here" >&2; exit 2 ;;
    esac
  done
fi
export DP FSDP TP EP=1 DEVICES=$(( DP * FSDP * TP ))

# meshtron's remat names -> MaxText's remat_policy. MaxText wraps every layer in jax.checkpoint
# whatever the policy ("none" behaves like "full"), so there is no remat-free MaxText run.
case "${REMAT:-full}" in
  full) export REMAT=full ;;
  selective) export REMAT=minimal ;;  # saves the q/k/v/out and MLP matmul outputs, recomputes attention
  *) echo "maxtext.sh: REMAT=${REMAT} has no MaxText equivalent (full | selective)" >&2; exit 2 ;;
esac
export DTYPE="${DTYPE:-float32}" WEIGHT_DTYPE=float32
export GLOBAL_BATCH="${BATCH:-8}" SEQ="${SEQ:-256}" STEPS="${STEPS:-20}" WARMUP="${WARMUP:-5}"
unset PDB

out="$(mktemp)"
trap 'rm -f "$out"' EXIT
set +e
bash "$RUNNER" custom "$@" | tee "$out"
rc=${PIPESTATUS[0]}
set -e
last="$(tail -n 1 "$out")"
tps="$(sed -n 's/.*tokens_per_s=\([0-9.a-z]*\).*/\1/p' <<< "$last")"
step="$(sed -n 's/.*step_s=\([0-9.a-z]*\).*/\1/p' <<< "$last")"
[ "$tps" = "nan" ] && tps=null
[ "$step" = "nan" ] && step=null
printf '{"benchmark": "train_step", "trainer": "maxtext", "model": "%s", "layout": "%s", "batch": %s, "seq": %s, "remat": "%s", "dtype": "%s", "tokens_per_s": %s, "step_s": %s, "steps_timed": %s, "load_average_1m": %s}\n' \
  "$MODEL" "$LAYOUT" "$GLOBAL_BATCH" "$SEQ" "${REMAT/minimal/selective}" "$DTYPE" "${tps:-null}" "${step:-null}" \
  "$(( STEPS - WARMUP ))" "$(cut -d' ' -f1 /proc/loadavg)"
exit "$rc"
