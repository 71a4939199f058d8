#!/usr/bin/env bash
# Stage a revision's code (default HEAD) in the git-ignored folder .before/, for
# `tools/device_certify.sh ab`, which runs the same benches under it and under the working tree in
# one GPU call. Carry ".before" in that call (about 2.5 MB). Nothing is committed.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
rev=${1:-HEAD}
grep -qx '/.before/' .git/info/exclude 2>/dev/null || echo '/.before/' >> .git/info/exclude
rm -rf .before
mkdir .before
git archive "$rev" -- bench certify impl spec pyproject.toml | tar -x -C .before
git log -1 --format='%h %s' "$rev" > .before/REVISION
du -sh .before
cat .before/REVISION
