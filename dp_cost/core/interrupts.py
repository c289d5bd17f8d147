"""Ctrl-C, SIGTERM and SIGHUP as one interrupt of the CLI, and what an interrupted run prints.

SIGTERM (``timeout``, batch schedulers) and SIGHUP (a dropped ssh session) are handled as
Ctrl-C is: a KeyboardInterrupt (``Terminated`` for those two) the CLI turns into "keep what
finished", exit 130 for Ctrl-C and 143 for the others. A hangup ignored at the start (nohup)
stays ignored. Ctrl-C is handled even where it was ignored at the start (a job a shell script
put in the background), so that ``kill -INT`` still stops the run.

An interrupt is raised where it leaves everything whole: never inside an import (a module left
half imported breaks the next import of it: numpy's "cannot load module more than once", a
RecursionError; the start-up imports torch, opacus, scipy and numpy for seconds), nor inside a
finalizer (Python drops what one raises: the interrupt would be lost), but as soon as the import
or finalizer under way has ended; never inside a ``held`` block, but at its end; and once: a
second signal while the first is on its way to its handler is recorded (its exit code counts),
not raised again.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shlex
import shutil
import signal
import sys
import time

from dp_cost.core import streams
from dp_cost.core.schema import EXIT_INTERRUPTED, EXIT_TERMINATED

INTERRUPTS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
CONTINUE = "Continue this run with:"  # the line that gives the command (tests read it)

# An interrupt that arrived during an import is raised by SIGALRM this long after, or again
# later while the import goes on.
RETRY_S = 0.05
# A raised interrupt reaches its handler (which ignores every later signal) well within this: a
# signal until then is recorded only; one after it is raised again (the first was lost, raised
# where Python drops exceptions: a finalizer).
IN_FLIGHT_S = 1.0

_received = []  # the signals that interrupted this run
_pending = []  # received and not raised yet
_held = []  # non-empty inside held(): a signal is recorded, and raised once the block ends
_raised_at = []  # when an interrupt was last raised (time.monotonic)
_collecting = []  # non-empty while the garbage collector runs (and with it finalizers)
_hooks_before = [sys.unraisablehook]  # sys.unraisablehook before install()


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP: handled exactly like Ctrl-C, exit 143."""


def _on_interrupt(signum, frame):
    _received.append(signum)
    _pending.append(signum)
    _raise_when_whole(frame)


def _on_alarm(signum, frame):
    _raise_when_whole(frame)


def _raise_when_whole(frame) -> None:
    """Raise the interrupt pending, unless a ``held`` block runs (it raises it at its end),
    ``frame`` is inside an import or a finalizer (raised RETRY_S later, by SIGALRM: this
    again), or one was raised less than IN_FLIGHT_S ago (it is on its way: this one is recorded
    only)."""
    if not _pending or _held:
        return
    if _must_wait(frame):
        signal.setitimer(signal.ITIMER_REAL, RETRY_S)
        return
    try:  # one call: a handler that ran since the check above may have taken it already
        signum = _pending.pop()
    except IndexError:
        return
    _pending.clear()
    now = time.monotonic()
    if _raised_at and now - _raised_at[-1] < IN_FLIGHT_S:
        return
    _raised_at.append(now)
    raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated()


def _must_wait(frame) -> bool:
    """Whether ``frame`` runs inside an import (importlib's frames are below it), or where
    Python drops a raised exception ("Exception ignored in ..."): a finalizer (``__del__``, or
    anything the garbage collector runs while it collects), where the interrupt would be lost."""
    if _collecting:
        return True
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith("<frozen importlib") or code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _on_unraisable(unraisable) -> None:
    """Python dropped an exception it could not raise (a weakref callback, a finalizer the checks
    above did not see): an interrupt of ours is pending again, raised RETRY_S later."""
    error = unraisable.exc_value
    if not isinstance(error, KeyboardInterrupt) or not _raised_at:
        _hooks_before[0](unraisable)
        return
    _raised_at.pop()  # it never reached its handler
    _pending.append(_received[-1] if isinstance(error, Terminated) else signal.SIGINT)
    signal.setitimer(signal.ITIMER_REAL, RETRY_S)


def _on_collection(phase: str, info: dict) -> None:
    _collecting[:] = [True] if phase == "start" else []


def install() -> dict:
    """Handle every interrupt from now on; returns the handlers replaced, for ``restore``."""
    _received.clear()
    _pending.clear()
    _raised_at.clear()
    _collecting.clear()
    previous = {signum: signal.getsignal(signum) for signum in (*INTERRUPTS, signal.SIGALRM)}
    for signum in INTERRUPTS:
        if signum != signal.SIGHUP or previous[signum] != signal.SIG_IGN:
            signal.signal(signum, _on_interrupt)
    signal.signal(signal.SIGALRM, _on_alarm)
    if _on_collection not in gc.callbacks:
        gc.callbacks.append(_on_collection)
    if sys.unraisablehook is not _on_unraisable:
        _hooks_before[0], sys.unraisablehook = sys.unraisablehook, _on_unraisable
    return previous


def restore(previous: dict) -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)
    with contextlib.suppress(ValueError):
        gc.callbacks.remove(_on_collection)
    if sys.unraisablehook is _on_unraisable:
        sys.unraisablehook = _hooks_before[0]
    restore_handlers(list(previous.items()))


def restore_handlers(handlers: list) -> None:
    """Each (signal, handler) set again, every one of them even when a signal that arrives
    between two raises through a handler already restored: the rest would keep the one they
    had (a fork guard's recorder, say: a SIGTERM recorded and never acted on). A None handler
    (not set from Python) is left as it is."""
    if not handlers:
        return
    (signum, handler), *rest = handlers
    try:
        if handler is not None:
            signal.signal(signum, handler)
    finally:
        restore_handlers(rest)


@contextlib.contextmanager
def held():
    """Run the block whole: a signal that arrives inside interrupts once it has ended."""
    _held.append(True)
    try:
        yield
    finally:
        _held.pop()
    _raise_when_whole(sys._getframe())


def ignore() -> None:
    """From now on nothing interrupts: the clean-up after an interrupt runs to its end."""
    signal.setitimer(signal.ITIMER_REAL, 0)  # an interrupt waiting for an import's end: dropped
    for signum in INTERRUPTS:
        signal.signal(signum, signal.SIG_IGN)


def exit_code() -> int:
    terminated = signal.SIGTERM in _received or signal.SIGHUP in _received
    return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED


def say(text: str, stream=None) -> None:
    """print, to a terminal that may be gone (a dropped ssh session: EIO): the files are what
    counts, so that stream goes to /dev/null from then on instead of stopping the clean-up (or
    the interpreter's exit; see ``core.streams``)."""
    stream = sys.stdout if stream is None else stream
    try:
        print(text, file=stream, flush=True)
    except OSError:
        streams.drop(stream)


def say_continue(command_line: list[str], run_name: str | None, resume: bool = True) -> None:
    """On stderr: the command that continues the run (see ``continue_command``)."""
    command = continue_command(command_line, run_name, resume)
    say(f"{CONTINUE} {command}", sys.stderr)
    if "<hidden>" in command:
        say("(<hidden>: the token given on the command line, not shown)", sys.stderr)


def continue_command(command_line: list[str], run_name: str | None, resume: bool = True) -> str:
    """``command_line`` (the CLI's words as run.json records them, a token hidden) with
    ``--resume --run_name RUN_NAME``: what continues the run; without ``--resume`` where the
    run directory is gone (nothing was written into it: --resume refuses a missing one), the
    same name run again. Without a run name yet (the default one is chosen with the run
    directory), the command as given."""
    words = command_line[1:]
    if run_name is not None:
        kept, value_of_run_name = [], False
        for word in words:
            if not value_of_run_name and word != "--resume" and not word.startswith("--run_name"):
                kept.append(word)
            value_of_run_name = word == "--run_name"
        words = [*kept, *(["--resume"] if resume else []), "--run_name", run_name]
    return shlex.join([*launcher_words(), *words])


def launcher_words(program: str = "profiling_script.py") -> list[str]:
    """How this CLI was started, as one types it again: ``dp-cost``; torchrun; or python (by
    its path unless ``python`` on the PATH is this interpreter) and the script."""
    started_as = sys.argv[0] if sys.argv else ""
    if os.path.basename(started_as) == "dp-cost":
        return ["dp-cost"]
    script = started_as if started_as.endswith(program) else program
    world = os.environ.get("WORLD_SIZE")
    if world is not None:  # torchrun's own options are not known here on several nodes
        if os.environ.get("LOCAL_WORLD_SIZE", world) == world:
            return ["torchrun", "--standalone", f"--nproc_per_node={world}", script]
        return ["torchrun", "(its options as before)", script]
    python = shutil.which("python")
    same = python is not None and os.path.abspath(python) == os.path.abspath(sys.executable)
    return ["python" if same else sys.executable, script]
