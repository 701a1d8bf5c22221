"""One sentence for a FOO-VB step that diverged (`FloatingPointError`): the layer that moved most, its first
effective learning rate, and what to pass."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .calibration import step_prior_blocks
from .posteriors import KroneckerBlock

if TYPE_CHECKING:
    from .optimizer import FOOVB

__all__ = ["divergence_advice"]


def divergence_advice(opt: FOOVB, grad_scale: float | None) -> str:
    """One sentence for a step that diverged: the layer whose mean grew most since its first update, its first
    effective learning rate on the user's loss (eta x its mean step's prior variance per weight, V, x the loss's
    rescaling to L_n), and what to pass. The posterior is the last step's (a refused update is undone)."""
    growth = {block: float(block.state["mean"].norm()) / max(norm, 1e-12)
              for block, norm in opt._progress.first_mean_norms.items()}
    if not growth and not opt._progress.prior_variances:
        return "No update succeeded before this one"
    widened = step_prior_blocks(opt.blocks) if opt.step_prior > 1 else []
    factors = {block: opt.step_prior if block in widened else 1.0 for block in opt.blocks}  # V / v0 (step_prior)
    step_priors = {block: variance * factors[block] for block, variance in opt._progress.prior_variances.items()}
    ranking = growth or step_priors  # a divergence at the first update: the layer with the widest step prior
    block = max(ranking, key=ranking.get)
    names = {id(module): name for name, module in opt.model.named_modules()}
    name = names.get(id(block.module), "?") or "(the model itself)"
    variance, widening = opt._progress.prior_variances[block], factors[block]
    rate = opt.mean_step * widening / opt.prior_scale * variance * (grad_scale or 1.0)  # eta V
    if not opt.implicit_mean:
        fix = "pass implicit_mean=True (each step bounded by the curvature it measures), or a smaller mean_step"
    else:
        coupled = ("curvature_damping=True (weights whose curvature is coupled), posterior='kronecker', "
                   if opt.posterior_family == "diagonal" and not opt.curvature_damping else "")
        prior = (f"a larger alpha (the prior's variance is 2 (1 - alpha) / (fan_in + 2); e.g. "
                 f"alpha={(1 + opt.param_groups[0]['alpha']) / 2:g})" if isinstance(block, KroneckerBlock)
                 else f"a smaller std_init (e.g. std_init={math.sqrt(variance) / 2:.2g})")
        wider = f"a smaller step_prior (e.g. step_prior={max(widening / 4, 1):g}), " if widening > 1 else ""
        fix = f"pass {coupled}{wider}a smaller mean_step (e.g. mean_step={opt.mean_step / 4:g}) or {prior}"
    lead = (f"Layer {name!r} moved most: its mean's norm is {growth[block]:.3g}x that after the first step, its"
            if growth else f"At the first update, layer {name!r} had the widest mean step's prior: its")
    return (f"{lead} first effective learning rate on the loss (eta x the mean step's prior variance x "
            f"{grad_scale or 1:g} terms) was {rate:.3g}; {fix}")
