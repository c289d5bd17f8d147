"""The bottom layer: what measuring and reporting both need, free of torch.

``files`` (atomic writes, JSON in and out), ``schema`` (the result file's keys and the names both
sides share), ``settings`` (the one table of experiment settings), ``fmt`` (ratios and the one
table renderer) and ``kernel_names`` (profiler trace reading and kernel categories).
"""
