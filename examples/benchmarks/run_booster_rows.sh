#!/usr/bin/env bash
# The Booster rows of the benchmark table, on one GPU (world size 1), each a single process that also times
# its peers. Results go to stdout and, when OUT is set, to $OUT/benchmark_*.json.
#   examples/benchmarks/run_booster_rows.sh 1b     # HF Llama 1B, b8 s2048, every plugin vs eager/compile/FSDP2
#   examples/benchmarks/run_booster_rows.sh 8b     # Llama3-8B shape, b2 s2048, activation checkpointing, vs FSDP2
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
case "${1:-1b}" in
  1b)
    python examples/benchmarks/benchmark.py -c 1b -b 8 -l 2048 -s 10 -i 3 \
      -p zero2,zero1,ddp,fsdp,gemini --compare --peers eager,compile,fsdp2 ;;
  8b)
    # 8B at world 1: bf16 working weights + fp32 master, gradient and Adam moments (18 bytes a parameter) do not
    # fit in 141 GB, so Gemini keeps 30% of the optimizer (the last chunks) on the host, updated during backward
    python examples/benchmarks/benchmark.py -c 8b -b 2 -l 2048 -g -s 6 -i 2 --lazy \
      -p gemini --offload-optim-frac 0.3 --compare --peers fsdp2 ;;
  *) echo "usage: $0 1b|8b" >&2; exit 2 ;;
esac
