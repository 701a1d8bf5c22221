"""The MNIST digits shipped with the package, read from the original IDX files and MD5-verified.

MNIST is the base of every permuted-MNIST benchmark of the paper (sections "Discrete/Continuous task-agnostic
Permuted MNIST") and the first task of the vision-datasets mix, so it is embedded in ``foovb/data/files/``
(the four original ``*.gz`` files plus ``MD5SUMS.uncompressed``, the MD5 of each file after gunzip).

The IDX reader here (:func:`parse_idx`, :func:`read_idx`) is shared with the other IDX-format datasets
(Fashion-MNIST, notMNIST) in :mod:`foovb_suite.data.datasets`.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import math
import os
import zlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

MNIST_MEAN = 0.1307
"""Mean pixel intensity of the MNIST training images, after scaling to [0, 1]."""
MNIST_STD = 0.3081
"""Standard deviation of the MNIST training pixel intensities, after scaling to [0, 1]."""

MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
"""Uncompressed IDX file names, keyed by the :class:`MNIST` field they fill (stored as ``NAME.gz``)."""
MD5SUMS_FILE = "MD5SUMS.uncompressed"

KNOWN_IDX_MD5: dict[str, dict[str, str]] = {
    # The canonical MNIST sums: the same values as the embedded files/MD5SUMS.uncompressed (a test checks this).
    "MNIST": {
        "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
        "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
        "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
        "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
    },
    # Computed with `gunzip -c NAME.gz | md5sum` from Debian's dataset-fashion-mnist files (the project's
    # shared/data/fashion-mnist; equal to the MD5SUMS.uncompressed there). Debian re-compressed the files, so
    # their .gz bytes differ from Zalando's download (whose .gz MD5s are in datasets.py), not their content.
    "Fashion-MNIST": {
        "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
        "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
        "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
        "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
    },
}
"""MD5 of each file's uncompressed IDX content, per dataset, where the originals are available to check against
(notMNIST-to-MNIST publishes none). Used to name the dataset a misplaced file belongs to."""

_IDX_UINT8 = 0x08
_IDX_IMAGES_NDIM = 3
_IDX_LABELS_NDIM = 1
IDX_MAX_BYTES = 1 << 30
"""The most data an IDX file may announce in its header: 1 GiB, 20 times the largest file of these datasets
(MNIST's and Fashion-MNIST's 47 MB of training images). A header beyond it is refused before anything is read."""


class DataFileError(ValueError):
    """A data file that is there but cannot be used: corrupt or truncated, not in the expected format, or another
    dataset's file. The message names the file, says what is wrong and what to do (``remedy``)."""

    def __init__(self, path: object, problem: str, remedy: str = "delete it and fetch it again") -> None:
        super().__init__(f"{problem}; {remedy}")
        self.path = path
        """The file (or, where a whole folder holds the wrong files, the folder)."""
        self.problem = problem
        """What is wrong, naming the file."""
        self.remedy = remedy

    def __reduce__(self) -> tuple[type[DataFileError], tuple[object, str, str]]:
        return type(self), (self.path, self.problem, self.remedy)


def identify_idx_content(md5: str) -> tuple[str, str] | None:
    """``(dataset, file name)`` of the known IDX file (:data:`KNOWN_IDX_MD5`) whose content has this MD5."""
    for dataset, sums in KNOWN_IDX_MD5.items():
        for name, known in sums.items():
            if known == md5:
                return dataset, name
    return None


@dataclass(frozen=True)
class MNIST:
    """The MNIST train and test splits as tensors.

    ``load_mnist`` caches one instance per root, so the tensors are shared: never modify them in place.
    """

    train_images: Tensor
    """uint8 (60000, 28, 28)"""
    train_labels: Tensor
    """int64 (60000,)"""
    test_images: Tensor
    """uint8 (10000, 28, 28)"""
    test_labels: Tensor
    """int64 (10000,)"""


def _idx_shape(header: bytes, expected_ndim: int, source: str) -> tuple[int, ...]:
    """The shape an IDX header (its first ``4 + 4 * expected_ndim`` bytes) announces.

    Checks the magic number (uint8 data of ``expected_ndim`` dimensions) and that the header is complete; raises
    :class:`DataFileError` naming ``source`` otherwise.
    """
    if len(header) < 4:
        raise DataFileError(source, f"{source}: too short to be an IDX file ({len(header)} bytes)")
    if header[0] != 0 or header[1] != 0 or header[2] != _IDX_UINT8 or header[3] != expected_ndim:
        magic = int.from_bytes(header[:4], "big")
        expected = (_IDX_UINT8 << 8) | expected_ndim
        raise DataFileError(source, f"{source}: bad IDX magic number 0x{magic:08x}, expected 0x{expected:08x}")
    if len(header) < 4 + 4 * expected_ndim:
        raise DataFileError(source, f"{source}: truncated IDX header")
    return tuple(int.from_bytes(header[4 + 4 * k : 8 + 4 * k], "big") for k in range(expected_ndim))


def _size_mismatch(source: str, shape: tuple[int, ...], expected_size: int, actual: str) -> DataFileError:
    """The error for an IDX file whose length is not the one its header announces (``actual``: what it has)."""
    return DataFileError(
        source, f"{source}: IDX header announces shape {shape} ({expected_size} bytes) but the file has {actual}"
    )


def available_memory() -> int | None:
    """Bytes of memory available to this process without swapping (``MemAvailable`` of ``/proc/meminfo``, else the
    free physical pages ``os.sysconf`` reports); None where neither says."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # in kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf, or no such name on this system
        return None


def _checked_idx_size(shape: tuple[int, ...], source: str) -> int:
    """The data bytes of an IDX file of ``shape``, refused (:class:`DataFileError` naming ``source``) above
    :data:`IDX_MAX_BYTES` or above half the available memory (the bytes read and the array made of them)."""
    data_size = math.prod(shape)  # exact: a Python int does not overflow
    if data_size > IDX_MAX_BYTES:
        raise DataFileError(
            source,
            f"{source}: IDX header announces shape {shape} ({data_size} bytes of data), more than the "
            f"{IDX_MAX_BYTES} bytes an IDX file of these datasets may hold (refused unread)",
        )
    memory = available_memory()
    if memory is not None and 2 * data_size > memory:
        raise DataFileError(
            source,
            f"{source}: IDX header announces shape {shape} ({data_size} bytes of data), and reading it needs twice "
            f"that, more than the {memory} bytes of memory available (refused unread)",
            "free memory, or delete it and fetch it again if the shape is not the dataset's",
        )
    return data_size


def parse_idx(data: bytes | bytearray, expected_ndim: int, source: str) -> np.ndarray:
    """Parse the bytes of an uncompressed uint8 IDX file (http://yann.lecun.com/exdb/mnist/).

    The header is a big-endian magic number ``0x0000 TT NN`` (``TT`` = 0x08 for unsigned bytes, ``NN`` the
    number of dimensions) followed by ``NN`` big-endian uint32 sizes, then the data in C order.
    ``source`` names the file in error messages. Returns a writable uint8 array of the stored shape.
    Checks the magic number (uint8 data of ``expected_ndim`` dimensions) and that the size matches the header;
    raises :class:`DataFileError` (a ``ValueError``) naming ``source`` otherwise.
    """
    header_size = 4 + 4 * expected_ndim
    shape = _idx_shape(data[:header_size], expected_ndim, source)
    expected_size = header_size + math.prod(shape)
    if len(data) != expected_size:
        raise _size_mismatch(source, shape, expected_size, f"{len(data)} bytes")
    return np.frombuffer(data, dtype=np.uint8, offset=header_size).reshape(shape).copy()


def read_file_bytes(file: Traversable) -> bytes:
    """Read ``file``; raises ``FileNotFoundError`` naming it where there is none."""
    if not file.is_file():
        raise FileNotFoundError(f"missing data file: {file}")
    return file.read_bytes()


def read_idx_bytes(file: Traversable, expected_ndim: int, compressed: bool) -> bytearray:
    """The content of the uint8 IDX file ``file`` (gunzipped when ``compressed``): its header and data.

    Reads the header first and then incrementally no more than the data it announces, plus one byte to see the end:
    a gzip bomb (a few kB that decompress to gigabytes) costs no more memory than its header claims. Raises
    ``FileNotFoundError`` for a missing file and :class:`DataFileError` (a ``ValueError``) naming the file for data
    that is not gzip, a truncated or corrupt gzip stream (never a raw ``EOFError`` / ``zlib.error``), a bad IDX
    header (:func:`_idx_shape`), a shape refused by :func:`_checked_idx_size`, and content shorter or longer
    than the header says.
    """
    if not file.is_file():
        raise FileNotFoundError(f"missing data file: {file}")
    source = str(file)
    header_size = 4 + 4 * expected_ndim
    with file.open("rb") as raw:
        if compressed:
            if raw.read(2) != b"\x1f\x8b":
                raise DataFileError(
                    file, f"corrupt gzip file {file} (it does not start with the gzip magic bytes 1f 8b)"
                )
            raw.seek(0)
        try:
            with gzip.GzipFile(fileobj=raw, mode="rb") if compressed else contextlib.nullcontext(raw) as content:
                header = content.read(header_size)
                shape = _idx_shape(header, expected_ndim, source)
                expected_size = header_size + _checked_idx_size(shape, source)
                idx_content = bytearray(expected_size)  # filled in place: no second copy of the data
                idx_content[:header_size] = header
                with memoryview(idx_content)[header_size:] as data:
                    received = content.readinto(data)
                if received < expected_size - header_size:
                    raise _size_mismatch(source, shape, expected_size, f"{header_size + received} bytes")
                if content.read(1):  # reaching the end also checks the gzip stream's CRC and length
                    raise _size_mismatch(source, shape, expected_size, "more (the rest is refused unread)")
        except (gzip.BadGzipFile, EOFError, zlib.error) as error:
            raise DataFileError(file, f"corrupt gzip file {file} ({type(error).__name__}: {error})") from error
    return idx_content


def read_idx(path: Path, expected_ndim: int) -> np.ndarray:
    """Read a uint8 IDX file from disk; a ``.gz`` suffix means gzip-compressed."""
    data = read_idx_bytes(path, expected_ndim, compressed=path.suffix == ".gz")
    return parse_idx(data, expected_ndim, str(path))


def _read_md5sums(root: Traversable) -> dict[str, str]:
    """Parse ``MD5SUMS.uncompressed`` (``md5sum`` output format: ``<hex digest>  <file name>`` per line)."""
    md5sums_file = root / MD5SUMS_FILE
    remedy = "fix it (`md5sum` output of the gunzipped files) or delete it"
    try:
        text = read_file_bytes(md5sums_file).decode("ascii")
    except UnicodeDecodeError as error:
        raise DataFileError(md5sums_file, f"{md5sums_file} is not an md5sum text file ({error})", remedy) from error
    md5sums = {}
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2:
            raise DataFileError(md5sums_file, f"{md5sums_file}: malformed line {line!r}", remedy)
        digest, name = fields
        md5sums[name.lstrip("*")] = digest.lower()
    return md5sums


def _read_verified_idx(
    root: Traversable, name: str, expected_md5: str | None, expected_ndim: int
) -> np.ndarray:
    file = root / f"{name}.gz"
    if expected_md5 is None:
        raise DataFileError(
            root / MD5SUMS_FILE, f"{root / MD5SUMS_FILE} has no checksum for {name}", "add its line or delete the file"
        )
    data = read_idx_bytes(file, expected_ndim, compressed=True)
    actual_md5 = hashlib.md5(data, usedforsecurity=False).hexdigest()
    known = identify_idx_content(actual_md5)
    if known is not None and known[0] != "MNIST":  # even where the folder's own MD5SUMS lists it
        raise DataFileError(file, f"{file} holds {known[0]}'s {known[1]}, so these are not MNIST's files")
    if actual_md5 != expected_md5:
        what = f"it is {known[0]}'s {known[1]}" if known else "the file is corrupt or not the original MNIST file"
        raise DataFileError(
            file, f"MD5 mismatch for {file} (after gunzip): expected {expected_md5}, got {actual_md5}; {what}"
        )
    return parse_idx(data, expected_ndim, str(file))


def _default_root() -> Traversable:
    return resources.files("foovb_suite.data") / "files"


@functools.lru_cache(maxsize=4)
def _load_mnist_cached(root_key: str | None) -> MNIST:
    root = _default_root() if root_key is None else Path(root_key)
    # A folder of the four original files needs no checksum file of its own: the embedded one holds their sums.
    md5sums = _read_md5sums(root if (root / MD5SUMS_FILE).is_file() else _default_root())
    arrays = {
        field: _read_verified_idx(
            root,
            name,
            md5sums.get(name),
            _IDX_IMAGES_NDIM if field.endswith("images") else _IDX_LABELS_NDIM,
        )
        for field, name in MNIST_FILES.items()
    }
    for split in ("train", "test"):
        num_images, num_labels = len(arrays[f"{split}_images"]), len(arrays[f"{split}_labels"])
        if num_images != num_labels:
            raise ValueError(f"MNIST {split} split has {num_images} images but {num_labels} labels")
    return MNIST(
        **{
            field: torch.from_numpy(array).long() if field.endswith("labels") else torch.from_numpy(array)
            for field, array in arrays.items()
        }
    )


def load_mnist(root: str | Path | None = None) -> MNIST:
    """Load MNIST from ``root`` (default: the files embedded in the package), verifying every file's MD5.

    ``root`` must hold the four ``*-ubyte.gz`` files; they are checked against its ``MD5SUMS.uncompressed``
    when it has one (``md5sum`` format, sums after gunzip), else against the original files' sums shipped with
    the package. The result is cached per
    root (loading takes about a second). Raises ``FileNotFoundError`` for a missing file and
    :class:`DataFileError` (a ``ValueError``) for a corrupt one (bad gzip stream, MD5 mismatch, bad IDX header),
    naming the file (and the dataset it belongs to, where its content is a known one of another dataset).
    """
    return _load_mnist_cached(None if root is None else str(Path(root).resolve()))
