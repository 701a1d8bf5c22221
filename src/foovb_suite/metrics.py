"""Evaluation metrics: prediction-mode accuracy, NLL, calibration and accuracy-matrix summaries.

Prediction modes (see docs/ARCHITECTURE.md):

* ``"mean"``: the prediction of the point estimate / posterior-mean network.
* ``"bma"``: the Bayesian model average, the mean of the K sampled networks' class probabilities.
* ``"single"``: the mean over the K sampled networks of each network's own accuracy (the metric reported
  by the reference implementation of the matrix-variate FOO-VB, which averages the test accuracy of the
  sampled networks, paper appendix "Implementation details").

Accuracy matrix ``R[i, j]``: accuracy on task ``j`` after training stage ``i`` (NaN where task ``j`` has not
been seen yet; fully filled matrices are accepted too).
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.typing import ArrayLike
from torch import Tensor

from foovb.predict import Predictions

PROBABILITY_MODES = ("mean", "bma")
ACCURACY_MODES = ("mean", "bma", "single")


def _require_samples(pred: Predictions, mode: str) -> Tensor:
    if pred.samples is None:
        raise ValueError(f"prediction mode {mode!r} needs sampled-network probabilities (samples)")
    return pred.samples


def _as_labels(y: ArrayLike | Tensor, num_inputs: int) -> Tensor:
    labels = torch.as_tensor(y).long()
    if labels.shape != (num_inputs,):
        raise ValueError(f"labels must have shape ({num_inputs},), got {tuple(labels.shape)}")
    if num_inputs == 0:
        raise ValueError("no inputs: a metric of an empty set is undefined")
    return labels


def mode_probabilities(pred: Predictions, mode: str) -> Tensor:
    """``(r, C)`` class probabilities of prediction mode ``"mean"`` or ``"bma"`` (average of sample probs)."""
    if mode == "mean":
        return pred.mean
    if mode == "bma":
        return _require_samples(pred, mode).mean(dim=0)
    raise ValueError(f"unknown probability mode {mode!r}; expected one of {PROBABILITY_MODES}")


def accuracy(pred: Predictions, y: ArrayLike | Tensor, mode: str = "mean") -> float:
    """Fraction of correctly classified inputs under ``mode`` (``"mean"``, ``"bma"`` or ``"single"``).

    ``"single"`` is the mean over the K sampled networks of each network's accuracy.
    """
    if pred.mean.dim() != 2:
        raise ValueError(f"accuracy needs (r, C) class probabilities, got predictions of shape "
                         f"{tuple(pred.mean.shape)}")
    labels = _as_labels(y, pred.mean.shape[0])
    if mode == "single":
        sample_predictions = _require_samples(pred, mode).argmax(dim=-1)  # (K, r)
        return (sample_predictions == labels).double().mean().item()
    if mode not in PROBABILITY_MODES:
        raise ValueError(f"unknown accuracy mode {mode!r}; expected one of {ACCURACY_MODES}")
    return (mode_probabilities(pred, mode).argmax(dim=-1) == labels).double().mean().item()


def nll(probs: ArrayLike | Tensor, y: ArrayLike | Tensor, min_probability: float = 1e-12) -> float:
    """Mean negative log-likelihood ``-mean_n log p_n[y_n]``, the log clamped at ``min_probability``."""
    probabilities = torch.as_tensor(probs)
    labels = _as_labels(y, probabilities.shape[0])
    true_class_probability = probabilities.gather(1, labels[:, None]).squeeze(1)
    return -true_class_probability.clamp_min(min_probability).log().double().mean().item()


def ece(probs: ArrayLike | Tensor, y: ArrayLike | Tensor, n_bins: int = 15) -> float:
    """Expected calibration error (Guo et al. 2017, "On calibration of modern neural networks").

    With ``n_bins`` equal-width confidence bins,
    ``ECE = sum_b |B_b|/n * |acc(B_b) - conf(B_b)|`` where the confidence is the top-class probability and
    bin ``b`` holds the confidences in ``(b/n_bins, (b+1)/n_bins]``.
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    probabilities = torch.as_tensor(probs).double()
    labels = _as_labels(y, probabilities.shape[0])
    confidence, predicted = probabilities.max(dim=1)
    correct = (predicted == labels).double()
    bin_index = (torch.ceil(confidence * n_bins).long() - 1).clamp(0, n_bins - 1)
    bin_confidence_sum = torch.bincount(bin_index, weights=confidence, minlength=n_bins)
    bin_correct_sum = torch.bincount(bin_index, weights=correct, minlength=n_bins)
    return ((bin_correct_sum - bin_confidence_sum).abs().sum() / labels.numel()).item()


def validate_accuracy_matrix(accuracy_matrix: ArrayLike) -> np.ndarray:
    """Return ``accuracy_matrix`` as a float array after checking it is a valid ``R[i, j]`` matrix.

    It must be square ``(T, T)`` with ``T >= 1`` and finite on and below the diagonal (every task seen so far
    was evaluated); entries above the diagonal may be NaN (task not seen yet) or finite.
    """
    matrix = np.asarray(accuracy_matrix, dtype=float)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] == 0:
        raise ValueError(f"accuracy matrix must be square (T, T) with T >= 1, got shape {matrix.shape}")
    lower = np.tril(matrix)
    if not np.all(np.isfinite(lower)):
        raise ValueError("accuracy matrix must be finite on and below the diagonal (R[i, j] for j <= i)")
    if np.any(np.isinf(matrix)):
        raise ValueError("accuracy matrix must not contain infinities")
    return matrix


def _require_two_tasks(matrix: np.ndarray, metric: str) -> None:
    if matrix.shape[0] < 2:
        raise ValueError(f"{metric} needs at least 2 tasks, got an accuracy matrix of shape {matrix.shape}")


def average_accuracy(accuracy_matrix: ArrayLike) -> np.ndarray:
    """Average accuracy over the tasks seen so far after each stage: ``A_i = mean_{j<=i} R[i, j]`` (the paper's
    figure "permuted_mnist_avg_acc")."""
    matrix = validate_accuracy_matrix(accuracy_matrix)
    seen = np.tril(np.ones_like(matrix, dtype=bool))
    return np.where(seen, matrix, 0.0).sum(axis=1) / seen.sum(axis=1)


def first_task_accuracy(accuracy_matrix: ArrayLike) -> np.ndarray:
    """Accuracy on the first task after each stage, ``R[:, 0]`` (the paper's figure "permuted_mnist_first_task_acc")."""
    return validate_accuracy_matrix(accuracy_matrix)[:, 0].copy()


def forgetting(accuracy_matrix: ArrayLike) -> float:
    """Average forgetting after the last stage (Chaudhry et al. 2018, "Riemannian Walk").

    ``f_j = max_{j <= l < T-1} R[l, j] - R[T-1, j]`` averaged over tasks ``j = 0 .. T-2``: only stages after
    task ``j`` was learned count (entries above the diagonal, not-yet-seen tasks, are ignored even if filled).
    """
    matrix = validate_accuracy_matrix(accuracy_matrix)
    _require_two_tasks(matrix, "forgetting")
    num_tasks = matrix.shape[0]
    earlier = matrix[: num_tasks - 1, : num_tasks - 1]
    best_previous = np.where(np.tril(np.ones_like(earlier, dtype=bool)), earlier, -np.inf).max(axis=0)
    return float(np.mean(best_previous - matrix[num_tasks - 1, : num_tasks - 1]))


def backward_transfer(accuracy_matrix: ArrayLike) -> float:
    """Backward transfer (Lopez-Paz & Ranzato 2017, "Gradient Episodic Memory"):
    ``mean_{j < T-1} R[T-1, j] - R[j, j]``."""
    matrix = validate_accuracy_matrix(accuracy_matrix)
    _require_two_tasks(matrix, "backward transfer")
    num_tasks = matrix.shape[0]
    return float(np.mean(matrix[num_tasks - 1, : num_tasks - 1] - np.diag(matrix)[: num_tasks - 1]))
