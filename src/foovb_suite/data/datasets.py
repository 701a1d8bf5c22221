"""The datasets of the vision-datasets mix (paper appendix "Task-aware continual learning on vision
datasets").

MNIST, notMNIST, Fashion-MNIST, SVHN and CIFAR-10, as in Ritter et al. (2018). MNIST is embedded in the
package (:mod:`foovb_suite.data.mnist`); the others are read from a data directory with this layout::

    DATA_DIR/fashion_mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz
    DATA_DIR/notmnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz    (notMNIST-to-MNIST files)
    DATA_DIR/svhn/{train,test}_32x32.mat                                  (needs scipy)
    DATA_DIR/cifar10/cifar-10-batches-py/{data_batch_1..5,test_batch}     (the extracted python tarball)

IDX files may also be stored gunzipped (same name without ``.gz``). :func:`download_dataset` fetches the
official files into that layout; :func:`load_dataset` never touches the network.
"""

from __future__ import annotations

import hashlib
import pickle
import shutil
import tarfile
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from foovb_suite.data.mnist import MNIST_FILES, load_mnist, read_idx

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

    subdir: str
    required_files: tuple[str, ...]
    downloads: tuple[_Download, ...]
    read: Callable[[Path], tuple[Tensor, Tensor, Tensor, Tensor]]
    """(dataset directory) -> (train_images, train_labels, test_images, test_labels)"""


def _find_file(directory: Path, relative: str) -> Path | None:
    """``directory/relative`` or, for a ``.gz`` name, its gunzipped version, whichever exists."""
    for candidate in (directory / relative, directory / relative.removesuffix(".gz")):
        if candidate.is_file():
            return candidate
    return None


def _read_idx_dataset(directory: Path) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The four MNIST-format IDX files (Fashion-MNIST, notMNIST); grayscale images get a channel axis."""
    arrays = {}
    for field, name in MNIST_FILES.items():
        path = _find_file(directory, f"{name}.gz")
        if path is None:
            raise FileNotFoundError(f"missing data file: {directory / name}.gz")
        arrays[field] = read_idx(path, expected_ndim=3 if field.endswith("images") else 1)
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
        raise ValueError(
            f"{path} is not a valid SVHN .mat file (needs variables X and y): {type(error).__name__}: {error}"
        ) from error
    if images.ndim != 4 or images.shape[:3] != (32, 32, 3) or images.shape[3] != labels.size:
        raise ValueError(
            f"{path}: expected X of shape (32, 32, 3, N) and N labels, got X {images.shape}, y {labels.shape}"
        )
    images, labels = _checked_bytes(images, path, "X"), _checked_labels(labels, path, "y")
    labels = labels.reshape(-1)
    labels[labels == 10] = 0
    return torch.from_numpy(np.ascontiguousarray(images.transpose(3, 2, 0, 1))), torch.from_numpy(labels)


def _checked_bytes(values: np.ndarray, path: Path, name: str) -> np.ndarray:
    """`values` as uint8, refusing what a cast would silently change (floats, values outside 0..255)."""
    values = np.asarray(values)
    if not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"{path}: {name} must hold integer pixel values in 0..255, got dtype {values.dtype}")
    if values.size and not 0 <= values.min() <= values.max() <= 255:
        raise ValueError(f"{path}: {name} must hold pixel values in 0..255, got {values.min()}..{values.max()}")
    return values.astype(np.uint8)


def _checked_labels(values: object, path: Path, name: str) -> np.ndarray:
    """`values` as int64, refusing non-integer labels."""
    values = np.asarray(values)
    if not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"{path}: {name} must hold integer labels, got dtype {values.dtype}")
    return values.astype(np.int64)


def _read_svhn(directory: Path) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (*_read_svhn_mat(directory / "train_32x32.mat"), *_read_svhn_mat(directory / "test_32x32.mat"))


_CIFAR10_DIR = "cifar-10-batches-py"
_CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{k}" for k in range(1, 6))
_CIFAR10_TEST_BATCH = "test_batch"


def _read_cifar10_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 python batch: a pickled dict with ``data`` (N, 3072) uint8 rows (R, G, B planes of
    32x32) and ``labels``. Unpickling runs code from the file: only read the official (MD5-checked) files."""
    if not path.is_file():
        raise FileNotFoundError(f"missing data file: {path}")
    try:
        with path.open("rb") as handle:
            content = pickle.load(handle, encoding="bytes")
        # the official files have bytes keys; files pickled by Python 3 code have str keys
        data = content.get(b"data", content.get("data"))
        labels = content.get(b"labels", content.get("labels"))
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as error:
        raise ValueError(f"{path} is not a CIFAR-10 python batch: {error}") from error
    if data is None or labels is None:
        raise ValueError(f"{path} is not a CIFAR-10 python batch (needs keys 'data' and 'labels')")
    data, labels = _checked_bytes(data, path, "data"), _checked_labels(labels, path, "labels")
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(labels):
        raise ValueError(f"{path}: expected data of shape (N, 3072) with N labels, got {data.shape}")
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
        subdir="fashion_mnist",
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
        read=_read_idx_dataset,
    ),
    "notmnist": _DatasetSource(
        subdir="notmnist",
        required_files=_IDX_GZ_NAMES,
        downloads=tuple(_Download(_NOTMNIST_URL + name, md5=None) for name in _IDX_GZ_NAMES),
        read=_read_idx_dataset,
    ),
    "svhn": _DatasetSource(
        subdir="svhn",
        required_files=("train_32x32.mat", "test_32x32.mat"),
        downloads=(
            _Download(_SVHN_URL + "train_32x32.mat", "e26dedcc434d2e4c54c9b2d4a06d8373"),
            _Download(_SVHN_URL + "test_32x32.mat", "eb5a983be6a315427106f1b9d5f0e8a7"),
        ),
        read=_read_svhn,
    ),
    "cifar10": _DatasetSource(
        subdir="cifar10",
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


def _missing_files(source: _DatasetSource, directory: Path) -> list[Path]:
    return [
        directory / relative for relative in source.required_files if _find_file(directory, relative) is None
    ]


def load_dataset(name: str, data_dir: str | Path) -> ImageDataset:
    """Load dataset ``name`` (one of :data:`DATASET_NAMES`) from ``data_dir`` (layout: module docstring).

    ``"mnist"`` returns the embedded MD5-verified copy and ignores ``data_dir``. Raises ``FileNotFoundError``
    listing every missing file and where to get it, ``ValueError`` for a file in the wrong format.
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
    directory = Path(data_dir) / source.subdir
    missing = _missing_files(source, directory)
    if missing:
        raise FileNotFoundError(
            f"dataset {name!r} is incomplete; missing files:\n"
            + "\n".join(f"  {path}" for path in missing)
            + f"\nRun foovb_suite.data.download_dataset({name!r}, {str(data_dir)!r}) on a machine with internet "
            f"access, or by hand:\n{_fetch_instructions(source, directory)}"
        )
    train_images, train_labels, test_images, test_labels = source.read(directory)
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
    directory = Path(data_dir) / source.subdir
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
