"""dp_cost: what differential privacy costs in PyTorch training, measured.

The machinery behind the top-level ``profiling_script.py`` (the CLI), ``models.py`` and
``trainers.py``; ARCHITECTURE.md maps its folders.
"""
