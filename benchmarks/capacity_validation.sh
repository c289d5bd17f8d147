#!/usr/bin/env bash
# Predicted against measured peak memory on one GPU or several: every config is predicted on fake tensors
# (--mode=capacity) and then run on the card (--validate: --steps 2 after --warmup_steps 1, no
# trace, the memory breakdown); capacity.md in each run directory lists predicted MB, measured
# MB and the error per config. Also records the card's CUDA-side overheads (cuda_overheads.json).
#
# Usage: benchmarks/capacity_validation.sh [output_dir]   (default: ./runs/capacity_validation)
# GRID=1b runs only the 1b grid; GRID=lora only the Llama LoRA configs; GRID=ranks only
# Llama-3.1-8B full fine-tuning under FSDP2 and the 1b model under DDP (8 samples a rank) on
# RANKS GPUs each (default "2 4"; torchrun jobs, each rank predicting its own peak before the
# job measures it).
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
cd "$(dirname "$0")/.."
out="${1:-./runs/capacity_validation}"
grid="${GRID:-all}"
mkdir -p "$out"
if [[ "$grid" != ranks ]]; then
    python benchmarks/cuda_overheads.py > "$out/cuda_overheads.json"
fi
# run NAME ARGS...: one more part of run NAME (made here: --resume refuses a missing run)
run() {
    mkdir -p "$out/$1"
    python profiling_script.py --mode=capacity --validate --output_dir "$out" --run_name "$1" \
        --resume "${@:2}"
}
if [[ "$grid" == all || "$grid" == 1b ]]; then
    for precision in "bf16 --dtype bfloat16 --attention sdpa" "fp32 --dtype float32 --attention explicit"; do
        read -r name flags <<< "$precision"
        # shellcheck disable=SC2086
        run "$name" $flags --batch_sizes 8 --seq_lens 512 1024
        # shellcheck disable=SC2086
        run "$name" $flags --batch_sizes 2 --seq_lens 4096
        # shellcheck disable=SC2086
        run "$name" $flags --batch_sizes 1 --seq_lens 16384
    done
fi
if [[ "$grid" == all || "$grid" == lora ]]; then
    for dtype in bfloat16 float32; do
        run "lora_$dtype" --model meta-llama/Llama-3.2-3B-Instruct --use_lora \
            --lora_rank 32 --seq_lens 256 --batch_sizes 16 --max_physical_batch_size 2 --dtype "$dtype"
    done
    run lora8b_bf16 --model meta-llama/Llama-3.1-8B-Instruct --use_lora --lora_rank 16 \
        --seq_lens 512 --batch_sizes 16 --max_physical_batch_size 4 --dtype bfloat16
fi
if [[ "$grid" == all || "$grid" == ranks ]]; then
    for ranks in ${RANKS:-2 4}; do
        mkdir -p "$out/fsdp8b_${ranks}" "$out/ddp1b_${ranks}"
        torchrun --nproc_per_node "$ranks" --standalone profiling_script.py --mode=capacity \
            --validate --output_dir "$out" --resume --run_name "fsdp8b_${ranks}" \
            --model meta-llama/Llama-3.1-8B-Instruct --seq_lens 512 --batch_sizes 16 \
            --max_physical_batch_size 2 --dtype bfloat16 --no_poisson --distributed fsdp \
            --trainers standard ghost flash
        torchrun --nproc_per_node "$ranks" --standalone profiling_script.py --mode=capacity \
            --validate --output_dir "$out" --resume --run_name "ddp1b_${ranks}" --model 1b \
            --seq_lens 512 --batch_sizes $((8 * ranks)) --dtype bfloat16 --attention sdpa \
            --distributed ddp
    done
fi
