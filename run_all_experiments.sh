#!/usr/bin/env bash
# Memory breakdown suite (as the older memory_test/test_algo/run_all_experiments.sh): every
# registered trainer in its own process on one shape, the exact breakdown of each peak, then the plots and summary.txt. The knobs are environment
# variables, read here only (the CLI takes flags):
#   VOCAB_SIZE=32000 HIDDEN_DIM=2048 NUM_LAYERS=20 NUM_HEADS=16 SEQ_LEN=16384 BATCH_SIZE=1
#   NUM_ITER=3 WARMUP_ITER=2 ATTENTION=sdpa TRAINERS="standard dpsgd ghost flash" DTYPE=float32
# SDPA is the default: explicit-softmax attention keeps B*H*T^2 probabilities and cannot hold
# T=16384 on an 80 GB card even without DP. Extra arguments go to profiling_script.py.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
OUTPUT_DIR=${OUTPUT_DIR:-./memory_profiling_results}
RUN_NAME=${RUN_NAME:-run_$(date +%Y%m%d_%H%M%S)}
read -r -a trainers <<< "${TRAINERS:-standard dpsgd ghost flash}"

if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "run_all_experiments.sh: no CUDA GPU visible to PyTorch; the breakdown needs the CUDA" \
         "caching allocator's history. CPU check: $PYTHON profiling_script.py --mode=test" >&2
    exit 1
fi

status=0
"$PYTHON" profiling_script.py --mode=memory --device cuda --model 1b \
    --vocab_size "${VOCAB_SIZE:-32000}" --hidden_dim "${HIDDEN_DIM:-2048}" \
    --num_layers "${NUM_LAYERS:-20}" --num_heads "${NUM_HEADS:-16}" \
    --max_seq_len "$(( ${SEQ_LEN:-16384} > 16384 ? ${SEQ_LEN:-16384} : 16384 ))" \
    --seq_len "${SEQ_LEN:-16384}" --batch_size "${BATCH_SIZE:-1}" \
    --num_iter "${NUM_ITER:-3}" --warmup_iter "${WARMUP_ITER:-2}" \
    --attention "${ATTENTION:-sdpa}" --dtype "${DTYPE:-float32}" \
    --trainers "${trainers[@]}" \
    --output_dir "$OUTPUT_DIR" --run_name "$RUN_NAME" "$@" || status=$?

cat <<MSG

Results: $OUTPUT_DIR/$RUN_NAME/summary.txt, summary.md, visualizations/
  (memory_breakdown_comparison.png, memory_timeline.png, performance_tradeoff.png)
Re-render from the result files: $PYTHON profiling_script.py --mode=report --input_dir $OUTPUT_DIR/$RUN_NAME
MSG
exit $status
