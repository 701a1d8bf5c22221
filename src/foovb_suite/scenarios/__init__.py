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

One module a family: :mod:`.mnist` (the MNIST images, :class:`MNISTImages`, the permuted-MNIST tasks,
:class:`PermutedMNIST`, and the four MNIST streams), :mod:`.vision_mix`, :mod:`.in_memory` (your own tasks),
:mod:`.joint`; :mod:`.base` holds what they share (:class:`Batch`, the :class:`Scenario` protocol, the seeded
generators, the sequential and gradual-mix schedules).

Iterations are numbered from 0; ``eval_points`` hold numbers of completed iterations, so the runner
evaluates after yielding iteration ``e - 1`` for each ``e`` in ``eval_points``. All randomness of a stream
comes from generators seeded by ``(seed, purpose, epoch or iteration)``, never from the global RNG, so
``batches(k)`` reproduces exactly the tail of ``batches(0)`` from iteration ``k`` on (resuming a run).
"""

from __future__ import annotations

from .base import Batch, Scenario
from .in_memory import ContinuousTasks, DiscreteTasks, InMemoryTasks, data_digest
from .joint import JointStream
from .mnist import ContinuousPermutedMNIST, DiscretePermutedMNIST, MNISTImages, PermutedMNIST, RotatedMNIST, SplitMNIST
from .vision_mix import VisionMix

__all__ = ["Batch", "ContinuousPermutedMNIST", "ContinuousTasks", "DiscretePermutedMNIST", "DiscreteTasks",
           "InMemoryTasks", "JointStream", "MNISTImages", "PermutedMNIST", "RotatedMNIST", "Scenario", "SplitMNIST",
           "VisionMix", "data_digest"]
