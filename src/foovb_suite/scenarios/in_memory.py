"""Your own tasks, held in memory (:class:`InMemoryTasks`, e.g. from torch Datasets: the custom scenario's), one
after another (:class:`DiscreteTasks`) or mixed gradually (:class:`ContinuousTasks`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, IterableDataset

from .base import (
    Batch,
    Scenario,
    _BenchmarkStream,
    _gather_by_task,
    _GradualMixStream,
    _SequentialTaskStream,
)


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
        """``examples`` (inputs, labels) as float32 and int64, checked: finite inputs of the tasks' one shape,
        one label >= 0 per example, at least one example; ``what`` names them in errors."""
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
        inputs = inputs.float()
        finite = torch.isfinite(inputs.reshape(len(inputs), -1)).all(1)
        if not bool(finite.all()):  # else the learners' first steps diverge, and their errors blame the settings
            bad = (~finite).nonzero().flatten()
            raise ValueError(f"{what}: non-finite inputs (NaN or inf) in {len(bad)} example(s), the first example "
                             f"{int(bad[0])}")
        return inputs, labels.long()

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
            got = (f"a {type(example).__name__} of {len(example)}" if isinstance(example, tuple | list)
                   else f"a {type(example).__name__}")
            raise ValueError(f"{where}: expected an (x, y) pair, got {got}")
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
