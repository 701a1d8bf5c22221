"""What keeps a run directory sound when runs are killed, disks fill and two runs meet: checkpoints written
atomically with a format version and a digest of their content (checked on load), and one writer per directory.

A checkpoint is a plain `torch.save` dict (torch.load's default weights_only=True reads it) with two more entries:
"format" (`FORMAT`, `VERSION`) and "digest", the SHA-256 of everything else in it (`content_digest`: every tensor's
dtype, shape and bytes, every Python value), so that altered bytes inside a valid file are found, not trained on.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointError", "FORMAT", "RunDirectoryBusy", "RunLock", "VERSION", "content_digest", "load_checkpoint",
           "save_checkpoint", "send_to_devnull", "write_atomically"]

FORMAT = "foovb-run-checkpoint"
VERSION = 2  # 1: the checkpoints of foovb 1.0, without "format" and "digest" (read, not verified)
_REQUIRED = ("learner", "iteration", "records", "train_seconds", "stds")


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted: unreadable, not a foovb run's, or altered since it was written."""


class RunDirectoryBusy(FileExistsError):
    """Another live process holds the run directory's lock."""


def _update(digest: Any, value: Any) -> None:
    """Feed one value, recursively, into `digest` (type-tagged, so that e.g. 1 and "1" and 1.0 differ)."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        digest.update(f"T{data.dtype}{tuple(data.shape)}".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    elif isinstance(value, dict):
        digest.update(f"D{len(value)}".encode())
        for key, item in value.items():
            _update(digest, key)
            _update(digest, item)
    elif isinstance(value, (list, tuple)):
        digest.update(f"{'L' if isinstance(value, list) else 'U'}{len(value)}".encode())
        for item in value:
            _update(digest, item)
    elif isinstance(value, (bytes, bytearray)):
        digest.update(b"B%d:" % len(value) + bytes(value))
    else:  # None, bool, int, float, str, torch.dtype / torch.Size reprs
        digest.update(f"{type(value).__name__}:{value!r};".encode())


def content_digest(state: dict[str, Any]) -> str:
    """SHA-256 of a checkpoint's entries other than "format" and "digest"."""
    digest = hashlib.sha256()
    _update(digest, {key: value for key, value in state.items() if key not in ("format", "digest")})
    return digest.hexdigest()


def send_to_devnull(fd: int) -> None:
    """From now on, what is written to file descriptor `fd` goes to the null device (its reader is gone)."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


def write_atomically(data: bytes, path: Path) -> None:
    """`path` holds `data` or what it held before, never a part: a temporary file, flushed to disk, then renamed.
    A full disk or a refused write leaves no temporary file and raises an OSError that says so."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as error:  # a second Ctrl-C / SIGTERM during the write too: no temporary file left
        tmp.unlink(missing_ok=True)
        if not isinstance(error, OSError):
            raise
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(path.parent).free / 2**20
            raise OSError(error.errno, f"no space left to write {path} ({len(data) / 2**20:.1f} MiB needed, "
                                       f"{free:.1f} MiB free); what it held before is kept") from error
        raise OSError(error.errno, f"cannot write {path}: {error.strerror or error}") from error


def save_checkpoint(state: dict[str, Any], path: Path) -> None:
    """Write a checkpoint with its format and digest, atomically (`write_atomically`)."""
    buffer = io.BytesIO()
    torch.save({**state, "format": [FORMAT, VERSION], "digest": content_digest(state)}, buffer)
    write_atomically(buffer.getvalue(), path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint written by `save_checkpoint`, its digest checked (one of foovb 1.0, without a digest, is read
    with a warning). Anything else is a `CheckpointError` that names the file and what to do."""
    advice = ("start the run again in another directory (--out), or restore the file from a backup")
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not a checkpoint file; {advice}")
    with open(path, "rb") as handle:
        if handle.read(4) != b"PK\x03\x04":  # torch.save writes a zip archive
            raise CheckpointError(f"{path} is not a readable foovb checkpoint (not a torch checkpoint file: empty, "
                                  f"truncated at its start, or another kind of file); {advice}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - torch raises RuntimeError, EOFError, UnpicklingError, ... here
        cause = " ".join(str(error).split()).split(". ")[0][:160] or type(error).__name__
        if "weights_only" in cause or "Unsupported global" in cause or "Weights only load failed" in cause:
            cause = "it holds objects that a foovb checkpoint never holds"
        raise CheckpointError(f"{path} is not a readable foovb checkpoint (truncated, corrupt or another file: "
                              f"{cause}); {advice}") from error
    if not isinstance(state, dict) or not all(key in state for key in _REQUIRED):
        raise CheckpointError(f"{path} is not a foovb run checkpoint (it lacks the entries "
                              f"{', '.join(_REQUIRED)}); {advice}")
    found = state.pop("format", None)
    if found is None:
        print(f"foovb: warning: {path} was written by foovb 1.0, without a digest: its content is not verified",
              file=sys.stderr)
        return state
    if not (isinstance(found, list) and found[:1] == [FORMAT] and len(found) == 2 and type(found[1]) is int):
        raise CheckpointError(f"{path} is not a foovb run checkpoint (format {found!r}); {advice}")
    if found[1] > VERSION:
        raise CheckpointError(f"{path} was written by a newer foovb (checkpoint version {found[1]}, this one reads "
                              f"up to {VERSION}): upgrade foovb to resume it")
    if state.pop("digest", None) != content_digest(state):
        raise CheckpointError(f"{path} was altered after it was written (its content does not match its digest); "
                              f"{advice}")
    return state


class RunLock:
    """One writer per run directory: an exclusive `fcntl.flock` on `<run_dir>/.foovb.lock`, held while the block
    runs and released by the operating system when the process ends, however it ends (no stale lock). The file
    holds the holder's pid, named when a second run is refused. A lock file removed or replaced while a run holds
    it (an `rm` of the directory's files) would let a second run in: `confirm` (called before every write) takes
    the new file's lock or stops this run. Where fcntl does not exist (Windows), no lock."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / ".foovb.lock"
        self.handle: Any = None

    def __enter__(self) -> RunLock:
        try:
            import fcntl  # noqa: F401
        except ImportError:  # pragma: no cover - Windows
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = self._acquire()
        return self

    def _acquire(self) -> Any:
        """The open, flocked lock file at `self.path` with this pid in it; RunDirectoryBusy if another run has it."""
        import fcntl

        while True:
            handle = open(self.path, "a+")  # noqa: SIM115 - held for the life of the run
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "unknown"
                handle.close()
                raise RunDirectoryBusy(f"{self.path.parent} is in use by another foovb run (pid {holder}); wait for "
                                       "it to end, or choose another directory (--out)") from None
            try:
                if self._is_locked_file(handle):  # not removed or replaced between open and flock: ours
                    handle.seek(0)
                    handle.truncate()
                    handle.write(f"{os.getpid()}\n")
                    handle.flush()
                    return handle
            except BaseException:
                handle.close()
                raise
            handle.close()

    def _is_locked_file(self, handle: Any) -> bool:
        """Whether `self.path` is still the file `handle` has open."""
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            return False
        held = os.fstat(handle.fileno())
        return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)

    def confirm(self) -> None:
        """Before a write: if the lock file was removed, take the lock again on a new one; if another file is at
        its path (another run's, live or finished) or the directory is gone, raise without writing."""
        if self.handle is None or self._is_locked_file(self.handle):
            return
        stopping = "this run stops without writing, so that two runs' files do not mix"
        if not self.path.parent.is_dir():
            raise RunDirectoryBusy(f"the run directory {self.path.parent} was removed while this run held it: "
                                   f"{stopping}")
        if self.path.exists():
            raise RunDirectoryBusy(f"{self.path} was replaced while this run held it (another foovb run, pid "
                                   f"{self.path.read_text().strip() or 'unknown'}, took the directory): {stopping}")
        try:
            handle = self._acquire()
        except RunDirectoryBusy as error:  # another run created the file just now
            raise RunDirectoryBusy(f"{self.path} was removed while this run held it, and {error}: {stopping}") from None
        self.handle.close()
        self.handle = handle

    def __exit__(self, *exc: object) -> None:
        if self.handle is not None:
            self.handle.close()  # closing releases the flock
            self.handle = None
