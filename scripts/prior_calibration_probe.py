"""The robustness grid with a prior calibrated on the first batch: a hypothesis for issue 54 (session 41), since
session 42 the library's `foovb.calibration` for the calibration itself. The step is this probe's own: as given,
eta divided by the factor (`--keep-step`, what FOOVB(calibrate_prior=...) did in session 42) or by its square root;
FOOVB(calibrate_prior=...) now steps with the uncalibrated prior's precision instead (session 43).

Before the first step, every FOO-VB learner's prior variance is scaled down by one factor (for all blocks alike)
until the sampled networks' outputs on the cell's first batch differ from the mean network's by at most `--calibrate`
times the spread of the mean's outputs over that batch (`depth_probe.py --noise` measures the same ratio: 143 for the
paper's MLP as torch initialises it, 1,188 for the LeNet); a prior already below it is left as it is. Everything
else is `benchmarks/robustness_grid.py`, whose arguments follow `--calibrate` (give the runs their own `--tag`).
`--keep-step` (right after the target) also divides the mean step eta by the variance's factor, so that the first
steps' effective learning rate, about eta B sigma^2, is the uncalibrated prior's; `--keep-half-step` by its square
root (session 42). The library's secant check goes in the candidate's settings:

    python scripts/prior_calibration_probe.py --calibrate 150 --out runs/grid_calib --half tuning --seeds 0 \\
        --examples 3072 --tag kron_calib150 --learners foovb_kronecker --jobs 2
    python scripts/prior_calibration_probe.py --calibrate 150 --keep-half-step --out runs/grid_calib ... \\
        --tag kron_secant_calib150_keephalf --kronecker '{"secant_check": true}'

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

from foovb import FOOVB  # noqa: E402
from foovb.calibration import calibrate  # noqa: E402

TARGET = "FOOVB_PRIOR_CALIBRATION"  # the environment variable that carries --calibrate into the workers
KEEP_STEP = "FOOVB_PRIOR_CALIBRATION_KEEP_STEP"  # and --keep-step
_first_inputs: list[Tensor] = []
_make_stream, _make_optimizer = grid.make_stream, grid.make_optimizer


@torch.no_grad()
def calibrated_factor(optimizer: FOOVB, model: nn.Module, x: Tensor, target: float) -> float:
    """`foovb.calibration.calibrate` on the batch x, the model in eval mode (what FOOVB(calibrate_prior=target)
    does at its first step, without dividing the step); returns the variance's factor."""
    def outputs(seed: int | None) -> Tensor:
        if seed is None:
            return model(x)
        with optimizer.sampled_params(seed=seed):
            return model(x)

    was_training = model.training
    model.eval()  # batch norm from its running statistics: the mean's and the samples' outputs comparable
    try:
        return calibrate(optimizer.blocks, outputs, target)
    finally:
        model.train(was_training)


def make_stream(*args: object, **kwargs: object) -> grid.Stream:
    stream = _make_stream(*args, **kwargs)
    _first_inputs[:] = [next(iter(stream.batches()))[0]]
    return stream


def make_optimizer(learner: str, model: nn.Module, seed: int, candidate: dict) -> torch.optim.Optimizer:
    optimizer = _make_optimizer(learner, model, seed, candidate)
    if learner.startswith("foovb_") and os.environ.get(TARGET):
        factor = calibrated_factor(optimizer, model, _first_inputs[0], float(os.environ[TARGET]))
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
