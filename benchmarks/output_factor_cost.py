"""What the output layer's diagonal output factor (`diagonal_output_factor`, on in `FOOVB(model)` since session 49)
costs or saves per step, against the full factor and the floor (the bare sequential K-sample loop of
`closure_path.py` on the same network, batch and loss), alternating in one process so that a busy host slows all
alike (in an order that flips every round); the ratios are the medians of each round's. Models: a 784-32-784 ReLU
autoencoder (summed squared error, batch 64: a 784 x 784 output factor) and the paper's 784-100-100-10 MLP (summed
cross-entropy, batch 128: a 10 x 10 one). Real MNIST images, K = 10.

    python benchmarks/output_factor_cost.py [--repeats 10] [--steps 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from closure_path import bare_diagonal_loop
from step_time import mlp
from torch import nn

from foovb import FOOVB
from foovb_suite.data import MNIST_MEAN, MNIST_STD, load_mnist


def steps_ms(step: Callable[[], object], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) * 1000 / steps


def squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs - targets).square().sum()


def summed_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets, reduction="sum")


def ratio(times: dict[object, list[float]], top: object, bottom: object) -> float:
    """The median of the rounds' ratios top / bottom (a round's load slows both alike)."""
    return statistics.median(t / b for t, b in zip(times[top], times[bottom], strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10, help="alternating rounds of timings")
    parser.add_argument("--steps", type=int, default=4, help="steps per timing")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    mnist = load_mnist()
    images = ((mnist.train_images[:128].float() / 255 - MNIST_MEAN) / MNIST_STD).flatten(1)
    cases = [("autoencoder 784-32-784, batch 64", lambda: nn.Sequential(nn.Linear(784, 32), nn.ReLU(),
                                                                         nn.Linear(32, 784)),
              images[:64], images[:64], squared_error),
             ("MLP 784-100-100-10, batch 128", mlp, images, mnist.train_labels[:128], summed_cross_entropy)]
    print(f"torch {torch.__version__}, CPU, {args.threads} thread(s), K = 10; {args.repeats} alternating rounds of "
          f"{args.steps} steps each; medians in ms, ratios: the medians of the rounds' ratios\n")
    print("| model | FOOVB(model) | diagonal_output_factor=False | floor | FOOVB(model) / floor | False / floor | "
          "False / FOOVB(model) |")
    print("|---|---|---|---|---|---|---|")
    for name, build, x, y, loss_fn in cases:
        steps = {}
        for diagonal in (True, False):
            torch.manual_seed(0)
            model = build()
            optimizer = FOOVB(model, seed=0, diagonal_output_factor=diagonal)

            def closure(model: nn.Module = model, x: torch.Tensor = x, y: torch.Tensor = y,
                        loss_fn: Callable = loss_fn) -> torch.Tensor:
                loss = loss_fn(model(x), y)
                loss.backward()
                return loss

            steps[diagonal] = lambda optimizer=optimizer, closure=closure: optimizer.step(closure)
        torch.manual_seed(0)
        steps["floor"] = bare_diagonal_loop(x, y, 10, build(), loss_fn)
        for step in steps.values():  # warm-up
            steps_ms(step, 2)
        times: dict[object, list[float]] = {key: [] for key in steps}
        for round_ in range(args.repeats):  # the order flips every round: the first of a round ran slower
            for key, step in list(steps.items())[:: 1 if round_ % 2 == 0 else -1]:
                times[key].append(steps_ms(step, args.steps))
        median = {key: statistics.median(values) for key, values in times.items()}
        print(f"| {name} | {median[True]:.1f} | {median[False]:.1f} | {median['floor']:.1f} | "
              f"{ratio(times, True, 'floor'):.2f} | {ratio(times, False, 'floor'):.2f} | "
              f"**{ratio(times, False, True):.2f}** |", flush=True)


if __name__ == "__main__":
    main()
