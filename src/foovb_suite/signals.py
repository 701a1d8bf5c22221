"""Ctrl-C, SIGTERM and SIGHUP during a run: a first one is deferred to the end of the iteration
(`deferred_interrupt`), so that the run checkpoints before it stops (`RunInterrupted`); a second one stops at once.
The progress bar's stream outlives a terminal that the same Ctrl-C closed (`StderrWhileReadable`)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from .rundir import send_to_devnull

__all__ = ["STOP_SIGNALS", "RunInterrupted", "StderrWhileReadable", "StopRequests", "deferred_interrupt"]

# Ctrl-C; what SLURM, Kubernetes and `timeout` send before a kill; a closed terminal or SSH session (POSIX only)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()))


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a run (a KeyboardInterrupt, so `except KeyboardInterrupt` still catches it); the
    message says what was saved. `checkpoint_iteration`: where `--resume` continues (None: no checkpoint);
    `signal_number`: the signal (SIGINT for a KeyboardInterrupt raised otherwise)."""

    def __init__(self, message: str, checkpoint_iteration: int | None, signal_number: int = signal.SIGINT):
        self.signal_number = int(signal_number)
        super().__init__(message)
        self.checkpoint_iteration = checkpoint_iteration


class _StopNow(KeyboardInterrupt):
    """A second Ctrl-C or SIGTERM: stop at once (`signal_number`: which one, for the exit status)."""

    def __init__(self, signal_number: int):
        super().__init__()
        self.signal_number = signal_number


class StderrWhileReadable:
    """The progress bar's stream: sys.stderr until a write fails (a `| tee` stopped by Ctrl-C, a closed terminal),
    then nothing, so that the run goes on to its checkpoint instead of dying in the bar's BrokenPipeError."""

    def write(self, text: str) -> int:
        try:
            return sys.stderr.write(text)
        except OSError:
            send_to_devnull(2)
            return len(text)

    def flush(self) -> None:
        try:
            sys.stderr.flush()
        except OSError:
            send_to_devnull(2)

    def __getattr__(self, name: str) -> Any:
        return getattr(sys.stderr, name)


class StopRequests:
    """The signals received within `deferred_interrupt`: called, the first one (None: none yet). `then`: what the
    run does on a first one, as its message says (the runner changes it once training has ended)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.then = "stopping after this iteration (again: stop at once, keeping the last checkpoint)"

    def __call__(self) -> int | None:
        return self.received[0] if self.received else None


@contextlib.contextmanager
def deferred_interrupt(enabled: bool) -> Iterator[StopRequests]:
    """Within the block, a first Ctrl-C (SIGINT), SIGTERM (what SLURM, Kubernetes and `timeout` send before a
    kill) or SIGHUP (a closed terminal; not where `nohup` ignores it) only records the signal, returned by a
    function that the training loop checks between iterations, so that no step or evaluation is cut in half and the
    run checkpoints before it stops; a second one raises KeyboardInterrupt at once. Not `enabled` (distributed runs,
    whose processes could stop at different iterations), or outside the main thread (where no signal handler can be
    set), the signals act as usual."""
    requests = StopRequests()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield requests
        return

    def handler(signum: int, frame: Any) -> None:
        if requests.received:
            raise _StopNow(signum)
        requests.received.append(signum)
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        try:  # os.write: print could re-enter a write to stderr that the signal cut
            os.write(2, f"\nfoovb: {name}: {requests.then}\n".encode())
        except OSError:  # stderr's reader is gone (`| tee`, which the same Ctrl-C stopped): checkpoint all the same
            send_to_devnull(2)

    # (a SIGHUP that `nohup` ignores stays ignored)
    previous = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS
                if signum in (signal.SIGINT, signal.SIGTERM) or signal.getsignal(signum) is not signal.SIG_IGN}
    try:
        yield requests
    finally:
        for signum, handler_before in previous.items():
            default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
            signal.signal(signum, handler_before if handler_before is not None else default)
