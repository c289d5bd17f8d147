#!/usr/bin/env bash
# Single-GPU Hugging Face analysis (the older run_single_gpu_analysis.sh's suite) as one
# --mode=hf_sweep run directory:
#   1. basic: seq 128, batch 8, physical 1, full fine-tuning
#   2. sequence length 64 / 128 / 256 at batch 8
#   3. logical batch 8 / 16 / 32 at seq 128
#   4. LoRA rank 16 / 32 against full fine-tuning (seq 128, batch 8)
#   5. physical batch 1 / 2 / 4 (seq 128, batch 8)
# Every config runs in its own process; the parts share one run directory (made first, and
# --resumed by every part), so a config common to several parts runs once, and the last part's report
# covers all of them: memory_profile_results.json, memory_profile_summary.csv,
# peak_memory_comparison.png, memory_usage_timeline.png, ... and summary.md with the findings.
#
# Usage: ./run_single_gpu_analysis.sh [--token TOKEN] [more profiling_script.py arguments]
# The token (or HF_TOKEN from the environment, preferred: a command line is visible to other
# users) reaches the workers through the environment only; it is never printed or written. It is
# needed with --pretrained (real weights from the Hub or a local cache); the default random
# weights have the same shapes, so the same memory and time.
# Knobs, read here only: MODEL (meta-llama/Llama-3.2-3B-Instruct), TRAINERS ("dpsgd", the older script's
# Opacus per-sample gradients), NUM_STEPS (5), OUTPUT_DIR (./single_gpu_memory_results),
# RUN_NAME (analysis_<timestamp>), DEVICE (cuda; cpu for a check with MODEL=tiny-llama), PYTHON.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-meta-llama/Llama-3.2-3B-Instruct}
DEVICE=${DEVICE:-cuda}
OUTPUT_DIR=${OUTPUT_DIR:-./single_gpu_memory_results}
RUN_NAME=${RUN_NAME:-analysis_$(date +%Y%m%d_%H%M%S)}
read -r -a trainers <<< "${TRAINERS:-dpsgd}"

extra=()
while (($#)); do
    case "$1" in
        --token)
            if (($# < 2)); then
                echo "run_single_gpu_analysis.sh: --token needs a value" >&2
                exit 2
            fi
            export HF_TOKEN="$2"
            shift 2
            ;;
        --token=*)
            export HF_TOKEN="${1#--token=}"
            shift
            ;;
        *)
            extra+=("$1")
            shift
            ;;
    esac
done

if [[ $DEVICE == cuda ]] &&
    ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "run_single_gpu_analysis.sh: no CUDA GPU visible to PyTorch (check nvidia-smi and that" \
         "torch is a CUDA build). CPU check: DEVICE=cpu MODEL=tiny-llama $0" >&2
    exit 1
fi

mkdir -p "$OUTPUT_DIR/$RUN_NAME"  # --resume continues a run directory, never makes one
status=0
part() {  # part <title> <sweep arguments...>: one hf_sweep invocation into the shared run
    local title=$1 code=0
    shift
    echo "== $title"
    "$PYTHON" profiling_script.py --mode=hf_sweep --device "$DEVICE" --model_name "$MODEL" \
        --trainers "${trainers[@]}" --num_steps "${NUM_STEPS:-5}" \
        --results_dir "$OUTPUT_DIR" --run_name "$RUN_NAME" --resume "$@" ${extra[@]+"${extra[@]}"} ||
        code=$?
    if ((code == 2 || code == 130)); then  # bad arguments or Ctrl-C: the later parts would too
        exit "$code"
    fi
    if ((code != 0)); then
        status=$code
    fi
}

part "1/5 basic: seq 128, batch 8, no LoRA" \
    --seq_length 128 --batch_size 8 --max_physical_batch_size 1
part "2/5 sequence length 64 / 128 / 256 at batch 8" \
    --seq_lengths 64 128 256 --batch_size 8 --max_physical_batch_size 1
part "3/5 batch 8 / 16 / 32 at seq 128" \
    --seq_length 128 --batch_sizes 8 16 32 --max_physical_batch_size 1
part "4/5 LoRA rank 16 / 32 (full fine-tuning: part 1)" \
    --seq_length 128 --batch_size 8 --max_physical_batch_size 1 --use_lora --lora_ranks 16 32
part "5/5 physical batch 1 / 2 / 4" \
    --seq_length 128 --batch_size 8 --max_physical_batch_sizes 1 2 4

cat <<MSG

Results: $OUTPUT_DIR/$RUN_NAME/  (summary.md with the findings, memory_profile_summary.csv,
  memory_profile_results.json, peak_memory_comparison.png, memory_usage_timeline.png,
  memory_analysis_overview.png, memory_heatmap.png, detailed_memory_analysis.png,
  operation_level_breakdown.png, memory_timeline_config_<config>.png; one directory per config)
Re-render from the result files: $PYTHON profiling_script.py --mode=report --input_dir $OUTPUT_DIR/$RUN_NAME
MSG
exit $status
