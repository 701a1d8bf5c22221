"""The diagonal step(closure) against its floor, the bare sequential K-sample loop, alternating (issue 59, item 3).

`FOOVB(model, "diagonal")` (the default preset: antithetic pairs, K = 10) steps the paper's 784-100-100-10 MLP on
a real MNIST batch of 128 through `step(closure)`, a summed cross-entropy; the floor is `closure_path.py`'s bare
loop on the same network and batch: K forward/backward passes, one `torch.randn` per antithetic pair and tensor,
each sample written into the parameters and its gradient summed in place, a trivial update (what any diagonal
K-sample step on torch's CPU generator pays). The two alternate in one process, `--steps` steps per timing, so
that a busy host slows both alike; prints every pair, the medians and the median of the per-pair ratios.

    python benchmarks/closure_floor.py [--repeats 9] [--steps 20] [--threads 1] [--settings '{"secant_check": true}']

`--settings`: FOOVB keyword arguments (JSON) for the timed optimizer, against the same floor (e.g. what an option
costs: `secant_check` adds one forward and backward per step, K + 1 passes against the floor's K).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from closure_path import bare_diagonal_loop
from step_time import mlp

from foovb import FOOVB
from foovb_suite.data import MNIST_MEAN, MNIST_STD, load_mnist


def steps_ms(step: Callable[[], object], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) * 1000 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9, help="alternating pairs of timings")
    parser.add_argument("--steps", type=int, default=20, help="steps per timing")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--k", type=int, default=10, help="Monte Carlo samples per step")
    parser.add_argument("--settings", default="{}", help="FOOVB keyword arguments (JSON) of the timed optimizer")
    args = parser.parse_args()
    settings = json.loads(args.settings)
    torch.set_num_threads(args.threads)
    mnist = load_mnist()
    x = ((mnist.train_images[:128].float() / 255 - MNIST_MEAN) / MNIST_STD).flatten(1)
    y = mnist.train_labels[:128]
    torch.manual_seed(0)
    model = mlp()
    optimizer = FOOVB(model, "diagonal", mc_samples=args.k, seed=0, **settings)

    def closure() -> torch.Tensor:
        loss = F.cross_entropy(model(x), y, reduction="sum")
        loss.backward()
        return loss

    def foovb_step() -> None:
        optimizer.step(closure)

    floor = bare_diagonal_loop(x, y, args.k)
    print(f"torch {torch.__version__}, CPU, {args.threads} thread(s); MLP 784-100-100-10, batch 128, K={args.k}; "
          f"{args.repeats} alternating timings of {args.steps} steps each; FOOVB settings {settings}\n")
    for step in (foovb_step, floor):  # warm-up
        steps_ms(step, 3)
    print(f"| pair | FOOVB(model, 'diagonal', **{settings}).step(closure) ms | bare sequential loop ms | ratio |")
    print("|---|---|---|---|")
    steps, floors = [], []
    for pair in range(args.repeats):
        steps.append(steps_ms(foovb_step, args.steps))
        floors.append(steps_ms(floor, args.steps))
        print(f"| {pair + 1} | {steps[-1]:.2f} | {floors[-1]:.2f} | {steps[-1] / floors[-1]:.3f} |")
    ratios = [s / f for s, f in zip(steps, floors, strict=True)]
    print(f"| median | {statistics.median(steps):.2f} | {statistics.median(floors):.2f} | "
          f"**{statistics.median(ratios):.3f}** |")


if __name__ == "__main__":
    main()
