#!/usr/bin/env bash
# Predicted against measured peak memory on one GPU: every config is predicted on fake tensors
# (--mode=capacity) and then run on the card (--validate: --steps 2 after --warmup_steps 1, no
# trace, the memory breakdown); capacity.md in each run directory lists predicted MB, measured
# MB and the error per config. Also records the card's CUDA-side overheads (cuda_overheads.json).
#
# Usage: benchmarks/capacity_validation.sh [output_dir]   (default: ./runs/capacity_validation)
# GRID=1b runs only the 1b grid; GRID=lora only the Llama LoRA configs.
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
cd "$(dirname "$0")/.."
out="${1:-./runs/capacity_validation}"
grid="${GRID:-all}"
mkdir -p "$out"
python benchmarks/cuda_overheads.py > "$out/cuda_overheads.json"
run() { python profiling_script.py --mode=capacity --validate --output_dir "$out" --resume "$@"; }
if [[ "$grid" == all || "$grid" == 1b ]]; then
    for precision in "bf16 --dtype bfloat16 --attention sdpa" "fp32 --dtype float32 --attention explicit"; do
        read -r name flags <<< "$precision"
        # shellcheck disable=SC2086
        run --run_name "$name" $flags --batch_sizes 8 --seq_lens 512 1024
        # shellcheck disable=SC2086
        run --run_name "$name" $flags --batch_sizes 2 --seq_lens 4096
        # shellcheck disable=SC2086
        run --run_name "$name" $flags --batch_sizes 1 --seq_lens 16384
    done
fi
if [[ "$grid" == all || "$grid" == lora ]]; then
    for dtype in bfloat16 float32; do
        run --run_name "lora_$dtype" --model meta-llama/Llama-3.2-3B-Instruct --use_lora \
            --lora_rank 32 --seq_lens 256 --batch_sizes 16 --max_physical_batch_size 2 --dtype "$dtype"
    done
    run --run_name lora8b_bf16 --model meta-llama/Llama-3.1-8B-Instruct --use_lora --lora_rank 16 \
        --seq_lens 512 --batch_sizes 16 --max_physical_batch_size 4 --dtype bfloat16
fi
