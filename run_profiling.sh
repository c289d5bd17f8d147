#!/usr/bin/env bash
# GPU suite (as the older run_profiling.sh): the 1b model, every registered trainer x batch {4,8} x seq {512,1024},
# each config in its own process, torch.profiler traces for TensorBoard / Perfetto, and a table.
# Extra arguments go to profiling_script.py (e.g. --trainers standard dpsgd, --dtype bfloat16).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "run_profiling.sh: no CUDA GPU visible to PyTorch (check nvidia-smi and that torch is a" \
         "CUDA build). For a CPU check run: $PYTHON profiling_script.py --mode=test" >&2
    exit 1
fi

OUTPUT_DIR=${OUTPUT_DIR:-./runs}
RUN_NAME=${RUN_NAME:-profile_$(date +%Y%m%d_%H%M%S)}
status=0
"$PYTHON" profiling_script.py --mode=profile --device cuda \
    --output_dir "$OUTPUT_DIR" --run_name "$RUN_NAME" "$@" || status=$?

cat <<MSG

Results:     $OUTPUT_DIR/$RUN_NAME/  (summary.md, summary.csv, visualizations/memory_curve.png,
             one directory per config with result.json and its trace)
TensorBoard: tensorboard --logdir=$OUTPUT_DIR    (then open http://localhost:6006, PyTorch Profiler tab)
The *.pt.trace.json.gz files also open directly in Perfetto (https://ui.perfetto.dev) and in
chrome://tracing, no TensorBoard plugin needed.
MSG
exit $status
