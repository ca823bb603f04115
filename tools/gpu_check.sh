#!/usr/bin/env bash
# One call on a lent GPU machine (the device tool), from the repository root:
#   bash tools/gpu_check.sh [STAGES]        STAGES: comma-separated, default "env,graph,bench"
#   env    the GPU, the driver and the libraries found there
#   graph  tests/test_graph.py's GPU cases (cuBLAS products, replayed updates)
#   bench  bench/gpu.py on the configurations in $CONFIGS (default all five), eager and graph
#   kernels  bench/gpu_kernels.py: the replayed update's kernels by device time ($KERNEL_CONFIGS)
#   suite  every test marked gpu (python -m pytest -m gpu)
# On a machine that cannot reach a package index, the packages it lacks travel as wheels
# in .whl/ (array-api-compat, array-api-strict, pooch, platformdirs were missing on the
# H200 lent on 2026-11-26); they are installed into /tmp/site.  Logs go to $OUT (default
# /tmp/gpu_check).
set -uo pipefail
STAGES=${1:-env,graph,bench}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
has() { [[ ",$STAGES," == *",$1,"* ]]; }
if has env; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv 2>&1 | tee "$OUT/env.txt"
    python3 - <<'EOF' 2>&1 | tee -a "$OUT/env.txt"
import platform, cupy, numpy, torch
print("python", platform.python_version(), "numpy", numpy.__version__, "cupy", cupy.__version__,
      "cuda runtime", cupy.cuda.runtime.runtimeGetVersion(), "torch", torch.__version__,
      "torch cuda", torch.version.cuda, "device", cupy.cuda.runtime.getDeviceProperties(0)["name"])
EOF
fi
if has graph; then
    timeout "${GRAPH_SECONDS:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
        tests/test_graph.py 2>&1 | tee "$OUT/graph_tests.log" | tail -40
    if grep -q "^FAILED.*fused" "$OUT/graph_tests.log"; then
        echo "the fused softmax kernels failed their tests: NPFORMER_GPU_FUSED=0 from here on"
        export NPFORMER_GPU_FUSED=0
    fi
fi
if has bench; then
    timeout "${BENCH_SECONDS:-300}" python3 bench/gpu.py --configs "${CONFIGS:-lm,imdb,seq2seq,imdb_large,lm_large}" \
        --steps "${STEPS:-10}" --warmup "${WARMUP:-3}" --markdown --json "$OUT/gpu.json" 2>&1 \
        | tee "$OUT/bench.log"
fi
if has kernels; then
    timeout "${KERNELS_SECONDS:-120}" python3 bench/gpu_kernels.py \
        --configs "${KERNEL_CONFIGS:-imdb_large,lm_large,seq2seq}" 2>&1 | tee "$OUT/kernels.log"
fi
if has suite; then
    timeout "${SUITE_SECONDS:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider -x \
        2>&1 | tee "$OUT/suite.log" | tail -30
fi
