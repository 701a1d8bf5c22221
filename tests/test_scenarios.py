"""Tests of the continual-learning streams: permutations, normalisation, the continuous task schedule,
per-batch task sampling, epoch structure, resumability, the vision mix and the joint oracle."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from foovb_suite.data import ImageDataset, load_mnist
from foovb_suite.learners import make_learner
from foovb_suite.models import make_model
from foovb_suite.scenarios import (
    Batch,
    ContinuousPermutedMNIST,
    ContinuousTasks,
    DiscretePermutedMNIST,
    DiscreteTasks,
    InMemoryTasks,
    JointStream,
    PermutedMNIST,
    RotatedMNIST,
    SplitMNIST,
    VisionMix,
    base,
)

MEAN, STD = 0.1307, 0.3081  # the normalisation the paper's code uses for MNIST


@pytest.fixture(scope="module")
def permuted_mnist() -> PermutedMNIST:
    return PermutedMNIST(num_tasks=3, seed=0)


@pytest.fixture(scope="module")
def padded_permuted_mnist() -> PermutedMNIST:
    return PermutedMNIST(num_tasks=3, seed=0, pad_to_32=True)


def expected_probabilities(iteration: int, num_tasks: int, iterations_per_task: int) -> list[float]:
    """The continuous schedule written out task by task, straight from its definition."""
    u = iteration / iterations_per_task
    weights = []
    for task in range(num_tasks):
        ramp_in = 0.5 + 2 * (u - task) if task > 0 else math.inf
        ramp_out = 0.5 + 2 * (task + 1 - u) if task < num_tasks - 1 else math.inf
        weights.append(min(1.0, max(0.0, min(ramp_in, ramp_out))))
    return weights


def record_indices(monkeypatch: pytest.MonkeyPatch, stream) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Make ``stream`` log the (tasks, indices) of every batch it builds."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    build = stream.train_batch

    def recording(tasks: torch.Tensor, indices: torch.Tensor) -> Batch:
        calls.append((tasks.clone(), indices.clone()))
        return build(tasks, indices)

    monkeypatch.setattr(stream, "train_batch", recording)
    return calls


def assert_same_batches(actual: list[tuple[int, Batch]], expected: list[tuple[int, Batch]]) -> None:
    assert [iteration for iteration, _ in actual] == [iteration for iteration, _ in expected]
    for (_, got), (_, want) in zip(actual, expected, strict=True):
        assert torch.equal(got.x, want.x) and torch.equal(got.y, want.y) and torch.equal(got.task, want.task)


# --- the permuted-MNIST benchmark ------------------------------------------------------------------------


def test_permutations_identity_first_deterministic_and_seed_dependent(permuted_mnist):
    permutations = permuted_mnist.permutations
    assert permutations.shape == (3, 784)
    assert torch.equal(permutations[0], torch.arange(784))
    for task in range(3):
        assert torch.equal(permutations[task].sort().values, torch.arange(784))
    assert not torch.equal(permutations[1], permutations[2])
    assert torch.equal(PermutedMNIST(num_tasks=3, seed=0).permutations, permutations)
    other_seed = PermutedMNIST(num_tasks=3, seed=1).permutations
    assert torch.equal(other_seed[0], permutations[0])
    assert not torch.equal(other_seed[1], permutations[1])


def test_inputs_are_permuted_then_normalised(permuted_mnist):
    mnist = load_mnist()
    indices = torch.tensor([0, 59999, 123])
    plain = (mnist.train_images[indices].reshape(3, 784).float() / 255 - MEAN) / STD
    for task in range(3):
        batch = permuted_mnist.train_batch(torch.full((3,), task), indices)
        assert batch.x.shape == (3, 784) and batch.x.dtype == torch.float32
        torch.testing.assert_close(batch.x, plain[:, permuted_mnist.permutations[task]])
        assert torch.equal(batch.y, mnist.train_labels[indices])
    test_x, test_y = permuted_mnist.test_set(2)
    expected = (mnist.test_images.reshape(10000, 784).float() / 255 - MEAN) / STD
    torch.testing.assert_close(test_x, expected[:, permuted_mnist.permutations[2]])
    assert torch.equal(test_y, mnist.test_labels)


def test_padding_comes_before_permuting(padded_permuted_mnist):
    mnist = load_mnist()
    assert padded_permuted_mnist.input_shape == (1024,)
    indices = torch.tensor([7, 8])
    identity = padded_permuted_mnist.train_batch(torch.zeros(2, dtype=torch.int64), indices).x.reshape(
        2, 32, 32
    )
    # standardised with the statistics of the padded images (the reference's 0.1000 / 0.2752)
    padded = torch.nn.functional.pad(load_mnist().train_images.float() / 255, (2, 2, 2, 2))
    mean, std = padded_permuted_mnist.pixel_mean, padded_permuted_mnist.pixel_std
    assert abs(mean - padded.mean().item()) < 2e-4 and abs(std - padded.std().item()) < 2e-4
    assert abs(mean - 0.1000) < 2e-4 and abs(std - 0.2752) < 2e-4
    torch.testing.assert_close(identity[:, 2:30, 2:30], (mnist.train_images[indices].float() / 255 - mean) / std)
    border = torch.ones(32, 32, dtype=torch.bool)
    border[2:30, 2:30] = False
    torch.testing.assert_close(identity[:, border], torch.full((2, 240), -mean / std))
    permuted = padded_permuted_mnist.train_batch(torch.ones(2, dtype=torch.int64), indices).x
    torch.testing.assert_close(permuted, identity.reshape(2, 1024)[:, padded_permuted_mnist.permutations[1]])


def test_mixed_task_batch_permutes_each_sample_for_its_own_task(permuted_mnist):
    indices = torch.tensor([5, 6, 7, 8])
    tasks = torch.tensor([2, 0, 2, 1])
    mixed = permuted_mnist.train_batch(tasks, indices)
    for row in range(4):
        alone = permuted_mnist.train_batch(tasks[row : row + 1], indices[row : row + 1])
        assert torch.equal(mixed.x[row], alone.x[0]) and mixed.y[row] == alone.y[0]
    assert torch.equal(mixed.task, tasks)


# --- discrete stream ----------------------------------------------------------------------------------------


def test_discrete_stream_epochs_and_hidden_boundaries(permuted_mnist, monkeypatch):
    stream = DiscretePermutedMNIST(
        permuted_mnist, epochs_per_task=2, batch_size=128, seed=3, train_subset=1000
    )
    assert stream.batches_per_epoch == (8, 8, 8)  # ceil(1000 / 128), last batch kept
    assert stream.eval_points == (16, 32, 48) and stream.num_iterations == 48
    calls = record_indices(monkeypatch, stream)
    batches = list(stream.batches())
    assert [iteration for iteration, _ in batches] == list(range(48))
    assert [len(batch.y) for _, batch in batches[:8]] == [128] * 7 + [1000 - 7 * 128]
    epochs = [torch.cat([indices for _, indices in calls[start : start + 8]]) for start in range(0, 48, 8)]
    for epoch, order in enumerate(epochs):
        assert torch.equal(order.sort().values, torch.arange(1000))  # every image once per epoch
        assert (calls[epoch * 8][0] == epoch // 2).all()  # tasks in sequence, 2 epochs each
    assert not torch.equal(epochs[0], epochs[1])  # reshuffled every epoch
    assert not torch.equal(epochs[1], epochs[2])


def test_discrete_stream_shuffles_each_task_differently(permuted_mnist, monkeypatch):
    """The epoch shuffle is seeded by (seed, task, epoch): epoch 0 of task 1 does not repeat task 0's order."""
    stream = DiscretePermutedMNIST(permuted_mnist, epochs_per_task=1, batch_size=50, seed=0, train_subset=200)
    calls = record_indices(monkeypatch, stream)
    list(stream.batches())
    orders = [torch.cat([indices for _, indices in calls[start : start + 4]]) for start in (0, 4, 8)]
    assert [calls[start][0][0].item() for start in (0, 4, 8)] == [0, 1, 2]
    for order in orders:
        assert torch.equal(order.sort().values, torch.arange(200))
    assert not torch.equal(orders[0], orders[1])
    assert not torch.equal(orders[1], orders[2])


def test_full_discrete_defaults_match_the_paper(permuted_mnist):
    stream = DiscretePermutedMNIST(permuted_mnist)
    assert stream.batches_per_epoch[0] == 469 and stream.num_iterations == 3 * 20 * 469


# --- continuous stream --------------------------------------------------------------------------------------


def test_continuous_schedule_matches_closed_form(permuted_mnist):
    stream = ContinuousPermutedMNIST(PermutedMNIST(num_tasks=4, seed=0), iterations_per_task=20)
    iterations = torch.arange(stream.num_iterations)
    probabilities = stream.task_probabilities(iterations)
    assert probabilities.shape == (80, 4)
    torch.testing.assert_close(probabilities.sum(1), torch.ones(80, dtype=torch.float64), rtol=0, atol=1e-12)
    assert ((probabilities > 0).sum(1) <= 2).all()
    for iteration in range(80):
        expected = torch.tensor(expected_probabilities(iteration, 4, 20), dtype=torch.float64)
        torch.testing.assert_close(stream.task_probabilities(iteration), expected)
        torch.testing.assert_close(probabilities[iteration], expected)


def test_continuous_schedule_hand_computed_points():
    stream = ContinuousPermutedMNIST(PermutedMNIST(num_tasks=4, seed=0), iterations_per_task=100)

    def weight(iteration: int, task: int) -> float:
        return stream.task_probabilities(iteration)[task].item()

    assert weight(0, 0) == 1.0  # task 0 never ramps in
    assert weight(399, 3) == 1.0  # the last task never ramps out
    for task in range(4):
        assert weight(task * 100 + 50, task) == 1.0  # u = t + 1/2
    for task in range(1, 4):
        # ramp in over [t - 1/4, t + 1/4] (length D/2), crossing the previous task's ramp out at u = t
        assert weight(task * 100 - 25, task) == 0.0 and weight(task * 100 + 25, task) == 1.0
        assert weight(task * 100, task) == pytest.approx(0.5) and weight(
            task * 100, task - 1
        ) == pytest.approx(0.5)
        assert weight(task * 100 - 10, task) == pytest.approx(0.3)  # 1/2 + 2 (u - t) at u = t - 0.1
        assert weight(task * 100 - 10, task - 1) == pytest.approx(0.7)


def test_continuous_batches_follow_the_schedule(permuted_mnist, monkeypatch):
    stream = ContinuousPermutedMNIST(permuted_mnist, iterations_per_task=40, batch_size=128, seed=5)
    calls = record_indices(monkeypatch, stream)
    batches = list(stream.batches())
    probabilities = stream.task_probabilities(torch.arange(stream.num_iterations))
    counts = torch.stack([torch.bincount(tasks, minlength=3) for tasks, _ in calls]).double()
    assert (counts.sum(1) == 128).all()
    assert not ((counts > 0) & (probabilities == 0)).any()  # never a task outside its support
    # each count is Binomial(128, p): the total deviation over the run is within a few standard errors
    deviation = (counts - 128 * probabilities).sum(0)
    standard_error = (128 * probabilities * (1 - probabilities)).sum(0).sqrt()
    assert (deviation.abs() <= 4 * standard_error).all(), (deviation, standard_error)
    ramp = (probabilities > 0).sum(1) == 2  # mixing really happens during the ramps
    assert ((counts[ramp] > 0).sum(1) == 2).float().mean() > 0.9
    for (tasks, indices), (_, batch) in zip(calls, batches, strict=True):
        assert len(indices.unique()) == 128  # no image twice within a batch
        assert torch.equal(batch.task, tasks)
    all_indices = torch.cat([indices for _, indices in calls])
    assert len(all_indices.unique()) < len(all_indices)  # but images recur across batches


def test_continuous_eval_points():
    permuted_mnist = PermutedMNIST(num_tasks=3, seed=0)
    assert ContinuousPermutedMNIST(permuted_mnist, iterations_per_task=10).eval_points == (10, 20, 30)
    every_7 = ContinuousPermutedMNIST(permuted_mnist, iterations_per_task=10, eval_every=7)
    assert every_7.eval_points == (7, 10, 14, 20, 21, 28, 30)  # and every task end


# --- resuming -----------------------------------------------------------------------------------------------


def small_vision_datasets() -> list[ImageDataset]:
    generator = torch.Generator().manual_seed(0)

    def dataset(name: str, shape: tuple[int, int, int], train: int, test: int) -> ImageDataset:
        return ImageDataset(
            name,
            torch.randint(0, 256, (train, *shape), dtype=torch.uint8, generator=generator),
            torch.randint(0, 10, (train,), generator=generator),
            torch.randint(0, 256, (test, *shape), dtype=torch.uint8, generator=generator),
            torch.randint(0, 10, (test,), generator=generator),
        )

    return [dataset("gray", (1, 28, 28), 50, 6), dataset("color", (3, 32, 32), 30, 4)]


@pytest.mark.parametrize("kind", ["discrete", "continuous", "vision", "joint", "vision_joint", "rotated",
                                  "custom_discrete", "custom_continuous"])
def test_resuming_reproduces_the_tail_of_a_full_run(permuted_mnist, kind):
    def make(seed: int):
        if kind == "custom_discrete":
            return DiscreteTasks(numbered_tasks([50, 30]), epochs_per_task=2, batch_size=16, seed=seed)
        if kind == "custom_continuous":
            return ContinuousTasks(numbered_tasks([50, 30]), iterations_per_task=8, batch_size=16, seed=seed)
        if kind == "discrete":
            return DiscretePermutedMNIST(
                permuted_mnist, epochs_per_task=2, batch_size=64, seed=seed, train_subset=300
            )
        if kind == "continuous":
            return ContinuousPermutedMNIST(permuted_mnist, iterations_per_task=8, batch_size=32, seed=seed)
        if kind == "vision":
            return VisionMix(small_vision_datasets(), epochs_per_task=2, batch_size=16, seed=seed)
        if kind == "vision_joint":
            return JointStream(VisionMix(small_vision_datasets(), epochs_per_task=2, batch_size=16), seed=seed)
        if kind == "rotated":
            return RotatedMNIST(PermutedMNIST(num_tasks=1), num_tasks=2, iterations_per_task=4, batch_size=16,
                                seed=seed)
        scenario = DiscretePermutedMNIST(permuted_mnist, epochs_per_task=2, batch_size=64, train_subset=100)
        return JointStream(scenario, seed=seed)

    stream = make(seed=1)
    torch.manual_seed(0)
    full = list(stream.batches())
    assert len(full) == stream.num_iterations
    torch.manual_seed(123)  # the global RNG state must not matter
    assert_same_batches(list(make(seed=1).batches()), full)
    for start in (1, stream.num_iterations // 2 + 1, stream.num_iterations - 1, stream.num_iterations):
        assert_same_batches(list(stream.batches(start)), full[start:])
    different = list(make(seed=2).batches())
    assert any(not torch.equal(a.y, b.y) for (_, a), (_, b) in zip(full, different, strict=True))
    with pytest.raises(ValueError, match="start_iteration"):
        next(stream.batches(stream.num_iterations + 1))


# --- split MNIST ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def split_mnist() -> SplitMNIST:
    return SplitMNIST(PermutedMNIST(num_tasks=1, pad_to_32=True), epochs_per_task=2, batch_size=1000, seed=3)


def test_split_mnist_tasks_are_digit_pairs_with_shared_binary_labels(split_mnist):
    mnist = load_mnist()
    digits = [mnist.train_labels[rows] for rows in split_mnist.train_rows]
    assert [sorted(d.unique().tolist()) for d in digits] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert split_mnist.train_sizes == tuple(int(((mnist.train_labels // 2) == t).sum()) for t in range(5))
    assert sum(split_mnist.train_sizes) == 60000 and split_mnist.num_classes == 2
    assert split_mnist.input_shape == (1024,) and not split_mnist.task_aware
    test_total = 0
    for task in range(5):
        x, y = split_mnist.test_set(task)
        rows = torch.nonzero(mnist.test_labels // 2 == task).flatten()
        torch.testing.assert_close(y, mnist.test_labels[rows] - 2 * task)  # "first or second digit of the pair"
        torch.testing.assert_close(x, split_mnist.images.test_set(0)[0][rows])  # padded, standardised, unpermuted
        test_total += len(y)
    assert test_total == 10000
    # a mixed-task batch: each row is its task's example, labelled within its pair
    tasks, indices = torch.tensor([0, 4, 2]), torch.tensor([5, 0, 17])
    batch = split_mnist.train_batch(tasks, indices)
    for k, (task, index) in enumerate(zip(tasks.tolist(), indices.tolist(), strict=True)):
        row = split_mnist.train_rows[task][index]
        assert batch.y[k] == mnist.train_labels[row] - 2 * task
        torch.testing.assert_close(batch.x[k], split_mnist.images.train_batch(torch.zeros(1, dtype=torch.int64),
                                                                               row.reshape(1)).x[0])


def test_split_mnist_stream_visits_each_pair_for_its_epochs_in_order(split_mnist, monkeypatch):
    calls = record_indices(monkeypatch, split_mnist)
    batches = list(split_mnist.batches())
    per_task = [2 * math.ceil(size / 1000) for size in split_mnist.train_sizes]
    assert split_mnist.eval_points == tuple(itertools.accumulate(per_task))
    tasks = [int(t.unique()) for t, _ in calls]
    assert tasks == [task for task, count in enumerate(per_task) for _ in range(count)]
    for task, count in enumerate(per_task):  # every example of the pair once per epoch
        start = sum(per_task[:task])
        first_epoch = torch.cat([indices for _, indices in calls[start : start + count // 2]])
        assert torch.equal(first_epoch.sort().values, torch.arange(split_mnist.train_sizes[task]))
    assert all(set(batch.y.tolist()) <= {0, 1} for _, batch in batches)
    with pytest.raises(ValueError, match="num_tasks"):
        SplitMNIST(PermutedMNIST(num_tasks=1), num_tasks=6)
    with pytest.raises(ValueError, match="num_tasks=1"):
        SplitMNIST(PermutedMNIST(num_tasks=2))


# --- rotated MNIST -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rotated_mnist() -> RotatedMNIST:
    return RotatedMNIST(PermutedMNIST(num_tasks=1, pad_to_32=True), num_tasks=4, iterations_per_task=5,
                        batch_size=8, max_angle=120.0, seed=2)


def test_rotated_mnist_angle_schedule_and_task_angles(rotated_mnist):
    assert rotated_mnist.num_iterations == 20 and rotated_mnist.eval_points == (5, 10, 15, 20)
    assert [rotated_mnist.angle(i) for i in (0, 1, 10, 19)] == [0.0, 6.0, 60.0, 114.0]
    assert [rotated_mnist.task_angle(t) for t in range(4)] == [15.0, 45.0, 75.0, 105.0]  # middles of the periods
    batches = list(rotated_mnist.batches())
    upright = rotated_mnist.images
    for iteration, batch in batches[::7]:
        indices = torch.randperm(60000, generator=base._generator(2, base._ITERATION_SAMPLE, iteration))[:8]
        assert torch.equal(batch.y, upright.train_labels[indices])
        assert torch.equal(batch.task, torch.full((8,), iteration // 5))
        x = upright.encode(upright.train_pixels[indices], 0)
        torch.testing.assert_close(batch.x, rotated_mnist.rotate(x, 6.0 * iteration))


def test_rotated_mnist_refuses_a_batch_larger_than_the_training_set(rotated_mnist):
    """It trained on the 60,000 images as a batch while the config recorded the batch size asked for."""
    with pytest.raises(ValueError, match="batch_size 60001 exceeds the 60000 training images"):
        RotatedMNIST(rotated_mnist.images, num_tasks=2, iterations_per_task=5, batch_size=60001)


def test_rotation_is_exact_at_right_angles_and_keeps_black_outside(rotated_mnist):
    x, _ = rotated_mnist.images.test_set(0)
    x = x[:5]
    images = x.reshape(5, 32, 32)
    torch.testing.assert_close(rotated_mnist.rotate(x, 0.0), x)
    torch.testing.assert_close(rotated_mnist.rotate(x, 360.0), x, atol=1e-5, rtol=0)
    # counter-clockwise as displayed (row 0 at the top): numpy/torch rot90
    torch.testing.assert_close(rotated_mnist.rotate(x, 90.0).reshape(5, 32, 32), torch.rot90(images, 1, (1, 2)),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(rotated_mnist.rotate(x, 180.0).reshape(5, 32, 32), images.flip(1, 2),
                               atol=1e-5, rtol=0)
    black = images[0, 0, 0]
    turned = rotated_mnist.rotate(x, 45.0).reshape(5, 32, 32)
    torch.testing.assert_close(turned[:, 0, 0], black.expand(5))  # a corner that came from outside the image
    test_x, test_y = rotated_mnist.test_set(2)
    torch.testing.assert_close(test_x[:5], rotated_mnist.rotate(x, 75.0))
    assert torch.equal(test_y, rotated_mnist.images.test_labels)
    with pytest.raises(ValueError, match="max_angle"):
        RotatedMNIST(rotated_mnist.images, max_angle=0.0)


def test_rotated_joint_oracle_trains_on_every_task_angle(rotated_mnist, monkeypatch):
    calls = record_indices(monkeypatch, rotated_mnist)
    _, batch = next(iter(JointStream(rotated_mnist, seed=1).batches()))
    tasks, indices = calls[0]
    assert len(tasks.unique()) > 1  # the periods mixed in one batch
    upright = rotated_mnist.images
    x = upright.encode(upright.train_pixels[indices], 0)
    for k, task in enumerate(tasks.tolist()):  # each image turned by its task's test angle, 15 + 30 t degrees
        torch.testing.assert_close(batch.x[k], rotated_mnist.rotate(x[k : k + 1], 15.0 + 30.0 * task)[0])


# --- vision mix ---------------------------------------------------------------------------------------------


def test_vision_mix_converts_and_normalises_per_dataset():
    gray, color = small_vision_datasets()
    mix = VisionMix([gray, color], epochs_per_task=1, batch_size=16)
    assert mix.num_tasks == 2 and mix.task_aware and mix.num_classes == 10
    assert mix.input_shape == (3, 32, 32)
    assert mix.eval_points == (4, 6)  # ceil(50 / 16), then ceil(30 / 16) more
    for task, dataset in enumerate((gray, color)):
        count = len(dataset.train_labels)
        batch = mix.train_batch(torch.full((count,), task), torch.arange(count))
        assert batch.x.shape == (count, 3, 32, 32)
        torch.testing.assert_close(batch.x.mean(dim=(0, 2, 3)), torch.zeros(3), rtol=0, atol=1e-5)
        torch.testing.assert_close(
            batch.x.std(dim=(0, 2, 3), unbiased=False), torch.ones(3), rtol=0, atol=1e-5
        )
        assert torch.equal(batch.y, dataset.train_labels)
    gray_test, gray_labels = mix.test_set(0)
    assert torch.equal(gray_labels, gray.test_labels)
    assert torch.equal(gray_test[:, 0], gray_test[:, 1]) and torch.equal(gray_test[:, 0], gray_test[:, 2])
    # standardised with the training statistics over the padded images
    padded_train = torch.zeros(50, 32, 32, dtype=torch.float64)
    padded_train[:, 2:30, 2:30] = gray.train_images[:, 0].double()
    mean, std = padded_train.mean(), padded_train.std(unbiased=False)
    torch.testing.assert_close(gray_test[:, 0, 2:30, 2:30], ((gray.test_images[:, 0] - mean) / std).float())
    torch.testing.assert_close(gray_test[:, 0, 0, 0], torch.full((6,), float(-mean / std)))
    color_test, _ = mix.test_set(1)
    color_train = color.train_images.double()
    red_mean, red_std = color_train[:, 0].mean(), color_train[:, 0].std(unbiased=False)
    torch.testing.assert_close(color_test[:, 0], ((color.test_images[:, 0] - red_mean) / red_std).float())


def test_vision_mix_tasks_are_dataset_indices():
    mix = VisionMix(small_vision_datasets(), epochs_per_task=1, batch_size=16)
    tasks = [batch.task.unique().tolist() for _, batch in mix.batches()]
    assert tasks == [[0]] * 4 + [[1]] * 2


@pytest.mark.parametrize("kind", ["foovb", "sgd"])
def test_vision_mix_trains_a_multi_head_mlp(kind):
    """The vision mix is task-aware with one 10-way head per task: an MLP gets num_classes * num_heads outputs and
    each task trains and predicts through its own head."""
    mix = VisionMix(small_vision_datasets(), epochs_per_task=1, batch_size=16)
    model = make_model("mlp", mix.input_shape, mix.num_classes, num_heads=mix.num_tasks, hidden=(8,))
    assert model(torch.zeros(1, *mix.input_shape)).shape == (1, mix.num_classes * mix.num_tasks)
    extra = {"mc_samples": 2, "eval_samples": 2} if kind == "foovb" else {}
    learner = make_learner(kind, model, num_heads=mix.num_tasks, classes_per_head=mix.num_classes, **extra)
    for _, batch in mix.batches():
        task = int(batch.task[0])
        assert math.isfinite(learner.observe(batch.x, batch.y, task))
    for task in range(mix.num_tasks):
        x, _ = mix.test_set(task)
        probabilities = learner.predict(x, task).mean
        assert probabilities.shape == (len(x), mix.num_classes)
        torch.testing.assert_close(probabilities.sum(dim=1), torch.ones(len(x)))


def test_vision_mix_by_name_reports_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="train_32x32.mat"):
        VisionMix(("svhn",), data_dir=tmp_path)


# --- joint oracle -------------------------------------------------------------------------------------------


def test_joint_stream_mixes_all_tasks_once_per_epoch(permuted_mnist, monkeypatch):
    scenario = DiscretePermutedMNIST(permuted_mnist, epochs_per_task=2, batch_size=50, train_subset=200)
    joint = JointStream(scenario, seed=4)
    assert joint.num_iterations == scenario.num_iterations == 24
    assert joint.eval_points == scenario.eval_points and joint.batches_per_epoch == 12
    calls = record_indices(monkeypatch, joint)
    batches = list(joint.batches())
    assert len(batches) == 24
    first_epoch = {
        (task, index)
        for tasks, indices in calls[:12]
        for task, index in zip(tasks.tolist(), indices.tolist(), strict=True)
    }
    assert first_epoch == {(task, index) for task in range(3) for index in range(200)}
    assert len(batches[0][1].task.unique()) == 3
    for (tasks, indices), (_, batch) in zip(calls, batches, strict=True):
        assert torch.equal(batch.x, permuted_mnist.train_batch(tasks, indices).x)


def test_task_aware_joint_stream_keeps_each_batch_to_one_task_and_mixes_the_tasks(monkeypatch):
    mix = VisionMix(small_vision_datasets(), epochs_per_task=2, batch_size=16)  # 50 and 30 training images
    joint = JointStream(mix, seed=2)
    assert joint.task_aware and joint.batches_per_epoch == 4 + 2
    assert joint.num_iterations == mix.num_iterations == 12
    calls = record_indices(monkeypatch, joint)
    batches = list(joint.batches())
    assert all(len(batch.task.unique()) == 1 for _, batch in batches)
    for epoch in range(2):
        epoch_calls = calls[6 * epoch : 6 * (epoch + 1)]
        seen = [(int(tasks[0]), index) for tasks, indices in epoch_calls for index in indices.tolist()]
        assert sorted(seen) == [(0, index) for index in range(50)] + [(1, index) for index in range(30)]
        order = [int(tasks[0]) for tasks, _ in epoch_calls]
        assert order != sorted(order)  # the tasks' batches are interleaved, not one task after the other
    assert [indices.tolist() for _, indices in calls[:6]] != [indices.tolist() for _, indices in calls[6:]]


def test_normalization_none_feeds_unit_pixels(permuted_mnist):
    plain = PermutedMNIST(num_tasks=2, seed=0, normalization="none")
    x, _ = plain.test_set(1)
    expected = load_mnist().test_images.reshape(10000, 784).float() / 255
    torch.testing.assert_close(x, expected[:, plain.permutations[1]])
    with pytest.raises(ValueError, match="normalization"):
        PermutedMNIST(num_tasks=2, normalization="zscore")


# --- your own tasks (the custom scenario) ------------------------------------------------------------------------


def numbered_datasets(sizes: Sequence[int], test_size: int = 4) -> list[tuple[TensorDataset, TensorDataset]]:
    """Tasks whose training example ``k`` of task ``t`` has inputs ``(t, k)`` (test examples: ``(t, -1 - k)``)
    and label ``2t + k % 2``: a batch says which examples it holds."""
    def dataset(task: int, indices: torch.Tensor) -> TensorDataset:
        inputs = torch.stack([torch.full_like(indices, task), indices], 1).float()
        return TensorDataset(inputs, 2 * task + indices.abs() % 2)

    return [(dataset(task, torch.arange(size)), dataset(task, -1 - torch.arange(test_size)))
            for task, size in enumerate(sizes)]


def numbered_tasks(sizes: Sequence[int]) -> InMemoryTasks:
    return InMemoryTasks.from_datasets(numbered_datasets(sizes))


class _ListDataset(Dataset):
    """A map-style Dataset over a list of examples, as they are."""

    def __init__(self, examples: list) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int):
        return self.examples[index]


def test_in_memory_tasks_read_datasets_and_infer_the_input_shape_and_classes():
    image = np.arange(6, dtype=np.uint8).reshape(1, 2, 3)  # arrays and integer labels of several kinds
    train = _ListDataset([(image, 0), (torch.ones(1, 2, 3), np.int64(4)), (image.tolist(), torch.tensor(2))])
    test = _ListDataset([(image, np.array(1))])
    tasks = InMemoryTasks.from_datasets([(train, test)])
    assert (tasks.num_tasks, tasks.input_shape, tasks.num_classes, tasks.train_sizes) == (1, (1, 2, 3), 5, (3,))
    x, y = tasks.test_set(0)
    assert x.dtype == torch.float32 and torch.equal(x[0], torch.from_numpy(image).float())
    assert y.tolist() == [1]
    batch = tasks.train_batch(torch.tensor([0, 0]), torch.tensor([2, 1]))
    assert batch.y.tolist() == [2, 4] and torch.equal(batch.x[1], torch.ones(1, 2, 3))
    assert InMemoryTasks.from_datasets([(train, test)], num_classes=7).num_classes == 7
    subset = InMemoryTasks.from_datasets(numbered_datasets([10, 6]), train_subset=5)
    assert subset.train_sizes == (5, 5) and subset.num_classes == 4
    assert subset.digest() == InMemoryTasks.from_datasets(numbered_datasets([10, 6]), train_subset=5).digest()
    assert subset.digest() != InMemoryTasks.from_datasets(numbered_datasets([10, 6]), train_subset=4).digest()


class _Stream(IterableDataset):
    def __iter__(self):
        yield torch.zeros(2), 0


@pytest.mark.parametrize(("tasks", "options", "message"), [
    (42, {}, r"expected a list of tasks, each a \(train, test\) pair of torch Datasets, got int"),
    ([], {}, "got an empty list"),
    ([numbered_datasets([3])[0][0]], {}, r"task 0: expected a \(train, test\) pair, got TensorDataset"),
    ([(torch.zeros(3, 2), torch.zeros(3, 2))], {}, "task 0's training set: expected a map-style torch Dataset .*got "
                                                    "Tensor"),
    ([(_Stream(), _Stream())], {}, "task 0's training set: .*got an IterableDataset, which cannot be indexed"),
    ([(_ListDataset([torch.zeros(2)]), _ListDataset([]))], {},
     r"task 0's training set, example 0: expected an \(x, y\) pair, got a Tensor"),
    ([(_ListDataset([(torch.zeros(2), 0, 0)]), _ListDataset([]))], {},  # a tuple of 3 is said so
     r"task 0's training set, example 0: expected an \(x, y\) pair, got a tuple of 3"),
    ([(TensorDataset(torch.tensor([[0.0, 1.0], [float("nan"), 0.0]]), torch.zeros(2, dtype=torch.long)),) * 2], {},
     r"task 0's training set: non-finite inputs \(NaN or inf\) in 1 example\(s\), the first example 1"),
    ([(_ListDataset([(torch.zeros(2), 0.5)]), _ListDataset([]))], {},
     "example 0: the label is 0.5, expected an integer class index >= 0"),
    ([(_ListDataset([(torch.zeros(2), torch.tensor(-1))]), _ListDataset([]))], {}, "the label is tensor\\(-1\\)"),
    ([(_ListDataset([(torch.zeros(2), 0), (torch.zeros(3), 1)]), _ListDataset([]))], {},
     r"example 1: x has shape \(3,\), example 0 \(2,\); every example's x must have one shape"),
    ([(_ListDataset([("a picture", 0)]), _ListDataset([]))], {}, "example 0: x is a str, not convertible"),
    ([(_ListDataset([(torch.zeros(2), 0)]), _ListDataset([]))], {}, "task 0's test set is empty"),
    ([*numbered_datasets([3]), (TensorDataset(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long)),) * 2], {},
     r"task 1's training set: inputs of shape \(5,\), but task 0's training inputs have shape \(2,\)"),
    (numbered_datasets([3]), {"train_subset": 4}, r"task 0's training set has 3 examples, fewer than train_subset"),
    (numbered_datasets([3]), {"num_classes": 1}, "num_classes is 1, but the labels go up to 1"),
])
def test_in_memory_tasks_refuse_what_is_not_a_stream_of_tasks_naming_it(tasks, options, message):
    with pytest.raises(ValueError, match=message):
        InMemoryTasks.from_datasets(tasks, **options)


def test_a_dataset_that_fails_is_named_with_the_example():
    class Broken(_ListDataset):
        def __getitem__(self, index: int):
            raise OSError(f"cannot read file {index}")

    with pytest.raises(ValueError, match="task 0's training set, example 0: reading it raised OSError: cannot read"):
        InMemoryTasks.from_datasets([(Broken([None]), Broken([None]))])


def test_discrete_tasks_train_each_task_for_its_epochs_in_order(monkeypatch):
    stream = DiscreteTasks(numbered_tasks([10, 6]), epochs_per_task=2, batch_size=4, seed=3)
    assert (stream.num_tasks, stream.task_aware, stream.input_shape, stream.num_classes) == (2, False, (2,), 4)
    assert stream.eval_points == (6, 10)  # 3 then 2 batches per epoch, 2 epochs each
    batches = [batch for _, batch in stream.batches()]
    seen = [batch.x[:, 1].long() for batch in batches]  # the inputs hold each example's index
    for task, (first, last, size) in enumerate([(0, 3, 10), (3, 6, 10), (6, 8, 6), (8, 10, 6)]):
        epoch = torch.cat(seen[first:last])
        assert sorted(epoch.tolist()) == list(range(size))  # every example of the task once per epoch
        assert all((batch.x[:, 0] == task // 2).all() and (batch.task == task // 2).all()
                   for batch in batches[first:last])
    assert not torch.equal(torch.cat(seen[0:3]), torch.cat(seen[3:6]))  # reshuffled every epoch
    for batch in batches:
        assert torch.equal(batch.y, 2 * batch.task + batch.x[:, 1].long() % 2)
    x, y = stream.test_set(1)
    assert x[:, 0].eq(1).all() and y.tolist() == [3, 2, 3, 2]


def test_continuous_tasks_mix_on_the_continuous_schedule_drawing_from_each_task():
    tasks = numbered_tasks([40, 12, 20])
    stream = ContinuousTasks(tasks, iterations_per_task=30, batch_size=12, seed=1, eval_every=20)
    reference = ContinuousPermutedMNIST.__new__(ContinuousPermutedMNIST)  # the schedule, without loading MNIST
    reference.num_tasks, reference.iterations_per_task = 3, 30
    iterations = torch.arange(stream.num_iterations)
    assert torch.equal(stream.task_probabilities(iterations), reference.task_probabilities(iterations))
    assert stream.eval_points == (20, 30, 40, 60, 80, 90)
    counts = torch.zeros(stream.num_iterations, 3)
    for iteration, batch in stream.batches():
        assert len(batch.y) == 12
        counts[iteration] = torch.bincount(batch.task, minlength=3)
        for task in batch.task.unique().tolist():
            rows = batch.task == task
            indices = batch.x[rows, 1].long()
            assert (batch.x[rows, 0] == task).all() and len(indices.unique()) == len(indices)
            assert int(indices.max()) < tasks.train_sizes[task]  # drawn from the task's own training set
    probabilities = stream.task_probabilities(iterations)
    assert not ((counts > 0) & (probabilities == 0)).any()
    assert ((counts > 0).sum(1) == 2).any()  # mixing happens
    with pytest.raises(ValueError, match="batch_size 13 exceeds the 12 training examples of a task"):
        ContinuousTasks(tasks, iterations_per_task=30, batch_size=13)
    # one after another too: an epoch was silently one batch of the whole task (a helper's trial, session 50)
    with pytest.raises(ValueError, match=r"batch_size 13 exceeds the 12 training examples of a task \(an epoch would "
                                         r"be one batch of the whole task\): pass at most 12"):
        DiscreteTasks(tasks, epochs_per_task=1, batch_size=13)
    assert DiscreteTasks(tasks, epochs_per_task=1, batch_size=12).batches_per_epoch == (4, 1, 2)  # 40, 12, 20
