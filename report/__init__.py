"""Reporting: tables, plots and sweep views, rendered from result files alone (no torch).

``summary.write_summary(run_dir, results)`` is the entry point (``results``: ``load_results``).
Below it: ``results`` (reading, ordering, and the comparison keys ``shape_key`` and the sweep's
``series_key``), ``tables`` (summary and kernel tables, CSV), ``text`` (summary.txt), ``plots``
(a run's four plots), ``sweep`` (a sweep's fits, findings and files) with ``sweep_peak_plots``
and ``sweep_detail_plots``, and ``figures`` (matplotlib setup, saving, shared drawing pieces).
"""
