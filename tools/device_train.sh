#!/usr/bin/env bash
# One training call on the GPU machine (docs/training.md "On the GPU machine"). Run from the
# repository root there, with `.whl` (the wheels the machine lacks) and `runs/tiny` carried:
#
#     bash tools/device_train.sh MINUTES [EXTENSION_JSON_FILE|-] [export]
#
# MINUTES: training time of this call (--max-minutes; keep it under the call's limit with room for
# the start-up and the state's trip back). EXTENSION_JSON_FILE: a file holding the --extend JSON,
# for the first call of an extension only ('-' or nothing: resume). 'export': write the checkpoint
# and its card to $OUT/ck.safetensors and $OUT/ck.md when training ends (otherwise --no-export).
#
# The training state comes back under $OUT as state.part.NN (pieces of 15 MB: files above the
# machine's size limit do not come back); put it back together here before the next call:
#     cat DIR/state.part.* > runs/tiny/state.pt
set -u
minutes=${1:?minutes of training}
extension=${2:--}
export_now=${3:-}
out=${OUT:?run this through the GPU machine, which sets OUT}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1

args=(--run-dir runs/tiny --max-minutes "$minutes")
if [ "$extension" != "-" ]; then args+=(--extend "$(cat "$extension")"); fi
if [ "$export_now" = "export" ]; then args+=(--out "$out/ck.safetensors"); else args+=(--no-export); fi

# train_tiny stops by itself after MINUTES and saves its state; the timeout only keeps a runaway
# export evaluation from reaching the call's 600 s limit, which would lose the state's trip back
timeout 575 python3 -m impl.train.train_tiny "${args[@]}" 2>&1 | tee "$out/log" | grep -v '^{' | tail -40
grep '"task": "retrieval"' "$out/log" | tail -8
split -b 15M -d runs/tiny/state.pt "$out/state.part."
ls -la "$out"
