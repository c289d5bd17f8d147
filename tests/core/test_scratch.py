"""A run's scratch folder (core/scratch.py): where tempfile and programs started by a run put
their temporaries."""

import os
import subprocess
import sys
import tempfile

from dp_cost.core import scratch


def test_a_temporary_is_named_so_that_another_program_can_open_it(tmp_path):
    """Libraries hand tempfile's paths to programs of their own (Triton gives ptxas the PTX it
    wrote): the path must name the file in that program too, not through this process's
    /proc/self/fd (ptxas could not open its input: flash failed on a GPU)."""
    with scratch.scratch_folder(str(tmp_path)) as path:
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as temporary:
            temporary.write("ok")
        assert os.path.dirname(temporary.name) == path == os.environ["TMPDIR"]
        read = [sys.executable, "-c", "import sys; print(open(sys.argv[1]).read())", temporary.name]
        assert subprocess.run(read, capture_output=True, text=True).stdout.strip() == "ok"
    assert not os.path.exists(path)  # removed on the way out
