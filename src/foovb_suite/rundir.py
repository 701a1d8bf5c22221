"""What keeps a run directory sound when runs are killed, disks fill and two runs meet: checkpoints written
atomically with a format version and a digest of their content (checked on load), and one writer per directory.

A checkpoint is a plain `torch.save` dict (torch.load's default weights_only=True reads it) with two more entries:
"format" (`FORMAT`, `VERSION`) and "digest", the SHA-256 of everything else in it (`content_digest`: every tensor's
dtype, shape and bytes, every Python value), so that altered bytes inside a valid file are found, not trained on.
From version 3 it also records what it belongs to: "run", the identity drawn when its run started and the config that
run computes with (the runner refuses to resume it in another run's directory or under another config).
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointError", "FORMAT", "RunDirectoryBusy", "RunLock", "VERSION", "content_digest", "load_checkpoint",
           "make_directory", "not_a_file", "save_checkpoint", "send_to_devnull", "write_atomically"]

FORMAT = "foovb-run-checkpoint"
# 1: the checkpoints of foovb 1.0, without "format" and "digest" (read, not verified); 2: without "run" (read, their
# run not verified); 3: with "run"
VERSION = 3
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


def not_a_file(path: Path) -> str | None:
    """What `path` is when it exists but is no regular file (following symbolic links): a directory, a named pipe, a
    device, a socket or a broken link; None for a regular file or nothing at all."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return f"a symbolic link to {os.readlink(path)}, which does not exist" if os.path.islink(path) else None
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (fifo)"), (stat.S_ISCHR, "a device"),
             (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))
    kind = next((name for test, name in kinds if test(mode)), None)
    if kind is not None and os.path.islink(path):
        kind += f" (a symbolic link to {os.readlink(path)})"
    return kind


def write_error(error: OSError, path: Path, size: int, kept: str = "") -> OSError:
    """The OSError to raise for a failed write of `size` bytes to `path`: it names the file and, on a full file
    system, what ran out (the bytes, or the inodes: no file can be created however many bytes are free)."""
    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return OSError(error.errno, f"cannot write {path}: {error.strerror or error}{kept}")
    try:
        space = os.statvfs(path.parent)
        inodes_out = space.f_files > 0 and space.f_favail == 0
        free = space.f_bavail * space.f_frsize / 2**20
    except OSError:
        inodes_out, free = False, shutil.disk_usage(path.parent).free / 2**20
    needed = f"{size} bytes" if size < 2**20 else f"{size / 2**20:.1f} MiB"
    detail = ("no free inodes (file entries) are left on its file system" if inodes_out
              else f"{needed} needed, {free:.1f} MiB free")
    return OSError(error.errno, f"no space left to write {path} ({detail}){kept}")


def make_directory(path: Path) -> None:
    """`path` and its parents as directories (existing ones kept); a failure is an OSError naming `path` and, on a
    full file system, what ran out (`write_error`)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OSError(errno.EEXIST, f"cannot create the directory {path}: a file of that name is in the way") from None
    except OSError as error:
        raise write_error(error, path, 0) from error


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
        kept = "; what it held before is kept" if path.exists() else "; nothing was written"
        raise write_error(error, path, len(data), kept) from error


def save_checkpoint(state: dict[str, Any], path: Path) -> None:
    """Write a checkpoint with its format and digest, atomically (`write_atomically`)."""
    buffer = io.BytesIO()
    torch.save({**state, "format": [FORMAT, VERSION], "digest": content_digest(state)}, buffer)
    write_atomically(buffer.getvalue(), path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint written by `save_checkpoint`, its digest checked (one of foovb 1.0, without a digest, is read
    with a warning). Anything else is a `CheckpointError` that names the file and what to do."""
    advice = ("start the run again in another directory (--out), or restore the file from a backup")
    kind = not_a_file(path)
    if kind is not None:
        raise CheckpointError(f"{path} is {kind}, not a checkpoint file; {advice}")
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
    run = state.get("run")
    if found[1] >= 3 and not (isinstance(run, dict) and isinstance(run.get("id"), str)
                              and isinstance(run.get("config"), dict)):
        raise CheckpointError(f"{path} is not a foovb run checkpoint (its 'run' entry, the run it belongs to, is "
                              f"missing or malformed); {advice}")
    return state


def _in_use(run_dir: Path, holder: str) -> str:
    return (f"{run_dir} is in use by another foovb run (pid {holder or 'unknown'}); wait for it to end, or choose "
            "another directory (--out)")


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
        make_directory(self.path.parent)
        self.handle = self._acquire()
        return self

    @staticmethod
    def busy_message(run_dir: Path) -> str | None:
        """RunDirectoryBusy's message if a live run holds `run_dir`'s lock, else None; creates nothing (for checks
        made before the lock is taken, such as --resume's, so that they name the live run)."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            return None
        path = Path(run_dir) / ".foovb.lock"
        try:
            handle = open(path)  # noqa: SIM115 - closed below
        except OSError:
            return None
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _in_use(path.parent, handle.read().strip())
            fcntl.flock(handle, fcntl.LOCK_UN)
        return None

    def _acquire(self) -> Any:
        """The open, flocked lock file at `self.path` with this pid in it; RunDirectoryBusy if another run has it."""
        import fcntl

        while True:
            try:
                handle = open(self.path, "a+")  # noqa: SIM115 - held for the life of the run
            except OSError as error:  # no inode left, a read-only directory: the error names the lock file
                raise write_error(error, self.path, 0) from error
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip()
                handle.close()
                raise RunDirectoryBusy(_in_use(self.path.parent, holder)) from None
            try:
                if self._is_locked_file(handle):  # not removed or replaced between open and flock: ours
                    handle.seek(0)
                    handle.truncate()
                    try:  # unbuffered, so that closing the handle after a failed write does not fail again
                        os.write(handle.fileno(), f"{os.getpid()}\n".encode())
                    except OSError as error:  # a full disk: the error names the lock file
                        raise write_error(error, self.path, 16) from error
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
