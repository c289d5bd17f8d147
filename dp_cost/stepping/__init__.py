"""How a trainer's step runs: its physical chunks, eagerly or padded to one size (``chunks``),
and the padded step captured and replayed as CUDA graphs (``graph``)."""
