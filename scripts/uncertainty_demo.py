"""Uncertainty you can use: out-of-distribution scores and a drift alarm from a FOO-VB posterior.

Trains `FOOVB(model)` (the default: matrix-variate layers, K = 10) and Adam (lr 1e-3) on the same MNIST batches, the
same 784-100-100-10 MLP from the same initialisation, then prints two markdown tables:

(a) Out-of-distribution detection: the AUROC of each per-input score at telling MNIST's test images (negatives) from
    an out-of-distribution set (positives: higher score = more likely out of distribution): MNIST with its pixels
    permuted, Fashion-MNIST's test images, uniform-noise images and MNIST's digits flipped upside down. The scores:
    FOO-VB's predictive entropy H(p̄) and mutual information H(p̄) − mean_k H(p_k) (`foovb.predict.uncertainty`,
    K sampled networks), its expected entropy and the softmax entropy of its posterior-mean network, and the
    softmax entropy of the Adam network. AUROC = P(score_out > score_in) + P(equal) / 2, the Mann-Whitney U
    statistic over n_in n_out, from the scores' average ranks.
(b) A drift alarm on a stream without task labels: after training on MNIST, each learner sees N MNIST batches
    (held-out images), then M batches of a second task (permuted MNIST, or Fashion-MNIST with the same 10 outputs).
    The statistic is the running mean of the batches' mean scores over the last `window` batches (1: the batch
    alone); the alarm fires when it is above mean + 3 std of the same statistic on held-out MNIST batches of the
    same size (scored right after training). Two ways: a deployed model that only scores the stream, and a learner
    that scores each batch, then trains on it (a fresh copy of the trained learner per stream). Reported over
    several stream orders per training seed: the false alarms among the N batches before the switch, the delay (the
    number of second-task batches seen before the first alarm; 0: the first one raised it) and the fraction of
    second-task batches that raise it.

    python scripts/uncertainty_demo.py [--epochs 2] [--seeds 0 1 2] [--stream-batch 4] [--windows 1 4]
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from foovb import FOOVB
from foovb.predict import predict, uncertainty, uncertainty_from_samples
from foovb_suite.data import MNIST_MEAN, MNIST_STD, load_dataset, load_mnist

NUM_SAMPLES = 10  # sampled networks per uncertainty score
TRAIN_ROWS = 50_000  # MNIST training images 0..49,999 train; the rest are held out for the drift alarm
CALIBRATION_ROWS = range(50_000, 55_000)  # the alarm's threshold is set on these
STREAM_ROWS = range(55_000, 60_000)  # the stream's MNIST batches (and, permuted, its permuted-MNIST batches)
THRESHOLD_STDS = 3.0

ScoreFn = Callable[[Tensor], dict[str, Tensor]]


def normalized(images: Tensor) -> Tensor:
    """uint8 (N, 28, 28) or (N, 1, 28, 28) images as the MLP's inputs: (x / 255 − MNIST mean) / MNIST std, flat."""
    return ((images.float() / 255 - MNIST_MEAN) / MNIST_STD).flatten(1)


def make_mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10))


def softmax_entropy(model: nn.Module, inputs: Tensor) -> Tensor:
    """H(softmax(f(x))) per input: the K = 1 case of `uncertainty_from_samples`."""
    with torch.no_grad():
        return uncertainty_from_samples(torch.softmax(model(inputs), -1)[None]).predictive_entropy


def accuracy(model: nn.Module, inputs: Tensor, labels: Tensor) -> float:
    with torch.no_grad():
        return (model(inputs).argmax(1) == labels).float().mean().item()


class FooVBLearner:
    """`FOOVB(model)` with its defaults; its scores come from K sampled networks and its posterior-mean network."""

    def __init__(self, model: nn.Module, seed: int):
        self.seed = seed
        self.optimizer = FOOVB(model, seed=seed)

    def copy(self) -> FooVBLearner:
        """An independent learner in this one's state (FOOVB's state_dict copies its tensors; a deepcopy of a torch
        optimizer keeps only its param groups and state)."""
        twin = FooVBLearner(copy.deepcopy(self.optimizer.model), self.seed)
        twin.optimizer.load_state_dict(self.optimizer.state_dict())
        return twin

    def train_on(self, inputs: Tensor, labels: Tensor) -> None:
        self.optimizer.step_batched(inputs, labels, F.cross_entropy)

    def scores(self, inputs: Tensor) -> dict[str, Tensor]:
        result = uncertainty(self.optimizer, inputs, NUM_SAMPLES)
        return {"FOO-VB predictive entropy": result.predictive_entropy,
                "FOO-VB mutual information": result.mutual_information,
                "FOO-VB expected entropy": result.expected_entropy,
                "FOO-VB posterior-mean softmax entropy": softmax_entropy(self.optimizer.model, inputs)}

    def point_accuracy(self, inputs: Tensor, labels: Tensor) -> float:
        """The accuracy of the posterior-mean network."""
        return accuracy(self.optimizer.model, inputs, labels)

    def describe_accuracy(self, inputs: Tensor, labels: Tensor) -> str:
        model_average = predict(self.optimizer, inputs, NUM_SAMPLES).samples.mean(0)
        model_average_accuracy = (model_average.argmax(1) == labels).float().mean().item()
        return f"posterior mean {100 * self.point_accuracy(inputs, labels):.2f}%, model average (K = {NUM_SAMPLES}) " \
               f"{100 * model_average_accuracy:.2f}%"


class AdamLearner:
    """torch.optim.Adam at lr 1e-3 on the mean cross-entropy; its score is the softmax entropy."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def copy(self) -> AdamLearner:
        """An independent learner in this one's state."""
        twin = AdamLearner(copy.deepcopy(self.model))
        twin.optimizer.load_state_dict(copy.deepcopy(self.optimizer.state_dict()))  # torch would share the moments
        return twin

    def train_on(self, inputs: Tensor, labels: Tensor) -> None:
        self.optimizer.zero_grad()
        F.cross_entropy(self.model(inputs), labels).backward()
        self.optimizer.step()

    def scores(self, inputs: Tensor) -> dict[str, Tensor]:
        return {"Adam softmax entropy": softmax_entropy(self.model, inputs)}

    def point_accuracy(self, inputs: Tensor, labels: Tensor) -> float:
        return accuracy(self.model, inputs, labels)

    def describe_accuracy(self, inputs: Tensor, labels: Tensor) -> str:
        return f"{100 * self.point_accuracy(inputs, labels):.2f}%"


Learner = FooVBLearner | AdamLearner


def auroc(in_distribution: Tensor, out_of_distribution: Tensor) -> float:
    """Area under the ROC curve of telling OOD (positive) from in-distribution inputs by a score, higher = OOD:
    U / (n_in n_out) with the Mann-Whitney U = R_out − n_out (n_out + 1) / 2, R_out the sum of the OOD scores' ranks
    among all scores (tied scores share their average rank, so a tie counts 1/2)."""
    scores = torch.cat([in_distribution, out_of_distribution]).double()
    order = scores.argsort()
    _, group, group_sizes = torch.unique_consecutive(scores[order], return_inverse=True, return_counts=True)
    group_average_rank = group_sizes.cumsum(0) - (group_sizes - 1) / 2  # 1-based ranks
    ranks = torch.empty_like(scores)
    ranks[order] = group_average_rank[group].double()
    n_in, n_out = len(in_distribution), len(out_of_distribution)
    return ((ranks[n_in:].sum() - n_out * (n_out + 1) / 2) / (n_in * n_out)).item()


def batches(inputs: Tensor, labels: Tensor, batch_size: int, generator: torch.Generator) -> list[tuple[Tensor, Tensor]]:
    """The rows in a random order, cut into full batches."""
    order = torch.randperm(len(inputs), generator=generator)
    return [(inputs[rows], labels[rows]) for rows in order.split(batch_size) if len(rows) == batch_size]


def score_in_batches(score_fn: ScoreFn, inputs: Tensor, batch_size: int = 2_000) -> dict[str, Tensor]:
    parts = [score_fn(chunk) for chunk in inputs.split(batch_size)]
    return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}


@dataclass(frozen=True)
class Data:
    """MNIST split for training, OOD testing and the drift streams, and the OOD sets, all as the MLP's inputs."""

    train: tuple[Tensor, Tensor]
    test: tuple[Tensor, Tensor]
    out_of_distribution: dict[str, Tensor]
    calibration: Tensor
    stream_task1: tuple[Tensor, Tensor]
    second_tasks: dict[str, tuple[Tensor, Tensor]]


def load_data(data_dir: str) -> Data:
    """Fixed permutations and noise (seeds 1-3), whatever the training seed."""
    mnist = load_mnist()
    fashion = load_dataset("fashion_mnist", data_dir)
    inputs, labels = normalized(mnist.train_images), mnist.train_labels
    test_inputs = normalized(mnist.test_images)
    stream_task1 = (inputs[STREAM_ROWS.start:STREAM_ROWS.stop], labels[STREAM_ROWS.start:STREAM_ROWS.stop])
    ood_permutation = torch.randperm(784, generator=torch.Generator().manual_seed(1))
    noise = torch.randint(0, 256, (10_000, 28, 28), generator=torch.Generator().manual_seed(2))
    stream_permutation = torch.randperm(784, generator=torch.Generator().manual_seed(3))
    return Data(
        train=(inputs[:TRAIN_ROWS], labels[:TRAIN_ROWS]),
        test=(test_inputs, mnist.test_labels),
        out_of_distribution={"permuted MNIST": test_inputs[:, ood_permutation],
                             "Fashion-MNIST": normalized(fashion.test_images),
                             "uniform noise": normalized(noise),
                             "MNIST flipped upside down": normalized(mnist.test_images.flip(-2))},
        calibration=inputs[CALIBRATION_ROWS.start:CALIBRATION_ROWS.stop],
        stream_task1=stream_task1,
        second_tasks={"permuted MNIST": (stream_task1[0][:, stream_permutation], stream_task1[1]),
                      "Fashion-MNIST": (normalized(fashion.train_images[:len(STREAM_ROWS)]),
                                        fashion.train_labels[:len(STREAM_ROWS)])},
    )


@dataclass
class AlarmResult:
    """The drift alarm of one score over several streams."""

    false_alarms: int = 0  # pre-switch batches whose statistic is above the threshold, over all streams
    pre_switch_batches: int = 0  # those that could raise it (a full window), over all streams
    alarmed_after_switch: int = 0  # second-task batches whose statistic is above the threshold, over all streams
    post_switch_batches: int = 0
    delays: list[int | None] = field(default_factory=list)  # per stream: task-2 batches before the first alarm

    def add(self, other: AlarmResult) -> None:
        self.false_alarms += other.false_alarms
        self.pre_switch_batches += other.pre_switch_batches
        self.alarmed_after_switch += other.alarmed_after_switch
        self.post_switch_batches += other.post_switch_batches
        self.delays += other.delays

    def delay_summary(self) -> str:
        """Median (min-max) of the delays, and how many streams never raised the alarm."""
        detected = sorted(delay for delay in self.delays if delay is not None)
        missed = len(self.delays) - len(detected)
        if not detected:
            return "never"
        summary = f"{detected[len(detected) // 2]} ({detected[0]}-{detected[-1]})"
        return summary + (f", missed {missed} of {len(self.delays)}" if missed else "")


def running_mean(batch_scores: Tensor, window: int) -> Tensor:
    """(..., B − window + 1): the mean of each `window` consecutive batch scores along the last dimension."""
    return batch_scores.unfold(-1, window, 1).mean(-1)


def stream_scores(trained: Learner, data: Data, stream_task2: tuple[Tensor, Tensor], stream_batch: int,
                  learning: bool, args: argparse.Namespace) -> tuple[dict[str, Tensor], list[float]]:
    """The mean score of every batch of `args.streams` streams (N task-1 batches then M task-2 batches), per score
    ``(streams, N + M)``. `learning`: a fresh copy of the trained learner trains on each batch after scoring it,
    and the MNIST test accuracy it has after the N task-1 batches is returned per stream; else the trained learner
    only scores (a deployed model)."""
    traces: list[dict[str, list[float]]] = []  # per stream: score -> batch scores
    accuracies_at_switch = []
    for stream_seed in range(args.streams):
        generator = torch.Generator().manual_seed(stream_seed)
        before = batches(*data.stream_task1, stream_batch, generator)[:args.pre_switch]
        after = batches(*stream_task2, stream_batch, generator)[:args.post_switch]
        learner = trained.copy() if learning else trained
        trace: dict[str, list[float]] = {}
        for index, (inputs, labels) in enumerate(before + after):
            if learning and index == len(before):
                accuracies_at_switch.append(learner.point_accuracy(*data.test))
            for name, scores in learner.scores(inputs).items():
                trace.setdefault(name, []).append(scores.mean().item())
            if learning:
                learner.train_on(inputs, labels)
        traces.append(trace)
    return {name: torch.tensor([trace[name] for trace in traces]) for name in traces[0]}, accuracies_at_switch


def drift_alarm(calibration_scores: Tensor, batch_scores: Tensor, stream_batch: int, window: int,
                pre_switch: int) -> AlarmResult:
    """The alarm on the running mean of `window` batch scores: its threshold is mean + 3 std of that statistic on
    the held-out images' per-input scores `calibration_scores`, cut into consecutive batches of `stream_batch`;
    `batch_scores` ``(streams, N + M)`` are the streams' batch scores, the switch after the first N."""
    usable = len(calibration_scores) // stream_batch * stream_batch
    calibration = running_mean(calibration_scores[:usable].reshape(-1, stream_batch).mean(1), window)
    threshold = calibration.mean() + THRESHOLD_STDS * calibration.std()
    alarms = running_mean(batch_scores, window) > threshold  # entry i: the window ending at batch i + window − 1
    first_after_switch = pre_switch - window + 1
    before, after = alarms[:, :first_after_switch], alarms[:, first_after_switch:]
    delays = [int(row.nonzero()[0]) if bool(row.any()) else None for row in after]
    return AlarmResult(int(before.sum()), before.numel(), int(after.sum()), after.numel(), delays)


def train(data: Data, seed: int, args: argparse.Namespace) -> tuple[dict[str, Learner], int]:
    """Both learners on the same batches from the same initialisation; returns them and the number of steps."""
    learners: dict[str, Learner] = {"FOO-VB": FooVBLearner(make_mlp(seed), seed=seed),
                                    "Adam": AdamLearner(make_mlp(seed))}
    generator = torch.Generator().manual_seed(seed)
    steps = 0
    for _ in range(args.epochs):
        for inputs, labels in batches(*data.train, args.batch, generator):
            for learner in learners.values():
                learner.train_on(inputs, labels)
            steps += 1
    return learners, steps


def spread(values: list[float], digits: int = 3) -> str:
    """"mean (min-max)" of several values, the value alone of one."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{sum(values) / len(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2, help="passes over MNIST's first 50,000 training images")
    parser.add_argument("--batch", type=int, default=128, help="training batch size")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds")
    parser.add_argument("--stream-batch", type=int, default=4, help="images per batch of the drift streams")
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 4],
                        help="batches in the alarm's running mean (1: each batch alone)")
    parser.add_argument("--pre-switch", type=int, default=100, help="N: MNIST batches before the switch")
    parser.add_argument("--post-switch", type=int, default=30, help="M: second-task batches after it")
    parser.add_argument("--streams", type=int, default=5, help="stream orders per training seed")
    parser.add_argument("--data-dir", default="../shared/data", help="the folder holding fashion-mnist/")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if max(args.windows) > args.pre_switch:
        parser.error("a window must be at most --pre-switch batches")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    data = load_data(args.data_dir)

    aurocs: dict[str, dict[str, list[float]]] = {}  # score -> OOD set -> one AUROC per seed
    alarms: dict[tuple[int, bool, str, str], AlarmResult] = {}  # (window, learning, task, score) -> result
    accuracies_at_switch: dict[str, list[float]] = {}  # learner -> MNIST test accuracy after N stream batches
    for seed in args.seeds:
        seed_start = time.perf_counter()
        learners, steps = train(data, seed, args)
        print(f"Seed {seed}: {steps} steps ({args.epochs} passes over {TRAIN_ROWS:,} MNIST images, batch "
              f"{args.batch}) in {time.perf_counter() - seed_start:.0f} s, both learners; MNIST test accuracy: "
              + "; ".join(f"{name} {learner.describe_accuracy(*data.test)}" for name, learner in learners.items())
              + ".")
        for name, learner in learners.items():
            in_scores = score_in_batches(learner.scores, data.test[0])
            for ood_name, ood_inputs in data.out_of_distribution.items():
                for score, values in score_in_batches(learner.scores, ood_inputs).items():
                    aurocs.setdefault(score, {}).setdefault(ood_name, []).append(auroc(in_scores[score], values))
            calibration_scores = score_in_batches(learner.scores, data.calibration)
            for learning in (False, True):
                for task, stream_task2 in data.second_tasks.items():
                    traces, accuracies = stream_scores(learner, data, stream_task2, args.stream_batch, learning, args)
                    if task == next(iter(data.second_tasks)):  # the same N task-1 batches before every task
                        accuracies_at_switch.setdefault(name, []).extend(accuracies)
                    for score, batch_scores in traces.items():
                        for window in args.windows:
                            result = drift_alarm(calibration_scores[score], batch_scores, args.stream_batch, window,
                                                 args.pre_switch)
                            alarms.setdefault((window, learning, task, score), AlarmResult()).add(result)

    print(f"\n(a) OOD detection: AUROC against MNIST's 10,000 test images (K = {NUM_SAMPLES} sampled networks; "
          f"1 = perfect, 0.5 = chance), mean (min-max) over training seeds {args.seeds}\n")
    print("| score | " + " | ".join(data.out_of_distribution) + " |")
    print("|---|" + "---|" * len(data.out_of_distribution))
    for score, per_set in aurocs.items():
        print(f"| {score} | " + " | ".join(spread(per_set[name]) for name in data.out_of_distribution) + " |")

    tasks = list(data.second_tasks)
    print(f"\n(b) Drift alarm: {args.streams} streams per training seed of {args.pre_switch} MNIST batches then "
          f"{args.post_switch} batches of the second task, {args.stream_batch} images each. The statistic: the running "
          f"mean of the batches' mean score over the last `window` batches; the alarm: the statistic above mean + "
          f"{THRESHOLD_STDS:g} std of it on held-out MNIST ({len(CALIBRATION_ROWS):,} images). False alarms: over the "
          "pre-switch batches (the same before either task); delay: second-task batches before the first alarm, "
          "median (min-max) over the streams; alarmed: the fraction of second-task batches above the threshold. "
          "Learning: each batch scored, then trained on.\n")
    print("| window | learning | score | false alarms | " + " | ".join(
        f"{task}: delay | {task}: alarmed" for task in tasks) + " |")
    print("|---|---|---|---|" + "---|---|" * len(tasks))
    for window in args.windows:
        for learning in (False, True):
            for score in aurocs:
                results = [alarms[(window, learning, task, score)] for task in tasks]
                cells = [f"{results[0].false_alarms} of {results[0].pre_switch_batches}"]  # the same before each task
                for result in results:
                    cells += [result.delay_summary(), f"{result.alarmed_after_switch / result.post_switch_batches:.2f}"]
                print(f"| {window} | {'yes' if learning else 'no'} | {score} | " + " | ".join(cells) + " |")
    print(f"\nMNIST test accuracy after the {args.pre_switch} pre-switch batches (learning), mean (min-max) over "
          "streams and seeds: " + "; ".join(f"{name} {spread([100 * a for a in values], digits=2)}%"
                                            for name, values in accuracies_at_switch.items()) + ".")
    print(f"\nTotal {time.perf_counter() - start:.0f} s, {args.threads} thread(s), torch {torch.__version__}.")


if __name__ == "__main__":
    main()
