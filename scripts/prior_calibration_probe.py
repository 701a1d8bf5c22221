"""The robustness grid with a prior calibrated on the first batch: a hypothesis for issue 54 (session 41), not a
FOOVB feature.

Before the first step, every FOO-VB learner's prior variance is scaled down by one factor (for all blocks alike)
until the sampled networks' outputs on the cell's first batch differ from the mean network's by at most `--calibrate`
times the spread of the mean's outputs over that batch (`depth_probe.py --noise` measures the same ratio: 143 for the
paper's MLP as torch initialises it, 1,188 for the LeNet); a prior already below it is left as it is. Everything
else is `benchmarks/robustness_grid.py`, whose arguments follow `--calibrate` (give the runs their own `--tag`).
`--keep-step` (right after the target) also divides the mean step eta by the variance's factor, so that the first
steps' effective learning rate, about eta B sigma^2, is the uncalibrated prior's; `--keep-half-step` by its square
root (session 42):

    python scripts/prior_calibration_probe.py --calibrate 150 --out runs/grid_calib --half tuning --seeds 0 \\
        --examples 3072 --tag kron_calib150 --learners foovb_kronecker --jobs 2

(Copy `runs/grid/results.jsonl` into the `--out` folder first to reuse its baselines.) The grid's workers import this
module as their main module, so the two patches below apply in them too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import robustness_grid as grid  # noqa: E402
from depth_probe import noise_ratio, sampled_outputs  # noqa: E402

from foovb import FOOVB  # noqa: E402
from foovb.posteriors import DiagonalBlock, FullBlock, KroneckerBlock  # noqa: E402

TARGET = "FOOVB_PRIOR_CALIBRATION"  # the environment variable that carries --calibrate into the workers
KEEP_STEP = "FOOVB_PRIOR_CALIBRATION_KEEP_STEP"  # and --keep-step
_first_inputs: list[Tensor] = []
_make_stream, _make_optimizer = grid.make_stream, grid.make_optimizer


@torch.no_grad()
def calibrate(optimizer: FOOVB, model: nn.Module, x: Tensor, target: float) -> tuple[float, float, float]:
    """Scale every block's prior variance down until `depth_probe.noise_ratio` is at most 1.1 `target` (at most 10
    rounds); returns (the noise before, after, the variance's factor)."""
    was_training = model.training
    model.eval()  # batch norm from its running statistics: the mean's and the samples' outputs comparable
    before = noise = noise_ratio(*sampled_outputs(optimizer, model, x))
    factor = 1.0
    for _ in range(10):
        if noise <= 1.1 * target:
            break
        step = max((target / noise) ** 0.5, 0.05)
        factor *= step
        for block in optimizer.blocks:
            if isinstance(block, KroneckerBlock):  # Sigma = A A^T (x) B B^T: each factor by step^(1/4)
                block.state["input_sqrt_cov"].mul_(step**0.25)
                block.state["output_sqrt_cov"].mul_(step**0.25)
            elif isinstance(block, DiagonalBlock):
                block.state["std"].mul_(step**0.5)
            elif isinstance(block, FullBlock):
                block.state["sqrt_cov"].mul_(step**0.5)
        noise = noise_ratio(*sampled_outputs(optimizer, model, x))
    model.train(was_training)
    return before, noise, factor


def make_stream(*args: object, **kwargs: object) -> grid.Stream:
    stream = _make_stream(*args, **kwargs)
    _first_inputs[:] = [next(iter(stream.batches()))[0]]
    return stream


def make_optimizer(learner: str, model: nn.Module, seed: int, candidate: dict) -> torch.optim.Optimizer:
    optimizer = _make_optimizer(learner, model, seed, candidate)
    if learner.startswith("foovb_") and os.environ.get(TARGET):
        _, _, factor = calibrate(optimizer, model, _first_inputs[0], float(os.environ[TARGET]))
        if os.environ.get(KEEP_STEP):  # eta divided by the variance's factor (to the power 1: eta sigma^2 as before)
            optimizer.param_groups[0]["lr"] /= factor ** float(os.environ[KEEP_STEP])
    return optimizer


grid.make_stream, grid.make_optimizer = make_stream, make_optimizer

KEEP_FLAGS = {"--keep-step": ("1", "_keepstep"), "--keep-half-step": ("0.5", "_keephalf")}  # power, tag suffix


def parse_calibration(argv: list[str], tag: str, script: str) -> None:
    """`--calibrate TARGET [--keep-step | --keep-half-step]` at the front of `argv`: carried to the workers in the
    environment (the tag must name it: the candidate file cannot), then removed from `argv`."""
    target = float(argv[2])
    keep = KEEP_FLAGS.get(argv[3]) if len(argv) > 3 else None
    name = f"calib{target:g}" + (keep[1] if keep else "")
    if name not in tag or (keep is None and any(suffix in tag for _, suffix in KEEP_FLAGS.values())):
        sys.exit(f"{script}: error: --tag must name the calibration (e.g. kron_{name}), got {tag!r}")
    os.environ[TARGET] = str(target)
    if keep:
        os.environ[KEEP_STEP] = keep[0]
    argv[1 : 4 if keep else 3] = []


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "--calibrate":
        sys.exit(__doc__)
    parse_calibration(sys.argv, sys.argv[sys.argv.index("--tag") + 1] if "--tag" in sys.argv[:-1] else "default",
                      "prior_calibration_probe.py")
    grid.main()
