"""Process-wide test settings, applied before any test module loads.

- Where no GPU exists (CI), Triton kernels can only run interpreted: TRITON_INTERPRET must be set
  before triton is first imported (its own library functions are decorated at that import).
- One intra-op thread in the pytest process: tests compute in it and also fork workers from it
  (measure.processes.run_configs), and a child forked while an OpenMP pool exists can hang in
  its first parallel op (seen here in layer_norm). The CLI itself never computes before forking.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)
