import math

import numpy as np
import pytest
import torch

from foovb_suite.metrics import (
    Predictions,
    accuracy,
    average_accuracy,
    backward_transfer,
    ece,
    first_task_accuracy,
    forgetting,
    mode_probabilities,
    nll,
)

# Three inputs, two classes, two sampled networks. Labels [0, 1, 1].
MEAN = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7]])
SAMPLES = torch.tensor(
    [
        [[0.8, 0.2], [0.1, 0.9], [0.6, 0.4]],  # network 1: correct, correct, wrong -> 2/3
        [[0.4, 0.6], [0.3, 0.7], [0.45, 0.55]],  # network 2: wrong, correct, correct -> 2/3
    ]
)
LABELS = torch.tensor([0, 1, 1])


def test_prediction_modes_give_hand_computed_accuracies():
    pred = Predictions(mean=MEAN, samples=SAMPLES)
    # bma probabilities: [[0.6, 0.4], [0.2, 0.8], [0.525, 0.475]] -> correct, correct, wrong
    torch.testing.assert_close(mode_probabilities(pred, "bma"), SAMPLES.mean(dim=0))
    assert mode_probabilities(pred, "mean") is MEAN
    assert accuracy(pred, LABELS, "mean") == pytest.approx(2 / 3)  # correct, wrong, correct
    assert accuracy(pred, LABELS, "bma") == pytest.approx(2 / 3)
    assert accuracy(pred, LABELS, "single") == pytest.approx(4 / 6)
    assert accuracy(Predictions(mean=MEAN, samples=SAMPLES[:1]), LABELS, "single") == pytest.approx(2 / 3)
    # "single" differs from "bma" when the sampled networks disagree in a way their average hides
    disagreeing = torch.tensor([[[0.9, 0.1]], [[0.45, 0.55]], [[0.45, 0.55]]])
    pred = Predictions(mean=disagreeing[0], samples=disagreeing)
    assert accuracy(pred, torch.tensor([0]), "bma") == 1.0
    assert accuracy(pred, torch.tensor([0]), "single") == pytest.approx(1 / 3)


@pytest.mark.parametrize("mode", ["bma", "single"])
def test_modes_needing_samples_raise_naming_the_mode(mode):
    with pytest.raises(ValueError, match=mode):
        accuracy(Predictions(mean=MEAN), LABELS, mode)


def test_unknown_modes_and_bad_shapes_raise():
    pred = Predictions(mean=MEAN, samples=SAMPLES)
    with pytest.raises(ValueError, match="median"):
        accuracy(pred, LABELS, "median")
    with pytest.raises(ValueError, match="single"):
        mode_probabilities(pred, "single")
    with pytest.raises(ValueError, match="samples"):
        Predictions(mean=MEAN, samples=SAMPLES[:, :2])
    with pytest.raises(ValueError, match="mean"):
        Predictions(mean=MEAN[0, 0])
    for shape in ((3,), (3, 4, 2)):  # a regression's or a sequence model's outputs: argmax would broadcast
        with pytest.raises(ValueError, match=r"accuracy needs \(r, C\) class probabilities"):
            accuracy(Predictions(mean=torch.rand(shape)), LABELS, "mean")
    with pytest.raises(ValueError, match="labels"):
        accuracy(pred, LABELS[:2], "mean")
    empty = Predictions(mean=MEAN[:0], samples=SAMPLES[:, :0])
    for metric in (lambda: accuracy(empty, LABELS[:0], "single"), lambda: nll(MEAN[:0], LABELS[:0]),
                   lambda: ece(MEAN[:0], LABELS[:0])):
        with pytest.raises(ValueError, match="empty"):
            metric()


def test_nll_matches_closed_form_and_clamps_zero_probabilities():
    expected = -(math.log(0.9) + math.log(0.4) + math.log(0.7)) / 3
    assert nll(MEAN, LABELS) == pytest.approx(expected)
    assert nll(np.array([[1.0, 0.0]]), np.array([1])) == pytest.approx(-math.log(1e-12))


def test_ece_hand_computed_example():
    probs = torch.tensor([[0.95, 0.05], [0.95, 0.05], [0.3, 0.7], [0.3, 0.7]])
    labels = torch.tensor([0, 1, 1, 1])
    # bin (0.9333, 1]: conf 0.95, acc 0.5; bin (0.6667, 0.7333]: conf 0.7, acc 1.0
    assert ece(probs, labels) == pytest.approx(0.5 * 0.45 + 0.5 * 0.3)
    with pytest.raises(ValueError, match="n_bins"):
        ece(probs, labels, n_bins=0)


def test_ece_bins_are_closed_on_the_right():
    """Bin b holds the confidences in (b/n_bins, (b+1)/n_bins]: with 5 bins, 0.6 falls in (0.4, 0.6], not with
    0.7 in (0.6, 0.8]."""
    probs = torch.tensor([[0.6, 0.4], [0.7, 0.3]], dtype=torch.float64)
    labels = torch.tensor([0, 1])  # the first correct, the second wrong
    # separate bins: (|1 - 0.6| + |0 - 0.7|) / 2; one shared bin would give |1 - 1.3| / 2 = 0.15
    assert ece(probs, labels, n_bins=5) == pytest.approx(0.55)
    assert ece(probs[:1], labels[:1], n_bins=5) == pytest.approx(0.4)


def test_ece_is_small_when_calibrated_and_large_when_overconfident():
    generator = torch.Generator().manual_seed(0)
    num_inputs = 20_000
    confidence = 0.5 + 0.5 * torch.rand(num_inputs, generator=generator)
    probs = torch.stack([confidence, 1 - confidence], dim=1)
    correct = torch.rand(num_inputs, generator=generator) < confidence
    calibrated_labels = torch.where(correct, 0, 1)
    assert ece(probs, calibrated_labels) < 0.02

    overconfident = torch.tensor([[0.99, 0.01]]).repeat(num_inputs, 1)
    labels_correct_60_percent = (torch.rand(num_inputs, generator=generator) > 0.6).long()
    assert ece(overconfident, labels_correct_60_percent) == pytest.approx(0.39, abs=0.02)


NAN = float("nan")
# R[i, j]: accuracy on task j after training stage i
DISCRETE_R = np.array(
    [
        [0.90, NAN, NAN],
        [0.80, 0.95, NAN],
        [0.70, 0.85, 0.97],
    ]
)


def test_accuracy_matrix_metrics_match_hand_computation():
    np.testing.assert_allclose(average_accuracy(DISCRETE_R), [0.90, 0.875, (0.70 + 0.85 + 0.97) / 3])
    np.testing.assert_allclose(first_task_accuracy(DISCRETE_R), [0.90, 0.80, 0.70])
    # forgetting: task 0: max(0.90, 0.80) - 0.70 = 0.20; task 1: 0.95 - 0.85 = 0.10
    assert forgetting(DISCRETE_R) == pytest.approx(0.15)
    # BWT: (0.70 - 0.90 + 0.85 - 0.95) / 2
    assert backward_transfer(DISCRETE_R) == pytest.approx(-0.15)


def test_fully_filled_matrix_counts_only_stages_after_each_task_was_learned():
    full = np.array(
        [
            [0.50, 0.10, 0.10],
            [0.60, 0.90, 0.20],
            [0.55, 0.80, 0.95],
        ]
    )
    np.testing.assert_allclose(average_accuracy(full), [0.50, 0.75, (0.55 + 0.80 + 0.95) / 3])
    # task 0: max(0.50, 0.60) - 0.55; task 1: max(0.10, 0.90) - 0.80
    assert forgetting(full) == pytest.approx((0.05 + 0.10) / 2)
    assert backward_transfer(full) == pytest.approx((0.05 - 0.10) / 2)
    full[0, 1] = 0.99  # a stage before task 1 was trained: not forgetting (Chaudhry et al.: a_{l,j}, j <= l)
    assert forgetting(full) == pytest.approx((0.05 + 0.10) / 2)
    assert forgetting(np.where(np.tril(np.ones((3, 3), bool)), full, np.nan)) == forgetting(full)  # as the runner
    assert backward_transfer(full) == pytest.approx((0.05 - 0.10) / 2)


def test_forgetting_excludes_the_final_stage_from_the_maximum_and_can_be_negative():
    """f_j = max_{j <= l < T-1} R[l, j] - R[T-1, j]: a task that improved after it was learned has negative
    forgetting (not clipped to 0, as a maximum including the final stage would give)."""
    assert forgetting(np.array([[0.5, NAN], [0.9, 0.8]])) == pytest.approx(0.5 - 0.9)
    improved_then_forgot = np.array([[0.5, NAN, NAN], [0.9, 0.8, NAN], [0.95, 0.7, 0.6]])
    assert forgetting(improved_then_forgot) == pytest.approx(((0.9 - 0.95) + (0.8 - 0.7)) / 2)


@pytest.mark.parametrize(
    "bad_matrix",
    [
        np.zeros((2, 3)),
        np.zeros(3),
        np.zeros((0, 0)),
        np.array([[0.9, NAN], [NAN, 0.8]]),  # a seen task not evaluated
        np.array([[0.9, np.inf], [0.5, 0.8]]),
    ],
)
def test_malformed_accuracy_matrices_raise(bad_matrix):
    for metric in (average_accuracy, first_task_accuracy, forgetting, backward_transfer):
        with pytest.raises(ValueError, match="accuracy matrix"):
            metric(bad_matrix)


def test_forgetting_and_bwt_need_two_tasks():
    with pytest.raises(ValueError, match="2 tasks"):
        forgetting(np.array([[0.9]]))
    with pytest.raises(ValueError, match="2 tasks"):
        backward_transfer(np.array([[0.9]]))
