"""Reporting: tables, plots and sweep views, rendered from result files alone (no torch).

``summary.write_summary(run_dir, results)`` is the entry point (``results``: ``load_results``).
Below it: ``results`` (reading, ordering, and the comparison keys ``shape_key`` and the sweep's
``series_key``), ``result_check`` (is a parsed file a usable result), ``tables`` (summary with
the steps' spread, kernel table, CSV), ``text`` (summary.txt), ``plots`` (a run's four plots),
``html_report`` (report.html, the offline view) with ``run_info`` (its header: command line,
date, device, versions) and ``trace_analysis`` (trace_analysis.csv: Holistic Trace Analysis of
the traces, optional), ``sweep`` (a sweep's fits, findings and files)
with ``sweep_peak_plots`` and ``sweep_detail_plots``, and ``figures`` (matplotlib setup, saving,
running each plot so one failure loses nothing else, shared drawing pieces).
"""
