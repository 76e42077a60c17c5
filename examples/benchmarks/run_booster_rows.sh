#!/usr/bin/env bash
# The Booster rows of the benchmark table: 1b and 8b on one GPU, each one process that also times its peers;
# scale on 1 to 8 GPUs through torchrun. Results go to stdout and, when OUT is set, to $OUT/benchmark_*.json.
# The -liger peers need `pip install liger-kernel`; without it their rows say so and the others still run.
#   examples/benchmarks/run_booster_rows.sh 1b     # HF Llama 1B, b8 s2048, every plugin vs eager/compile/FSDP2
#                                                  # and the same with Liger-Kernel
#   examples/benchmarks/run_booster_rows.sh 8b     # Llama3-8B shape, b2 s2048, activation checkpointing, vs FSDP2
#                                                  # with and without Liger-Kernel
#   examples/benchmarks/run_booster_rows.sh scale  # Llama3-8B shape, s4096, on 1, 2, 4, 8 GPUs (those present),
#                                                  # LowLevelZero-2 and Gemini beside FSDP2 on the same GPUs
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
case "${1:-1b}" in
  1b)
    python examples/benchmarks/benchmark.py -c 1b -b 8 -l 2048 -s 10 -i 3 \
      -p zero2,zero1,ddp,fsdp,gemini --compare \
      --peers eager,compile,fsdp2,eager-liger,compile-liger,fsdp2-liger ;;
  8b)
    # 8B at world 1: one micro-batch's gradient stays in bf16 in both plugins (16 bytes a parameter with the fp32
    # master and Adam moments, as FSDP2's fp32 parameters, gradients and moments), so both fit without offload.
    # At ~130 of the 139 GiB, the allocator's expandable segments avoid fragmentation.
    PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
    python examples/benchmarks/benchmark.py -c 8b -b 2 -l 2048 -g -s 6 -i 2 --lazy \
      -p zero2,gemini --compare --peers fsdp2,fsdp2-liger ;;
  scale)
    gpus=$(python -c "import torch; print(torch.cuda.device_count())")
    for n in 1 2 4 8; do
      [ "$n" -le "$gpus" ] || break
      PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
      torchrun --standalone --nproc_per_node "$n" examples/benchmarks/benchmark.py -c 8b -b "${BATCH:-1}" -l 4096 -g \
        -s 6 -i 2 --lazy -p zero2,gemini --compare --peers fsdp2
    done ;;
  *) echo "usage: $0 1b|8b|scale" >&2; exit 2 ;;
esac
