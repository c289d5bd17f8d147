#!/usr/bin/env bash
# Llama-3.1-8B-Instruct full fine-tuning under FSDP2 on GPUS cards of one host (default: every
# card nvidia-smi lists): bf16, SGD, global batch 16, seq 512, physical 2 per rank (several
# chunks per rank), fixed-size batches, random weights, --steps 2 --warmup_steps 1; with the
# gradients reduce-scattered after every chunk (--fsdp_sync chunk: standard, ghost, flash) and
# once per logical batch (logical: standard, flash; ghost recorded skipped); then the table
# (benchmarks/scaling_table.py). A config out of memory is recorded oom.
#
# usage: bash benchmarks/fsdp_8b.sh [GPUS] [OUTPUT_DIR]
set -euo pipefail
case "${1:-}" in
    -h | --help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
gpus=${1:-$(nvidia-smi -L | wc -l)}
out=${2:-./runs}
cd "$(dirname "$0")/.."
for sync in chunk logical; do
    torchrun --standalone --nproc_per_node "$gpus" profiling_script.py --mode=hf \
        --model_name meta-llama/Llama-3.1-8B-Instruct --seq_length 512 --batch_size 16 \
        --max_physical_batch_size 2 --dtype bfloat16 --optimizer sgd --steps 2 --warmup_steps 1 \
        --no_trace --no_poisson --distributed fsdp --fsdp_sync "$sync" \
        --trainers standard ghost flash --output_dir "$out" --run_name "llama8b_x${gpus}_$sync"
done
python benchmarks/scaling_table.py "$out"
