"""What a run measures at an evaluation (`Evaluator`: every task's accuracy, NLL and ECE in every prediction mode),
what its evaluation records add up to (`metrics_per_mode`), and where the evaluations fall in tasks (`task_ends`,
`tasks_seen`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import metrics
from .config import Config, is_continuous
from .learners import Learner
from .metrics import ACCURACY_MODES, PROBABILITY_MODES

__all__ = ["Evaluator", "average_so_far", "metrics_per_mode", "task_ends", "tasks_seen"]


def task_ends(config: Config, scenario) -> list[int]:
    """Iteration count at which each task's period ends (stage boundaries for "tasks seen so far")."""
    if is_continuous(config.scenario):
        d = config.scenario.iterations_per_task
        return [(t + 1) * d for t in range(scenario.num_tasks)]
    inner = getattr(scenario, "scenario", scenario)  # JointStream wraps the sequential scenario
    return list(inner.eval_points)


def tasks_seen(records: list[dict], config: Config) -> list[float]:
    """The x values of the curve plots: the task count at each evaluation (stage + 1), fractional in the
    continuous scenario, whose evaluations every `eval_every` iterations fall inside task periods."""
    if is_continuous(config.scenario):
        return [r["iteration"] / config.scenario.iterations_per_task for r in records]
    return [r["stage"] + 1 for r in records]


class Evaluator:
    """Accuracy of every task's test set in every prediction mode the learner supports."""

    def __init__(self, scenario, test_subset: int | None, device: torch.device):
        self.test_sets = []
        for task in range(scenario.num_tasks):
            x, y = scenario.test_set(task)
            self.test_sets.append((x[:test_subset].to(device), y[:test_subset].to(device)))

    def __call__(self, learner: Learner, task_aware: bool) -> dict[str, Any]:
        accuracy: dict[str, list[float]] = {}
        calibration: dict[str, dict[str, list[float]]] = {"nll": {}, "ece": {}}
        for task, (x, y) in enumerate(self.test_sets):
            pred = _predict_in_chunks(learner, x, task if task_aware else None)
            modes = ACCURACY_MODES if pred.samples is not None else ("mean",)
            for mode in modes:
                accuracy.setdefault(mode, []).append(metrics.accuracy(pred, y, mode))
            for mode in PROBABILITY_MODES if pred.samples is not None else ("mean",):
                probs = metrics.mode_probabilities(pred, mode)
                calibration["nll"].setdefault(mode, []).append(metrics.nll(probs, y))
                calibration["ece"].setdefault(mode, []).append(metrics.ece(probs, y))
        return {"accuracy": accuracy, **calibration}


def _predict_in_chunks(learner: Learner, x: torch.Tensor, task: int | None, rows: int = 2500):
    parts = [learner.predict(x[i : i + rows], task) for i in range(0, len(x), rows)]
    samples = None if parts[0].samples is None else torch.cat([p.samples for p in parts], 1)
    return metrics.Predictions(torch.cat([p.mean for p in parts]), samples)


def average_so_far(record: dict) -> float:
    """Average posterior-mean accuracy over the tasks seen by an evaluation (the progress bar's avg_acc)."""
    return float(np.mean(record["accuracy"]["mean"][: record["stage"] + 1]))


def metrics_per_mode(records: list[dict], ends: list[int], num_tasks: int) -> dict[str, Any]:
    """Final metrics per mode from the evaluation records."""
    out: dict[str, Any] = {}
    last = records[-1]
    for mode in last["accuracy"]:
        matrix = np.array([r["accuracy"][mode] for r in records])
        seen = np.array([[j <= r["stage"] for j in range(num_tasks)] for r in records])
        average = np.where(seen, matrix, 0).sum(1) / seen.sum(1)
        entry = {"average_accuracy": float(average[-1]), "first_task_accuracy": float(matrix[-1, 0]),
                 "average_accuracy_curve": average.tolist()}
        at_ends = [i for i, r in enumerate(records) if r["iteration"] in ends]
        if len(at_ends) == num_tasks and num_tasks > 1:
            square = np.where(np.tril(np.ones((num_tasks, num_tasks), bool)), matrix[at_ends], np.nan)
            entry["forgetting"] = metrics.forgetting(square)
            entry["backward_transfer"] = metrics.backward_transfer(square)
        out[mode] = entry
    return out
