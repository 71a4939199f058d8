#!/usr/bin/env bash
# Perf records for dispatch on the GPU machine, after the staged wheels are installed
# (../shared/device/stage-gpu-wheels.sh). Run from the repository root there:
#
#     bash tools/device_perf_records.sh [SECONDS_PER_OP] [OP[:CELL] ...]   # default 240, gdn_prefill:long_t8192
#
# Writes $OUT/perf/sm_90.jsonl (copy it into reports/perf/) and $OUT/perf.log (each variant's check
# and time at each traced shape, one rc line per op).
set -u
out=${OUT:?run this through the GPU machine, which sets OUT}
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
limit=${1:-240}
shift || true
ops=("$@")
[ ${#ops[@]} -eq 0 ] && ops=(gdn_prefill:long_t8192)
mkdir -p "$out/perf"
for spec in "${ops[@]}"; do
  op=${spec%%:*}
  cell=()
  [ "$spec" != "$op" ] && cell=(--cell "${spec#*:}")
  t0=$(date +%s)
  timeout "$limit" python3 bench/perf_records.py --op "$op" "${cell[@]}" --out "$out/perf" \
      >> "$out/perf.log" 2>&1
  echo "perf records $spec: rc $? in $(( $(date +%s) - t0 )) s" | tee -a "$out/perf.log"
done
