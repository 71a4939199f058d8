#!/usr/bin/env bash
# Stage the GPU machine's peer packages (FlashInfer, CuTe DSL, fla, pydantic; Python 3.12, x86-64) as
# one xz-compressed tar of the unpacked wheels, cut into pieces of PIECE_MB (default 46) in git-ignored
# folders .devsite-1, -2, ...: each piece plus the project tree stays under the 64 MiB a call may carry.
# Unpacked and re-compressed, the packages take two pieces (about 91 MB; CuTe DSL's MLIR library sets
# that floor), where their wheels take four. None of them has a .data folder or an entry point, so
# unpacking a wheel installs it. It prints the calls to make, back to back on one warm machine.
# Nothing is committed.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
piece_mb=${PIECE_MB:-46}
grep -qx '/.devsite-\*/' .git/info/exclude 2>/dev/null || echo '/.devsite-*/' >> .git/info/exclude
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps $plat -d "$work/wheels" \
  flashinfer-python==0.7.2.post1 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi cuda-tile fla-core==0.6.0 \
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types typing-extensions typing-inspection
mkdir "$work/site"
for w in "$work"/wheels/*.whl; do
  python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$w" "$work/site"
done
tar -C "$work/site" -cf - . | xz -6 -T0 > "$work/site.tar.xz"
rm -rf .devsite-*
split -b "${piece_mb}000000" -d "$work/site.tar.xz" "$work/site.part."
n=0
for p in "$work"/site.part.*; do n=$((n+1)); mkdir -p ".devsite-$n"; mv "$p" ".devsite-$n/"; done
du -sh .devsite-*
unpack='mkdir -p /tmp/site && cat /tmp/stage/site.part.* | python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.LZMAFile(sys.stdin.buffer), sys.stdout.buffer, 1 << 20)" | tar -x -C /tmp/site'
echo "On one GPU machine, from the project root there, $n calls back to back (a machine left idle is given back):"
for i in $(seq 1 "$n"); do
  if [ "$i" -lt "$n" ]; then
    echo " $i. carry [\".devsite-$i\"]:  mkdir -p /tmp/stage && cp .devsite-$i/* /tmp/stage/"
  else
    echo " $i. carry [\".devsite-$i\"]:  mkdir -p /tmp/stage && cp .devsite-$i/* /tmp/stage/ && $unpack && export PYTHONPATH=\$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages && <your command>"
  fi
done
