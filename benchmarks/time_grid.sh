#!/usr/bin/env bash
# The step-time goal's grid on one GPU: the memory grid's one-process configs with fixed batches
# (1b fp32 and bf16, eager and SDPA attention, SGD and Adam, 512-4096 tokens, chunks of 1; Llama
# 3.2-1B full fine-tuning with Adam and LoRA, Llama-3.2-3B and Llama-3.1-8B LoRA; all four
# trainers) and the 1b model's CUDA-graphed steps (standard and flash), each measured as 3 steps
# after 2 warm-ups, untraced. Run it on two or more machines, each into its own folder, then cost
# them on any CPU, one config's measured step the median of its steps on every machine:
#     python benchmarks/time_recost.py --pool MACHINE_A MACHINE_B
#
# Usage: benchmarks/time_grid.sh [output_dir]   (default: ./runs/time_grid)
# Each run's own limit, in seconds: RUN_LIMIT (default 900).
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
cd "$(dirname "$0")/.."
out="${1:-./runs/time_grid}"
mkdir -p "$out"
status=0
# run MODE NAME ARGS...: one run of the grid; a run that fails is reported and the grid goes on
run() {
    local start=$SECONDS
    if timeout "${RUN_LIMIT:-900}" python profiling_script.py --mode="$1" --run_name "$2" \
        --steps 3 --warmup_steps 2 --no_trace --output_dir "$out" "${@:3}"; then
        echo "time_grid: $2 done in $((SECONDS - start)) s"
    else
        echo "time_grid: $2 failed (exit $?) after $((SECONDS - start)) s" >&2
        status=1
    fi
}
bf16=(--model 1b --dtype bfloat16 --attention sdpa)
run profile g_1024 "${bf16[@]}" --batch_sizes 8 --seq_lens 1024
run profile g_2048_adam "${bf16[@]}" --batch_sizes 4 --seq_lens 2048 --optimizer adam
run profile g_4096 "${bf16[@]}" --batch_sizes 2 --seq_lens 4096 --max_physical_batch_sizes 1
run profile g_graphed "${bf16[@]}" --batch_sizes 8 --seq_lens 512 1024 --cuda_graph \
    --trainers standard flash
run profile g_fp32_adam --model 1b --dtype float32 --attention explicit --batch_sizes 4 \
    --seq_lens 512 --optimizer adam
run profile g_fp32_4096 --model 1b --dtype float32 --attention sdpa --batch_sizes 2 \
    --seq_lens 4096 --max_physical_batch_sizes 1
run hf g_l1_full_adam --model meta-llama/Llama-3.2-1B-Instruct --dtype bfloat16 --optimizer adam \
    --batch_sizes 8 --seq_lens 512 --max_physical_batch_sizes 4 --no_poisson
run hf g_l1_eager_fp32 --model meta-llama/Llama-3.2-1B-Instruct --use_lora --lora_ranks 16 \
    --dtype float32 --attention explicit --batch_sizes 8 --seq_lens 512 \
    --max_physical_batch_sizes 4 --no_poisson
run hf g_l3_fp32 --model meta-llama/Llama-3.2-3B-Instruct --use_lora --lora_ranks 8 \
    --dtype float32 --batch_sizes 4 --seq_lens 1024 --max_physical_batch_sizes 2 --no_poisson
run hf g_l8_lora --model meta-llama/Llama-3.1-8B-Instruct --use_lora --lora_ranks 16 \
    --dtype bfloat16 --batch_sizes 16 --seq_lens 512 --max_physical_batch_sizes 4 --no_poisson
exit "$status"
