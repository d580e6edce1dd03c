#!/usr/bin/env bash
# Every node-scale benchmark in one prepared run on a 16-core machine (under 9 minutes), each step under
# its own time limit so that one slow step cannot take the others' results with it:
#   1. the resharded (row -> column) and replicated load at 2, 4 and 8 ranks beside DCP (device_node_scale.sh);
#   2. 2 simulated nodes x 4 ranks, one torchrun per node, resharded and replicated loads beside DCP (bench_nodes.py);
#      both 1 and 2 print each load's chosen routes and the route inputs the job measured (`*`);
#   3. the memory tier: save stall, training-loop overhead and CPU per checkpoint beside DCP, and peer
#      recovery against the cold local disk (bench_memory.py; its S3 cell runs only where moto is installed);
#   4. the wire of peer recovery: one gloo pair against several connections per pair (bench_wire.py).
# Not here, for a device call of its own (these three take most of a call's 10 minutes): the async-save stall
# of 8 ranks on one node, `python benchmarks/bench_async.py --ranks 8 --gib 1.0 --repeats 3 [--memory]`.
#
#   OUT=/some/dir bash benchmarks/device_all.sh      # Markdown tables and logs in $OUT
#
# Installs nothing (set PYTHONPATH to wheels carried beside torch where the machine lacks a dependency).
set -x
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
SCRATCH_DIR=${SCRATCH_DIR:-/var/tmp}
export TMPDIR="$SCRATCH_DIR"

OUT="$OUT" PYTHON="$PYTHON" GIB=${GIB:-1.0} REPEATS=${REPEATS:-3} SCRATCH_DIR="$SCRATCH_DIR" \
    timeout "${NODE_S:-180}" bash benchmarks/device_node_scale.sh

timeout "${NODES_S:-150}" "$PYTHON" benchmarks/bench_nodes.py --gib "${NODES_GIB:-0.25}" --ranks-per-node 4 \
    --repeats "${REPEATS:-3}" --timeout "${NODES_S:-150}" --out "$OUT/nodes.md" 2>&1 | tee "$OUT/nodes.log"

timeout "${MEMORY_S:-180}" "$PYTHON" benchmarks/bench_memory.py --parts save,recovery,training \
    --gib "${MEMORY_GIB:-0.25}" --repeats 2 --steps 40 --every 5 --timeout "${MEMORY_S:-180}" \
    --out "$OUT/memory.md" 2>&1 | tee "$OUT/memory.log"
timeout "${WIRE_S:-60}" "$PYTHON" benchmarks/bench_wire.py --mib 256 --repeats 5 --lanes 1,2,4 \
    --out "$OUT/wire.md" 2>&1 | tee "$OUT/wire.log"
exit 0
