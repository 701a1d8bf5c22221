"""Where the vision datasets are found (issue 39): the folder names in use under the data directory a user names
(`fashion-mnist` as in the project's shared data, torchvision's `FashionMNIST/raw` and `cifar-10-batches-py`),
then where a system package installs them (Debian's `dataset-fashion-mnist`: /usr/share/datasets/fashion-mnist),
the user's copy first; a dataset found nowhere is an error naming every place looked at."""

import dataclasses
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from foovb_suite.config import ConfigError, config_from_dict
from foovb_suite.data import dataset_folders, load_dataset
from foovb_suite.data import datasets as datasets_module
from tests.test_data import missing_file_lines, write_fake_mnist_root, write_idx_dataset, write_md5sums

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def system_dir(tmp_path, monkeypatch) -> Path:
    """Fashion-MNIST's system folder moved under tmp_path (empty until a test writes it)."""
    folder = tmp_path / "usr" / "share" / "datasets" / "fashion-mnist"
    source = datasets_module._SOURCES["fashion_mnist"]
    monkeypatch.setitem(datasets_module._SOURCES, "fashion_mnist", dataclasses.replace(source, system_dirs=(folder,)))
    return folder


def test_debians_folder_is_looked_at_after_the_data_directory() -> None:
    """The path `dpkg -c dataset-fashion-mnist_0.0~git20200523.55506a9-1_all.deb` lists (Debian 12)."""
    assert dataset_folders("fashion_mnist", "data") == [
        Path("data/fashion_mnist"), Path("data/fashion-mnist"), Path("data/FashionMNIST/raw"),
        Path("/usr/share/datasets/fashion-mnist")]
    assert dataset_folders("fashion_mnist", None) == [Path("/usr/share/datasets/fashion-mnist")]
    assert dataset_folders("cifar10", "data") == [Path("data/cifar10"), Path("data")]


@pytest.mark.parametrize(("folder", "compressed"), [("fashion-mnist", True), ("FashionMNIST/raw", False)])
def test_fashion_mnist_is_found_under_its_other_folder_names(tmp_path, system_dir, folder, compressed) -> None:
    arrays = write_idx_dataset(tmp_path / "data" / folder, np.random.default_rng(1), compressed=compressed)
    write_md5sums(tmp_path / "data" / folder, arrays)  # a stand-in declares its content
    dataset = load_dataset("fashion_mnist", tmp_path / "data")
    assert torch.equal(dataset.train_images[:, 0], torch.from_numpy(arrays[0]))
    assert torch.equal(dataset.test_labels, torch.from_numpy(arrays[3]).long())


def test_the_system_copy_is_used_when_the_data_directory_has_none(tmp_path, system_dir) -> None:
    arrays = write_fake_mnist_root(system_dir, np.random.default_rng(2))
    for data_dir in (tmp_path / "empty", None):
        dataset = load_dataset("fashion_mnist", data_dir)
        assert torch.equal(dataset.train_images[:, 0], torch.from_numpy(arrays[0]))


def test_the_users_copy_comes_before_the_system_one(tmp_path, system_dir) -> None:
    write_fake_mnist_root(system_dir, np.random.default_rng(3))
    mine = write_fake_mnist_root(tmp_path / "data" / "fashion_mnist", np.random.default_rng(4))
    dataset = load_dataset("fashion_mnist", tmp_path / "data")
    assert torch.equal(dataset.train_images[:, 0], torch.from_numpy(mine[0]))


def test_a_complete_folder_is_preferred_to_an_incomplete_one(tmp_path, system_dir) -> None:
    write_idx_dataset(tmp_path / "data" / "fashion_mnist", np.random.default_rng(5))
    (tmp_path / "data" / "fashion_mnist" / "t10k-images-idx3-ubyte.gz").unlink()
    arrays = write_fake_mnist_root(system_dir, np.random.default_rng(6))
    dataset = load_dataset("fashion_mnist", tmp_path / "data")
    assert torch.equal(dataset.train_images[:, 0], torch.from_numpy(arrays[0]))


def test_found_nowhere_names_every_place_looked_at_and_the_files(tmp_path, system_dir) -> None:
    with pytest.raises(FileNotFoundError) as error:
        load_dataset("fashion_mnist", tmp_path)
    message = str(error.value)
    assert message.startswith("dataset 'fashion_mnist' was not found; looked in:")
    for folder in ("fashion_mnist", "fashion-mnist", "FashionMNIST/raw"):
        assert f"  {tmp_path / folder}\n" in message
    assert f"  {system_dir}\n" in message
    assert len(missing_file_lines(message)) == 4
    assert "fashion-mnist.s3-website" in message  # where to get them


def test_an_incomplete_folder_is_the_one_the_error_names(tmp_path, system_dir) -> None:
    write_idx_dataset(tmp_path / "fashion-mnist", np.random.default_rng(7))
    (tmp_path / "fashion-mnist" / "train-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError) as error:
        load_dataset("fashion_mnist", tmp_path)
    assert f"{tmp_path / 'fashion-mnist'} is incomplete" in str(error.value)
    assert missing_file_lines(str(error.value)) == [str(tmp_path / "fashion-mnist" / "train-labels-idx1-ubyte.gz")]


def test_no_data_directory_and_no_system_copy_says_to_name_one(system_dir) -> None:
    with pytest.raises(FileNotFoundError, match=r"(?s)\(no data directory given\)|scenario.data_dir") as error:
        load_dataset("notmnist", None)
    assert "scenario.data_dir" in str(error.value)


def test_cifar10_is_found_in_torchvisions_layout(tmp_path) -> None:
    batch_dir = tmp_path / "cifar-10-batches-py"
    batch_dir.mkdir()
    data = np.arange(2 * 3072, dtype=np.uint8).reshape(2, 3072)
    for name in [f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]:
        with (batch_dir / name).open("wb") as handle:
            pickle.dump({b"data": data, b"labels": [3, 4]}, handle)
    dataset = load_dataset("cifar10", tmp_path)
    assert dataset.train_images.shape == (10, 3, 32, 32)
    assert dataset.test_labels.tolist() == [3, 4]


def test_the_vision_mix_config_needs_no_data_directory() -> None:
    config = config_from_dict({"scenario": {"kind": "vision_mix", "num_tasks": 2,
                                            "datasets": ["mnist", "fashion_mnist"]}, "model": {"kind": "lenet"}})
    assert config.scenario.data_dir is None
    with pytest.raises(ConfigError, match="scenario.data_dir"):  # still only for the vision mix
        config_from_dict({"scenario": {"kind": "split_mnist", "data_dir": "data"}})


SHARED_DATA = next((path for path in (REPO.parent / "shared/data", REPO / "shared/data")
                    if (path / "fashion-mnist").is_dir()), None)


@pytest.mark.skipif(SHARED_DATA is None, reason="the project's shared/data is not here")
def test_the_shared_fashion_mnist_is_found_by_naming_its_parent() -> None:
    """The real files (Debian's), checked by their content: 60,000 + 10,000 images, 6,000 + 1,000 per class."""
    dataset = load_dataset("fashion_mnist", SHARED_DATA)
    assert dataset.train_images.shape == (60000, 1, 28, 28) and dataset.test_images.shape == (10000, 1, 28, 28)
    assert torch.bincount(dataset.train_labels).tolist() == [6000] * 10
    assert torch.bincount(dataset.test_labels).tolist() == [1000] * 10


@pytest.mark.parametrize("folder", ["fashion-mnist", "my_copy"])
def test_a_data_dir_that_is_the_datasets_own_folder_names_its_parent(tmp_path, monkeypatch, folder):
    """scenario.data_dir naming the dataset's folder itself listed every missing file and a download (a helper's
    trial, session 50); it now says to name the folder that holds it."""
    source = dataclasses.replace(datasets_module._source("fashion_mnist"), system_dirs=())  # not this machine's copy
    monkeypatch.setattr(datasets_module, "_source", lambda name: source)
    own = tmp_path / folder
    own.mkdir()
    for relative in source.required_files:
        (own / relative).write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=f"scenario.data_dir \\({own}\\) .*name the folder that holds it.*"
                                                f"{tmp_path}") as error:
        load_dataset("fashion_mnist", own)
    assert "download" not in str(error.value)
