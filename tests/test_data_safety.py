"""Data files are trusted only after a content check (issue 36, item 4).

Each test here feeds the dataset readers a file that is not what its name says: a crafted CIFAR-10 pickle that
would run code, truncated or random bytes, another dataset's files in the wrong folder. Every such file must be
refused with a ``ValueError`` that names it and says how to replace it, never a raw ``EOFError`` /
``zlib.error`` / ``UnpicklingError`` / ``OverflowError``, and never by running what the file asks for.

These tests only use ``ValueError`` and the public loaders, so that they also run (and fail) against the
readers as they were before the check (see the notes in each test).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pickle
import shutil
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from foovb_suite.data import load_dataset, load_mnist

REPO = Path(__file__).resolve().parents[1]
EMBEDDED_MNIST = REPO / "src" / "foovb_suite" / "data" / "files"
IDX_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
CIFAR_BATCHES = (*(f"data_batch_{k}" for k in range(1, 6)), "test_batch")
# the project's shared data (Debian's dataset-fashion-mnist files): next to the checkout, or inside it
SHARED_FASHION_MNIST = next(
    (path for path in (REPO.parent / "shared/data/fashion-mnist", REPO / "shared/data/fashion-mnist") if path.is_dir()),
    None,
)
needs_fashion_mnist = pytest.mark.skipif(SHARED_FASHION_MNIST is None, reason="shared/data/fashion-mnist not here")


def idx_bytes(array: np.ndarray) -> bytes:
    """A uint8 array in the IDX format (magic 0x0000 08 NDIM, big-endian uint32 sizes, data)."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(size.to_bytes(4, "big") for size in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_idx_files(directory: Path, seed: int, image_size: int = 28, max_label: int = 9) -> list[np.ndarray]:
    """Four tiny valid IDX files (gzipped) of random content, in IDX_NAMES order."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = [
        rng.integers(0, 256, size=(5, image_size, image_size), dtype=np.uint8),
        rng.integers(0, max_label + 1, size=5, dtype=np.uint8),
        rng.integers(0, 256, size=(3, image_size, image_size), dtype=np.uint8),
        rng.integers(0, max_label + 1, size=3, dtype=np.uint8),
    ]
    for name, array in zip(IDX_NAMES, arrays, strict=True):
        (directory / f"{name}.gz").write_bytes(gzip.compress(idx_bytes(array)))
    return arrays


def write_md5sums(directory: Path, arrays: list[np.ndarray]) -> None:
    lines = [f"{hashlib.md5(idx_bytes(a)).hexdigest()}  {n}" for n, a in zip(IDX_NAMES, arrays, strict=True)]
    (directory / "MD5SUMS.uncompressed").write_text("\n".join(lines) + "\n")


def cifar_batch(rng: np.random.Generator, rows: int = 2) -> dict[bytes, object]:
    """A batch in the official format: bytes keys, uint8 (N, 3072) data, a list of int labels."""
    return {
        b"batch_label": b"testing batch 1 of 1",
        b"labels": rng.integers(0, 10, size=rows).tolist(),
        b"data": rng.integers(0, 256, size=(rows, 3072), dtype=np.uint8),
        b"filenames": [b"img%d.png" % k for k in range(rows)],
    }


class _Python2StylePickler(pickle._Pickler):
    """Writes bytes the way Python 2 wrote its ``str`` (SHORT_BINSTRING / BINSTRING), as in the official CIFAR-10
    batches, instead of Python 3's ``_codecs.encode(..., "latin1")`` for protocol 2."""

    def save_bytes(self, obj: bytes) -> None:
        if len(obj) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(obj)]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    dispatch = dict(pickle._Pickler.dispatch)
    dispatch[bytes] = save_bytes


def python2_style_pickle(content: object) -> bytes:
    """Protocol 2 with Python 2 strings and numpy 1's module name, like the official ``cifar-10-batches-py``."""
    buffer = io.BytesIO()
    _Python2StylePickler(buffer, protocol=2).dump(content)
    return buffer.getvalue().replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")


def write_cifar10(directory: Path, batch: dict | None = None, seed: int = 0, protocol: int = 2) -> Path:
    """Six genuine-format batches (all equal to `batch` when given); returns the batch folder."""
    rng = np.random.default_rng(seed)
    batch_dir = directory / "cifar10" / "cifar-10-batches-py"
    batch_dir.mkdir(parents=True)
    for name in CIFAR_BATCHES:
        (batch_dir / name).write_bytes(pickle.dumps(cifar_batch(rng) if batch is None else batch, protocol=protocol))
    return batch_dir


def assert_names_file_and_remedy(message: str, path: Path, dataset: str, data_dir: Path) -> None:
    """The message names the file and says how to replace it (download_dataset, or the file's source)."""
    assert str(path) in message, message
    assert f"download_dataset({dataset!r}, {str(data_dir)!r})" in message, message


# --- CIFAR-10: a crafted pickle must not run ---------------------------------------------------------------


class _Payload:
    """Unpickles by calling ``function(*args)``: what a crafted pickle does to run code."""

    def __init__(self, function: object, *args: object) -> None:
        self.function, self.args = function, args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.function, self.args


@pytest.mark.parametrize("runner", ["exec", "os.system"])
def test_crafted_cifar10_pickle_is_refused_and_never_run(tmp_path, runner):
    """Before the check: ``pickle.load`` ran the payload (the marker file appeared), then failed on its result."""
    marker = tmp_path / "marker"
    if runner == "exec":
        payload = _Payload(exec, f"open({str(marker)!r}, 'w').write('ran')")
        loads = "__builtin__.exec"  # a protocol-2 pickle names Python 2's module
    else:
        payload = _Payload(os.system, f"echo ran > '{marker}'")
        loads = f"{os.system.__module__}.system"  # posix.system on Linux
    batch_dir = write_cifar10(tmp_path, seed=1)
    crafted = batch_dir / "data_batch_3"
    labels = [1, 2]
    crafted.write_bytes(pickle.dumps({b"data": payload, b"labels": labels}, protocol=2))
    with pytest.raises(ValueError, match="not a CIFAR-10 batch: it asks to load") as error:
        load_dataset("cifar10", tmp_path)
    assert f"{crafted} is not a CIFAR-10 batch: it asks to load {loads}" in str(error.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    "pickled",
    [
        pytest.param(lambda batch: pickle.dumps(batch, protocol=2), id="protocol-2"),
        pytest.param(lambda batch: pickle.dumps(batch, protocol=4), id="protocol-4"),
        pytest.param(lambda batch: pickle.dumps(batch, protocol=5), id="protocol-5"),
        pytest.param(python2_style_pickle, id="python2-style"),
        pytest.param(lambda batch: pickle.dumps({k.decode(): v for k, v in batch.items()}), id="str-keys"),
    ],
)
def test_genuine_format_cifar10_batches_still_load(tmp_path, pickled):
    """The restricted unpickler reads every way a real batch is pickled (a guard, not a failure before)."""
    rng = np.random.default_rng(2)
    batch_dir = tmp_path / "cifar10" / "cifar-10-batches-py"
    batch_dir.mkdir(parents=True)
    written = {}
    for name in CIFAR_BATCHES:
        written[name] = cifar_batch(rng)
        (batch_dir / name).write_bytes(pickled(written[name]))
    dataset = load_dataset("cifar10", tmp_path)
    train_rows = np.concatenate([written[name][b"data"] for name in CIFAR_BATCHES[:5]])
    assert torch.equal(dataset.train_images.reshape(10, -1), torch.from_numpy(train_rows))
    assert dataset.train_labels.tolist() == sum((written[name][b"labels"] for name in CIFAR_BATCHES[:5]), [])
    assert dataset.test_labels.tolist() == written["test_batch"][b"labels"]


def test_python2_style_pickle_looks_like_the_official_batches():
    """The helper above writes what the official files hold: numpy.core names, Python 2 strings, no _codecs."""
    data = python2_style_pickle(cifar_batch(np.random.default_rng(0)))
    assert b"cnumpy.core.multiarray\n_reconstruct\n" in data and b"_codecs" not in data
    assert pickle.loads(data, encoding="bytes")[b"data"].shape == (2, 3072)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (pickle.dumps([1, 2, 3]), "is not a CIFAR-10 python batch"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [3, 10]}), r"labels must be 0\.\.9"),
        (pickle.dumps({b"data": [[0] * 3072] * 2, b"labels": [3, 1]}), "data must be a numpy array"),
    ],
    ids=["a-list", "label-10", "data-not-an-array"],
)
def test_cifar10_batch_of_the_wrong_shape_is_named(tmp_path, content, match):
    batch_dir = write_cifar10(tmp_path, seed=3)
    (batch_dir / "test_batch").write_bytes(content)
    with pytest.raises(ValueError, match=match) as error:
        load_dataset("cifar10", tmp_path)
    assert_names_file_and_remedy(str(error.value), batch_dir / "test_batch", "cifar10", tmp_path)


# --- truncated files ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fashion_mnist", "notmnist"])
def test_truncated_gzip_is_named_with_how_to_fetch_it_again(tmp_path, name):
    """Before: "corrupt gzip file ... (delete it and fetch it again)" without where from or how."""
    arrays = write_idx_files(tmp_path / name, seed=4)
    write_md5sums(tmp_path / name, arrays)
    broken = tmp_path / name / "train-images-idx3-ubyte.gz"
    broken.write_bytes(broken.read_bytes()[:-30])
    with pytest.raises(ValueError, match=r"corrupt gzip file .*train-images-idx3-ubyte\.gz") as error:
        load_dataset(name, tmp_path)
    assert_names_file_and_remedy(str(error.value), broken, name, tmp_path)
    assert "/train-images-idx3-ubyte.gz" in str(error.value).split("or download ")[1]  # the file's own URL


def test_truncated_cifar10_batch_is_named_with_how_to_extract_it_again(tmp_path):
    """Before: a ValueError naming the file but not what to do."""
    batch_dir = write_cifar10(tmp_path, seed=5, protocol=4)
    broken = batch_dir / "data_batch_1"
    broken.write_bytes(broken.read_bytes()[:3000])
    with pytest.raises(ValueError, match="is not a CIFAR-10 python batch") as error:
        load_dataset("cifar10", tmp_path)
    assert_names_file_and_remedy(str(error.value), broken, "cifar10", tmp_path)
    assert "cifar-10-python.tar.gz" in str(error.value)


# --- random bytes ------------------------------------------------------------------------------------------

_RANDOM = np.random.default_rng(6).bytes(256)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"\x8e" + (2**63).to_bytes(8, "little") + _RANDOM, id="BINBYTES8-too-long"),  # OverflowError
        pytest.param(b"\x96" + (2**62).to_bytes(8, "little") + _RANDOM, id="BYTEARRAY8-huge"),  # MemoryError
        pytest.param(b"I12x\n." + _RANDOM, id="INT-not-a-number"),  # ValueError not naming the file
        pytest.param(_RANDOM, id="random"),
        pytest.param(b"", id="empty"),  # EOFError
    ],
)
def test_random_bytes_as_cifar10_batch_raise_a_value_error_naming_the_file(tmp_path, content):
    """Before: OverflowError / MemoryError / an unnamed ValueError escaped for the first three."""
    batch_dir = write_cifar10(tmp_path, seed=7)
    (batch_dir / "data_batch_2").write_bytes(content)
    with pytest.raises(ValueError, match="is not a CIFAR-10 python batch") as error:
        load_dataset("cifar10", tmp_path)
    assert_names_file_and_remedy(str(error.value), batch_dir / "data_batch_2", "cifar10", tmp_path)


@pytest.mark.parametrize(
    ("name", "file_name"),
    [
        ("fashion_mnist", "t10k-labels-idx1-ubyte.gz"),
        ("notmnist", "t10k-labels-idx1-ubyte.gz"),
        ("notmnist", "t10k-labels-idx1-ubyte"),  # stored gunzipped: random bytes are no IDX header
        ("notmnist", "t10k-images-idx3-ubyte.gz:gzip-magic"),  # gzip magic, then garbage
    ],
)
def test_random_bytes_as_idx_file_raise_a_value_error_naming_the_file(tmp_path, name, file_name):
    """Before: a ValueError naming the file, without how to replace it."""
    arrays = write_idx_files(tmp_path / name, seed=8)
    write_md5sums(tmp_path / name, arrays)
    file_name, _, variant = file_name.partition(":")
    target = tmp_path / name / file_name
    (tmp_path / name / f"{file_name.removesuffix('.gz')}.gz").unlink()
    target.write_bytes((b"\x1f\x8b" if variant else b"") + _RANDOM)
    with pytest.raises(ValueError) as error:
        load_dataset(name, tmp_path)
    assert_names_file_and_remedy(str(error.value), target, name, tmp_path)


def test_random_bytes_as_svhn_file_raise_a_value_error_naming_the_file(tmp_path):
    pytest.importorskip("scipy.io")
    (tmp_path / "svhn").mkdir()
    for split in ("train", "test"):
        (tmp_path / "svhn" / f"{split}_32x32.mat").write_bytes(_RANDOM)
    with pytest.raises(ValueError, match="is not a valid SVHN .mat file") as error:
        load_dataset("svhn", tmp_path)
    assert_names_file_and_remedy(str(error.value), tmp_path / "svhn" / "train_32x32.mat", "svhn", tmp_path)
    assert "http://ufldl.stanford.edu/housenumbers/train_32x32.mat" in str(error.value)


def test_svhn_labels_outside_1_to_10_are_named(tmp_path):
    """Before: the error came from ImageDataset and named no file."""
    scipy_io = pytest.importorskip("scipy.io")
    (tmp_path / "svhn").mkdir()
    for split in ("train", "test"):
        images = np.zeros((32, 32, 3, 2), np.uint8)
        scipy_io.savemat(tmp_path / "svhn" / f"{split}_32x32.mat", {"X": images, "y": np.array([[3], [11]])})
    with pytest.raises(ValueError, match=r"y must hold SVHN labels 1\.\.10") as error:
        load_dataset("svhn", tmp_path)
    assert_names_file_and_remedy(str(error.value), tmp_path / "svhn" / "train_32x32.mat", "svhn", tmp_path)


# --- the wrong dataset in the folder -----------------------------------------------------------------------


@pytest.mark.parametrize("with_mnist_sums", [False, True], ids=["files", "whole-folder"])
def test_mnist_files_in_the_fashion_mnist_folder_are_refused(tmp_path, with_mnist_sums):
    """Before: MNIST's files loaded as Fashion-MNIST without a word."""
    folder = tmp_path / "fashion_mnist"
    folder.mkdir()
    for name in IDX_NAMES:
        shutil.copy(EMBEDDED_MNIST / f"{name}.gz", folder)
    if with_mnist_sums:  # the whole MNIST folder copied, its checksum file included
        shutil.copy(EMBEDDED_MNIST / "MD5SUMS.uncompressed", folder)
    with pytest.raises(ValueError) as error:
        load_dataset("fashion_mnist", tmp_path)
    message = str(error.value)
    assert f"{folder / 'train-images-idx3-ubyte.gz'} holds MNIST's train-images-idx3-ubyte" in message
    assert "not Fashion-MNIST's files" in message
    assert f"download_dataset('fashion_mnist', {str(tmp_path)!r})" in message
    assert message.count(". ") == 0 and "\n" not in message  # one sentence


def test_mnist_files_in_the_notmnist_folder_are_refused(tmp_path):
    """notMNIST has no published sums, but known files of another dataset are named. Before: loaded silently."""
    folder = tmp_path / "notmnist"
    folder.mkdir()
    for name in IDX_NAMES:
        shutil.copy(EMBEDDED_MNIST / f"{name}.gz", folder)
    with pytest.raises(ValueError, match="holds MNIST's train-images-idx3-ubyte, so these are not notMNIST's files"):
        load_dataset("notmnist", tmp_path)


def test_fashion_mnist_without_its_own_sums_must_be_the_published_files(tmp_path):
    """Valid IDX files that are not Fashion-MNIST's are refused unless the folder lists their sums itself."""
    arrays = write_idx_files(tmp_path / "fashion_mnist", seed=9)
    with pytest.raises(ValueError, match="is not Fashion-MNIST's train-images-idx3-ubyte: its MD5") as error:
        load_dataset("fashion_mnist", tmp_path)
    assert "f4a8712d7a061bf5bd6d2ca38dc4d50a" in str(error.value)
    write_md5sums(tmp_path / "fashion_mnist", arrays)  # a stand-in dataset, declared as such
    assert load_dataset("fashion_mnist", tmp_path).train_images.shape == (5, 1, 28, 28)
    labels = tmp_path / "fashion_mnist" / "t10k-labels-idx1-ubyte.gz"
    labels.write_bytes(gzip.compress(idx_bytes((arrays[3] + 1) % 10)))  # valid, but not the listed content
    with pytest.raises(ValueError, match=r"is not Fashion-MNIST's t10k-labels-idx1-ubyte.*the sum in .*MD5SUMS"):
        load_dataset("fashion_mnist", tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "match", "file_name"),
    [
        ({"image_size": 32}, "holds 32x32 images, not notMNIST's 28x28", "train-images-idx3-ubyte.gz"),
        ({"max_label": 12}, r"holds label 1[0-2], outside 0\.\.9", "train-labels-idx1-ubyte.gz"),
    ],
    ids=["32x32-images", "label-above-9"],
)
def test_idx_files_outside_the_format_are_named(tmp_path, kwargs, match, file_name):
    """Before: 32x32 images loaded; a label of 10+ failed in ImageDataset without naming the file."""
    write_idx_files(tmp_path / "notmnist", seed=10, **kwargs)
    labels_file = tmp_path / "notmnist" / "train-labels-idx1-ubyte.gz"
    if "max_label" in kwargs:  # make sure a label above 9 is there
        labels_file.write_bytes(gzip.compress(idx_bytes(np.array([1, 12, 3, 4, 5], np.uint8))))
    with pytest.raises(ValueError, match=match) as error:
        load_dataset("notmnist", tmp_path)
    assert_names_file_and_remedy(str(error.value), tmp_path / "notmnist" / file_name, "notmnist", tmp_path)


@needs_fashion_mnist
def test_the_real_fashion_mnist_files_load_and_are_told_apart(tmp_path):
    """Debian's Fashion-MNIST files pass the check; swapped or misplaced ones are named."""
    folder = tmp_path / "fashion_mnist"
    folder.mkdir()
    for name in IDX_NAMES:
        (folder / f"{name}.gz").symlink_to(SHARED_FASHION_MNIST / f"{name}.gz")
    dataset = load_dataset("fashion_mnist", tmp_path)
    assert dataset.train_images.shape == (60000, 1, 28, 28) and dataset.test_images.shape == (10000, 1, 28, 28)
    assert dataset.train_labels[:4].tolist() == [9, 0, 0, 3]  # ankle boot, T-shirt, T-shirt, dress
    (folder / "t10k-labels-idx1-ubyte.gz").unlink()
    (folder / "t10k-labels-idx1-ubyte.gz").symlink_to(SHARED_FASHION_MNIST / "train-labels-idx1-ubyte.gz")
    with pytest.raises(ValueError, match="is not Fashion-MNIST's t10k-labels-idx1-ubyte.*it is Fashion-MNIST's train"):
        load_dataset("fashion_mnist", tmp_path)
    mnist_folder = tmp_path / "mnist"  # and the other way round: Fashion-MNIST's files as MNIST
    mnist_folder.mkdir()
    for name in IDX_NAMES:
        (mnist_folder / f"{name}.gz").symlink_to(SHARED_FASHION_MNIST / f"{name}.gz")
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte\.gz holds Fashion-MNIST's .*not MNIST's files"):
        load_mnist(mnist_folder)
    shutil.copy(SHARED_FASHION_MNIST / "MD5SUMS.uncompressed", mnist_folder)  # even when listed as its content
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte\.gz holds Fashion-MNIST's .*not MNIST's files"):
        load_mnist(mnist_folder)


def test_the_hard_coded_mnist_sums_are_the_embedded_ones():
    from foovb_suite.data.mnist import KNOWN_IDX_MD5

    embedded = dict(line.split()[::-1] for line in (EMBEDDED_MNIST / "MD5SUMS.uncompressed").read_text().splitlines())
    assert KNOWN_IDX_MD5["MNIST"] == embedded
    if SHARED_FASHION_MNIST is not None:
        shared = (SHARED_FASHION_MNIST / "MD5SUMS.uncompressed").read_text().splitlines()
        assert KNOWN_IDX_MD5["Fashion-MNIST"] == dict(line.split()[::-1] for line in shared)


# --- sizes the header announces: gzip bombs, absurd shapes (issue "no input reaches a traceback") --------------


def write_gzip_bomb(path: Path, announced: np.ndarray, zeros_mib: int) -> None:
    """A valid IDX header and data of ``announced``, then ``zeros_mib`` MiB of zeros the header does not announce:
    ~100 kB on disk per 100 MiB decompressed."""
    with gzip.GzipFile(path, "wb", compresslevel=9) as bomb:
        bomb.write(idx_bytes(announced))
        zeros = bytes(1 << 20)
        for _ in range(zeros_mib):
            bomb.write(zeros)


@pytest.mark.parametrize("loader", ["notmnist", "mnist"])
def test_a_gzip_bomb_is_refused_without_decompressing_it(tmp_path, loader):
    """5 images announced, 100 MiB of zeros after them. Before: gunzipped whole (a 2 GiB one peaked at 4.5 GB RSS,
    a larger one raised MemoryError), then refused by size; now the read stops one byte past the announced size."""
    folder = tmp_path / loader
    arrays = write_idx_files(folder, seed=11)
    write_md5sums(folder, arrays)
    bomb = folder / "train-images-idx3-ubyte.gz"
    write_gzip_bomb(bomb, arrays[0], zeros_mib=100)
    assert bomb.stat().st_size < 200_000
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as error:
            load_dataset("notmnist", tmp_path) if loader == "notmnist" else load_mnist(folder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(error.value).startswith(
        f"{bomb}: IDX header announces shape (5, 28, 28) (3936 bytes) but the file has more (the rest is refused "
        "unread); "
    )
    if loader == "notmnist":
        assert_names_file_and_remedy(str(error.value), bomb, "notmnist", tmp_path)
    assert peak < 5 * 2**20, f"peak of {peak} bytes traced while refusing the bomb"


def test_an_idx_file_shorter_than_its_header_is_refused(tmp_path):
    """Ten images announced, five there: the read stops at the end of the stream, naming both sizes."""
    folder = tmp_path / "notmnist"
    arrays = write_idx_files(folder, seed=12)
    short = folder / "train-images-idx3-ubyte.gz"
    content = bytearray(idx_bytes(arrays[0]))
    content[4:8] = (10).to_bytes(4, "big")
    short.write_bytes(gzip.compress(bytes(content)))
    with pytest.raises(ValueError) as error:
        load_dataset("notmnist", tmp_path)
    assert str(error.value).startswith(
        f"{short}: IDX header announces shape (10, 28, 28) (7856 bytes) but the file has 3936 bytes; "
    )
    assert_names_file_and_remedy(str(error.value), short, "notmnist", tmp_path)


@pytest.mark.parametrize(
    ("file_name", "shape"),
    [
        ("train-images-idx3-ubyte.gz", (1, 2**31, 2**31)),
        ("train-images-idx3-ubyte.gz", (2**32 - 1,) * 3),  # 2**96 bytes: numpy's int64 product wraps around
        ("train-images-idx3-ubyte", (2**32 - 1,) * 3),  # stored gunzipped
        ("t10k-labels-idx1-ubyte.gz", (2**32 - 1,)),  # 4 GiB of labels
    ],
)
def test_an_idx_header_with_an_absurd_shape_is_refused_unread(tmp_path, monkeypatch, file_name, shape):
    """Before: the whole file was read and its length compared with a product that could overflow; now nothing
    past the header is read (every read of the gzip stream is recorded)."""
    folder = tmp_path / "notmnist"
    write_idx_files(folder, seed=13)
    target = folder / file_name
    (folder / f"{file_name.removesuffix('.gz')}.gz").unlink()
    content = bytes([0, 0, 0x08, len(shape)]) + b"".join(size.to_bytes(4, "big") for size in shape) + bytes(64)
    target.write_bytes(gzip.compress(content) if file_name.endswith(".gz") else content)
    read_sizes = []

    class RecordingGzipFile(gzip.GzipFile):
        def read(self, size: int = -1) -> bytes:
            read_sizes.append(size)
            return super().read(size)

    monkeypatch.setattr(gzip, "GzipFile", RecordingGzipFile)
    with pytest.raises(ValueError) as error:
        load_dataset("notmnist", tmp_path)
    data_size = int(np.prod(shape, dtype=object))
    assert str(error.value).startswith(
        f"{target}: IDX header announces shape {shape} ({data_size} bytes of data), more than the 1073741824 bytes "
        "an IDX file of these datasets may hold (refused unread); "
    )
    assert_names_file_and_remedy(str(error.value), target, "notmnist", tmp_path)
    if file_name.endswith(".gz"):
        assert read_sizes[-1] == 4 + 4 * len(shape)  # the header, and nothing after it


def test_an_idx_file_larger_than_the_available_memory_is_refused_unread(tmp_path, monkeypatch):
    """The bound by memory: the data (5 x 28 x 28 = 3920 bytes) is read into bytes and copied into an array."""
    from foovb_suite.data import mnist

    assert mnist.available_memory() > 0  # /proc/meminfo's MemAvailable, or sysconf's free pages
    write_idx_files(tmp_path / "notmnist", seed=14)
    monkeypatch.setattr(mnist, "available_memory", lambda: 7839)
    with pytest.raises(ValueError) as error:
        load_dataset("notmnist", tmp_path)
    images = tmp_path / "notmnist" / "train-images-idx3-ubyte.gz"
    assert str(error.value).startswith(
        f"{images}: IDX header announces shape (5, 28, 28) (3920 bytes of data), and reading it needs twice that, "
        "more than the 7839 bytes of memory available (refused unread); "
    )
    monkeypatch.setattr(mnist, "available_memory", lambda: 7840)
    assert load_dataset("notmnist", tmp_path).train_images.shape == (5, 1, 28, 28)


def test_the_cli_refuses_a_gzip_bomb_in_one_line_before_writing(tmp_path, capsys):
    """The user's view of the bomb: `foovb run` exits with 2 and one line naming the file, nothing written."""
    from foovb_suite.cli import main

    bomb = tmp_path / "data" / "notmnist" / "train-images-idx3-ubyte.gz"
    arrays = write_idx_files(bomb.parent, seed=15)
    write_gzip_bomb(bomb, arrays[0], zeros_mib=20)
    config = tmp_path / "c.yaml"
    config.write_text(f"scenario: {{kind: vision_mix, num_tasks: 1, datasets: [notmnist], data_dir: {bomb.parents[1]}}}"
                      "\nlearner: {kind: sgd}\n")
    assert main(["run", str(config), "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"foovb: error: scenario: {bomb}: IDX header announces shape (5, 28, 28) (3936 bytes) but "
                          "the file has more (the rest is refused unread); ")
    assert err.count("\n") == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["c.yaml", "data"]
