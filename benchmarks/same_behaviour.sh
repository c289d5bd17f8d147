#!/usr/bin/env bash
# Does a change of code keep what the GPU measures? Runs the same two measurements on this
# checkout and on another one (e.g. `git worktree add /tmp/parent HEAD~1`), one after the other
# on the same card, and compares them:
#   - bench_flash.py steps, bf16 (8, 512), 20 timed steps, run old, new, new, old (a drift of
#     the host over the run falls on both alike; PAIRS=n repeats that n times, for host-bound
#     steps whose runs differ by more than the goal): each trainer's mean of its medians,
#     new / old (the goal: within 3%);
#   - --mode=memory at (1, 2048): peak_memory_mb and the breakdown's keys, per trainer
#     (the goal: equal).
# usage: [PAIRS=n] benchmarks/same_behaviour.sh OLD_CHECKOUT [OUTPUT_DIR]   (needs CUDA)
set -euo pipefail
usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; }
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
tree_of() { if [ "$1" = new ]; then echo "$NEW"; else echo "$OLD"; fi; }
round=0
order=""
for _ in $(seq "${PAIRS:-1}"); do order="$order old new new old"; done
for tag in $order; do
    round=$((round + 1))
    (cd "$(tree_of $tag)" && "$PYTHON" bench_flash.py steps --dtypes bfloat16 --shapes 8x512 \
        --steps 20 --warmup_steps 3 --output_dir "$OUT/$tag" --run_name "steps$round")
done
for tag in old new; do
    (cd "$(tree_of $tag)" && "$PYTHON" profiling_script.py --mode=memory --seq_lens 2048 \
        --batch_sizes 1 --output_dir "$OUT/$tag" --run_name memory)
done
"$PYTHON" - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
def results(tag, run):
    found = {}
    for path in glob.glob(os.path.join(out, tag, run, "*", "result.json")):
        found[os.path.basename(os.path.dirname(path))] = json.load(open(path))
    return found
def medians(tag):
    found = {}
    for run in sorted(os.listdir(os.path.join(out, tag))):
        if run.startswith("steps"):
            for name, result in results(tag, run).items():
                found.setdefault(name, []).append(result.get("median_time_ms"))
    return found
ok = True
print("step time, bf16 (8, 512): each run's median ms, old -> new (new / old of their means)")
old, new = medians("old"), medians("new")
for name in sorted(old):
    a, b = old[name], new.get(name, [])
    ratio = noise = None
    if a and b and None not in a + b:
        ratio = (sum(b) / len(b)) / (sum(a) / len(a))
        # The same code's two runs differ by this much: below it a ratio says nothing.
        noise = max(abs(x - y) / min(x, y) for x, y in ((max(a), min(a)), (max(b), min(b))))
    ok &= ratio is not None and abs(ratio - 1) <= 0.03
    shown = f"{ratio:.3f}, the runs of one code apart by {noise:.1%}" if ratio else "not measured"
    print(f"  {name}: {[round(x, 1) for x in a if x]} -> {[round(x, 1) for x in b if x]} ({shown})")
print("--mode=memory (1, 2048): peak_memory_mb old -> new, breakdown keys equal")
old, new = results("old", "memory"), results("new", "memory")
for name in sorted(old):
    a, b = old[name], new.get(name, {})
    same_keys = sorted(a.get("breakdown") or {}) == sorted(b.get("breakdown") or {})
    equal = a.get("peak_memory_mb") == b.get("peak_memory_mb")
    ok &= same_keys and equal
    print(f"  {name}: {a.get('peak_memory_mb')} -> {b.get('peak_memory_mb')}, keys equal: {same_keys}")
print("same behaviour: " + ("yes" if ok else "NO"))
PY
