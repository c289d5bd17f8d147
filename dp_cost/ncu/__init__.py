"""Nsight Compute (ncu): command lines, report export and parsing, per-step traffic aggregation.

    ncu --replay-mode app-range --clock-control none --metrics dram__bytes_read.sum,... \\
        --target-processes all -f -o ncu_reports/report_dpsgd_bs8_seq256 \\
        python profiling_script.py --mode=profile --trainer=dpsgd ... --ncu       # ncu.command
    ncu --import ncu_reports/report_dpsgd_bs8_seq256.ncu-rep --csv --page raw ...  # ncu.export
    python profiling_script.py --mode=ncu_report --input_dir ncu_reports   # ncu.summary

The worker (``--ncu``) runs its warm-up steps outside the profiled range and one step between
``torch.cuda.profiler.start()`` and ``stop()`` (cudaProfilerStart/Stop), so every kernel of that
step -- the backward ones that autograd launches from its own thread included -- is inside the
range, and nothing else is. Two ways to measure it (``ncu.command.REPLAY_MODES``):

- kernel replay (``--profile-from-start off``): one result per kernel. ncu replays each kernel
  once per metric pass and, by default, flushes the caches before each replay, so the DRAM bytes
  of a kernel are what it moves from a cold L2; their sum over the step is the step's traffic
  when no data survives in L2 between kernels. Per-kernel numbers give the per-category
  breakdown, at ~0.15 s of ncu overhead per kernel (a step launches 100-520).
- range replay (``--replay-mode app-range`` or ``range``): one result for the whole range, a
  row named ``range`` in the export: the real step's DRAM / L2 bytes with warm caches between
  kernels (dirty lines written back during the step count as writes) and the range's GPU time.
  app-range reruns the whole application once per metric pass and has no API restrictions;
  range captures the API calls inside the range and replays them, which supports only a subset
  of CUDA APIs (some trainers' steps are rejected).

Modules: ``metrics`` (metric names, nvprof-era translation), ``command`` (finding ncu, report
names, the profiling and export command lines), ``export`` (parsing ``--page raw`` CSV, units,
aggregation, loading reports), ``summary`` (tables, plot, ``write_ncu_summary``) and ``cli``
(``python -m dp_cost.ncu command ...`` / ``... metrics ...`` for run_profiling_ncu.sh).
Nothing here imports torch.
"""
