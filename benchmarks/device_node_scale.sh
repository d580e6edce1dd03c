#!/usr/bin/env bash
# Node-scale load benchmark on a 16-core machine (one run, under 5 minutes): the resharded (row -> column)
# and the replicated (DDP-style) load at 2, 4 and 8 ranks, 1 GiB, tierckpt beside torch DCP.
#
#   OUT=/some/dir bash benchmarks/device_node_scale.sh        # table in $OUT/node_scale.md
#
# Installs nothing: torch and the repository's dependencies must import (set PYTHONPATH as needed; the
# repository's src/ is put first here). GIB, REPEATS, RANKS and PYTHON override the defaults.
set -x
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-$PWD/node-scale-out}
GIB=${GIB:-1.0}
REPEATS=${REPEATS:-3}
RANKS=${RANKS:-2,4,8}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' || {
    echo "torch does not import: nothing run" | tee "$OUT/node_scale.md"; exit 1; }
"$PYTHON" -c 'import tierckpt, crc32c, numpy; from tierckpt.backends import mapped_read; print("mapped reads", mapped_read.available())' || {
    echo "tierckpt or its dependencies do not import: nothing run" | tee "$OUT/node_scale.md"; exit 1; }
lscpu | head -20 > "$OUT/lscpu.txt"
uname -r >> "$OUT/lscpu.txt"
# Scratch on the local disk (not tmpfs), so that loads read a file system's page cache as on a node.
SCRATCH=$(mktemp -d "${SCRATCH_DIR:-/var/tmp}/tierckpt-node-XXXXXX")
trap 'rm -rf "$SCRATCH"' EXIT
df -h "$SCRATCH" >> "$OUT/lscpu.txt"
timeout 290 "$PYTHON" benchmarks/bench_matrix.py --cases node --ranks "$RANKS" --gib "$GIB" --repeats "$REPEATS" \
    --tmp "$SCRATCH" --out "$OUT/node_scale.md" 2>&1 | tee "$OUT/node_scale.log"
status=$?
{ echo; echo '```'; cat "$OUT/lscpu.txt"; echo '```'; } >> "$OUT/node_scale.md"
exit $status
