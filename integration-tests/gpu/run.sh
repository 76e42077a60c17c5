#!/usr/bin/env bash
# GPU tests and benchmarks, run with the python that is already on the machine (no installs).
#   bash integration-tests/gpu/run.sh tests          pytest -m gpu over every package and the integration tests
#   bash integration-tests/gpu/run.sh bench NAME...  examples/benchmarks/bench_NAME.py (or benchmark.py for "booster")
#   bash integration-tests/gpu/run.sh                both, every benchmark
#   bash integration-tests/gpu/run.sh multigpu       on 2-8 GPUs: the parity matrix with NCCL, the 8B scaling rows
#                                                    and the communication-overlap profile on every GPU
# cai must be importable: either installed (pip install --no-deps dist/*.whl) or from the source tree, which
# this script puts on PYTHONPATH when cai is not installed.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if ! $PY -c "import cai.mesh" 2>/dev/null; then
  echo "cai is not installed: install the wheels first (nox -s build here, then pip install --no-deps dist/*.whl there)" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1
mode=${1:-all}
shift || true
run_tests() { $PY -m pytest -m gpu -q -p no:cacheprovider packages integration-tests; }
run_bench() {
  for name in "$@"; do
    if [ "$name" = booster ]; then $PY examples/benchmarks/benchmark.py --compare; else $PY "examples/benchmarks/bench_${name}.py"; fi
  done
}
run_multigpu() {
  CAI_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider integration-tests/test_parity_matrix.py
  bash examples/benchmarks/run_booster_rows.sh scale
  n=$($PY -c "import torch; print(torch.cuda.device_count())")
  for plugin in zero2 gemini; do
    torchrun --standalone --nproc_per_node "$n" examples/benchmarks/profile_overlap.py -c 8b -p "$plugin" -b 1 -l 4096 -g
  done
}
case "$mode" in
  tests) run_tests ;;
  multigpu) run_multigpu ;;
  bench) run_bench "$@" ;;
  all) run_tests; run_bench kernels cpu_adam zero gemini ckpt booster ;;
  *) echo "usage: $0 [tests|bench NAME...|all|multigpu]" >&2; exit 2 ;;
esac
