"""What step_prior costs `FOOVB(model)`'s matrix-variate step over a stream, not one repeated batch: training time per
step of the discrete headline MLP (1024-100-100-10, 32 x 32 padded MNIST, batch 128, K = 10, step(closure)) on two
permuted-MNIST tasks, for

* `default`: `FOOVB(model, "kronecker")` (step_prior 16 on every layer but the output layer; the 1,025-wide input
  factor's eigendecomposition refreshed when the factor has moved by more than a tenth, `linalg.refreshed_factor_eigh`);
* `exact`: the same, every factor decomposed at every step (`linalg.WIDE_FACTOR` lifted);
* `narrow`: step_prior on layers of at most 511 inputs and outputs only (factors at most 512 wide: the default of
  sessions 45-46);
* `no_step_prior`: step_prior=1, secant_check=False (the default before session 45).

The settings take their steps in turns of `--chunk` steps each, so that a change in the machine's load falls on all of
them; a refresh happens mostly at a task's first steps, so the mean over the stream is the figure (a median of a few
steps is not). Prints, measured in this one run: ms per step (mean over the stream), the ratio to `no_step_prior` and
to `narrow`, and the share of the wide factor's steps that took a decomposition.

    python benchmarks/step_prior_cost.py [--steps-per-task 300] [--chunk 25] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from unittest import mock

import torch
import torch.nn.functional as F
from step_time import mlp

import foovb.calibration
import foovb.linalg
from foovb import FOOVB
from foovb_suite.data import MNIST_MEAN, MNIST_STD, load_mnist

SETTINGS = {"default": {}, "exact": {}, "narrow": {}, "no_step_prior": {"step_prior": 1, "secant_check": False}}
LIMITS = {"exact": (foovb.linalg, "WIDE_FACTOR", 10**9), "narrow": (foovb.calibration, "STEP_PRIOR_MAX_FEATURES", 511)}


class Learner:
    """One setting's model and optimizer, stepping through the same batches."""

    def __init__(self, name: str):
        torch.manual_seed(0)
        self.name, self.model = name, mlp((1024, 100, 100, 10))
        self.seconds, self.steps, self.decompositions = 0.0, 0, 0
        with self.patched():
            self.opt = FOOVB(self.model, "kronecker", seed=0, **SETTINGS[name])

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """This setting's library constant (if any) in place, and the wide factors' decompositions counted."""
        original_eigh = foovb.linalg.factor_eigh

        def counted(sqrt_cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.decompositions += len(sqrt_cov) > 512
            return original_eigh(sqrt_cov)

        with contextlib.ExitStack() as stack:
            if self.name in LIMITS:
                stack.enter_context(mock.patch.object(*LIMITS[self.name]))
            stack.enter_context(mock.patch.object(foovb.linalg, "factor_eigh", counted))
            yield

    def train(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        def one_step(x: torch.Tensor, y: torch.Tensor) -> None:
            def closure() -> torch.Tensor:
                loss = F.cross_entropy(self.model(x), y)
                loss.backward()
                return loss

            self.opt.step(closure)

        with self.patched():
            tic = time.perf_counter()
            for x, y in batches:
                one_step(x, y)
            self.seconds += time.perf_counter() - tic
        self.steps += len(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps-per-task", type=int, default=300)
    parser.add_argument("--chunk", type=int, default=25, help="steps each setting takes per turn")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    mnist = load_mnist()
    images = F.pad(mnist.train_images.float(), (2, 2, 2, 2))
    x_all = ((images / 255 - MNIST_MEAN) / MNIST_STD).flatten(1)
    generator = torch.Generator().manual_seed(0)
    permutations = [torch.arange(1024), torch.randperm(1024, generator=generator)]
    batches = []
    for permutation in permutations:
        order = torch.randperm(len(x_all), generator=generator)[: 128 * args.steps_per_task].view(-1, 128)
        batches += [(x_all[rows][:, permutation], mnist.train_labels[rows]) for rows in order]
    learners = [Learner(name) for name in SETTINGS]
    print(f"torch {torch.__version__}, CPU, {args.threads} thread(s); 1024-100-100-10, batch 128, K = 10, "
          f"step(closure); 2 permuted-MNIST tasks x {args.steps_per_task} steps, turns of {args.chunk} steps")
    for start in range(0, len(batches), args.chunk):
        for learner in learners:
            learner.train(batches[start:start + args.chunk])
    ms = {learner.name: 1e3 * learner.seconds / learner.steps for learner in learners}
    print("\n| setting | ms per step | / no_step_prior | / narrow | wide-factor decompositions per step |")
    print("|---|---|---|---|---|")
    for learner in learners:
        print(f"| {learner.name} | {ms[learner.name]:.1f} | {ms[learner.name] / ms['no_step_prior']:.2f}x | "
              f"{ms[learner.name] / ms['narrow']:.2f}x | {learner.decompositions / learner.steps:.3f} |")


if __name__ == "__main__":
    main()
