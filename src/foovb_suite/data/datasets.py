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

Files are trusted only after a content check (:mod:`foovb_suite.data.formats`, the readers of the file formats).
Every unusable file raises a ``ValueError`` (:class:`DataFileError`) that names it and says how to replace it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tarfile
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from foovb_suite.data.formats import (
    CIFAR10_DIR,
    CIFAR10_TEST_BATCH,
    CIFAR10_TRAIN_BATCHES,
    NUM_CLASSES,
    find_file,
    read_cifar10,
    read_idx_dataset,
    read_svhn,
)
from foovb_suite.data.mnist import KNOWN_IDX_MD5, MD5SUMS_FILE, MNIST_FILES, DataFileError, load_mnist

DATASET_NAMES = ("mnist", "notmnist", "fashion_mnist", "svhn", "cifar10")
"""Names accepted by :func:`load_dataset`, in the task order of the vision-datasets mix."""


@dataclass(frozen=True)
class ImageDataset:
    """A labelled image dataset: uint8 images ``(N, C, H, W)`` and int64 labels ``(N,)`` per split."""

    name: str
    train_images: Tensor
    train_labels: Tensor
    test_images: Tensor
    test_labels: Tensor
    num_classes: int = NUM_CLASSES

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
            read_idx_dataset, dataset="Fashion-MNIST", published_md5=KNOWN_IDX_MD5["Fashion-MNIST"]
        ),
        system_dirs=(Path("/usr/share/datasets/fashion-mnist"),),  # Debian's dataset-fashion-mnist package
    ),
    "notmnist": _DatasetSource(
        subdirs=("notmnist", "notMNIST"),
        required_files=_IDX_GZ_NAMES,
        downloads=tuple(_Download(_NOTMNIST_URL + name, md5=None) for name in _IDX_GZ_NAMES),
        read=functools.partial(read_idx_dataset, dataset="notMNIST", published_md5=None),
    ),
    "svhn": _DatasetSource(
        subdirs=("svhn", "SVHN"),
        required_files=("train_32x32.mat", "test_32x32.mat"),
        downloads=(
            _Download(_SVHN_URL + "train_32x32.mat", "e26dedcc434d2e4c54c9b2d4a06d8373"),
            _Download(_SVHN_URL + "test_32x32.mat", "eb5a983be6a315427106f1b9d5f0e8a7"),
        ),
        read=read_svhn,
    ),
    "cifar10": _DatasetSource(
        subdirs=("cifar10", "."),  # "." holds torchvision's DATA_DIR/cifar-10-batches-py
        required_files=tuple(
            f"{CIFAR10_DIR}/{name}" for name in (*CIFAR10_TRAIN_BATCHES, CIFAR10_TEST_BATCH)
        ),
        downloads=(
            _Download(
                "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
                "c58f30108f718f92721af3b95e74349a",
                extract=True,
            ),
        ),
        read=read_cifar10,
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
        directory / relative for relative in source.required_files if find_file(directory, relative) is None
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
    if data_dir is not None and not Path(data_dir).exists():  # a typo, or a relative path read from elsewhere
        relative = "" if Path(data_dir).is_absolute() else f" (a relative path, read from {Path.cwd()})"
        raise FileNotFoundError(
            f"dataset {name!r} was not found: scenario.data_dir {data_dir} does not exist{relative}; it should hold "
            f"{source.subdirs[0]}/ with {', '.join(source.required_files)}; foovb_suite.data.download_dataset("
            f"{name!r}, {str(data_dir)!r}) fetches them on a machine with internet access")
    if data_dir is not None and not _missing_files(source, Path(data_dir)):  # the dataset's own folder was named
        folder = Path(data_dir)
        move = "" if folder.name in source.subdirs else f", with the files in {source.subdirs[0]}/ there (or a link)"
        raise FileNotFoundError(f"dataset {name!r}: scenario.data_dir ({data_dir}) holds the dataset's files itself; "
                                f"name the folder that holds it: {folder.parent}{move}")
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
