#!/usr/bin/env bash
# Does a change of code keep what the GPU measures? Runs the same measurements on this checkout
# and on another one (e.g. `git worktree add /tmp/parent HEAD~1`), one after the other on the
# same card, and compares them:
#   - bench_flash.py steps, bf16, 20 timed steps, eager at EAGER_SHAPES (default 8x1024) and
#     as CUDA graphs at GRAPH_SHAPES (default 8x512, standard and flash), RUNS times each
#     (default 3), alternating old, new, new, old, old, new... (a drift of the host over the
#     run falls on both alike): each config's median of its runs' medians, new / old (the goal:
#     within 3%);
#   - --mode=memory, bf16, at MEMORY_SHAPES (default 1x2048 8x512): peak_memory_mb and the
#     breakdown's keys, per trainer (the goal: equal).
# TRAINERS (default: all four) picks the eager steps' trainers.
# SKIP_STEPS=1 or SKIP_MEMORY=1 leaves that part out; an empty *_SHAPES leaves that run out.
# usage: [RUNS=n] [TRAINERS=...] benchmarks/same_behaviour.sh OLD_CHECKOUT [OUTPUT_DIR]
# (needs CUDA)
set -euo pipefail
usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in
    -h | --help) usage; exit 0 ;;
    "") usage >&2; exit 2 ;;
esac
NEW=$(cd "$(dirname "$0")/.." && pwd)
OLD=$(cd "$1" && pwd)
OUT=${2:-runs/same_behaviour_$(date +%Y%m%d_%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
EAGER_SHAPES=${EAGER_SHAPES-8x1024}
GRAPH_SHAPES=${GRAPH_SHAPES-8x512}
MEMORY_SHAPES=${MEMORY_SHAPES-1x2048 8x512}
TRAINERS=${TRAINERS:-standard dpsgd ghost flash}
tree_of() { if [ "$1" = new ]; then echo "$NEW"; else echo "$OLD"; fi; }
round=0
order=""
for i in $(seq "${RUNS:-3}"); do
    if [ $((i % 2)) = 1 ]; then order="$order old new"; else order="$order new old"; fi
done
[ "${SKIP_STEPS:-0}" = 1 ] && order=""
for tag in $order; do
    round=$((round + 1))
    # shellcheck disable=SC2086
    [ -z "$EAGER_SHAPES" ] || (cd "$(tree_of $tag)" && "$PYTHON" bench_flash.py steps \
        --dtypes bfloat16 --shapes $EAGER_SHAPES --trainers $TRAINERS --steps 20 \
        --warmup_steps 3 --output_dir "$OUT/$tag" --run_name "steps$round")
    # shellcheck disable=SC2086
    [ -z "$GRAPH_SHAPES" ] || (cd "$(tree_of $tag)" && "$PYTHON" bench_flash.py steps \
        --dtypes bfloat16 --shapes $GRAPH_SHAPES --trainers standard flash --cuda_graph \
        --steps 20 --warmup_steps 3 --output_dir "$OUT/$tag" --run_name "graphsteps$round")
done
[ "${SKIP_MEMORY:-0}" = 1 ] && MEMORY_SHAPES=""
for tag in old new; do
    for shape in $MEMORY_SHAPES; do
        (cd "$(tree_of $tag)" && "$PYTHON" profiling_script.py --mode=memory --dtype bfloat16 \
            --batch_sizes "${shape%x*}" --seq_lens "${shape#*x}" --output_dir "$OUT/$tag" \
            --run_name "memory$shape")
    done
done
"$PYTHON" - "$OUT" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
def results(tag, run):
    found = {}
    for path in glob.glob(os.path.join(out, tag, run, "*", "result.json")):
        found[os.path.basename(os.path.dirname(path))] = json.load(open(path))
    return found
def medians(tag):
    found = {}
    folder = os.path.join(out, tag)
    for run in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if run.startswith(("steps", "graphsteps")):
            for name, result in results(tag, run).items():
                found.setdefault(name, []).append(result.get("median_time_ms"))
    return found
ok = True
print("step time, bf16: each run's median ms, old -> new (new / old of their medians)")
old, new = medians("old"), medians("new")
for name in sorted(old):
    a, b = old[name], new.get(name, [])
    ratio = noise = None
    if a and b and None not in a + b:
        ratio = statistics.median(b) / statistics.median(a)
        # The same code's runs differ by this much: below it a ratio says nothing.
        noise = max(abs(x - y) / min(x, y) for x, y in ((max(a), min(a)), (max(b), min(b))))
    ok &= ratio is not None and abs(ratio - 1) <= 0.03
    shown = f"{ratio:.3f}, the runs of one code apart by {noise:.1%}" if ratio else "not measured"
    print(f"  {name}: {[round(x, 1) for x in a if x]} -> {[round(x, 1) for x in b if x]} ({shown})")
print("--mode=memory: peak_memory_mb old -> new, breakdown keys equal")
for run in sorted(os.listdir(os.path.join(out, "old")) if os.path.isdir(os.path.join(out, "old")) else []):
    if not run.startswith("memory"):
        continue
    old, new = results("old", run), results("new", run)
    for name in sorted(old):
        a, b = old[name], new.get(name, {})
        same_keys = sorted(a.get("breakdown") or {}) == sorted(b.get("breakdown") or {})
        equal = a.get("peak_memory_mb") == b.get("peak_memory_mb")
        ok &= same_keys and equal and a.get("peak_memory_mb") is not None
        print(f"  {run} {name}: {a.get('peak_memory_mb')} -> {b.get('peak_memory_mb')}, "
              f"keys equal: {same_keys}")
print("same behaviour: " + ("yes" if ok else "NO"))
PY
