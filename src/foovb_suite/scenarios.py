"""Continual-learning data streams (paper section "Applications and Experiments", appendix "Implementation
details").

A stream yields ``(iteration, Batch)`` pairs; the learner only ever sees the batches, and in the task-agnostic
scenarios the runner never shows it ``Batch.task`` either (see ``docs/ARCHITECTURE.md``, "Streams").

* :class:`DiscretePermutedMNIST`: permuted-MNIST tasks one after another, boundaries hidden from the learner.
* :class:`ContinuousPermutedMNIST`: tasks fade into each other, so no boundary exists at all.
* :class:`RotatedMNIST`: the images turn a little at every step, a drift without tasks.
* :class:`SplitMNIST`: digit pairs one after another, one 2-way output shared by all (domain-incremental).
* :class:`VisionMix`: the task-aware sequence MNIST, notMNIST, Fashion-MNIST, SVHN, CIFAR-10.
* :class:`DiscreteTasks` and :class:`ContinuousTasks`: your own tasks (:class:`InMemoryTasks`, e.g. from torch
  Datasets), one after another as in the discrete permuted MNIST or mixed gradually as in the continuous one.
* :class:`JointStream`: the joint-training ("offline") oracle on any of the above.

Iterations are numbered from 0; ``eval_points`` hold numbers of completed iterations, so the runner
evaluates after yielding iteration ``e - 1`` for each ``e`` in ``eval_points``. All randomness of a stream
comes from generators seeded by ``(seed, purpose, epoch or iteration)``, never from the global RNG, so
``batches(k)`` reproduces exactly the tail of ``batches(0)`` from iteration ``k`` on (resuming a run).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset, IterableDataset

from foovb_suite.data import DATASET_NAMES, MNIST_MEAN, MNIST_STD, ImageDataset, load_dataset, load_mnist

# Purposes in the seed derivation, so that streams drawn from the same seed are independent.
_PERMUTATIONS, _EPOCH_SHUFFLE, _ITERATION_SAMPLE, _JOINT_SHUFFLE = range(4)

_MNIST_SIDE = 28
_PADDED_SIDE = 32
_VISION_MIX_SHAPE = (3, _PADDED_SIDE, _PADDED_SIDE)


@dataclass(frozen=True)
class Batch:
    """One training batch: ``x`` float inputs ready for the model, ``y`` int64 labels, ``task`` int64
    per-sample task ids (for evaluation/analysis, and for task-aware learners only)."""

    x: Tensor
    y: Tensor
    task: Tensor


class Scenario(Protocol):
    """What the runner needs from a stream (``docs/ARCHITECTURE.md``, "Streams")."""

    @property
    def num_tasks(self) -> int: ...
    @property
    def num_iterations(self) -> int: ...
    @property
    def eval_points(self) -> tuple[int, ...]:
        """Sorted numbers of completed iterations after which to evaluate; the last is ``num_iterations``."""
        ...

    @property
    def input_shape(self) -> tuple[int, ...]: ...
    @property
    def num_classes(self) -> int:
        """Classes per task (per head for multi-head models)."""
        ...

    @property
    def batch_size(self) -> int: ...
    @property
    def task_aware(self) -> bool:
        """Whether the learner may be told ``Batch.task``."""
        ...

    @property
    def train_sizes(self) -> tuple[int, ...]:
        """Number of training examples of each task (valid ``indices`` of :meth:`train_batch`)."""
        ...

    def test_set(self, task: int) -> tuple[Tensor, Tensor]:
        """All test inputs (float, model-ready) and labels of ``task``."""
        ...

    def train_batch(self, tasks: Tensor, indices: Tensor) -> Batch:
        """The batch of training examples ``indices[k]`` of task ``tasks[k]``."""
        ...

    def batches(self, start_iteration: int = 0) -> Iterator[tuple[int, Batch]]:
        """``(iteration, batch)`` for iterations ``start_iteration .. num_iterations - 1``."""
        ...


def _generator(*keys: int) -> torch.Generator:
    """A fresh ``torch.Generator`` whose seed is derived from the non-negative integer ``keys``."""
    seed = np.random.SeedSequence(list(keys)).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(seed))


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")


def _check_seed(seed: int) -> None:
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")


def _check_start(start_iteration: int, num_iterations: int) -> None:
    if not 0 <= start_iteration <= num_iterations:
        raise ValueError(f"start_iteration must be in [0, {num_iterations}], got {start_iteration}")


def _gather_by_task(
    tasks: Tensor, indices: Tensor, fetch: Callable[[int, Tensor], tuple[Tensor, Tensor]]
) -> Batch:
    """Assemble a batch whose samples may come from several tasks; ``fetch(task, indices)`` returns the inputs
    and labels of some training examples of a single task."""
    rows_of_task = {task: tasks == task for task in tasks.unique().tolist()}
    pieces = {task: fetch(task, indices[rows]) for task, rows in rows_of_task.items()}
    some_x = next(iter(pieces.values()))[0]
    x = torch.empty((len(indices), *some_x.shape[1:]), dtype=some_x.dtype)
    y = torch.empty(len(indices), dtype=torch.int64)
    for task, rows in rows_of_task.items():
        x[rows], y[rows] = pieces[task]
    return Batch(x, y, tasks)


class PermutedMNIST:
    """The permuted-MNIST tasks: task ``t`` shows every MNIST image with its pixels shuffled by permutation
    ``t``.

    Task 0 is the identity (plain MNIST); tasks ``1..T-1`` use pixel permutations drawn from ``seed``. With
    ``pad_to_32`` the images are first zero-padded to 32x32, as in the continuous experiment (appendix
    "Continuous permuted MNIST", following Hsu et al. 2018), and the permutations act on all 1024 pixels.
    Images are stored once as uint8; inputs are permuted and scaled on the fly and flattened to ``(r, 784)`` or
    ``(r, 1024)``. ``normalization``:

    * ``"standard"``: ``(x/255 - mean) / std`` with the pixel statistics of the images fed to the model:
      0.1307 / 0.3081 for MNIST, and those of the zero-padded images (0.1000 / 0.2752) with ``pad_to_32``,
      as the reference implementation does for the continuous experiment;
    * ``"none"``: ``x/255`` in [0, 1]. FOO-VB's step is sigma^2 E[g] and the first layer's gradients grow
      with the input scale, so the scaling interacts with sigma_init (README: measured on the discrete run).
    """

    num_classes = 10
    NORMALIZATIONS = ("standard", "none")

    def __init__(self, num_tasks: int = 10, seed: int = 0, pad_to_32: bool = False,
                 normalization: str = "standard") -> None:
        _check_positive(num_tasks=num_tasks)
        _check_seed(seed)
        if normalization not in self.NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {self.NORMALIZATIONS}, got {normalization!r}")
        self.num_tasks = num_tasks
        self.seed = seed
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
        num_pixels = self.train_pixels.shape[1]
        generator = _generator(seed, _PERMUTATIONS)
        self.permutations = torch.stack(
            [torch.arange(num_pixels)]
            + [torch.randperm(num_pixels, generator=generator) for _ in range(num_tasks - 1)]
        )
        """int64 (T, D): input pixel ``j`` of task ``t`` is original pixel ``permutations[t, j]``"""

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

    def encode(self, pixels: Tensor, task: int) -> Tensor:
        """Model inputs of task ``task`` from uint8 unpermuted ``pixels`` (r, D): permute, then scale."""
        unit = pixels[:, self.permutations[task]].float() / 255
        return unit if self.normalization == "none" else (unit - self.pixel_mean) / self.pixel_std

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


class _BenchmarkStream:
    """What a task-agnostic stream takes from its benchmark, the tasks' data (:class:`PermutedMNIST` or
    :class:`InMemoryTasks`): the inputs' shape, the classes, the test sets and the training batches."""

    task_aware = False
    benchmark: PermutedMNIST | InMemoryTasks

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.benchmark.input_shape

    @property
    def num_classes(self) -> int:
        return self.benchmark.num_classes

    def test_set(self, task: int) -> tuple[Tensor, Tensor]:
        return self.benchmark.test_set(task)

    def train_batch(self, tasks: Tensor, indices: Tensor) -> Batch:
        return self.benchmark.train_batch(tasks, indices)


class _SequentialTaskStream(ABC):
    """Tasks one after another, ``epochs_per_task`` epochs each over the task's training set, reshuffled every
    epoch, last partial batch kept (``drop_last=False``). Evaluation happens at the end of each task."""

    def __init__(self, train_sizes: Sequence[int], epochs_per_task: int, batch_size: int, seed: int) -> None:
        _check_positive(epochs_per_task=epochs_per_task, batch_size=batch_size, num_tasks=len(train_sizes))
        _check_seed(seed)
        self.train_sizes = tuple(train_sizes)
        self.epochs_per_task = epochs_per_task
        self.batch_size = batch_size
        self.seed = seed
        self.batches_per_epoch = tuple(math.ceil(size / batch_size) for size in self.train_sizes)
        self.eval_points = tuple(accumulate(epochs_per_task * count for count in self.batches_per_epoch))
        """the last iteration of each task (a number of completed iterations)"""

    @property
    def num_tasks(self) -> int:
        return len(self.train_sizes)

    @property
    def num_iterations(self) -> int:
        return self.eval_points[-1]

    @abstractmethod
    def train_batch(self, tasks: Tensor, indices: Tensor) -> Batch:
        """The batch of training examples ``indices[k]`` of task ``tasks[k]``."""

    def batches(self, start_iteration: int = 0) -> Iterator[tuple[int, Batch]]:
        _check_start(start_iteration, self.num_iterations)
        iteration = start_iteration
        while iteration < self.num_iterations:
            task = bisect.bisect_right(self.eval_points, iteration)
            task_start = self.eval_points[task - 1] if task else 0
            epoch, first_batch = divmod(iteration - task_start, self.batches_per_epoch[task])
            order = torch.randperm(
                self.train_sizes[task], generator=_generator(self.seed, _EPOCH_SHUFFLE, task, epoch)
            )
            for position in range(first_batch, self.batches_per_epoch[task]):
                indices = order[position * self.batch_size : (position + 1) * self.batch_size]
                yield iteration, self.train_batch(torch.full_like(indices, task), indices)
                iteration += 1


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

    ``images``: a one-task :class:`PermutedMNIST` (the identity permutation), which loads, pads and scales the
    images.
    """

    task_aware = False
    num_classes = 2

    def __init__(self, images: PermutedMNIST, num_tasks: int = 5, epochs_per_task: int = 4, batch_size: int = 128,
                 seed: int = 0) -> None:
        if images.num_tasks != 1:
            raise ValueError("SplitMNIST reads unpermuted images: pass PermutedMNIST(num_tasks=1, ...)")
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
        return self.images.encode(pixels[rows], 0), labels[rows] % 2

    def train_batch(self, tasks: Tensor, indices: Tensor) -> Batch:
        return _gather_by_task(tasks, indices, lambda task, rows: self._examples(
            self.images.train_pixels, self.images.train_labels, self.train_rows[task][rows]))

    def test_set(self, task: int) -> tuple[Tensor, Tensor]:
        """The test images of the task's two digits, labelled 0 / 1."""
        return self._examples(self.images.test_pixels, self.images.test_labels, self.test_rows[task])


def _period_eval_points(num_iterations: int, iterations_per_task: int, eval_every: int) -> tuple[int, ...]:
    """Every ``eval_every`` iterations, and at the end of every task period (forgetting and BWT need those)."""
    return tuple(sorted({*range(eval_every, num_iterations + 1, eval_every),
                         *range(iterations_per_task, num_iterations + 1, iterations_per_task)}))


class _GradualMixStream(_BenchmarkStream, ABC):
    """Tasks that fade into each other, so there are no task boundaries at all (paper section "Continuous
    task-agnostic Permuted MNIST", figure "tasks_distribution").

    With ``D = iterations_per_task`` and ``u = i / D`` at iteration ``i``, task ``t`` has weight
    ``p_t(i) = clip(1/2 + 2 min(u - t, t + 1 - u), 0, 1)``: full weight on ``[t + 1/4, t + 3/4]`` and linear
    ramps of length ``D/2`` centred on ``u = t`` (in) and ``u = t + 1`` (out), where the neighbouring task
    ramps the other way, so the weights sum to 1. Task 0 never ramps in and the last task never ramps out. (The
    paper's text states that at most two tasks mix during a transition and that a task lasts 9380 iterations;
    its figure, missing from the LaTeX source, would show the ramp. This ramp is the project's reconstruction;
    a review found it equal to the task probabilities of the authors' published code, to 3e-8.) The
    number of samples of each task in a batch is Multinomial(batch_size, p(i)); which training examples they are
    is the subclass's :meth:`_draw_indices`, from the same per-iteration generator. Evaluation: every
    ``eval_every`` iterations (default: once per period) and at the end of every period.
    """

    def __init__(self, benchmark: PermutedMNIST | InMemoryTasks, train_sizes: Sequence[int],
                 iterations_per_task: int, batch_size: int, seed: int, eval_every: int | None) -> None:
        eval_every = iterations_per_task if eval_every is None else eval_every
        _check_positive(iterations_per_task=iterations_per_task, batch_size=batch_size, eval_every=eval_every)
        _check_seed(seed)
        if batch_size > min(train_sizes):  # a batch is drawn without replacement from one task's examples
            raise ValueError(f"batch_size {batch_size} exceeds the {min(train_sizes)} training examples of a task")
        self.benchmark = benchmark
        self.iterations_per_task = iterations_per_task
        self.batch_size = batch_size
        self.seed = seed
        self.train_sizes = tuple(train_sizes)
        self.num_tasks = len(self.train_sizes)
        self.num_iterations = self.num_tasks * iterations_per_task
        self.eval_points = _period_eval_points(self.num_iterations, iterations_per_task, eval_every)

    def task_probabilities(self, iteration: int | Sequence[int] | Tensor) -> Tensor:
        """float64 task weights ``p(i)``: shape ``(T,)`` for one iteration, ``(n, T)`` for ``n`` of them."""
        progress = torch.as_tensor(iteration, dtype=torch.float64).unsqueeze(-1) / self.iterations_per_task
        task = torch.arange(self.num_tasks, dtype=torch.float64)
        ramp_in = 0.5 + 2 * (progress - task)
        ramp_out = 0.5 + 2 * (task + 1 - progress)
        ramp_in[..., 0] = math.inf
        ramp_out[..., -1] = math.inf
        return torch.minimum(ramp_in, ramp_out).clamp(0, 1)

    @abstractmethod
    def _draw_indices(self, tasks: Tensor, generator: torch.Generator) -> Tensor:
        """The training examples of a batch whose samples belong to ``tasks``: index ``k`` of task ``tasks[k]``."""

    def batches(self, start_iteration: int = 0) -> Iterator[tuple[int, Batch]]:
        _check_start(start_iteration, self.num_iterations)
        for iteration in range(start_iteration, self.num_iterations):
            generator = _generator(self.seed, _ITERATION_SAMPLE, iteration)
            tasks = torch.multinomial(
                self.task_probabilities(iteration), self.batch_size, replacement=True, generator=generator
            )
            yield iteration, self.train_batch(tasks, self._draw_indices(tasks, generator))


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
    (:class:`JointStream`) trains on all ``T`` test angles mixed. ``images``: a one-task
    :class:`PermutedMNIST` (the identity permutation), which loads, pads and scales the images (zero-padded
    32x32 images keep the corners of a rotated digit).
    """

    task_aware = False
    num_classes = 10

    def __init__(self, images: PermutedMNIST, num_tasks: int = 10, iterations_per_task: int = 1000,
                 batch_size: int = 128, max_angle: float = 180.0, seed: int = 0,
                 eval_every: int | None = None) -> None:
        if images.num_tasks != 1:
            raise ValueError("RotatedMNIST reads unpermuted images: pass PermutedMNIST(num_tasks=1, ...)")
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
        black = self.images.encode(torch.zeros(1, self.side * self.side, dtype=torch.uint8), 0)[0, 0].item()
        images = x.reshape(-1, 1, self.side, self.side) - black  # black pixels become 0 so zero padding is black
        grid = F.affine_grid(theta, list(images.shape), align_corners=False)
        return (F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
                + black).reshape(len(x), -1)

    def train_batch(self, tasks: Tensor, indices: Tensor, degrees: float | None = None) -> Batch:
        """Training images ``indices`` rotated by ``degrees``, ``tasks`` holding their periods; without
        ``degrees`` (the joint oracle's batches) each image is rotated by its task's test angle."""
        if degrees is None:
            return _gather_by_task(tasks, indices, lambda task, rows: (
                self.rotate(self.images.encode(self.images.train_pixels[rows], 0), self.task_angle(task)),
                self.images.train_labels[rows]))
        x = self.images.encode(self.images.train_pixels[indices], 0)
        return Batch(self.rotate(x, degrees), self.images.train_labels[indices], tasks)

    def test_set(self, task: int) -> tuple[Tensor, Tensor]:
        x, y = self.images.test_set(0)
        return self.rotate(x, self.task_angle(task)), y

    def batches(self, start_iteration: int = 0) -> Iterator[tuple[int, Batch]]:
        _check_start(start_iteration, self.num_iterations)
        for iteration in range(start_iteration, self.num_iterations):
            generator = _generator(self.seed, _ITERATION_SAMPLE, iteration)
            indices = torch.randperm(self.images.num_train, generator=generator)[: self.batch_size]
            period = torch.full_like(indices, iteration // self.iterations_per_task)
            yield iteration, self.train_batch(period, indices, self.angle(iteration))


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


class InMemoryTasks:
    """Tasks given as data, held in memory: each task's training and test inputs and labels as tensors (the
    custom scenario's, read from torch Datasets by :meth:`from_datasets`). One output of ``num_classes`` classes
    is shared by all tasks (task-agnostic); the inputs are fed to the model as they are.

    Args:
        train, test: per task, ``(inputs, labels)``: float inputs of one shape for every example of every task,
            and their integer class labels (>= 0).
        num_classes: the model's output size; default: the largest label + 1.
    """

    def __init__(self, train: Sequence[tuple[Tensor, Tensor]], test: Sequence[tuple[Tensor, Tensor]],
                 num_classes: int | None = None) -> None:
        if not train or len(train) != len(test):
            raise ValueError(f"expected as many test sets as training sets, at least one: got {len(train)} training "
                             f"and {len(test)} test sets")
        self.input_shape = tuple(train[0][0].shape[1:])
        """the shape of one example's inputs"""
        self.train = [self._checked(examples, f"task {task}'s training set") for task, examples in enumerate(train)]
        """per task, (float32 inputs, int64 labels)"""
        self.test = [self._checked(examples, f"task {task}'s test set") for task, examples in enumerate(test)]
        largest = max(int(labels.max()) for _, labels in [*self.train, *self.test])
        if num_classes is not None and num_classes <= largest:
            raise ValueError(f"num_classes is {num_classes}, but the labels go up to {largest}")
        self.num_classes = largest + 1 if num_classes is None else num_classes
        self.train_sizes = tuple(len(labels) for _, labels in self.train)

    def _checked(self, examples: tuple[Tensor, Tensor], what: str) -> tuple[Tensor, Tensor]:
        """``examples`` (inputs, labels) as float32 and int64, checked: inputs of the tasks' one shape, one
        label >= 0 per example, at least one example; ``what`` names them in errors."""
        inputs, labels = examples
        if tuple(inputs.shape[1:]) != self.input_shape:
            raise ValueError(f"{what}: inputs of shape {tuple(inputs.shape[1:])}, but task 0's training inputs have "
                             f"shape {self.input_shape}: every task's inputs must have one shape")
        if labels.shape != (len(inputs),) or labels.is_floating_point() or labels.dtype == torch.bool:
            raise ValueError(f"{what}: expected one integer label per example, got labels of shape "
                             f"{tuple(labels.shape)} and dtype {labels.dtype} for {len(inputs)} examples")
        if len(labels) == 0:
            raise ValueError(f"{what}: no examples")
        if int(labels.min()) < 0:
            raise ValueError(f"{what}: a negative label ({int(labels.min())})")
        return inputs.float(), labels.long()

    @classmethod
    def from_datasets(cls, tasks: Any, num_classes: int | None = None,
                      train_subset: int | None = None) -> InMemoryTasks:
        """The tasks of ``tasks``, a list of ``(train, test)`` pairs of map-style torch Datasets whose examples
        are ``(x, y)`` pairs: ``x`` a tensor or array (converted to float32), ``y`` an integer class label (an int,
        or a one-element integer tensor or array). Every example is read once, here. ``train_subset``: only the
        first N training examples of each task. A wrong structure or example is a ValueError that names it."""
        expected = "expected a list of tasks, each a (train, test) pair of torch Datasets"
        if not isinstance(tasks, list | tuple):
            raise ValueError(f"{expected}, got {type(tasks).__name__}")
        if not tasks:
            raise ValueError(f"{expected}, got an empty {type(tasks).__name__}")
        train, test = [], []
        for task, pair in enumerate(tasks):
            if not (isinstance(pair, list | tuple) and len(pair) == 2):
                got = f"a {len(pair)}-{type(pair).__name__}" if isinstance(pair, list | tuple) else type(pair).__name__
                raise ValueError(f"{expected}; task {task}: expected a (train, test) pair, got {got}")
            train.append(_read_examples(pair[0], f"task {task}'s training set", train_subset))
            test.append(_read_examples(pair[1], f"task {task}'s test set"))
        return cls(train, test, num_classes)

    @property
    def num_tasks(self) -> int:
        return len(self.train_sizes)

    def train_batch(self, tasks: Tensor, indices: Tensor) -> Batch:
        return _gather_by_task(tasks, indices, lambda task, rows: (self.train[task][0][rows],
                                                                   self.train[task][1][rows]))

    def test_set(self, task: int) -> tuple[Tensor, Tensor]:
        return self.test[task]

    def digest(self) -> str:
        """SHA-256 of the tasks' examples and of ``num_classes``: what a run trains and is evaluated on (a run of
        the custom scenario records it, and ``--resume`` refuses data that changed since)."""
        sha = hashlib.sha256(repr((self.num_classes, self.train_sizes)).encode())
        for tensor in (tensor for pair in [*self.train, *self.test] for tensor in pair):
            sha.update(repr(tuple(tensor.shape)).encode())
            sha.update(tensor.contiguous().numpy())
        return sha.hexdigest()


def _read_examples(dataset: Any, what: str, limit: int | None = None) -> tuple[Tensor, Tensor]:
    """All (or the first ``limit``) examples of the map-style torch Dataset ``dataset`` (``what`` names it in
    errors) as float32 inputs and int64 labels."""
    expected = "expected a map-style torch Dataset (e.g. TensorDataset(x, y))"
    if isinstance(dataset, IterableDataset) or not isinstance(dataset, Dataset):
        got = "an IterableDataset, which cannot be indexed" if isinstance(dataset, IterableDataset) else \
            type(dataset).__name__
        raise ValueError(f"{what}: {expected}, got {got}")
    try:
        size = len(dataset)
    except TypeError:
        raise ValueError(f"{what}: {expected}, got a {type(dataset).__name__} without len()") from None
    if limit is not None and limit > size:
        raise ValueError(f"{what} has {size} examples, fewer than train_subset ({limit})")
    inputs, labels = [], []
    for index in range(size if limit is None else limit):
        where = f"{what}, example {index}"
        try:
            example = dataset[index]
        except Exception as error:  # noqa: BLE001 - the user's dataset code: any failure is reported as it is
            raise ValueError(f"{where}: reading it raised {type(error).__name__}: {error}") from error
        if not (isinstance(example, tuple | list) and len(example) == 2):
            raise ValueError(f"{where}: expected an (x, y) pair, got {type(example).__name__}")
        x, y = example
        try:
            inputs.append(torch.as_tensor(x, dtype=torch.float32, device="cpu"))
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"{where}: x is a {type(x).__name__}, not convertible to a float tensor "
                             f"({' '.join(str(error).split())})") from None
        if inputs[-1].shape != inputs[0].shape:
            raise ValueError(f"{where}: x has shape {tuple(inputs[-1].shape)}, example 0 {tuple(inputs[0].shape)}; "
                             "every example's x must have one shape")
        labels.append(_class_index(y, where))
    if not inputs:
        raise ValueError(f"{what} is empty")
    return torch.stack(inputs), torch.tensor(labels, dtype=torch.int64)


def _class_index(label: Any, where: str) -> int:
    """``label`` (an int, or a one-element integer tensor or array) as an int >= 0; ``where`` names it in errors."""
    value = label
    if isinstance(label, Tensor | np.ndarray | np.generic):
        as_tensor = torch.as_tensor(label)
        if as_tensor.numel() == 1 and not (as_tensor.is_floating_point() or as_tensor.is_complex()
                                           or as_tensor.dtype == torch.bool):
            value = int(as_tensor.item())
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: the label is {label!r}, expected an integer class index >= 0")
    return value


class DiscreteTasks(_BenchmarkStream, _SequentialTaskStream):
    """In-memory tasks one after another, as :class:`DiscretePermutedMNIST` trains its tasks: ``epochs_per_task``
    epochs over each task's training set, reshuffled every epoch, evaluated at the end of every task. The task
    switches are never announced to the learner."""

    def __init__(self, benchmark: InMemoryTasks, epochs_per_task: int = 20, batch_size: int = 128,
                 seed: int = 0) -> None:
        self.benchmark = benchmark
        super().__init__(benchmark.train_sizes, epochs_per_task, batch_size, seed)


class ContinuousTasks(_GradualMixStream):
    """In-memory tasks mixed gradually, on the schedule of :class:`ContinuousPermutedMNIST`
    (:class:`_GradualMixStream`): each task's samples of a batch are drawn without replacement from that task's
    training set, independently for every batch. ``batch_size`` must not exceed the smallest training set."""

    def __init__(self, benchmark: InMemoryTasks, iterations_per_task: int, batch_size: int = 128, seed: int = 0,
                 eval_every: int | None = None) -> None:
        super().__init__(benchmark, benchmark.train_sizes, iterations_per_task, batch_size, seed, eval_every)

    def _draw_indices(self, tasks: Tensor, generator: torch.Generator) -> Tensor:
        indices = torch.empty_like(tasks)
        for task in tasks.unique().tolist():
            rows = tasks == task
            indices[rows] = torch.randperm(self.train_sizes[task], generator=generator)[: int(rows.sum())]
        return indices


def data_digest(stream: Scenario) -> str | None:
    """:meth:`InMemoryTasks.digest` of a stream of in-memory tasks (also inside a :class:`JointStream`); None
    for the built-in benchmarks, whose files are checked when they load."""
    benchmark = getattr(getattr(stream, "scenario", stream), "benchmark", None)
    return benchmark.digest() if isinstance(benchmark, InMemoryTasks) else None


class JointStream:
    """The joint-training oracle (the "Offline (oracle)" curve of the continuous experiment): the training
    data of all of ``scenario``'s tasks mixed together, reshuffled every epoch, for the same number of
    iterations, batch size and evaluation points as ``scenario``.

    In a task-aware scenario (one head per task) every batch holds one task's images, as a multi-head learner
    needs: each epoch cuts every task's shuffled images into batches and interleaves all the batches in a
    random order, so the tasks are still learned together."""

    def __init__(self, scenario: Scenario, seed: int = 0) -> None:
        _check_seed(seed)
        self.scenario = scenario
        self.seed = seed
        self.num_tasks = scenario.num_tasks
        self.num_iterations = scenario.num_iterations
        self.eval_points = scenario.eval_points
        self.input_shape = scenario.input_shape
        self.num_classes = scenario.num_classes
        self.batch_size = scenario.batch_size
        self.task_aware = scenario.task_aware
        self.train_sizes = scenario.train_sizes
        self._task_offsets = torch.tensor([0, *accumulate(scenario.train_sizes)])
        self.pool_size = int(self._task_offsets[-1])
        if self.task_aware:
            self.batches_per_epoch = sum(math.ceil(size / scenario.batch_size) for size in self.train_sizes)
        else:
            self.batches_per_epoch = math.ceil(self.pool_size / scenario.batch_size)

    def test_set(self, task: int) -> tuple[Tensor, Tensor]:
        return self.scenario.test_set(task)

    def train_batch(self, tasks: Tensor, indices: Tensor) -> Batch:
        return self.scenario.train_batch(tasks, indices)

    def batches(self, start_iteration: int = 0) -> Iterator[tuple[int, Batch]]:
        _check_start(start_iteration, self.num_iterations)
        iteration = start_iteration
        while iteration < self.num_iterations:
            epoch, first_batch = divmod(iteration, self.batches_per_epoch)
            epoch_batches = self._epoch_batches(epoch)
            last_batch = min(self.batches_per_epoch, first_batch + self.num_iterations - iteration)
            for pool_indices in epoch_batches[first_batch:last_batch]:
                tasks = torch.bucketize(pool_indices, self._task_offsets[1:], right=True)
                yield iteration, self.train_batch(tasks, pool_indices - self._task_offsets[tasks])
                iteration += 1

    def _epoch_batches(self, epoch: int) -> list[Tensor]:
        """The pool indices of each batch of ``epoch``, in training order (see the class docstring)."""
        generator = _generator(self.seed, _JOINT_SHUFFLE, epoch)
        if not self.task_aware:
            return list(torch.randperm(self.pool_size, generator=generator).split(self.batch_size))
        batches = [(int(start) + torch.randperm(size, generator=generator)).split(self.batch_size)
                   for start, size in zip(self._task_offsets[:-1], self.train_sizes, strict=True)]
        flat = [batch for task_batches in batches for batch in task_batches]
        return [flat[position] for position in torch.randperm(len(flat), generator=generator).tolist()]
