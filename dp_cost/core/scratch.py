"""Every temporary file of a run inside its run directory.

A run's processes get a private folder, ``<run_dir>/.scratch-<random>`` (``files.Staging``), for
as long as the run lasts: Python's tempfile hands it out (the CPU peak's profiler export, and
any library that asks tempfile where temporaries go), the programs a worker starts find it in
TMPDIR, and torch's inductor cache (made when torch._dynamo is imported, in the system's
temporary folder by default) is made in it unless TORCHINDUCTOR_CACHE_DIR names another place.
It is removed when the run ends; a killed run's is removed by ``--resume`` or ``--mode=report``
(``rundir.remove_stale_temporaries``).
"""

from __future__ import annotations

import contextlib
import os
import tempfile

from dp_cost.core import files

PREFIX = ".scratch-"
PATH_MAX = os.pathconf("/", "PC_PATH_MAX") - 64  # room for the names tempfile makes inside
# What the folder is named to: the temporary folder, and torch's inductor cache if not set.
TEMPORARY_FOLDER, INDUCTOR_CACHE = "TMPDIR", "TORCHINDUCTOR_CACHE_DIR"


@contextlib.contextmanager
def scratch_folder(run_dir: str):
    """The run's scratch folder, made in ``run_dir`` and named to tempfile and the environment
    inside, removed with what is in it on the way out (the environment restored)."""
    saved = {name: os.environ.get(name) for name in (TEMPORARY_FOLDER, INDUCTOR_CACHE)}
    saved_tempdir = tempfile.tempdir
    with files.staging(run_dir, root=run_dir, prefix=PREFIX) as stage:
        path = os.path.join(run_dir, stage.name)
        os.environ[TEMPORARY_FOLDER] = path  # programs started from here
        os.environ.setdefault(INDUCTOR_CACHE, os.path.join(path, "torchinductor"))
        # By name, as TMPDIR: libraries hand tempfile's paths to programs of their own (Triton
        # gives ptxas its PTX file), where this process's /proc/self/fd/N is not this folder.
        # Only a run directory past PATH_MAX, which no name reaches, falls back to that.
        tempfile.tempdir = path if len(os.fsencode(path)) < PATH_MAX else stage.path
        try:
            yield path
        finally:
            tempfile.tempdir = saved_tempdir
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
