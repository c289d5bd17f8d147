"""How a trainer's step runs: its physical chunks, eagerly or for a capture (``chunks``), and
the whole step as one CUDA graph (``graph``)."""
