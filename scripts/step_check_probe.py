"""The robustness grid with a secant check on the mean step: a hypothesis for issue 54 (session 42), not a FOOVB
feature.

Why: on the 1-64-64-1 tanh regression net every layer's mean step corrects most of the batch's residual by itself
(implicit_mean's step is Newton-like within a block), and the blocks step together: on `regression/drift/64`,
seed 0, the three layers' steps each move the outputs by 0.2-2.2 times the residual and together by 1.7-2.5 times
from the third step on, so the residual changes sign and grows (the loss 0.39 -> 6.3 -> 39 in five steps).
The per-block bound of implicit_mean cannot see the coupling between blocks.

The check: after FOOVB's step, the gradient at the new mean g(mu + d) (one more call of the closure) and the samples'
E[g] give the curvature along the whole step d, c = d . (g(mu + d) - E[g]); where the step passes the secant
minimum, t = -E[g] . d / c < 1, the mean moves by t d instead (the covariance update is kept). Everything else is
`benchmarks/robustness_grid.py`, whose arguments follow (give the runs a `--tag` with "secant" in it);
`--calibrate TARGET [--keep-step | --keep-half-step]` in front adds `prior_calibration_probe.py`'s calibrated prior:

    python scripts/step_check_probe.py --out runs/grid_calib --half tuning --seeds 0 --examples 3072 \\
        --tag kron_secant --learners foovb_kronecker --jobs 2
    python scripts/step_check_probe.py --calibrate 150 --keep-step --out runs/grid_calib ... \\
        --tag kron_secant_calib150_keepstep

The grid's workers import this module as their main module, so the patches apply in them too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import prior_calibration_probe as calibration  # noqa: E402  (patches the grid's make_stream / make_optimizer)

import foovb.optimizer as foovb_optimizer  # noqa: E402
from foovb.posteriors import KroneckerBlock  # noqa: E402

SECANT = "FOOVB_SECANT_CHECK"  # the environment variable that carries the check into the workers
_step_mean_grad: dict = {}  # E[g] per parameter and the loss's scale to L_n, of the step just taken
_apply_update, _scale_statistics = foovb_optimizer.apply_update, foovb_optimizer.scale_statistics


def _recording_apply_update(stats: dict, losses: list[float], loss_rows: float, num_samples: int, *args: object,
                            **kwargs: object) -> float:
    for block, sums in stats.items():
        total = sums["psi_sum"] if isinstance(block, KroneckerBlock) else sums["grad_sum"]
        parts = block.split(total) if isinstance(block, KroneckerBlock) else [total]
        for param, part in zip(block.params, parts, strict=True):
            _step_mean_grad[param] = part.reshape(param.shape) / num_samples
    return _apply_update(stats, losses, loss_rows, num_samples, *args, **kwargs)


def _recording_scale_statistics(stats: dict, factor: float) -> None:
    _step_mean_grad["scale"] = factor
    _scale_statistics(stats, factor)


foovb_optimizer.apply_update, foovb_optimizer.scale_statistics = _recording_apply_update, _recording_scale_statistics


class SecantChecked:
    """A FOOVB whose mean step is cut back to the secant minimum along it (one more closure call per step)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        self.optimizer, self.params = optimizer, list(model.parameters())
        self.param_groups = optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor]) -> float:
        _step_mean_grad.clear()
        before = [p.detach().clone() for p in self.params]
        loss = self.optimizer.step(closure)
        scale = _step_mean_grad.get("scale") or 1.0
        with torch.enable_grad():
            closure()
        step = [p - q for p, q in zip(self.params, before, strict=True)]
        mean_grad = [_step_mean_grad.get(p, torch.zeros_like(p)) for p in self.params]
        at_new = [torch.zeros_like(p) if p.grad is None else p.grad * scale for p in self.params]
        self.optimizer.zero_grad()
        descent = -sum(float((g * d).sum()) for g, d in zip(mean_grad, step, strict=True))
        curvature = sum(float(((g1 - g) * d).sum()) for g, g1, d in zip(mean_grad, at_new, step, strict=True))
        if descent > 0 and curvature > descent:  # the secant minimum t = descent / curvature lies before the step
            for p, q, d in zip(self.params, before, step, strict=True):
                p.copy_(q + descent / curvature * d)
        return loss


def make_optimizer(learner: str, model: nn.Module, seed: int, candidate: dict) -> torch.optim.Optimizer:
    optimizer = calibration.make_optimizer(learner, model, seed, candidate)
    if learner.startswith("foovb_") and os.environ.get(SECANT):
        return SecantChecked(optimizer, model)
    return optimizer


calibration.grid.make_optimizer = make_optimizer

if __name__ == "__main__":
    tag = sys.argv[sys.argv.index("--tag") + 1] if "--tag" in sys.argv[:-1] else "default"
    if "secant" not in tag:
        sys.exit(f"step_check_probe.py: error: --tag must name the check (e.g. kron_secant), got {tag!r}")
    os.environ[SECANT] = "1"
    if len(sys.argv) > 2 and sys.argv[1] == "--calibrate":
        calibration.parse_calibration(sys.argv, tag, "step_check_probe.py")
    calibration.grid.main()
