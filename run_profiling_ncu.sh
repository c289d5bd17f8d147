#!/usr/bin/env bash
# Nsight Compute suite (as the older run_profiling_ncu.sh): DRAM / L2 traffic of one training
# step per trainer x batch x seq config. Every config runs under ncu in its own process and writes
# $OUTPUT_DIR/report_<trainer>_bs<B>_seq<T>.ncu-rep; then the comparison table and plot are
# written next to them (profiling_script.py --mode=ncu_report).
#
#   ./run_profiling_ncu.sh [--replay-mode app-range|kernel|range] [--metrics NAME[,NAME...]]
#                          [--clock-control none|base|boost|force-boost|reset] [--dry-run]
#                          [-- more profiling_script.py arguments, e.g. --dtype bfloat16]
#
# --replay-mode app-range (default): ncu reruns the app once per metric pass and keeps one result
#   for the measured step (the worker's cudaProfilerStart/Stop range): whole-step totals per
#   config (DRAM read / write, L2 bytes, the range's GPU time), warm caches between kernels as in
#   training; no per-kernel numbers. One config (flash bs 8 seq 256) took 16 s on an H200; the
#   default suite (16 configs) took 390 s on an H100 (benchmarks/README.md).
# --replay-mode kernel: per-kernel numbers and the per-category breakdown; ncu replays every
#   kernel of the step from a flushed L2 (~0.15 s each), so a config takes about a minute (71 s
#   for the one above, same H200). Measured on an H100 (2026-11-26) with the default model:
#   8 configs (bs 8) in 523 s, so the full default grid takes ~17-18 min. Kernel count, not model
#   size, sets the time: a DP step launches 300-520 kernels even for one layer. Narrow the grid
#   for a shorter run (BATCH_SIZES=8 SEQ_LENS=256: 4 configs, ~4 min).
# --replay-mode range: one result per step like app-range, but ncu captures and replays the
#   range's CUDA API calls; it supports only a subset of them (the ghost trainer's step failed).
#
# Environment knobs (read here only, never by the CLI):
#   TRAINERS="standard dpsgd ghost flash"  BATCH_SIZES="8 16"  SEQ_LENS="256 1024"
#   OUTPUT_DIR=ncu_reports  RUN_NAME=ncu_<timestamp> (result files: $OUTPUT_DIR/runs/$RUN_NAME)
#   MODEL_ARGS="--hidden_dim 1024 --num_layers 1 --num_heads 16 --vocab_size 32000"
#   NCU=/path/to/ncu (default: ncu on PATH)  PYTHON=python3
# Per-step bytes of the transformer blocks scale with the layer count (MODEL_ARGS).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

usage() {  # the header comment above
    awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
}

METRICS=""
CLOCK_CONTROL=none
REPLAY_MODE=app-range
DRY_RUN=0
EXTRA=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --metrics | --clock-control | --clock_control | --replay-mode | --replay_mode)
            if [[ $# -lt 2 ]]; then
                echo "error: $1 needs a value" >&2
                exit 2
            fi
            case "$1" in
                --metrics) METRICS=$2 ;;
                --replay-mode | --replay_mode) REPLAY_MODE=$2 ;;
                *) CLOCK_CONTROL=$2 ;;
            esac
            shift 2
            ;;
        --metrics=*) METRICS=${1#*=}; shift ;;
        --clock-control=* | --clock_control=*) CLOCK_CONTROL=${1#*=}; shift ;;
        --replay-mode=* | --replay_mode=*) REPLAY_MODE=${1#*=}; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; EXTRA+=("$@"); break ;;
        *) EXTRA+=("$1"); shift ;;
    esac
done

# ncu first: nothing runs or is written without it. A dry run only prints the commands, so it
# needs no ncu (they name plain `ncu`).
NCU=${NCU:-$(command -v ncu || true)}
if [[ $DRY_RUN == 1 && -z $NCU ]]; then
    NCU=ncu
elif [[ -z $NCU || ! -x $NCU ]]; then
    "$PYTHON" -c 'from dp_cost.ncu.command import NCU_MISSING_MESSAGE as m; print("error: " + m)' \
        >&2 2>/dev/null \
        || echo "error: ncu (Nsight Compute CLI) not found: put it on PATH or set NCU=/path/to/ncu" >&2
    exit 1
fi

# nvprof-era names (dram_read_throughput, ...) do not exist in ncu: stop with the replacement.
if [[ -n $METRICS ]]; then
    METRICS=$("$PYTHON" -m dp_cost.ncu metrics "$METRICS") || exit 2
fi
case "$CLOCK_CONTROL" in
    none | base | boost | force-boost | reset) ;;
    *) echo "error: --clock-control must be none, base, boost, force-boost or reset (got '$CLOCK_CONTROL')" >&2; exit 2 ;;
esac
case "$REPLAY_MODE" in
    app-range | kernel | range) ;;
    *) echo "error: --replay-mode must be app-range, kernel or range (got '$REPLAY_MODE')" >&2; exit 2 ;;
esac

TRAINERS=${TRAINERS:-"standard dpsgd ghost flash"}
BATCH_SIZES=${BATCH_SIZES:-"8 16"}
SEQ_LENS=${SEQ_LENS:-"256 1024"}
OUTPUT_DIR=${OUTPUT_DIR:-ncu_reports}
RUN_NAME=${RUN_NAME:-ncu_$(date +%Y%m%d_%H%M%S)}
MODEL_ARGS=${MODEL_ARGS:-"--hidden_dim 1024 --num_layers 1 --num_heads 16 --vocab_size 32000"}
read -r -a model_args <<<"$MODEL_ARGS"
PYTHON_BIN=$(command -v "$PYTHON")

# Every config --resumes one run directory, made here: --resume refuses a missing one.
if [[ $DRY_RUN == 0 ]]; then mkdir -p "$OUTPUT_DIR/runs/$RUN_NAME"; fi
failed=()
for batch in $BATCH_SIZES; do
    for seq in $SEQ_LENS; do
        for trainer in $TRAINERS; do
            # python -m dp_cost.ncu builds the command (one source of truth); it prints it shell-quoted.
            cmd=$("$PYTHON" -m dp_cost.ncu command --ncu "$NCU" --python "$PYTHON_BIN" \
                --report_dir "$OUTPUT_DIR" --trainer "$trainer" --batch_size "$batch" \
                --seq_len "$seq" --clock_control "$CLOCK_CONTROL" --replay_mode "$REPLAY_MODE" \
                ${METRICS:+--metrics "$METRICS"} \
                -- ${model_args[@]+"${model_args[@]}"} --output_dir "$OUTPUT_DIR/runs" \
                --run_name "$RUN_NAME" --resume ${EXTRA[@]+"${EXTRA[@]}"})
            echo "==> $cmd"
            if [[ $DRY_RUN == 1 ]]; then continue; fi
            if ! eval "$cmd"; then
                echo "!!! $trainer bs$batch seq$seq failed (see above); continuing" >&2
                failed+=("${trainer}_bs${batch}_seq${seq}")
            fi
        done
    done
done
if [[ $DRY_RUN == 1 ]]; then exit 0; fi

status=0
"$PYTHON" profiling_script.py --mode=ncu_report --input_dir "$OUTPUT_DIR" || status=$?
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "Failed configs: ${failed[*]}" >&2
    status=1
fi

cat <<MSG

Reports:  $OUTPUT_DIR/report_<trainer>_bs<B>_seq<T>.ncu-rep  (+ .csv exports)
Summary:  $OUTPUT_DIR/ncu_summary.md, ncu_summary.csv, ncu_comparison.png
Open one: ncu-ui $OUTPUT_DIR/report_dpsgd_bs8_seq256.ncu-rep
          ncu --import $OUTPUT_DIR/report_dpsgd_bs8_seq256.ncu-rep --page details
          ncu --import $OUTPUT_DIR/report_dpsgd_bs8_seq256.ncu-rep --csv --page raw > analysis.csv
Re-render: $PYTHON profiling_script.py --mode=ncu_report --input_dir $OUTPUT_DIR
MSG
exit $status
