"""The joint-training ("offline") oracle on any stream: all its tasks' training data mixed together."""

from __future__ import annotations

import math
from collections.abc import Iterator
from itertools import accumulate

import torch
from torch import Tensor

from .base import _JOINT_SHUFFLE, Batch, Scenario, _check_seed, _check_start, _generator


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
