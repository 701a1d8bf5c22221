"""The datasets of the vision-datasets mix (paper appendix "Task-aware continual learning on vision
datasets").

MNIST, notMNIST, Fashion-MNIST, SVHN and CIFAR-10, as in Ritter et al. (2018). MNIST is embedded in the
package (:mod:`foovb_suite.data.mnist`); the others are read from a data directory with this layout::

    DATA_DIR/fashion_mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz
    DATA_DIR/notmnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz    (notMNIST-to-MNIST files)
    DATA_DIR/svhn/{train,test}_32x32.mat                                  (needs scipy)
    DATA_DIR/cifar10/cifar-10-batches-py/{data_batch_1..5,test_batch}     (the extracted python tarball)

IDX files may also be stored gunzipped (same name without ``.gz``). The usual other names of a dataset's folder are
found too (``DATA_DIR/fashion-mnist``, torchvision's ``DATA_DIR/FashionMNIST/raw``, ``DATA_DIR/notMNIST``,
``DATA_DIR/SVHN``, torchvision's ``DATA_DIR/cifar-10-batches-py``), and so are the copies a system package
installs: Fashion-MNIST in ``/usr/share/datasets/fashion-mnist`` (Debian's ``dataset-fashion-mnist``), looked at
after the data directory (:func:`dataset_folders`). :func:`download_dataset` fetches the official files into the
first layout; :func:`load_dataset` never touches the network.

Files are trusted only after a content check. Fashion-MNIST's are compared with the MD5 of the original files'
uncompressed content (:data:`foovb_suite.data.mnist.KNOWN_IDX_MD5`); a folder may instead hold an
``MD5SUMS.uncompressed`` of its own (a stand-in dataset). No IDX folder accepts a known file of another dataset
(MNIST's in the Fashion-MNIST folder, say). notMNIST, SVHN and CIFAR-10 have no published content digests that
could be checked here: their files are checked for the published format (IDX headers and sizes, 28x28 images,
the ``X``/``y`` variables of SVHN, the dict of a CIFAR-10 batch, pixel values 0..255, labels in range). CIFAR-10
batches are pickles; they are read by an unpickler that can build only lists, dicts, strings, numbers and numpy
arrays, so a crafted file cannot run code. Every unusable file raises a ``ValueError`` (:class:`DataFileError`)
that names it and says how to replace it.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import pickle
import shutil
import tarfile
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from foovb_suite.data.mnist import (
    KNOWN_IDX_MD5,
    MD5SUMS_FILE,
    MNIST_FILES,
    DataFileError,
    _read_md5sums,
    identify_idx_content,
    load_mnist,
    parse_idx,
    read_idx_bytes,
)

try:  # the functions numpy's pickles of arrays name (numpy >= 2 moved numpy.core to numpy._core)
    from numpy._core.multiarray import _reconstruct as _np_reconstruct
    from numpy._core.numeric import _frombuffer as _np_frombuffer
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _reconstruct as _np_reconstruct
    from numpy.core.numeric import _frombuffer as _np_frombuffer

DATASET_NAMES = ("mnist", "notmnist", "fashion_mnist", "svhn", "cifar10")
"""Names accepted by :func:`load_dataset`, in the task order of the vision-datasets mix."""

_NUM_CLASSES = 10  # all five datasets are 10-way classification problems


@dataclass(frozen=True)
class ImageDataset:
    """A labelled image dataset: uint8 images ``(N, C, H, W)`` and int64 labels ``(N,)`` per split."""

    name: str
    train_images: Tensor
    train_labels: Tensor
    test_images: Tensor
    test_labels: Tensor
    num_classes: int = _NUM_CLASSES

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            images: Tensor = getattr(self, f"{split}_images")
            labels: Tensor = getattr(self, f"{split}_labels")
            if images.dtype != torch.uint8 or images.dim() != 4:
                raise ValueError(
                    f"{self.name}: {split} images must be uint8 (N, C, H, W), got {images.dtype} "
                    f"{tuple(images.shape)}"
                )
            if labels.dtype != torch.int64:
                raise ValueError(f"{self.name}: {split} labels must be int64, got {labels.dtype}")
            if labels.shape != images.shape[:1]:
                raise ValueError(f"{self.name}: {len(images)} {split} images but {len(labels)} labels")
            if len(labels) and not 0 <= int(labels.min()) <= int(labels.max()) < self.num_classes:
                raise ValueError(f"{self.name}: {split} labels outside [0, {self.num_classes})")
        if self.train_images.shape[1:] != self.test_images.shape[1:]:
            raise ValueError(f"{self.name}: train and test images differ in shape")
        for split in ("train", "test"):
            if len(getattr(self, f"{split}_images")) == 0:
                raise ValueError(f"{self.name}: the {split} set is empty")

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one image."""
        channels, height, width = self.train_images.shape[1:]
        return channels, height, width


@dataclass(frozen=True)
class _Download:
    """One file to fetch: where from, its MD5 (None where no official checksum is published), and whether
    it is a tarball to extract in place."""

    url: str
    md5: str | None
    extract: bool = False

    @property
    def file_name(self) -> str:
        return self.url.rsplit("/", 1)[1]


@dataclass(frozen=True)
class _DatasetSource:
    """Where a dataset lives under the data directory, which files its reader needs, where they come from."""

    subdirs: tuple[str, ...]
    """Its folder's names under the data directory, the one :func:`download_dataset` fills first."""
    required_files: tuple[str, ...]
    downloads: tuple[_Download, ...]
    read: Callable[[Path], tuple[Tensor, Tensor, Tensor, Tensor]]
    """(dataset directory) -> (train_images, train_labels, test_images, test_labels)"""
    system_dirs: tuple[Path, ...] = ()
    """Where system packages install it, looked at after the data directory."""


def _find_file(directory: Path, relative: str) -> Path | None:
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


def _read_idx_dataset(
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
        path = _find_file(directory, f"{name}.gz")
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
        if len(labels) and labels.max() >= _NUM_CLASSES:
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
    if labels.size and not 1 <= labels.min() <= labels.max() <= _NUM_CLASSES:
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


def _read_svhn(directory: Path) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (*_read_svhn_mat(directory / "train_32x32.mat"), *_read_svhn_mat(directory / "test_32x32.mat"))


_CIFAR10_DIR = "cifar-10-batches-py"
_CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{k}" for k in range(1, 6))
_CIFAR10_TEST_BATCH = "test_batch"


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
    if len(labels) and not 0 <= labels.min() <= labels.max() < _NUM_CLASSES:
        raise DataFileError(path, f"{path}: labels must be 0..9, got {labels.min()}..{labels.max()}")
    return data.reshape(-1, 3, 32, 32), labels


def _read_cifar10(directory: Path) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    train = [_read_cifar10_batch(directory / _CIFAR10_DIR / name) for name in _CIFAR10_TRAIN_BATCHES]
    test_images, test_labels = _read_cifar10_batch(directory / _CIFAR10_DIR / _CIFAR10_TEST_BATCH)
    return (
        torch.from_numpy(np.concatenate([images for images, _ in train])),
        torch.from_numpy(np.concatenate([labels for _, labels in train])),
        torch.from_numpy(test_images),
        torch.from_numpy(test_labels),
    )


_IDX_GZ_NAMES = tuple(f"{name}.gz" for name in MNIST_FILES.values())
_FASHION_MNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
_NOTMNIST_URL = "https://github.com/davidflanagan/notMNIST-to-MNIST/raw/master/"
_SVHN_URL = "http://ufldl.stanford.edu/housenumbers/"

_SOURCES: dict[str, _DatasetSource] = {
    "fashion_mnist": _DatasetSource(
        subdirs=("fashion_mnist", "fashion-mnist", "FashionMNIST/raw"),
        required_files=_IDX_GZ_NAMES,
        downloads=tuple(
            _Download(_FASHION_MNIST_URL + name, md5)
            for name, md5 in zip(
                _IDX_GZ_NAMES,
                (  # published in the Fashion-MNIST README
                    "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
                    "25c81989df183df01b3e8a0aad5dffbe",
                    "bef4ecab320f06d8554ea6380940ec79",
                    "bb300cfdad3c16e7a12a480ee83cd310",
                ),
                strict=True,
            )
        ),
        read=functools.partial(
            _read_idx_dataset, dataset="Fashion-MNIST", published_md5=KNOWN_IDX_MD5["Fashion-MNIST"]
        ),
        system_dirs=(Path("/usr/share/datasets/fashion-mnist"),),  # Debian's dataset-fashion-mnist package
    ),
    "notmnist": _DatasetSource(
        subdirs=("notmnist", "notMNIST"),
        required_files=_IDX_GZ_NAMES,
        downloads=tuple(_Download(_NOTMNIST_URL + name, md5=None) for name in _IDX_GZ_NAMES),
        read=functools.partial(_read_idx_dataset, dataset="notMNIST", published_md5=None),
    ),
    "svhn": _DatasetSource(
        subdirs=("svhn", "SVHN"),
        required_files=("train_32x32.mat", "test_32x32.mat"),
        downloads=(
            _Download(_SVHN_URL + "train_32x32.mat", "e26dedcc434d2e4c54c9b2d4a06d8373"),
            _Download(_SVHN_URL + "test_32x32.mat", "eb5a983be6a315427106f1b9d5f0e8a7"),
        ),
        read=_read_svhn,
    ),
    "cifar10": _DatasetSource(
        subdirs=("cifar10", "."),  # "." holds torchvision's DATA_DIR/cifar-10-batches-py
        required_files=tuple(
            f"{_CIFAR10_DIR}/{name}" for name in (*_CIFAR10_TRAIN_BATCHES, _CIFAR10_TEST_BATCH)
        ),
        downloads=(
            _Download(
                "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
                "c58f30108f718f92721af3b95e74349a",
                extract=True,
            ),
        ),
        read=_read_cifar10,
    ),
}


def _source(name: str) -> _DatasetSource:
    if name not in _SOURCES:
        raise ValueError(f"unknown dataset {name!r}; choose from {DATASET_NAMES}")
    return _SOURCES[name]


def _fetch_instructions(source: _DatasetSource, directory: Path) -> str:
    """How to obtain a dataset's files by hand (for offline machines)."""
    lines = []
    for download in source.downloads:
        target = directory / download.file_name
        checksum = f" (MD5 {download.md5})" if download.md5 else ""
        action = f"extract it into {directory}" if download.extract else f"save it as {target}"
        lines.append(f"  download {download.url}{checksum} and {action}")
    return "\n".join(lines)


def _remedy(name: str, data_dir: str | Path | None, source: _DatasetSource, directory: Path, bad: object) -> str:
    """What to do about an unusable file ``bad`` of dataset ``name`` (or, for a folder, about all its files)."""
    where = str(data_dir) if data_dir is not None else "DATA_DIR"
    run = f"foovb_suite.data.download_dataset({name!r}, {where!r})"
    if isinstance(bad, Path) and bad.is_dir():
        url = os.path.commonprefix([download.url for download in source.downloads]).rsplit("/", 1)[0] + "/"
        return f"delete the files in {bad} and run {run} to fetch the right ones, or download them from {url}"
    file_name = Path(str(bad)).name
    for download in source.downloads:
        checksum = f" (MD5 {download.md5})" if download.md5 else ""
        if download.extract:
            return (
                f"delete it and run {run} to extract it again, or download {download.url}{checksum} and extract it "
                f"into {directory}"
            )
        if file_name in (download.file_name, download.file_name.removesuffix(".gz")):
            return (
                f"delete it and run {run} to fetch it again, or download {download.url}{checksum} and save it as "
                f"{directory / download.file_name}"
            )
    return f"delete it and run {run}"


def _missing_files(source: _DatasetSource, directory: Path) -> list[Path]:
    return [
        directory / relative for relative in source.required_files if _find_file(directory, relative) is None
    ]


def dataset_folders(name: str, data_dir: str | Path | None) -> list[Path]:
    """The folders :func:`load_dataset` looks in for dataset ``name``, in order: its usual folder names under
    ``data_dir`` (none when ``data_dir`` is None), then where system packages install it."""
    source = _source(name)
    under = [Path(data_dir) / subdir for subdir in source.subdirs] if data_dir is not None else []
    return [*(Path(os.path.normpath(folder)) for folder in under), *source.system_dirs]


def _dataset_folder(name: str, data_dir: str | Path | None) -> Path:
    """The first of :func:`dataset_folders` that holds every file the dataset needs. Raises
    ``FileNotFoundError`` naming the places looked at, the files missing, and how to get them."""
    source = _source(name)
    missing = {folder: _missing_files(source, folder) for folder in dataset_folders(name, data_dir)}
    for folder, files in missing.items():
        if not files:
            return folder
    partial = [folder for folder, files in missing.items() if len(files) < len(source.required_files)]
    target = partial[0] if partial else (next(iter(missing)) if data_dir is not None
                                         else Path("DATA_DIR") / source.subdirs[0])
    looked = "\n".join(f"  {folder}" for folder in missing) or "  (no data directory given)"
    fetch = (f"Run foovb_suite.data.download_dataset({name!r}, {str(data_dir)!r}) on a machine with internet access, "
             "or by hand:" if data_dir is not None else "Name a data directory (scenario.data_dir), and put there:")
    where = f"{target} is incomplete; missing files" if partial else "missing files (where the first place wants them)"
    message = (
        f"dataset {name!r} was not found; looked in:\n{looked}\n{where}:\n"
        + "\n".join(f"  {path}" for path in missing.get(target) or _missing_files(source, target))
        + f"\n{fetch}\n{_fetch_instructions(source, target)}"
    )
    raise FileNotFoundError(message)


def load_dataset(name: str, data_dir: str | Path | None) -> ImageDataset:
    """Load dataset ``name`` (one of :data:`DATASET_NAMES`) from ``data_dir`` (layout: module docstring).

    ``"mnist"`` returns the embedded MD5-verified copy and ignores ``data_dir``. Raises ``FileNotFoundError``
    listing every missing file and where to get it, and :class:`DataFileError` (a ``ValueError``) for a file
    that fails its check (module docstring: corrupt, truncated, wrong format, another dataset's file), naming
    it and saying how to replace it.
    """
    if name == "mnist":
        mnist = load_mnist()
        return ImageDataset(
            name=name,
            train_images=mnist.train_images.unsqueeze(1),
            train_labels=mnist.train_labels,
            test_images=mnist.test_images.unsqueeze(1),
            test_labels=mnist.test_labels,
        )
    source = _source(name)
    directory = _dataset_folder(name, data_dir)
    try:
        train_images, train_labels, test_images, test_labels = source.read(directory)
    except DataFileError as error:
        if Path(str(error.path)).name == MD5SUMS_FILE:
            raise  # the folder's own checksum file: fix or delete it (its message says so)
        remedy = _remedy(name, data_dir, source, directory, error.path)
        raise DataFileError(error.path, error.problem, remedy) from error
    return ImageDataset(name, train_images, train_labels, test_images, test_labels)


def _md5_of_file(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fetch(download: _Download, target: Path, directory: Path) -> None:
    """Download one file to ``target`` via a temporary file, and check its MD5 when one is known."""
    partial = target.with_name(target.name + ".part")
    try:
        with urllib.request.urlopen(download.url) as response, partial.open("wb") as handle:
            shutil.copyfileobj(response, handle)
    except OSError as error:  # includes urllib.error.URLError
        partial.unlink(missing_ok=True)
        checksum = f" and check its MD5 is {download.md5}" if download.md5 else ""
        action = f"extract it into {directory}" if download.extract else f"place it at {target}"
        raise ConnectionError(
            f"could not download {download.url}: {error}. Offline, download it on another machine, "
            f"{action}{checksum}"
        ) from error
    if download.md5 is not None and (actual := _md5_of_file(partial)) != download.md5:
        partial.unlink()
        raise ValueError(f"MD5 mismatch for {download.url}: expected {download.md5}, got {actual}")
    partial.replace(target)


def download_dataset(name: str, data_dir: str | Path) -> Path:
    """Download dataset ``name`` into ``data_dir`` (the layout :func:`load_dataset` reads); return its folder.

    Does nothing when all files are already there. Checksums are verified where published (Fashion-MNIST,
    SVHN, CIFAR-10; the notMNIST-to-MNIST files have none and are only checked by parsing them). Raises
    ``ConnectionError`` (saying how to place the files by hand) when a download fails. ``"mnist"`` is embedded
    and needs nothing.
    """
    if name == "mnist":
        return Path(data_dir)
    source = _source(name)
    directory = Path(data_dir) / source.subdirs[0]
    if not _missing_files(source, directory):
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    for download in source.downloads:
        target = directory / download.file_name
        if not (target.is_file() and (download.md5 is None or _md5_of_file(target) == download.md5)):
            _fetch(download, target, directory)
        if download.extract:
            with tarfile.open(target) as archive:
                # the "data" filter (Python >= 3.10.12) refuses members that would land outside `directory`
                safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                archive.extractall(directory, **safe)
    load_dataset(name, data_dir)  # fails loudly now rather than at training time if a file is unusable
    return directory
