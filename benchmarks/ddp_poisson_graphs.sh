#!/usr/bin/env bash
# DDP with Poisson sampling and CUDA graphs on GPUS cards of one host (default 2): Llama-3.2-3B
# LoRA r32, bf16, seq 256, global batch 32 (physical 2 per rank), standard and flash graphed,
# 30 timed draws after DDP's 11 eager iterations; then what each rank replayed and flash's mean
# step over standard's (benchmarks/graph_replays.py).
#
# usage: bash benchmarks/ddp_poisson_graphs.sh [GPUS] [OUTPUT_DIR]   (needs GPUS CUDA cards)
set -euo pipefail
case "${1:-}" in
    -h | --help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
gpus=${1:-2}
out=${2:-./runs}
run="ddp_poisson_graphs_$(date +%Y%m%d_%H%M%S)"
cd "$(dirname "$0")/.."
torchrun --standalone --nproc_per_node "$gpus" profiling_script.py --mode=hf --distributed ddp \
    --model_name meta-llama/Llama-3.2-3B-Instruct --use_lora --lora_rank 32 --seq_length 256 \
    --batch_size 32 --max_physical_batch_size 2 --dtype bfloat16 --cuda_graph \
    --trainers standard flash --steps 30 --warmup_steps 11 --no_trace \
    --output_dir "$out" --run_name "$run"
python benchmarks/graph_replays.py "$out/$run"
