#!/usr/bin/env bash
# How long README's test command takes on this machine: `pip install -r requirements-dev.txt &&
# python -m pytest -q`, run from the repository root, its wall time printed at the end. Measure
# on a quiet machine (nothing else running; CI's size is 2 cores): the suite's workers share the
# cores, so other jobs lengthen it several times.
# usage: benchmarks/test_command_time.sh   (in the environment the tests run in)
set -euo pipefail
case "${1:-}" in
    -h | --help) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    "") ;;
    *) echo "usage: benchmarks/test_command_time.sh (no arguments)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)"
start=$(date +%s.%N)
status=0
pip install -q -r requirements-dev.txt && python -m pytest -q || status=$?
end=$(date +%s.%N)
echo "test command: $(python3 -c "print(f'{$end - $start:.1f}')") s wall, exit $status"
exit "$status"
