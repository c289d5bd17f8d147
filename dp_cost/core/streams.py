"""The CLI's output may be lost; the run is not.

Progress lines and tables go to stdout and stderr, which can go away under a run: a pipe whose
reader ended (``| head -1``: a broken pipe), a full disk (``> log`` on it: no space left), a
terminal gone with its ssh session (EIO). What counts is the run directory, so a stream whose
write fails is pointed at /dev/null from then on (its file descriptor too, so that neither the
workers forked later nor the interpreter's exit write to it again) and the run goes on silently
to its end, its exit code that of its configs.
"""

from __future__ import annotations

import contextlib
import os
import sys


def drop(stream) -> None:
    """From now on ``stream``'s file descriptor writes to /dev/null."""
    with contextlib.suppress(OSError, ValueError):  # ValueError: closed; OSError: no descriptor
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


class Losable:
    """A text stream (``sys.stdout``, ``sys.stderr``) whose failing write or flush drops it
    (``drop``) instead of raising: what it held is lost, the writer goes on."""

    def __init__(self, stream):
        self.stream = stream
        self.lost = False

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except (OSError, ValueError):
            self._lose()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except (OSError, ValueError):
            self._lose()

    def _lose(self) -> None:
        self.lost = True
        drop(self.stream)
        with contextlib.suppress(OSError, ValueError):  # what it still buffers: to /dev/null
            self.stream.flush()

    def __getattr__(self, name):  # fileno, isatty, encoding, ...: the stream's own
        return getattr(self.stream, name)


@contextlib.contextmanager
def losable_output():
    """``sys.stdout`` and ``sys.stderr`` as ``Losable`` streams inside (restored after)."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = Losable(sys.stdout), Losable(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
