#!/usr/bin/env bash
# Certification calls on the GPU machine, after the peer packages are unpacked
# (tools/stage_gpu_site.sh). Run from the repository root there:
#
#     bash tools/device_certify.sh receipts [SECONDS] [JOBS]  # sm_90 receipts not yet fresh, for at most
#                                       # SECONDS, in JOBS processes (default 1)
#     bash tools/device_certify.sh engine [PYTEST_ARGS...]  # GPU engine tests (at most ENGINE_TESTS_S,
#                                       # default 470 s), then the README's generate on cuda in what is
#                                       # left of CALL_S (default 590 s)
#     bash tools/device_certify.sh bench   # bench/prefill_graph.py, then bench/engine.py with
#                                       # speculation (eager, graphs, all_graphs), under CALL_S (590 s;
#                                       # the prefill bench at most PREFILL_S, 300 s, 0 skips it, with PREFILL_ARGS;
#                                       # the engine bench at BATCHES, 1,32,128, MODES, with ENGINE_ARGS)
#     bash tools/device_certify.sh session  # receipts (RECEIPTS_S, JOBS) beside the engine tests (those
#                                       # matching FIRST_K first)
#                                       # (TESTS_S), then AFTER (bench, or ab) in what is left of
#                                       # CALL_S (575 s), if 60 s or more
#     bash tools/device_certify.sh ab      # an engine change against the revision before it, same
#                                       # run: bench/prefill_graph.py (AB_LENGTHS, 128,512) and
#                                       # bench/engine.py eager (AB_BATCHES, 1,32) under the tree
#                                       # unpacked in .before/ (tools/stage_before.sh), then this one;
#                                       # AB_ARGS go to both (--layers 24 fits an 80 GB card);
#                                       # AB_ORDER "after before" runs this tree first
#     bash tools/device_certify.sh gates [SECONDS] [GATES_RUN_ARGS...]  # gates on cuda (default: the
#                                       # premerge and postmerge tiers), reports in $OUT/gates.tgz
#
# What it writes comes back under $OUT: sm_90.jsonl (copy it into reports/receipts/ before the next
# call: a stopped run resumes from the fresh receipts it carries), run.log, gpu_tests.log,
# generate.log, versions.txt, and for bench prefill_graph.md, prefill_graph.log, bv/engine.md and
# engine_bench.log.
set -u
out=${OUT:?run this through the GPU machine, which sets OUT}
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
part=${1:?receipts, engine, bench or gates}
shift

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$out/versions.txt" 2>&1

if [ "$part" = session ]; then
  # One call: the receipts in JOBS processes beside the GPU engine tests (the prefill and verify
  # graph tests first), then, with the GPU to itself, the benches in what is left of CALL_S.
  t0=$(date +%s)
  work=$(mktemp -d)
  bash "$0" receipts "${RECEIPTS_S:-290}" "${JOBS:-4}" > "$work/receipts.txt" 2>&1 &
  tests=tests/engine/test_engine_gpu.py
  first=${FIRST_K:-"prefill_graph or verify_graph"}
  timeout "${TESTS_S:-290}" python3 -m pytest -v -p no:cacheprovider "$tests" -k "$first" \
      > "$out/gpu_tests.log" 2>&1
  echo "GPU engine tests ($first): rc $?" | tee -a "$out/gpu_tests.log"
  left=$(( ${TESTS_S:-290} - ($(date +%s) - t0) ))
  timeout "$left" python3 -m pytest -v -p no:cacheprovider "$tests" -k "not ($first)" \
      >> "$out/gpu_tests.log" 2>&1
  echo "GPU engine tests (the others): rc $? after $(( $(date +%s) - t0 )) s" | tee -a "$out/gpu_tests.log"
  grep -E "FAILED|ERROR|passed|failed" "$out/gpu_tests.log" | tail -12
  wait
  cat "$work/receipts.txt"
  left=$(( ${CALL_S:-575} - ($(date +%s) - t0) ))
  [ "$left" -ge 60 ] || { echo "no time left for the benches ($left s)"; exit 0; }
  CALL_S=$left bash "$0" "${AFTER:-bench}"
  exit 0
fi

if [ "$part" = receipts ]; then
  limit=${1:-500}
  jobs=${2:-1}
  t0=$(date +%s)
  # JOBS processes, each over a group of ops balanced by the seconds of their last sm_90 receipts;
  # each merges its receipts under the receipts directory's lock as it goes.
  work=$(mktemp -d)
  python3 tools/op_groups.py "$jobs" reports/receipts/sm_90.jsonl > "$work/groups"
  i=0
  while read -r group; do
    i=$((i+1))
    timeout "$limit" python3 -m certify.cli run --arch sm_90 --outdated $group > "$work/run$i.log" 2>&1 &
  done < "$work/groups"
  wait
  cat "$work"/run[0-9]*.log > "$out/run.log"
  echo "certify run --arch sm_90 --outdated in $jobs processes: $(( $(date +%s) - t0 )) s" | tee -a "$out/run.log"
  cp reports/receipts/sm_90.jsonl "$out/sm_90.jsonl"
  tail -5 "$out/run.log"
  exit 0
fi

if [ "$part" = gates ]; then
  limit=${1:-400}
  shift || true
  [ $# -gt 0 ] || set -- --tier premerge --tier postmerge
  work=$(mktemp -d)
  t0=$(date +%s)
  timeout "$limit" python3 -m certify.cli gates run "$@" --report-dir "$work" -j 4 > "$out/gates.log" 2>&1
  echo "certify gates run $*: rc $? in $(( $(date +%s) - t0 )) s" | tee -a "$out/gates.log"
  tar -C "$work" -czf "$out/gates.tgz" .
  tail -25 "$out/gates.log"
  exit 0
fi

if [ "$part" = ab ]; then
  # Each revision in its own processes, one after the other, the GPU to itself; each log ends with
  # the reports its benches wrote.
  [ -d .before/bench ] || { echo "no .before/ tree: run tools/stage_before.sh here and carry .before"; exit 2; }
  # AB_ORDER ("before after", or "after before") picks which tree runs first.
  t0=$(date +%s)
  n=0
  for tag in ${AB_ORDER:-before after}; do
    n=$((n+1))
    root=$([ "$tag" = before ] && echo .before || echo .)
    log="$out/ab-$tag.log"
    work=$(mktemp -d)
    t1=$(date +%s)
    share=$(( (${CALL_S:-590} - (t1 - t0)) / ($([ "$n" = 1 ] && echo 2 || echo 1)) ))
    { echo "== $tag: $([ "$tag" = before ] && cat .before/REVISION || git rev-parse HEAD 2>/dev/null || echo this tree), $share s"
      timeout $(( share / 2 )) python3 "$root/bench/prefill_graph.py" --lengths "${AB_LENGTHS:-128,512}" \
          --out "$work" ${AB_ARGS:-}
      echo "bench/prefill_graph.py: rc $?"
      timeout $(( share - ($(date +%s) - t1) )) python3 "$root/bench/engine.py" --prompt-len 1024 \
          --batch "${AB_BATCHES:-1,32}" --modes eager --new-tokens 8 --out "$work" ${AB_ARGS:-}
      echo "bench/engine.py: rc $?"
      cat "$work"/*.md
    } > "$log" 2>&1
    grep -E "^\| [0-9]|rc [0-9]" "$log" | tail -12
  done
  exit 0
fi

if [ "$part" = bench ]; then
  t0=$(date +%s)
  if [ "${PREFILL_S:-300}" -gt 0 ]; then
    timeout "${PREFILL_S:-300}" python3 bench/prefill_graph.py --out "$out" ${PREFILL_ARGS:-} > "$out/prefill_graph.log" 2>&1
    echo "bench/prefill_graph.py: rc $? in $(( $(date +%s) - t0 )) s" | tee -a "$out/prefill_graph.log"
    tail -22 "$out/prefill_graph.log"
  fi
  left=$(( ${CALL_S:-590} - ($(date +%s) - t0) ))
  [ "$left" -ge 30 ] || { echo "no time left for bench/engine.py"; exit 0; }
  t1=$(date +%s)
  timeout "$left" python3 bench/engine.py --prompt-len 1024 --batch "${BATCHES:-1,32,128}" \
      --modes "${MODES:-eager,graphs,all_graphs}" --draft-length 3 --new-tokens 8 --out "$out/bv" ${ENGINE_ARGS:-} \
      > "$out/engine_bench.log" 2>&1
  echo "bench/engine.py with draft 3: rc $? in $(( $(date +%s) - t1 )) s" | tee -a "$out/engine_bench.log"
  tail -12 "$out/engine_bench.log"
  exit 0
fi

t0=$(date +%s)
timeout "${ENGINE_TESTS_S:-470}" python3 -m pytest -q -p no:cacheprovider tests/engine/test_engine_gpu.py "$@" \
    > "$out/gpu_tests.log" 2>&1
echo "GPU engine tests: rc $? in $(( $(date +%s) - t0 )) s" | tee -a "$out/gpu_tests.log"
tail -15 "$out/gpu_tests.log"

left=$(( ${CALL_S:-590} - ($(date +%s) - t0) ))
t1=$(date +%s)
timeout "$left" python3 -m impl.model.cli generate --random-weights --prompt "hello" \
    --draft-length 3 --device cuda > "$out/generate.log" 2>&1
echo "generate on cuda: rc $? in $(( $(date +%s) - t1 )) s" | tee -a "$out/generate.log"
tail -4 "$out/generate.log"
