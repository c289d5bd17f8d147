#!/usr/bin/env bash
# 1b, bf16, SDPA, seq 1024 on GPUS cards of one host (default: every card nvidia-smi lists),
# --steps 5 --warmup_steps 2 (graphed runs: DDP's 11 eager iterations first), one run per mode,
# the 1-GPU baselines on the same host; then the table (benchmarks/scaling_table.py). PARTS
# (default: one weak strong graph) picks what runs:
#   one     1 GPU at (8, 1024): standard, flash; per-layer flash and dpsgd
#   weak    DDP and FSDP2 x GPUS at 8 samples per rank: standard, flash; per-layer flash (and
#           dpsgd under DDP)
#   strong  DDP and FSDP2 x GPUS at global (8, 1024), eager: standard, flash; per-layer flash
#   graph   --cuda_graph at global (8, 1024), 1 GPU and DDP x GPUS: standard, flash
#   trace   (not by default) DDP and FSDP2 x GPUS at 8 samples per rank, standard and flash,
#           each config's traces kept (per rank a gzipped full trace and a light one), under
#           OUTPUT_DIR_traced (not in the table), for Holistic Trace Analysis:
#           benchmarks/trace_overlap.py OUTPUT_DIR_traced/trace_fsdp/<config> from HTA's own
#           environment (it says how; it reads the light traces)
# One chunk per rank: --fsdp_sync changes nothing here (benchmarks/fsdp_8b.sh runs several).
#
# usage: [PARTS="one weak"] bash benchmarks/scaling.sh [GPUS] [OUTPUT_DIR]
set -euo pipefail
case "${1:-}" in
    -h | --help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
gpus=${1:-$(nvidia-smi -L | wc -l)}
out=${2:-./runs}
parts=${PARTS:-one weak strong graph}
cd "$(dirname "$0")/.."
traced=(--mode=profile --model 1b --dtype bfloat16 --attention sdpa --seq_lens 1024 --steps 5
        --output_dir "$out")
common=("${traced[@]}" --no_trace)
one() { CUDA_VISIBLE_DEVICES=0 python profiling_script.py "${common[@]}" "$@"; }
ranks() { torchrun --standalone --nproc_per_node "$gpus" profiling_script.py "${common[@]}" "$@"; }
for part in $parts; do
    case $part in
        one)
            one --warmup_steps 2 --batch_sizes 8 --trainers standard flash --run_name one
            one --warmup_steps 2 --batch_sizes 8 --trainers flash dpsgd --clipping per_layer \
                --run_name one_perlayer ;;
        weak)
            for mode in ddp fsdp; do
                ranks --warmup_steps 2 --batch_sizes $((8 * gpus)) --distributed $mode \
                    --trainers standard flash --run_name "weak_$mode"
                per_layer=(flash); [ $mode = ddp ] && per_layer+=(dpsgd)
                ranks --warmup_steps 2 --batch_sizes $((8 * gpus)) --distributed $mode \
                    --trainers "${per_layer[@]}" --clipping per_layer --run_name "weak_${mode}_perlayer"
            done ;;
        strong)
            for mode in ddp fsdp; do
                ranks --warmup_steps 2 --batch_sizes 8 --distributed $mode \
                    --trainers standard flash --run_name "strong_$mode"
                ranks --warmup_steps 2 --batch_sizes 8 --distributed $mode \
                    --trainers flash --clipping per_layer --run_name "strong_${mode}_perlayer"
            done ;;
        graph)
            one --warmup_steps 11 --batch_sizes 8 --trainers standard flash --cuda_graph \
                --run_name one_graph
            ranks --warmup_steps 11 --batch_sizes 8 --distributed ddp --trainers standard flash \
                --cuda_graph --run_name strong_ddp_graph ;;
        trace)
            for mode in ddp fsdp; do
                torchrun --standalone --nproc_per_node "$gpus" profiling_script.py "${traced[@]}" \
                    --trace_gzip --warmup_steps 2 --batch_sizes $((8 * gpus)) --distributed $mode \
                    --trainers standard flash --output_dir "${out%/}_traced" --run_name "trace_$mode"
            done ;;
        *) echo "unknown part $part (one, weak, strong, graph, trace)" >&2; exit 2 ;;
    esac
done
# The table reads the untraced parts' runs: a trace part alone leaves it none to read.
if [ "$parts" != trace ]; then python benchmarks/scaling_table.py "$out"; fi
