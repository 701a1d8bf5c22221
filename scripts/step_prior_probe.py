"""The robustness grid with a wider prior for the mean step than for the samples: a hypothesis for issue 54
(session 43), before it becomes an option of FOOVB.

Every FOO-VB learner's blocks get, at construction, the two entries that `calibrate_prior` keeps
(`foovb.calibration`): the sampling prior's variance per weight v0 (the family's default prior, unchanged) and a
mean-step prior V = K v0, so that every mean step is taken with the covariance (Sigma^-1 - 1/v0 + 1/V)^-1: K times the
prior's step in the directions no batch has measured, the algorithm's step where the likelihood has taken over, the
samples' noise as before. K comes from the tag (`stepprior16`: 16). Everything else is
`benchmarks/robustness_grid.py`, whose arguments this takes:

    python scripts/step_prior_probe.py --out runs/grid_calib --half tuning --seeds 0 --examples 3072 \\
        --tag kron_stepprior16 --learners foovb_kronecker --jobs 2

The grid's workers import this module as their main module, so the two patches below apply in them too.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import robustness_grid as grid  # noqa: E402

from foovb.calibration import variance_per_weight  # noqa: E402

_make_optimizer, _run_one = grid.make_optimizer, grid.run_one


def make_optimizer(learner: str, model: nn.Module, seed: int, candidate: dict) -> torch.optim.Optimizer:
    optimizer = _make_optimizer(learner, model, seed, candidate)
    factor = candidate.get("step_prior")
    if learner.startswith("foovb_") and factor:
        for block in optimizer.blocks:
            block.state["calibrated_prior_variance"] = variance_per_weight(block)
            block.state["uncalibrated_prior_variance"] = block.state["calibrated_prior_variance"] * factor
    return optimizer


def run_one(job: dict) -> dict:
    """The grid's run with K from the tag (the candidate file holds the FOOVB keyword arguments only)."""
    match = re.search(r"stepprior(\d+(?:\.\d+)?)", job["tag"])
    return _run_one({**job, "candidate": {**job["candidate"], "step_prior": float(match.group(1)) if match else None}})


grid.make_optimizer, grid.run_one = make_optimizer, run_one

if __name__ == "__main__":
    tag = sys.argv[sys.argv.index("--tag") + 1] if "--tag" in sys.argv[:-1] else ""
    if not re.search(r"stepprior\d", tag):
        sys.exit("step_prior_probe.py: error: --tag must name the factor (e.g. kron_stepprior16)")
    grid.main()
