"""Tests of the dataset readers: the embedded MNIST (MD5-verified) and the other vision datasets,
round-tripped through tiny synthetic files written in each official format."""

from __future__ import annotations

import gzip
import hashlib
import io
import pickle
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from foovb_suite.data import MNIST_MEAN, MNIST_STD, ImageDataset, download_dataset, load_dataset, load_mnist
from foovb_suite.data.mnist import MD5SUMS_FILE, MNIST_FILES, parse_idx

EMBEDDED_MNIST = Path(__file__).resolve().parents[1] / "src" / "foovb_suite" / "data" / "files"
IDX_NAMES = tuple(MNIST_FILES.values())  # train images, train labels, test images, test labels


def idx_bytes(array: np.ndarray) -> bytes:
    """Serialise a uint8 array in the IDX format (magic 0x0000 08 NDIM, big-endian uint32 sizes, data)."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(size.to_bytes(4, "big") for size in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_idx_dataset(directory: Path, rng: np.random.Generator, compressed: bool = True) -> list[np.ndarray]:
    """Write the MNIST-layout IDX files of a tiny random dataset; return the arrays in IDX_NAMES order."""
    directory.mkdir(parents=True, exist_ok=True)
    arrays = [
        rng.integers(0, 256, size=(7, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, size=7, dtype=np.uint8),
        rng.integers(0, 256, size=(3, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, size=3, dtype=np.uint8),
    ]
    for name, array in zip(IDX_NAMES, arrays, strict=True):
        data = idx_bytes(array)
        if compressed:
            (directory / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (directory / name).write_bytes(data)
    return arrays


def write_md5sums(directory: Path, arrays: list[np.ndarray]) -> None:
    """The MD5SUMS.uncompressed of the IDX files `write_idx_dataset` wrote."""
    lines = [
        f"{hashlib.md5(idx_bytes(array)).hexdigest()}  {name}"
        for name, array in zip(IDX_NAMES, arrays, strict=True)
    ]
    (directory / MD5SUMS_FILE).write_text("\n".join(lines) + "\n")


def write_fake_mnist_root(directory: Path, rng: np.random.Generator) -> list[np.ndarray]:
    """A tiny MNIST root: the four IDX gz files plus a matching MD5SUMS.uncompressed."""
    arrays = write_idx_dataset(directory, rng)
    write_md5sums(directory, arrays)
    return arrays


# --- embedded MNIST ---------------------------------------------------------------------------------------


def test_embedded_mnist_shapes_and_pixel_statistics():
    mnist = load_mnist()
    assert mnist.train_images.shape == (60000, 28, 28) and mnist.train_images.dtype == torch.uint8
    assert mnist.test_images.shape == (10000, 28, 28) and mnist.test_images.dtype == torch.uint8
    assert mnist.train_labels.shape == (60000,) and mnist.train_labels.dtype == torch.int64
    assert mnist.test_labels.shape == (10000,) and mnist.test_labels.dtype == torch.int64
    assert set(mnist.train_labels.unique().tolist()) == set(range(10))
    pixels = mnist.train_images.double() / 255
    assert pixels.mean().item() == pytest.approx(MNIST_MEAN, abs=1e-4)
    assert pixels.std().item() == pytest.approx(MNIST_STD, abs=1e-4)
    assert load_mnist() is mnist  # cached


def test_mnist_round_trip_of_synthetic_root(tmp_path):
    arrays = write_fake_mnist_root(tmp_path, np.random.default_rng(0))
    mnist = load_mnist(tmp_path)
    fields = (mnist.train_images, mnist.train_labels, mnist.test_images, mnist.test_labels)
    for loaded, written in zip(fields, arrays, strict=True):
        assert torch.equal(loaded, torch.from_numpy(written.astype(loaded.numpy().dtype)))


def test_mnist_md5_verification_rejects_modified_copy(tmp_path):
    for file in EMBEDDED_MNIST.iterdir():
        shutil.copy(file, tmp_path)
    labels_file = tmp_path / "train-labels-idx1-ubyte.gz"
    labels = bytearray(gzip.decompress(labels_file.read_bytes()))
    labels[-1] = (labels[-1] + 1) % 10  # still a valid IDX file with valid labels, but not the original
    labels_file.write_bytes(gzip.compress(bytes(labels)))
    with pytest.raises(ValueError, match=r"MD5 mismatch.*train-labels-idx1-ubyte\.gz"):
        load_mnist(tmp_path)


def test_mnist_folder_without_checksum_file_is_checked_against_the_original_sums(tmp_path):
    """A folder of the four original files (as downloaded) needs no MD5SUMS of its own; other files are refused."""
    for name in IDX_NAMES:
        shutil.copy(EMBEDDED_MNIST / f"{name}.gz", tmp_path / f"{name}.gz")
    assert not (tmp_path / MD5SUMS_FILE).exists()
    assert torch.equal(load_mnist(tmp_path).test_labels, load_mnist().test_labels)
    write_idx_dataset(tmp_path / "fake", np.random.default_rng(3))  # valid IDX files, not MNIST's
    with pytest.raises(ValueError, match=r"MD5 mismatch.*train-images-idx3-ubyte\.gz"):
        load_mnist(tmp_path / "fake")


def test_mnist_truncated_gzip_is_reported(tmp_path):
    write_fake_mnist_root(tmp_path, np.random.default_rng(1))
    broken = tmp_path / "t10k-images-idx3-ubyte.gz"
    broken.write_bytes(broken.read_bytes()[:-20])
    with pytest.raises(ValueError, match=r"corrupt gzip file .*t10k-images-idx3-ubyte\.gz"):
        load_mnist(tmp_path)


def test_mnist_missing_file_is_named(tmp_path):
    write_fake_mnist_root(tmp_path, np.random.default_rng(2))
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match=r"t10k-labels-idx1-ubyte\.gz"):
        load_mnist(tmp_path)


def test_idx_parser_checks_magic_and_size():
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    data = idx_bytes(images)
    assert np.array_equal(parse_idx(data, 3, "ok"), images)
    with pytest.raises(ValueError, match="bad IDX magic"):
        parse_idx(data, 1, "labels-as-images")
    with pytest.raises(ValueError, match="bad IDX magic"):
        parse_idx(b"\x00\x00\x0d\x03" + data[4:], 3, "float-typed")
    with pytest.raises(ValueError, match="announces shape"):
        parse_idx(data[:-1], 3, "truncated")


# --- other datasets ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "compressed"), [("fashion_mnist", True), ("notmnist", False)])
def test_idx_datasets_round_trip(tmp_path, name, compressed):
    arrays = write_idx_dataset(tmp_path / name, np.random.default_rng(3), compressed=compressed)
    if name == "fashion_mnist":  # a stand-in for Fashion-MNIST is accepted only with its own content sums
        write_md5sums(tmp_path / name, arrays)
    dataset = load_dataset(name, tmp_path)
    assert dataset.name == name and dataset.image_shape == (1, 28, 28)
    assert torch.equal(dataset.train_images[:, 0], torch.from_numpy(arrays[0]))
    assert torch.equal(dataset.train_labels, torch.from_numpy(arrays[1]).long())
    assert torch.equal(dataset.test_images[:, 0], torch.from_numpy(arrays[2]))
    assert torch.equal(dataset.test_labels, torch.from_numpy(arrays[3]).long())


def test_svhn_round_trip(tmp_path):
    scipy_io = pytest.importorskip("scipy.io")
    rng = np.random.default_rng(4)
    written = {}
    (tmp_path / "svhn").mkdir()
    for split, count in (("train", 5), ("test", 4)):
        images = rng.integers(0, 256, size=(32, 32, 3, count), dtype=np.uint8)
        labels = np.array([[10], [1], [9], [10], [3]][:count], dtype=np.uint8)  # SVHN stores digit 0 as 10
        scipy_io.savemat(tmp_path / "svhn" / f"{split}_32x32.mat", {"X": images, "y": labels})
        written[split] = images, labels
    dataset = load_dataset("svhn", tmp_path)
    for split in ("train", "test"):
        images, labels = written[split]
        loaded = getattr(dataset, f"{split}_images")
        assert loaded.shape == (len(labels), 3, 32, 32)
        # image n, channel c, row h, column w is X[h, w, c, n]
        assert torch.equal(loaded, torch.from_numpy(images).permute(3, 2, 0, 1))
        expected_labels = [0 if label == 10 else int(label) for label in labels[:, 0]]
        assert getattr(dataset, f"{split}_labels").tolist() == expected_labels


def test_svhn_without_scipy_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "svhn").mkdir()
    for split in ("train", "test"):
        (tmp_path / "svhn" / f"{split}_32x32.mat").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "scipy.io", None)  # makes `from scipy.io import ...` fail
    with pytest.raises(ImportError, match="pip install scipy"):
        load_dataset("svhn", tmp_path)


def test_cifar10_round_trip(tmp_path):
    rng = np.random.default_rng(5)
    batch_dir = tmp_path / "cifar10" / "cifar-10-batches-py"
    batch_dir.mkdir(parents=True)
    written = {}
    for name in [f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]:
        rows = rng.integers(0, 256, size=(2, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=2).tolist()
        with (batch_dir / name).open("wb") as handle:
            pickle.dump({b"data": rows, b"labels": labels, b"batch_label": name.encode()}, handle)
        written[name] = rows, labels
    dataset = load_dataset("cifar10", tmp_path)
    train_rows = np.concatenate([written[f"data_batch_{k}"][0] for k in range(1, 6)])
    assert dataset.train_images.shape == (10, 3, 32, 32)
    # a row holds the 1024 red, then green, then blue values of the image in row-major order
    assert torch.equal(dataset.train_images[3, 1].flatten(), torch.from_numpy(train_rows[3, 1024:2048]))
    assert torch.equal(dataset.train_images.reshape(10, -1), torch.from_numpy(train_rows))
    assert dataset.train_labels.tolist() == sum((written[f"data_batch_{k}"][1] for k in range(1, 6)), [])
    assert torch.equal(dataset.test_images.reshape(2, -1), torch.from_numpy(written["test_batch"][0]))
    assert dataset.test_labels.tolist() == written["test_batch"][1]


@pytest.mark.parametrize(
    ("name", "expected_paths", "url"),
    [
        ("fashion_mnist", [f"fashion_mnist/{n}.gz" for n in IDX_NAMES], "fashion-mnist.s3-website"),
        ("notmnist", [f"notmnist/{n}.gz" for n in IDX_NAMES], "davidflanagan/notMNIST-to-MNIST"),
        ("svhn", ["svhn/train_32x32.mat", "svhn/test_32x32.mat"], "ufldl.stanford.edu/housenumbers"),
        (
            "cifar10",
            [f"cifar10/cifar-10-batches-py/data_batch_{k}" for k in range(1, 6)]
            + ["cifar10/cifar-10-batches-py/test_batch"],
            "cifar-10-python.tar.gz",
        ),
    ],
)
def test_missing_files_error_lists_files_and_sources(tmp_path, name, expected_paths, url):
    with pytest.raises(FileNotFoundError) as error:
        load_dataset(name, tmp_path)
    message = str(error.value)
    for relative in expected_paths:
        assert str(tmp_path / relative) in message
    assert url in message


def test_missing_files_error_lists_only_the_missing_ones(tmp_path):
    write_idx_dataset(tmp_path / "fashion_mnist", np.random.default_rng(6))
    (tmp_path / "fashion_mnist" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError) as error:
        load_dataset("fashion_mnist", tmp_path)
    assert missing_file_lines(str(error.value)) == [str(tmp_path / "fashion_mnist" / "t10k-labels-idx1-ubyte.gz")]


def missing_file_lines(message: str) -> list[str]:
    """The indented lines under "missing files:" of a FileNotFoundError of load_dataset."""
    lines = message.splitlines()
    start = next(i for i, line in enumerate(lines) if "missing files" in line and line.endswith(":")) + 1
    block = []
    for line in lines[start:]:
        if not line.startswith("  "):
            break
        block.append(line.strip())
    return block


def test_mnist_by_name_is_the_embedded_copy():
    dataset = load_dataset("mnist", "/nonexistent")
    assert dataset.train_images.shape == (60000, 1, 28, 28)
    assert torch.equal(dataset.test_labels, load_mnist().test_labels)


def test_unknown_dataset_and_invalid_image_dataset(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("imagenet", tmp_path)
    images = torch.zeros(2, 1, 4, 4, dtype=torch.uint8)
    labels = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="uint8"):
        ImageDataset("bad", images.float(), labels, images, labels)
    with pytest.raises(ValueError, match="labels outside"):
        ImageDataset("bad", images, labels + 10, images, labels)
    with pytest.raises(ValueError, match="2 train images but 1 labels"):
        ImageDataset("bad", images, labels[:1], images, labels)
    with pytest.raises(ValueError, match="train set is empty"):
        ImageDataset("bad", images[:0], labels[:0], images, labels)
    with pytest.raises(ValueError, match="test set is empty"):
        ImageDataset("bad", images, labels, images[:0], labels[:0])


def _write_cifar10(directory: Path, data: np.ndarray, labels: list) -> None:
    batch_dir = directory / "cifar10" / "cifar-10-batches-py"
    batch_dir.mkdir(parents=True)
    for name in [f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]:
        with (batch_dir / name).open("wb") as handle:
            pickle.dump({b"data": data, b"labels": labels}, handle)


@pytest.mark.parametrize(
    ("data", "labels", "match"),
    [
        (np.full((2, 3072), 0.8), [1, 2], "data must hold integer pixel values"),
        (np.full((2, 3072), 1000), [1, 2], "data must hold pixel values in 0..255, got 1000..1000"),
        (np.zeros((2, 3072), np.uint8), [1.9, 2.0], "labels must hold integer labels"),
    ],
    ids=["float-pixels", "pixels-above-255", "float-labels"],
)
def test_cifar10_values_a_cast_would_change_are_refused(tmp_path, data, labels, match):
    _write_cifar10(tmp_path, data, labels)
    with pytest.raises(ValueError, match=match):
        load_dataset("cifar10", tmp_path)


@pytest.mark.parametrize("content", [b"", b"MATLAB 5.0 garbage" * 3], ids=["empty", "garbage"])
def test_damaged_svhn_file_is_named_in_a_value_error(tmp_path, content):
    pytest.importorskip("scipy.io")
    (tmp_path / "svhn").mkdir()
    for split in ("train", "test"):
        (tmp_path / "svhn" / f"{split}_32x32.mat").write_bytes(content)
    with pytest.raises(ValueError, match="train_32x32.mat is not a valid SVHN .mat file"):
        load_dataset("svhn", tmp_path)


def test_download_failure_explains_the_offline_route(tmp_path, monkeypatch):
    def unreachable(url):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", unreachable)
    with pytest.raises(ConnectionError) as error:
        download_dataset("svhn", tmp_path)
    message = str(error.value)
    assert "Offline" in message and str(tmp_path / "svhn" / "train_32x32.mat") in message
    assert "e26dedcc434d2e4c54c9b2d4a06d8373" in message
    assert not list((tmp_path / "svhn").iterdir())  # no partial file left behind


def test_download_rejects_wrong_checksum(tmp_path, monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen", lambda url: io.BytesIO(b"not the real file"))
    with pytest.raises(ValueError, match="MD5 mismatch"):
        download_dataset("fashion_mnist", tmp_path)
    assert not list((tmp_path / "fashion_mnist").iterdir())


def test_download_skips_complete_dataset(tmp_path, monkeypatch):
    write_idx_dataset(tmp_path / "notmnist", np.random.default_rng(7))

    def must_not_be_called(url):
        raise AssertionError(f"unexpected download of {url}")

    monkeypatch.setattr(urllib.request, "urlopen", must_not_be_called)
    assert download_dataset("notmnist", tmp_path) == tmp_path / "notmnist"
