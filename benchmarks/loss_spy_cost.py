"""What reading the loss's scale from its autograd graph costs a default step (issue 58, "the loss scale").

`step(closure)` reads, on the first Monte Carlo sample of every step, how the closure's loss was reduced (a sum,
or a mean over how many rows: `foovb.reduction.LossSpy`, a TorchFunctionMode plus two global module hooks), so
that a mean loss is rescaled to the summed likelihood of the paper and a loss it cannot read is refused. This
script times the default `FOOVB(model)` step(closure) with the spy and with a stand-in that returns the scale
directly (what an explicit convention, "the loss is a mean over the batch's rows", would cost), alternating the
two in one process, on the paper's 784-100-100-10 MLP, batch 128, K = 10, a mean cross-entropy; both families.
Prints the medians and the ratio.

    python benchmarks/loss_spy_cost.py [--repeats 9] [--steps 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from unittest import mock

import torch
import torch.nn.functional as F
from step_time import mlp

import foovb.engine
from foovb import FOOVB
from foovb_suite.data import MNIST_MEAN, MNIST_STD, load_mnist


class GivenScale(contextlib.nullcontext):
    """LossSpy's interface with the scale given: the batch's rows, a mean loss."""

    rows = 128.0
    loss = None

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()

    def scale(self, declared: str, batch_size: int | None) -> float:
        return self.rows

    def reads_a_mean(self, declared: str, batch_size: int | None) -> bool:
        return True


def steps_ms(optimizer: FOOVB, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    def closure() -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step(closure)
    return (time.perf_counter() - start) * 1000 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=10, help="steps per timing")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    mnist = load_mnist()
    x = ((mnist.train_images[:128].float() / 255 - MNIST_MEAN) / MNIST_STD).flatten(1)
    y = mnist.train_labels[:128]
    print(f"torch {torch.__version__}, CPU, {args.threads} thread(s); MLP 784-100-100-10, batch 128, K=10, mean "
          f"cross-entropy; median of {args.repeats} alternating timings of {args.steps} steps each")
    print("\n| posterior | step(closure), loss read (ms) | scale given (ms) | read / given |")
    print("|---|---|---|---|")
    for posterior in ("auto", "diagonal"):
        torch.manual_seed(0)
        model = mlp()
        optimizer = FOOVB(model, posterior, seed=0)
        steps_ms(optimizer, model, x, y, 3)  # warm-up
        read, given = [], []
        for _ in range(args.repeats):
            read.append(steps_ms(optimizer, model, x, y, args.steps))
            with mock.patch.object(foovb.engine, "LossSpy", GivenScale):
                given.append(steps_ms(optimizer, model, x, y, args.steps))
        r, g = statistics.median(read), statistics.median(given)
        print(f"| {posterior} | {r:.2f} | {g:.2f} | {r / g:.3f} |")


if __name__ == "__main__":
    main()
