"""The secant check of a step's mean update, `FOOVB(..., secant_check=True)` (an extension of the paper).

Each block's implicit mean step is Newton-like within its block (eta Sigma H <= 1 along every direction of a
quadratic, `posteriors.step_tempering`), but the blocks step together: where their steps move the network's outputs
the same way, as every layer of a small regression net correcting the same residual, the whole step passes the
minimum along it by up to the number of layers, and the first steps oscillate and grow (docs/results/
robustness_grid.md, "The secant check"). The check evaluates the batch once more, at the new mean, and cuts the mean
step d to the secant minimum along it:

    t = -E[g] . d / (d . (g(mu + d) - E[g])),     mu <- mu + t d   where 0 < t < 1,

E[g] the step's Monte Carlo mean gradient (at the old mean; exact on a quadratic with antithetic pairs) and
g(mu + d) the gradient at the new mean, both of L_n on the step's batch. The covariance update is kept. On a
quadratic the cut step ends at the exact minimum of the loss along d; a step that does not pass it is kept whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .engine import StatisticsReducer, Step
from .posteriors import DiagonalBlock, KroneckerBlock, PosteriorBlock


def in_param_shapes(block: PosteriorBlock, tensor: Tensor) -> list[Tensor]:
    """A tensor in the layout of the block's state["mean"] as one tensor per parameter (views)."""
    return [tensor] if isinstance(block, DiagonalBlock) else block.split(tensor)


def mean_gradients(stats: dict[PosteriorBlock, dict], num_samples: int) -> list[Tensor]:
    """E[g] of every parameter of the blocks of `stats`, in the parameters' shapes, from the step's sums."""
    return [grad for block, sums in stats.items()
            for grad in in_param_shapes(block, sums["psi_sum" if isinstance(block, KroneckerBlock) else "grad_sum"]
                                        / num_samples)]


def mean_steps(blocks: Sequence[PosteriorBlock], means_before: Sequence[Tensor]) -> list[Tensor]:
    """The step each parameter's mean took, mu - mu_before, in the parameters' shapes."""
    return [new - old for block, before in zip(blocks, means_before, strict=True)
            for new, old in zip(block.mean_values(), in_param_shapes(block, before), strict=True)]


def secant_fraction(steps: Sequence[Tensor], mean_grads: Sequence[Tensor], new_grads: Sequence[Tensor],
                    reducer: StatisticsReducer | None = None) -> float:
    """The fraction t in (0, 1] of the mean step d (`steps`, per parameter) to keep: the secant minimum
    -E[g] . d / (d . (g(mu + d) - E[g])) where it lies inside the step, else 1 (a step that does not pass it, one
    that ascends, or a non-finite gradient at the new mean, which the next step's checks report). Under
    foovb.distributed, E[g] is the whole batch's already and g(mu + d) . d this process's part (`reducer`)."""
    descent = -float(sum(torch.vdot(g.flatten(), d.flatten()) for g, d in zip(mean_grads, steps, strict=True)))
    new_slope = float(sum(torch.vdot(g1.flatten(), d.flatten()) for g1, d in zip(new_grads, steps, strict=True)))
    if reducer is not None:
        new_slope = reducer.whole_batch(new_slope)
    curvature = new_slope + descent  # d . (g(mu + d) - E[g])
    if descent > 0 and curvature > descent:  # also False for NaN
        return descent / curvature
    return 1.0


@torch.no_grad()
def cut_mean_steps(blocks: Sequence[PosteriorBlock], means_before: Sequence[Tensor], fraction: float) -> None:
    """mu <- mu_before + fraction (mu - mu_before) for every block (its state's layout: the cut is linear)."""
    for block, before in zip(blocks, means_before, strict=True):
        block.state["mean"].sub_(before).mul_(fraction).add_(before)


def secant_fraction_at_new_mean(pending: Step, means_before: Sequence[Tensor], grads_before: Sequence[Tensor],
                                reducer: StatisticsReducer | None = None) -> float:
    """`secant_fraction` of the step just applied (the new mean in the model): the step's closure called once more
    for g(mu + d) (`Step.run_at_mean`, which leaves batch norm the new mean's statistics), in L_n's scale."""
    blocks = list(pending.stats)
    scale = pending.grad_scale if pending.grad_scale is not None else (pending.loss_rows or 1.0)
    grads_after = [grad * scale for grad in pending.run_at_mean()]
    return secant_fraction(mean_steps(blocks, means_before), grads_before, grads_after, reducer)
