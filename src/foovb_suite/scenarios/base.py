"""What every stream shares: the :class:`Batch`, the :class:`Scenario` protocol the runner reads, the seeded
generators, and the two schedules the streams are built on, tasks one after another (:class:`_SequentialTaskStream`)
and tasks that fade into each other (:class:`_GradualMixStream`).

All randomness of a stream comes from generators seeded by ``(seed, purpose, epoch or iteration)``
(:func:`_generator`), never from the global RNG, so ``batches(k)`` reproduces exactly the tail of ``batches(0)``
from iteration ``k`` on (resuming a run).
"""

from __future__ import annotations

import bisect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

# Purposes in the seed derivation, so that streams drawn from the same seed are independent.
_PERMUTATIONS, _EPOCH_SHUFFLE, _ITERATION_SAMPLE, _JOINT_SHUFFLE = range(4)


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


class Benchmark(Protocol):
    """The tasks' data behind a task-agnostic stream (:class:`~foovb_suite.scenarios.mnist.PermutedMNIST`,
    :class:`~foovb_suite.scenarios.in_memory.InMemoryTasks`): the inputs' shape, the classes, the test sets and
    the training batches."""

    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]: ...
    def test_set(self, task: int) -> tuple[Tensor, Tensor]: ...
    def train_batch(self, tasks: Tensor, indices: Tensor) -> Batch: ...


class _BenchmarkStream:
    """What a task-agnostic stream takes from its :class:`Benchmark`, the tasks' data: the inputs' shape, the
    classes, the test sets and the training batches."""

    task_aware = False
    benchmark: Benchmark

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
        if batch_size > min(train_sizes):  # it would silently be one batch of the whole task per epoch
            raise ValueError(f"batch_size {batch_size} exceeds the {min(train_sizes)} training examples of a task "
                             f"(an epoch would be one batch of the whole task): pass at most {min(train_sizes)}")
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

    def __init__(self, benchmark: Benchmark, train_sizes: Sequence[int],
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
