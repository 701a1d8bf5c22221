"""The readers of the vision datasets' file formats (:mod:`foovb_suite.data.datasets` says where the files live):
the MNIST-format IDX files of Fashion-MNIST and notMNIST, SVHN's ``.mat`` files, CIFAR-10's python batches.

Files are trusted only after a content check. Fashion-MNIST's are compared with the MD5 of the original files'
uncompressed content (:data:`foovb_suite.data.mnist.KNOWN_IDX_MD5`); a folder may instead hold an
``MD5SUMS.uncompressed`` of its own (a stand-in dataset). No IDX folder accepts a known file of another dataset
(MNIST's in the Fashion-MNIST folder, say). notMNIST, SVHN and CIFAR-10 have no published content digests that
could be checked here: their files are checked for the published format (IDX headers and sizes, 28x28 images,
the ``X``/``y`` variables of SVHN, the dict of a CIFAR-10 batch, pixel values 0..255, labels in range). CIFAR-10
batches are pickles; they are read by an unpickler that can build only lists, dicts, strings, numbers and numpy
arrays, so a crafted file cannot run code. Every unusable file raises a ``ValueError`` (:class:`DataFileError`)
that names it.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from foovb_suite.data.mnist import (
    MD5SUMS_FILE,
    MNIST_FILES,
    DataFileError,
    _read_md5sums,
    identify_idx_content,
    parse_idx,
    read_idx_bytes,
)

try:  # the functions numpy's pickles of arrays name (numpy >= 2 moved numpy.core to numpy._core)
    from numpy._core.multiarray import _reconstruct as _np_reconstruct
    from numpy._core.numeric import _frombuffer as _np_frombuffer
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _reconstruct as _np_reconstruct
    from numpy.core.numeric import _frombuffer as _np_frombuffer

NUM_CLASSES = 10  # all five datasets are 10-way classification problems


def find_file(directory: Path, relative: str) -> Path | None:
    """``directory/relative`` or, for a ``.gz`` name, its gunzipped version, whichever exists."""
    for candidate in (directory / relative, directory / relative.removesuffix(".gz")):
        if candidate.is_file():
            return candidate
    return None


_IDX_IMAGE_SIZE = (28, 28)


def _read_checked_idx(
    path: Path, name: str, dataset: str, published_md5: Mapping[str, str] | None, local_md5: Mapping[str, str] | None
) -> np.ndarray:
    """One IDX file of ``dataset``, trusted only after its content check.

    Refused (:class:`DataFileError`, naming the file): a corrupt or truncated gzip stream; a header announcing
    more data than these datasets hold or memory allows, or content longer or shorter than it announces
    (:func:`foovb_suite.data.mnist.read_idx_bytes`, which never reads past the announced size); content that is a
    known file of another dataset (:data:`KNOWN_IDX_MD5`); a malformed IDX file; content whose MD5 is not the
    one in the folder's own ``MD5SUMS.uncompressed`` (``local_md5``) or, without one, not the published one
    (``published_md5``, where the dataset has published sums).
    """
    expected_ndim = 3 if "images" in name else 1
    data = read_idx_bytes(path, expected_ndim, compressed=path.suffix == ".gz")
    md5 = hashlib.md5(data, usedforsecurity=False).hexdigest()
    known = identify_idx_content(md5)
    if known is not None and known[0] != dataset:
        raise DataFileError(
            path.parent, f"{path} holds {known[0]}'s {known[1]}, so these are not {dataset}'s files"
        )
    array = parse_idx(data, expected_ndim, source=str(path))
    expected = (local_md5 if local_md5 is not None else published_md5 or {}).get(name)
    if local_md5 is not None and expected is None:
        sums_file = path.parent / MD5SUMS_FILE
        raise DataFileError(sums_file, f"{sums_file} has no checksum for {name}", "add its line or delete the file")
    if expected is not None and md5 != expected:
        reference = f"the sum in {path.parent / MD5SUMS_FILE}" if local_md5 is not None else "the original file's"
        what = (
            f"it is {known[0]}'s {known[1]}"
            if known is not None
            else f"the file is damaged or another dataset's (a stand-in of your own needs its sums in {MD5SUMS_FILE})"
        )
        raise DataFileError(
            path,
            f"{path} is not {dataset}'s {name}: its MD5 after gunzip is {md5}, not {expected} ({reference}); {what}",
        )
    return array


def read_idx_dataset(
    directory: Path, dataset: str, published_md5: Mapping[str, str] | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The four MNIST-format IDX files (Fashion-MNIST, notMNIST); grayscale images get a channel axis.

    Each file goes through :func:`_read_checked_idx` (the content check; with the folder's own
    ``MD5SUMS.uncompressed`` when it has one); then the images must be 28x28, the labels 0..9 and each split must
    have as many labels as images, else a :class:`DataFileError` names the file.
    """
    local_md5 = _read_md5sums(directory) if (directory / MD5SUMS_FILE).is_file() else None
    arrays = {}
    paths = {}
    for field, name in MNIST_FILES.items():
        path = find_file(directory, f"{name}.gz")
        if path is None:
            raise FileNotFoundError(f"missing data file: {directory / name}.gz")
        paths[field] = path
        arrays[field] = _read_checked_idx(path, name, dataset, published_md5, local_md5)
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        images_path, labels_path = paths[f"{split}_images"], paths[f"{split}_labels"]
        if images.shape[1:] != _IDX_IMAGE_SIZE:
            raise DataFileError(
                images_path, f"{images_path} holds {images.shape[1]}x{images.shape[2]} images, not {dataset}'s 28x28"
            )
        if len(labels) and labels.max() >= NUM_CLASSES:
            raise DataFileError(labels_path, f"{labels_path} holds label {labels.max()}, outside 0..9")
        if len(images) != len(labels):
            raise DataFileError(
                labels_path, f"{images_path} holds {len(images)} images but {labels_path} {len(labels)} labels"
            )
    return (
        torch.from_numpy(arrays["train_images"]).unsqueeze(1),
        torch.from_numpy(arrays["train_labels"]).long(),
        torch.from_numpy(arrays["test_images"]).unsqueeze(1),
        torch.from_numpy(arrays["test_labels"]).long(),
    )


def _read_svhn_mat(path: Path) -> tuple[Tensor, Tensor]:
    """One SVHN ``*_32x32.mat`` file: ``X`` (32, 32, 3, N) uint8, ``y`` (N, 1) with digit 0 stored as 10."""
    try:
        from scipy.io import loadmat
    except ImportError as error:
        raise ImportError("reading SVHN (.mat files) needs scipy: pip install scipy") from error
    if not path.is_file():
        raise FileNotFoundError(f"missing data file: {path}")
    try:
        content = loadmat(str(path))
        images, labels = content["X"], content["y"]
    except Exception as error:  # scipy raises its own MatReadError, IndexError, ... for a damaged file
        raise DataFileError(
            path, f"{path} is not a valid SVHN .mat file (needs variables X and y): {type(error).__name__}: {error}"
        ) from error
    if not isinstance(images, np.ndarray) or not isinstance(labels, np.ndarray):
        types = f"{type(images).__name__}, {type(labels).__name__}"
        raise DataFileError(path, f"{path}: X and y must be numeric arrays, got {types}")
    if images.ndim != 4 or images.shape[:3] != (32, 32, 3) or images.shape[3] != labels.size:
        raise DataFileError(
            path, f"{path}: expected X of shape (32, 32, 3, N) and N labels, got X {images.shape}, y {labels.shape}"
        )
    images, labels = _checked_bytes(images, path, "X"), _checked_labels(labels, path, "y")
    labels = labels.reshape(-1)
    if labels.size and not 1 <= labels.min() <= labels.max() <= NUM_CLASSES:
        raise DataFileError(
            path, f"{path}: y must hold SVHN labels 1..10 (10 for digit 0), got {labels.min()}..{labels.max()}"
        )
    labels[labels == 10] = 0
    return torch.from_numpy(np.ascontiguousarray(images.transpose(3, 2, 0, 1))), torch.from_numpy(labels)


def _checked_bytes(values: np.ndarray, path: Path, name: str) -> np.ndarray:
    """`values` as uint8, refusing what a cast would silently change (floats, values outside 0..255)."""
    values = np.asarray(values)
    if not np.issubdtype(values.dtype, np.integer):
        raise DataFileError(
            path, f"{path}: {name} must hold integer pixel values in 0..255, got dtype {values.dtype}"
        )
    if values.size and not 0 <= values.min() <= values.max() <= 255:
        raise DataFileError(
            path, f"{path}: {name} must hold pixel values in 0..255, got {values.min()}..{values.max()}"
        )
    return values.astype(np.uint8)


def _checked_labels(values: object, path: Path, name: str) -> np.ndarray:
    """`values` as int64, refusing non-integer labels."""
    try:
        values = np.asarray(values)
    except ValueError as error:  # e.g. a ragged list
        raise DataFileError(path, f"{path}: {name} must hold integer labels ({error})") from error
    if not np.issubdtype(values.dtype, np.integer):
        raise DataFileError(path, f"{path}: {name} must hold integer labels, got dtype {values.dtype}")
    return values.astype(np.int64)


def read_svhn(directory: Path) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (*_read_svhn_mat(directory / "train_32x32.mat"), *_read_svhn_mat(directory / "test_32x32.mat"))


CIFAR10_DIR = "cifar-10-batches-py"
CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{k}" for k in range(1, 6))
CIFAR10_TEST_BATCH = "test_batch"


def _latin1_encode(text: object, encoding: object = "utf-8") -> bytes:
    """``_codecs.encode`` as a Python 3 pickle of protocol < 3 uses it to store bytes: ``(text, "latin1")``."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode is allowed only as (str, 'latin1'), got encoding {encoding!r}")
    return text.encode("latin-1")


_CIFAR10_PICKLE_GLOBALS: dict[tuple[str, str], object] = {
    # numpy arrays, pickled by numpy < 2 (the official files), numpy >= 2, and with protocol 5 (_frombuffer)
    ("numpy.core.multiarray", "_reconstruct"): _np_reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _np_reconstruct,
    ("numpy.core.numeric", "_frombuffer"): _np_frombuffer,
    ("numpy._core.numeric", "_frombuffer"): _np_frombuffer,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    # bytes in a Python 3 pickle of protocol 2 (e.g. the b"data" key)
    ("_codecs", "encode"): _latin1_encode,
}
"""All a CIFAR-10 batch pickle may name: what rebuilds a numpy array (lists, dicts, bytes, strings and numbers
need no name)."""


class _Cifar10BatchUnpickler(pickle.Unpickler):
    """Unpickles a CIFAR-10 python batch and nothing else: ``find_class`` hands out only
    :data:`_CIFAR10_PICKLE_GLOBALS`, so a crafted file cannot run code (``os.system``, ``eval``, ...)."""

    def __init__(self, file: io.BufferedIOBase, path: Path) -> None:
        super().__init__(file, encoding="bytes")  # the official files are Python 2 pickles of str (-> bytes)
        self._path = path

    def find_class(self, module: str, name: str) -> object:
        allowed = _CIFAR10_PICKLE_GLOBALS.get((module, name))
        if allowed is None:
            raise DataFileError(
                self._path, f"{self._path} is not a CIFAR-10 batch: it asks to load {module}.{name} (refused, not run)"
            )
        return allowed


def _read_cifar10_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 python batch: a pickled dict with ``data`` (N, 3072) uint8 rows (R, G, B planes of
    32x32) and ``labels`` (N integers 0..9).

    Read with :class:`_Cifar10BatchUnpickler`, which refuses anything but numpy arrays and plain values. Raises
    ``FileNotFoundError`` for a missing file and :class:`DataFileError` (a ``ValueError``) naming the file for
    one that is not such a batch: a damaged or truncated pickle (never a raw ``UnpicklingError``, ``EOFError``,
    ...), a pickle of anything else, wrong keys, shapes, dtypes or values.
    """
    if not path.is_file():
        raise FileNotFoundError(f"missing data file: {path}")
    try:
        content = _Cifar10BatchUnpickler(io.BytesIO(path.read_bytes()), path).load()
    except DataFileError:
        raise
    except Exception as error:  # a damaged pickle raises anything: UnpicklingError, EOFError, OverflowError, ...
        raise DataFileError(
            path, f"{path} is not a CIFAR-10 python batch (unreadable pickle: {type(error).__name__}: {error})"
        ) from error
    if not isinstance(content, dict):
        raise DataFileError(path, f"{path} is not a CIFAR-10 python batch (a pickled {type(content).__name__})")
    # the official files have bytes keys; files pickled by Python 3 code have str keys
    data = content.get(b"data", content.get("data"))
    labels = content.get(b"labels", content.get("labels"))
    if data is None or labels is None:
        raise DataFileError(path, f"{path} is not a CIFAR-10 python batch (needs keys 'data' and 'labels')")
    if not isinstance(data, np.ndarray):
        raise DataFileError(path, f"{path}: data must be a numpy array, got {type(data).__name__}")
    data, labels = _checked_bytes(data, path, "data"), _checked_labels(labels, path, "labels")
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or labels.ndim != 1 or len(data) != len(labels):
        raise DataFileError(
            path, f"{path}: expected data of shape (N, 3072) with N labels, got {data.shape} and {labels.shape}"
        )
    if len(labels) and not 0 <= labels.min() <= labels.max() < NUM_CLASSES:
        raise DataFileError(path, f"{path}: labels must be 0..9, got {labels.min()}..{labels.max()}")
    return data.reshape(-1, 3, 32, 32), labels


def read_cifar10(directory: Path) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    train = [_read_cifar10_batch(directory / CIFAR10_DIR / name) for name in CIFAR10_TRAIN_BATCHES]
    test_images, test_labels = _read_cifar10_batch(directory / CIFAR10_DIR / CIFAR10_TEST_BATCH)
    return (
        torch.from_numpy(np.concatenate([images for images, _ in train])),
        torch.from_numpy(np.concatenate([labels for _, labels in train])),
        torch.from_numpy(test_images),
        torch.from_numpy(test_labels),
    )
