"""The MNIST digits shipped with the package, read from the original IDX files and MD5-verified.

MNIST is the base of every permuted-MNIST benchmark of the paper (sections "Discrete/Continuous task-agnostic
Permuted MNIST") and the first task of the vision-datasets mix, so it is embedded in ``foovb/data/files/``
(the four original ``*.gz`` files plus ``MD5SUMS.uncompressed``, the MD5 of each file after gunzip).

The IDX reader here (:func:`parse_idx`, :func:`read_idx`) is shared with the other IDX-format datasets
(Fashion-MNIST, notMNIST) in :mod:`foovb_suite.data.datasets`.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
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

_IDX_UINT8 = 0x08
_IDX_IMAGES_NDIM = 3
_IDX_LABELS_NDIM = 1


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


def parse_idx(data: bytes, expected_ndim: int, source: str) -> np.ndarray:
    """Parse the bytes of an uncompressed uint8 IDX file (http://yann.lecun.com/exdb/mnist/).

    The header is a big-endian magic number ``0x0000 TT NN`` (``TT`` = 0x08 for unsigned bytes, ``NN`` the
    number of dimensions) followed by ``NN`` big-endian uint32 sizes, then the data in C order.
    ``source`` names the file in error messages. Returns a writable uint8 array of the stored shape.
    """
    if len(data) < 4:
        raise ValueError(f"{source}: too short to be an IDX file ({len(data)} bytes)")
    if data[0] != 0 or data[1] != 0 or data[2] != _IDX_UINT8 or data[3] != expected_ndim:
        magic = int.from_bytes(data[:4], "big")
        expected = (_IDX_UINT8 << 8) | expected_ndim
        raise ValueError(f"{source}: bad IDX magic number 0x{magic:08x}, expected 0x{expected:08x}")
    header_size = 4 + 4 * expected_ndim
    if len(data) < header_size:
        raise ValueError(f"{source}: truncated IDX header")
    shape = tuple(int.from_bytes(data[4 + 4 * k : 8 + 4 * k], "big") for k in range(expected_ndim))
    expected_size = header_size + int(np.prod(shape))
    if len(data) != expected_size:
        raise ValueError(
            f"{source}: IDX header announces shape {shape} ({expected_size} bytes) but the file has "
            f"{len(data)} bytes"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header_size).reshape(shape).copy()


def read_file_bytes(file: Traversable, compressed: bool) -> bytes:
    """Read ``file``, gunzipping it when ``compressed``; errors (missing, corrupt) name the file."""
    if not file.is_file():
        raise FileNotFoundError(f"missing data file: {file}")
    raw = file.read_bytes()
    if not compressed:
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as error:
        raise ValueError(f"corrupt gzip file {file} (delete it and fetch it again): {error}") from error


def read_idx(path: Path, expected_ndim: int) -> np.ndarray:
    """Read a uint8 IDX file from disk; a ``.gz`` suffix means gzip-compressed."""
    data = read_file_bytes(path, compressed=path.suffix == ".gz")
    return parse_idx(data, expected_ndim, str(path))


def _read_md5sums(root: Traversable) -> dict[str, str]:
    """Parse ``MD5SUMS.uncompressed`` (``md5sum`` output format: ``<hex digest>  <file name>`` per line)."""
    md5sums_file = root / MD5SUMS_FILE
    md5sums = {}
    for line in read_file_bytes(md5sums_file, compressed=False).decode("ascii").splitlines():
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2:
            raise ValueError(f"{md5sums_file}: malformed line {line!r}")
        digest, name = fields
        md5sums[name.lstrip("*")] = digest.lower()
    return md5sums


def _read_verified_idx(
    root: Traversable, name: str, expected_md5: str | None, expected_ndim: int
) -> np.ndarray:
    file = root / f"{name}.gz"
    if expected_md5 is None:
        raise ValueError(f"{root / MD5SUMS_FILE} has no checksum for {name}")
    data = read_file_bytes(file, compressed=True)
    actual_md5 = hashlib.md5(data, usedforsecurity=False).hexdigest()
    if actual_md5 != expected_md5:
        raise ValueError(
            f"MD5 mismatch for {file} (after gunzip): expected {expected_md5}, got {actual_md5}; "
            "the file is corrupt or not the original MNIST file"
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
    root (loading takes about a second). Raises ``FileNotFoundError`` for a missing file and ``ValueError``
    for a corrupt one (bad gzip stream, MD5 mismatch, bad IDX header), naming the file.
    """
    return _load_mnist_cached(None if root is None else str(Path(root).resolve()))
