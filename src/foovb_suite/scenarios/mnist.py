"""The MNIST streams: the images (:class:`MNISTImages`), the permuted-MNIST tasks (:class:`PermutedMNIST`) in
sequence (:class:`DiscretePermutedMNIST`) or mixed gradually (:class:`ContinuousPermutedMNIST`), Split MNIST
(:class:`SplitMNIST`) and gradually rotated MNIST (:class:`RotatedMNIST`)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from foovb_suite.data import MNIST_MEAN, MNIST_STD, load_mnist

from .base import (
    _ITERATION_SAMPLE,
    _PERMUTATIONS,
    Batch,
    _BenchmarkStream,
    _check_positive,
    _check_seed,
    _check_start,
    _gather_by_task,
    _generator,
    _GradualMixStream,
    _period_eval_points,
    _SequentialTaskStream,
)

_MNIST_SIDE = 28
_PADDED_SIDE = 32

class MNISTImages:
    """The MNIST images as the streams read them: stored once as uint8 rows, ``(60000, D)`` and ``(10000, D)``, and
    scaled to model inputs on the fly (:meth:`scale`), flattened to ``(r, 784)`` or ``(r, 1024)``. With
    ``pad_to_32`` the images are zero-padded to 32x32, as in the continuous experiment (appendix "Continuous
    permuted MNIST", following Hsu et al. 2018). ``normalization``:

    * ``"standard"``: ``(x/255 - mean) / std`` with the pixel statistics of the images fed to the model:
      0.1307 / 0.3081 for MNIST, and those of the zero-padded images (0.1000 / 0.2752) with ``pad_to_32``,
      as the reference implementation does for the continuous experiment;
    * ``"none"``: ``x/255`` in [0, 1]. FOO-VB's step is sigma^2 E[g] and the first layer's gradients grow
      with the input scale, so the scaling interacts with sigma_init (README: measured on the discrete run).

    :class:`SplitMNIST` and :class:`RotatedMNIST` read them as they are; :class:`PermutedMNIST` shows them through
    its tasks' pixel permutations.
    """

    num_classes = 10
    NORMALIZATIONS = ("standard", "none")

    def __init__(self, pad_to_32: bool = False, normalization: str = "standard") -> None:
        if normalization not in self.NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {self.NORMALIZATIONS}, got {normalization!r}")
        self.pad_to_32 = pad_to_32
        self.normalization = normalization
        # zero padding keeps a fraction 784/1024 of the pixels: E[x] and E[x^2] shrink by that factor
        kept = 1.0 if not pad_to_32 else _MNIST_SIDE**2 / _PADDED_SIDE**2
        self.pixel_mean = MNIST_MEAN * kept
        self.pixel_std = math.sqrt((MNIST_STD**2 + MNIST_MEAN**2) * kept - self.pixel_mean**2)
        mnist = load_mnist()
        self.train_pixels = self._flatten(mnist.train_images)
        """uint8 (60000, D): the unpermuted (padded) training images, one row each"""
        self.train_labels = mnist.train_labels
        self.test_pixels = self._flatten(mnist.test_images)
        self.test_labels = mnist.test_labels

    def _flatten(self, images: Tensor) -> Tensor:
        if self.pad_to_32:
            margin = (_PADDED_SIDE - _MNIST_SIDE) // 2
            images = F.pad(images, (margin, margin, margin, margin))
        return images.reshape(len(images), -1)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.train_pixels.shape[1],)

    @property
    def num_train(self) -> int:
        return len(self.train_pixels)

    def scale(self, pixels: Tensor) -> Tensor:
        """Model inputs from uint8 ``pixels`` (r, D): ``x/255``, standardised unless ``normalization="none"``."""
        unit = pixels.float() / 255
        return unit if self.normalization == "none" else (unit - self.pixel_mean) / self.pixel_std


class PermutedMNIST(MNISTImages):
    """The permuted-MNIST tasks: task ``t`` shows every MNIST image (:class:`MNISTImages`, whose ``pad_to_32`` and
    ``normalization`` it takes) with its pixels shuffled by permutation ``t``.

    Task 0 is the identity (plain MNIST); tasks ``1..T-1`` use pixel permutations drawn from ``seed``. With
    ``pad_to_32`` the permutations act on all 1024 pixels of the padded images. Inputs are permuted, then scaled.
    """

    def __init__(self, num_tasks: int = 10, seed: int = 0, pad_to_32: bool = False,
                 normalization: str = "standard") -> None:
        _check_positive(num_tasks=num_tasks)
        _check_seed(seed)
        super().__init__(pad_to_32, normalization)
        self.num_tasks = num_tasks
        self.seed = seed
        num_pixels = self.train_pixels.shape[1]
        generator = _generator(seed, _PERMUTATIONS)
        self.permutations = torch.stack(
            [torch.arange(num_pixels)]
            + [torch.randperm(num_pixels, generator=generator) for _ in range(num_tasks - 1)]
        )
        """int64 (T, D): input pixel ``j`` of task ``t`` is original pixel ``permutations[t, j]``"""

    def encode(self, pixels: Tensor, task: int) -> Tensor:
        """Model inputs of task ``task`` from uint8 unpermuted ``pixels`` (r, D): permute, then scale."""
        return self.scale(pixels[:, self.permutations[task]])

    def train_batch(self, tasks: Tensor, indices: Tensor) -> Batch:
        """Training images ``indices[k]``, each permuted for its task ``tasks[k]``."""
        return _gather_by_task(
            tasks,
            indices,
            lambda task, rows: (self.encode(self.train_pixels[rows], task), self.train_labels[rows]),
        )

    def test_set(self, task: int) -> tuple[Tensor, Tensor]:
        """The 10000 test images permuted for ``task``, and their labels."""
        return self.encode(self.test_pixels, task), self.test_labels


def _check_unpermuted(images: MNISTImages, stream: str) -> None:
    """A stream of the plain images refuses the tasks of a :class:`PermutedMNIST`, whose permutations it would
    not apply (one of a single task, the identity, is its images)."""
    if isinstance(images, PermutedMNIST) and images.num_tasks != 1:
        raise ValueError(f"{stream} reads unpermuted images: pass MNISTImages(...), not a PermutedMNIST of "
                         f"num_tasks={images.num_tasks} (only num_tasks=1 is unpermuted)")


class DiscretePermutedMNIST(_BenchmarkStream, _SequentialTaskStream):
    """Discrete task-agnostic permuted MNIST (paper section "Discrete task-agnostic Permuted MNIST").

    The benchmark's tasks in sequence, ``epochs_per_task`` epochs each (paper: 20, batch size 128, 469 batches
    per epoch). The task switches are never announced to the learner: they appear only in ``Batch.task`` and
    in ``eval_points`` (the end of every task). ``train_subset`` trains on the first N training images only,
    for quick demos and tests.
    """

    def __init__(
        self,
        benchmark: PermutedMNIST,
        epochs_per_task: int = 20,
        batch_size: int = 128,
        seed: int = 0,
        train_subset: int | None = None,
    ) -> None:
        num_train = benchmark.num_train if train_subset is None else train_subset
        if not 1 <= num_train <= benchmark.num_train:
            raise ValueError(f"train_subset must be in [1, {benchmark.num_train}], got {train_subset}")
        self.benchmark = benchmark
        super().__init__((num_train,) * benchmark.num_tasks, epochs_per_task, batch_size, seed)


class SplitMNIST(_SequentialTaskStream):
    """Domain-incremental, task-agnostic Split MNIST (Hsu et al. 2018, "Re-evaluating continual learning
    scenarios", incremental-domain Split MNIST): task ``t`` holds the digits ``2t`` and ``2t + 1`` and asks
    "first or second digit of the pair?", so every task shares one 2-way output (label ``digit - 2t``, i.e.
    ``digit % 2``) and the learner is never told which pair it sees. Tasks come one after another,
    ``epochs_per_task`` epochs each (Hsu et al.: 4, batch 128, 32x32 zero-padded images standardised with
    0.1000 / 0.2752, a 1024-400-400-2 MLP); ``num_tasks`` <= 5 keeps the first pairs.

    ``images``: the :class:`MNISTImages`, which load, pad and scale the images.
    """

    task_aware = False
    num_classes = 2

    def __init__(self, images: MNISTImages, num_tasks: int = 5, epochs_per_task: int = 4, batch_size: int = 128,
                 seed: int = 0) -> None:
        _check_unpermuted(images, "SplitMNIST")
        if not 1 <= num_tasks <= 5:
            raise ValueError(f"Split MNIST has 5 digit pairs; num_tasks must be in [1, 5], got {num_tasks}")
        self.images = images
        self.train_rows = [torch.nonzero(images.train_labels // 2 == task).flatten() for task in range(num_tasks)]
        self.test_rows = [torch.nonzero(images.test_labels // 2 == task).flatten() for task in range(num_tasks)]
        super().__init__([len(rows) for rows in self.train_rows], epochs_per_task, batch_size, seed)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.images.input_shape

    def _examples(self, pixels: Tensor, labels: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        return self.images.scale(pixels[rows]), labels[rows] % 2

    def train_batch(self, tasks: Tensor, indices: Tensor) -> Batch:
        return _gather_by_task(tasks, indices, lambda task, rows: self._examples(
            self.images.train_pixels, self.images.train_labels, self.train_rows[task][rows]))

    def test_set(self, task: int) -> tuple[Tensor, Tensor]:
        """The test images of the task's two digits, labelled 0 / 1."""
        return self._examples(self.images.test_pixels, self.images.test_labels, self.test_rows[task])


class ContinuousPermutedMNIST(_GradualMixStream):
    """Continuous task-agnostic permuted MNIST (paper section "Continuous task-agnostic Permuted MNIST"): the
    benchmark's tasks mixed gradually (:class:`_GradualMixStream` has the schedule). A batch's images are drawn
    without replacement from the whole training set, independently for every batch (i.e. with replacement
    across batches, appendix "Continuous permuted MNIST"), each permuted for its own task. The default
    duration, 9380 iterations per task, is the paper's: 20 epochs of ceil(60000 / 128) = 469 batches.
    """

    def __init__(
        self,
        benchmark: PermutedMNIST,
        iterations_per_task: int = 20 * 469,
        batch_size: int = 128,
        seed: int = 0,
        eval_every: int | None = None,
    ) -> None:
        super().__init__(benchmark, (benchmark.num_train,) * benchmark.num_tasks, iterations_per_task, batch_size,
                         seed, eval_every)

    def _draw_indices(self, tasks: Tensor, generator: torch.Generator) -> Tensor:
        return torch.randperm(self.benchmark.num_train, generator=generator)[: self.batch_size]


class RotatedMNIST:
    """Gradually rotated MNIST, a drift without tasks: at iteration ``i`` of ``n = T * D`` every training image
    is shown rotated by ``angle(i) = max_angle * i / n`` degrees (counter-clockwise, about the image centre,
    bilinear, zeros outside), so the input distribution turns continuously from upright to ``max_angle``. Each
    batch is drawn without replacement from the whole training set, independently for every batch. For
    evaluation the stream is cut into ``T`` periods of ``D = iterations_per_task`` iterations; "task" ``t`` is
    the test set rotated by the angle at the middle of period ``t``, ``(t + 1/2) * max_angle / T``, so that the
    first task measures how much of the first, nearly upright, digits survives the drift. The joint oracle
    (:class:`~foovb_suite.scenarios.joint.JointStream`) trains on all ``T`` test angles mixed. ``images``: the
    :class:`MNISTImages`, which load, pad and scale the images (zero-padded 32x32 images keep the corners of a
    rotated digit).
    """

    task_aware = False
    num_classes = 10

    def __init__(self, images: MNISTImages, num_tasks: int = 10, iterations_per_task: int = 1000,
                 batch_size: int = 128, max_angle: float = 180.0, seed: int = 0,
                 eval_every: int | None = None) -> None:
        _check_unpermuted(images, "RotatedMNIST")
        eval_every = iterations_per_task if eval_every is None else eval_every
        _check_positive(num_tasks=num_tasks, iterations_per_task=iterations_per_task, batch_size=batch_size,
                        eval_every=eval_every)
        _check_seed(seed)
        if not (math.isfinite(max_angle) and 0 < max_angle <= 360):
            raise ValueError(f"max_angle must be in (0, 360] degrees, got {max_angle}")
        if batch_size > images.num_train:  # randperm(...)[:batch_size] would train on smaller batches silently
            raise ValueError(f"batch_size {batch_size} exceeds the {images.num_train} training images")
        self.images = images
        self.num_tasks, self.iterations_per_task, self.batch_size = num_tasks, iterations_per_task, batch_size
        self.max_angle, self.seed = float(max_angle), seed
        self.num_iterations = num_tasks * iterations_per_task
        self.train_sizes = (images.num_train,) * num_tasks
        self.eval_points = _period_eval_points(self.num_iterations, iterations_per_task, eval_every)
        self.side = math.isqrt(images.input_shape[0])

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.images.input_shape

    def angle(self, iteration: int) -> float:
        """Rotation in degrees of the training images at ``iteration``."""
        return self.max_angle * iteration / self.num_iterations

    def task_angle(self, task: int) -> float:
        """Rotation in degrees of the test set of ``task``: the angle at the middle of its period."""
        return self.max_angle * (task + 0.5) / self.num_tasks

    def rotate(self, x: Tensor, degrees: float) -> Tensor:
        """Model inputs ``x`` (r, side * side) rotated counter-clockwise by ``degrees`` about the image centre;
        what falls outside the image is the value of a black pixel."""
        radians = math.radians(degrees)
        cos, sin = math.cos(radians), math.sin(radians)
        # grid_sample reads output pixel (u, v) from input (cos u - sin v, sin u + cos v) in normalised
        # (x right, y down) coordinates: the image content turns counter-clockwise on screen
        theta = torch.tensor([[cos, -sin, 0.0], [sin, cos, 0.0]], dtype=x.dtype).expand(len(x), 2, 3)
        black = self.images.scale(torch.zeros(1, self.side * self.side, dtype=torch.uint8))[0, 0].item()
        images = x.reshape(-1, 1, self.side, self.side) - black  # black pixels become 0 so zero padding is black
        grid = F.affine_grid(theta, list(images.shape), align_corners=False)
        return (F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
                + black).reshape(len(x), -1)

    def train_batch(self, tasks: Tensor, indices: Tensor, degrees: float | None = None) -> Batch:
        """Training images ``indices`` rotated by ``degrees``, ``tasks`` holding their periods; without
        ``degrees`` (the joint oracle's batches) each image is rotated by its task's test angle."""
        if degrees is None:
            return _gather_by_task(tasks, indices, lambda task, rows: (
                self.rotate(self.images.scale(self.images.train_pixels[rows]), self.task_angle(task)),
                self.images.train_labels[rows]))
        x = self.images.scale(self.images.train_pixels[indices])
        return Batch(self.rotate(x, degrees), self.images.train_labels[indices], tasks)

    def test_set(self, task: int) -> tuple[Tensor, Tensor]:
        x, y = self.images.scale(self.images.test_pixels), self.images.test_labels
        return self.rotate(x, self.task_angle(task)), y

    def batches(self, start_iteration: int = 0) -> Iterator[tuple[int, Batch]]:
        _check_start(start_iteration, self.num_iterations)
        for iteration in range(start_iteration, self.num_iterations):
            generator = _generator(self.seed, _ITERATION_SAMPLE, iteration)
            indices = torch.randperm(self.images.num_train, generator=generator)[: self.batch_size]
            period = torch.full_like(indices, iteration // self.iterations_per_task)
            yield iteration, self.train_batch(period, indices, self.angle(iteration))
