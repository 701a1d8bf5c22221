"""The vision-datasets mix: MNIST, notMNIST, Fashion-MNIST, SVHN, CIFAR-10 in sequence, task-aware (paper appendix
"Task-aware continual learning on vision datasets")."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from foovb_suite.data import DATASET_NAMES, ImageDataset, load_dataset

from .base import Batch, _gather_by_task, _SequentialTaskStream

_PADDED_SIDE = 32
_VISION_MIX_SHAPE = (3, _PADDED_SIDE, _PADDED_SIDE)

class VisionMix(_SequentialTaskStream):
    """Task-aware continual learning on vision datasets (paper appendix "Task-aware continual learning on
    vision datasets", following Ritter et al. 2018): MNIST, notMNIST, Fashion-MNIST, SVHN, CIFAR-10 in
    sequence, ``epochs_per_task`` epochs each (paper: 20, batch size 64).

    Every image becomes 3x32x32: grayscale is zero-padded 28 -> 32 (centred) and replicated to 3 channels.
    Each dataset is normalised to zero mean and unit variance per channel, with statistics of its own
    (converted) training set. ``Batch.task`` is the dataset index, which the runner gives to the task-aware
    (multi-head) learners. ``task_agnostic``: the learner is not told the task and predicts with one 10-way
    head shared by all datasets (the harder setting). ``train_subset``: train on the first N training images of
    each dataset (a reduced scale; the test sets stay whole). ``datasets`` holds names for
    :func:`foovb_suite.data.load_dataset` (read from ``data_dir`` and the places system packages install them;
    :func:`foovb_suite.data.dataset_folders`) or already loaded :class:`ImageDataset` objects.
    """

    input_shape = _VISION_MIX_SHAPE

    def __init__(
        self,
        datasets: Sequence[str | ImageDataset] = DATASET_NAMES,
        data_dir: str | Path | None = "data",
        epochs_per_task: int = 20,
        batch_size: int = 64,
        seed: int = 0,
        train_subset: int | None = None,
        task_agnostic: bool = False,
    ) -> None:
        loaded = [
            load_dataset(dataset, data_dir) if isinstance(dataset, str) else dataset for dataset in datasets
        ]
        if not loaded:
            raise ValueError("VisionMix needs at least one dataset")
        smallest = min(len(dataset.train_labels) for dataset in loaded)
        if train_subset is not None and not 1 <= train_subset <= smallest:
            raise ValueError(f"train_subset must be in [1, {smallest}] (the smallest training set), got {train_subset}")
        self.task_aware = not task_agnostic
        self.dataset_names = tuple(dataset.name for dataset in loaded)
        self.num_classes = max(dataset.num_classes for dataset in loaded)
        self._train_images = [_pad_to_32(dataset.train_images[:train_subset], dataset.name) for dataset in loaded]
        """uint8 (N, C, 32, 32) per dataset, C = 1 or 3 (grayscale is replicated only when normalising)"""
        self._test_images = [_pad_to_32(dataset.test_images, dataset.name) for dataset in loaded]
        self._train_labels = [dataset.train_labels[:train_subset] for dataset in loaded]
        self._test_labels = [dataset.test_labels for dataset in loaded]
        self.channel_statistics = [
            _channel_statistics(images, name)
            for images, name in zip(self._train_images, self.dataset_names, strict=True)
        ]
        """(mean, std) per dataset, float32 of shape (C, 1, 1), in raw pixel units"""
        super().__init__([len(images) for images in self._train_images], epochs_per_task, batch_size, seed)

    def _normalise(self, task: int, images: Tensor) -> Tensor:
        mean, std = self.channel_statistics[task]
        return ((images.float() - mean) / std).expand(-1, *_VISION_MIX_SHAPE)

    def train_batch(self, tasks: Tensor, indices: Tensor) -> Batch:
        return _gather_by_task(
            tasks,
            indices,
            lambda task, rows: (
                self._normalise(task, self._train_images[task][rows]),
                self._train_labels[task][rows],
            ),
        )

    def test_set(self, task: int) -> tuple[Tensor, Tensor]:
        return self._normalise(task, self._test_images[task]).contiguous(), self._test_labels[task]


def _pad_to_32(images: Tensor, name: str) -> Tensor:
    """Zero-pad uint8 ``(N, C, H, W)`` images to 32x32, centred (28 -> 2 pixels each side)."""
    channels, height, width = images.shape[1:]
    if channels not in (1, 3) or height > _PADDED_SIDE or width > _PADDED_SIDE:
        raise ValueError(f"{name}: cannot convert images of shape {tuple(images.shape[1:])} to 3x32x32")
    top, left = (_PADDED_SIDE - height) // 2, (_PADDED_SIDE - width) // 2
    return F.pad(images, (left, _PADDED_SIDE - width - left, top, _PADDED_SIDE - height - top))


def _channel_statistics(images: Tensor, name: str, chunk_size: int = 4096) -> tuple[Tensor, Tensor]:
    """Per-channel mean and standard deviation of uint8 ``(N, C, H, W)`` images, as float32 ``(C, 1, 1)``."""
    total = torch.zeros(images.shape[1], dtype=torch.float64)
    total_square = torch.zeros_like(total)
    for chunk in images.split(chunk_size):
        values = chunk.double()
        total += values.sum(dim=(0, 2, 3))
        total_square += values.square().sum(dim=(0, 2, 3))
    count = images.numel() // images.shape[1]
    mean = total / count
    std = (total_square / count - mean.square()).clamp_min(0).sqrt()
    if (std == 0).any():
        raise ValueError(f"{name}: a channel is constant over the training set, cannot normalise it")
    return mean.float().view(-1, 1, 1), std.float().view(-1, 1, 1)
