#!/usr/bin/env bash
# One visit to a lent GPU machine, inside one command of the device tool (at most 10 minutes):
# the phases of `make gpu-check` in issue [24]'s order, each cut off so the whole ends by
# $VISIT_S seconds, the JSON lines written straight to $OUT (they come back even if the command is
# cut short), the compiled programs and the trace tarred into $OUT/artifacts.tgz at the end.
# Usage (on the GPU machine): VISIT_S=570 benchmarks/gpu_visit.sh smoke:150 tests:210 train:rest
#   PHASE:SECONDS runs gpu_check's phase with that budget; "rest" takes what is left.
#   GPU_CHECK_ARGS adds options to every phase (e.g. "--attention=cudnn --remat=selective,none");
#   TESTS_K selects gpu tests by a pytest -k expression (spaces allowed: "not flash_kernel").
set -u
OUT=${OUT:-/tmp/gpu-out}; VISIT_S=${VISIT_S:-570}; ART=/tmp/gpu-artifacts
mkdir -p "$OUT" "$ART"
export PYTHONUNBUFFERED=1 MESHTRON_COMMIT=${MESHTRON_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv > "$OUT/nvidia-smi.csv" 2>&1
for item in "$@"; do
  phase=${item%%:*}; budget=${item#*:}
  left=$(( VISIT_S - ($(date +%s) - start) ))
  [ "$budget" = rest ] && budget=$left
  [ "$budget" -gt "$left" ] && budget=$left
  if [ "$budget" -lt 30 ]; then echo "visit: no time left for $phase"; continue; fi
  echo "visit: $phase for up to ${budget}s (t=$(( $(date +%s) - start ))s)"
  # The phase stops starting new measurements 20 s before its cut.
  timeout -k 5 "$budget" python3 -m benchmarks.gpu_check --phase "$phase" --out_dir "$OUT" \
    --budget_s $(( budget - 20 )) --artifacts_dir "$ART" ${GPU_CHECK_ARGS:-} \
    ${TESTS_K:+"--tests_k=$TESTS_K"}
  echo "visit: $phase rc=$? (t=$(( $(date +%s) - start ))s)"
  # After the first phase installed the carried wheels, later phases find them on the path.
  [ -d /tmp/meshtron-gpu-site ] && export PYTHONPATH=/tmp/meshtron-gpu-site
done
tar czf "$OUT/artifacts.tgz" -C "$ART" . 2>/dev/null
ls -la "$OUT"
