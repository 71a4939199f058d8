#!/usr/bin/env bash
# Every benchmark script on the GPU machine, as the README runs them (python3 bench/NAME.py from the
# repository root, nothing installed but the staged wheels), each under its own time limit. Writes
# $OUT/bench.log (one line per script: rc and seconds) and $OUT/bench.tgz (each script's output and
# the tables it wrote, under bench/: copy the ones to keep into reports/bench/). One archive, since
# a call brings back at most 8 files.
#
#     bash tools/device_bench_all.sh [SECONDS_PER_SCRIPT] [SCRIPT ...]   # default 120, every script
set -u
out=${OUT:?run this through the GPU machine, which sets OUT}
# the staged wheels (the catalog's pydantic among them); the scripts add the checkout themselves
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
limit=${1:-120}
shift || true
scripts=("$@")
if [ ${#scripts[@]} -eq 0 ]; then
  scripts=(gdn_decode gdn_prefill qsa_small qsa_sparse_gqa qsa_topk_expand small_ops hc_sinkhorn moe engine)
fi
work=$(mktemp -d)
mkdir -p "$work/bench"
for s in "${scripts[@]}"; do
  t0=$(date +%s)
  timeout "$limit" python3 "bench/$s.py" --out "$work/bench" > "$work/$s.log" 2>&1
  rc=$?
  echo "$s: rc $rc in $(( $(date +%s) - t0 )) s; $(tail -1 "$work/$s.log" | cut -c1-160)" | tee -a "$out/bench.log"
done
tar -C "$work" -czf "$out/bench.tgz" .
