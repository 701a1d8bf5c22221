"""The prior calibrated on the first batch, `FOOVB(..., calibrate_prior=TARGET)` (an extension of the paper).

A prior std taken from each layer's shape (std_init="xavier", or the matrix family's alpha split) is about 1.7 times
the std of torch's initial weights; through a deep network (four layers and two max-pools in the paper's LeNet) the
sampled networks' outputs are then mostly noise, and FOO-VB learns its first task slowly (docs/results/
robustness_grid.md, "The prior's scale and the network's depth"). Before the first step, this scales every block's
prior variance down by one common factor, in at most 10 rounds of sqrt(TARGET / ratio) each, until the output
noise on the step's batch,

    ratio = mean_k sum_rows ||f(theta_k, x) - f(mu, x)||^2 / sum_rows ||f(mu, x) - its batch mean||^2,

is at most 1.1 TARGET (10 samples from the inspection noise, the training noise stream untouched; the model in eval
mode, so that batch norm reads its running statistics). A prior already below it is left as it is.

The calibration removes noise, not plasticity: the samples are drawn from the calibrated posterior, but the mean step
is taken with the uncalibrated prior's precision, its covariance

    (Sigma^-1 - 1 / v0 + 1 / V)^-1,    v0 = f V,

with V the prior's variance per weight before the calibration, v0 after it and f the factor (`prior_scale`; each
block keeps v0 and V in its state). Where the posterior is still the prior (Sigma = v0) that is V, the uncalibrated
prior's step (about eta B V as an SGD learning rate); where the likelihood has taken over (Sigma^-1 >> 1 / v0) it is
Sigma, the algorithm's step; in between it is never more than V, nor than the inverse of the precision the likelihood
has added, (Sigma^-1 - 1 / v0)^-1: bounded by the curvature the steps measured. The matrix-variate family takes it in
the eigenbases of its two factors (two symmetric eigendecompositions per layer and step). Tried first (session 43,
docs/results/default_probes.md): eta / f for good (session 42), which keeps the raise after the likelihood has taken
over; and Sigma + (1/f - 1) Sigma^2 / v0, which at Sigma = v0 / 2 is 1 + (1/f - 1) / 2 times the algorithm's step
(3.6 times at f = 0.16), passes a quadratic's minimum there and let a regression net of the grid jump to a loss of
1,234.

`FOOVB(..., step_prior=K)` sets the same two entries at construction, v0 the prior and V = K v0, so that the mean
step's prior is K times the sampling prior's whether or not the prior is calibrated (with calibrate_prior, V is K
times the uncalibrated prior: the calibration keeps it), on every layer but the output layer,
nn.MultiheadAttention's own projections and matrix-variate layers with more than 1,024 inputs or outputs
(`step_prior_blocks`). Factors wider than 512 keep their eigendecomposition until they move by more than a tenth
(`linalg.refreshed_factor_eigh`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from .engine import RunningStatistics
from .posteriors import CALIBRATED, DiagonalBlock, KroneckerBlock, PosteriorBlock, output_layer_blocks
from .priors import AUTO_MAX_FEATURES

SAMPLES = 10  # sampled networks per measurement
ROUNDS = 10  # measurements at most
SLACK = 1.1  # a ratio up to SLACK x TARGET is accepted
MIN_SHRINK = 0.05  # the variance shrinks by at most 20x per round
STEP_PRIOR_MAX_FEATURES = AUTO_MAX_FEATURES  # the most inputs (the bias aside) or outputs step_prior widens


def first_tensor(output: object) -> Tensor | None:
    """The model's output as one tensor: itself, or the first tensor of a tuple or list (None where there is none)."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((item for item in output if isinstance(item, Tensor)), None)
    return None


def batch_spread(mean_output: Tensor) -> Tensor:
    """How much the mean network's outputs vary over the batch: summed squares about their mean over the rows."""
    mean_output = mean_output.detach().double()
    return (mean_output - mean_output.mean(0)).square().sum()


def noise_ratio(mean_output: Tensor, sample_outputs: Sequence[Tensor]) -> float:
    """The samples' output noise over the mean network's output spread across the batch (rows: the first axis)."""
    spread = batch_spread(mean_output).clamp_min(1e-30)
    mean_output = mean_output.detach().double()
    return sum(float((out.detach().double() - mean_output).square().sum() / spread)
               for out in sample_outputs) / len(sample_outputs)


@torch.no_grad()
def scale_prior_variance(blocks: Sequence[PosteriorBlock], factor: float) -> None:
    """Multiply every block's covariance by `factor` (the matrix family: each Kronecker factor by factor^(1/2),
    i.e. each square root by factor^(1/4))."""
    for block in blocks:
        if isinstance(block, KroneckerBlock):
            block.state["input_sqrt_cov"].mul_(factor**0.25)
            block.state["output_sqrt_cov"].mul_(factor**0.25)
        elif isinstance(block, DiagonalBlock):
            block.state["std"].mul_(factor**0.5)
        else:  # FullBlock
            block.state["sqrt_cov"].mul_(factor**0.5)


@torch.no_grad()
def calibrate(blocks: Sequence[PosteriorBlock], outputs: Callable[[int | None], Tensor | None], target: float) -> float:
    """Scale the blocks' prior variance down until `noise_ratio` is at most SLACK x `target`; returns the factor
    (1.0: unchanged). `outputs(seed)`: the model's output on the batch at the mean (seed None) or at the sampled
    network of inspection seed `seed`; None where the output is not a tensor. Where there is nothing to compare
    with (no tensor, outputs that do not vary over the batch) or the target is not reached, a warning says so."""
    mean_output = outputs(None)
    if mean_output is None or not float(batch_spread(mean_output)) > 0:
        warnings.warn("FOOVB: calibrate_prior compares the sampled networks' outputs with how the mean network's "
                      "outputs vary over the step's batch, and " + (
                          "the model's output is not a tensor, nor a tuple or list whose first tensor is the output"
                          if mean_output is None else "they do not vary (a batch of one row, or a constant output "
                          "such as a zero-initialised head)") + ": the prior was not calibrated", stacklevel=5)
        return 1.0
    factor = 1.0
    for round_number in range(ROUNDS + 1):
        ratio = noise_ratio(mean_output, [outputs(seed) for seed in range(SAMPLES)])
        if not ratio > SLACK * target:  # also where the ratio is NaN: the first step's checks report it
            break
        if round_number == ROUNDS:
            warnings.warn(f"FOOVB: calibrate_prior={target:g} was not reached: after {ROUNDS} rounds the prior's "
                          f"variance is {factor:.3g} times what it was and the output noise is still {ratio:.3g} (a "
                          "target too small for the model, or a first batch of nearly identical rows?)", stacklevel=5)
            break
        shrink = max((target / ratio) ** 0.5, MIN_SHRINK)  # half the way, in log: the ratio is not linear in it
        scale_prior_variance(blocks, shrink)
        factor *= shrink
    if factor < 1:
        for block in blocks:
            block.state["calibrated_prior_variance"] = variance_per_weight(block)
            block.state.setdefault("uncalibrated_prior_variance",  # step_prior sets K v0 before the calibration
                                   block.state["calibrated_prior_variance"] / factor)
    return factor


def step_prior_blocks(blocks: Sequence[PosteriorBlock]) -> list[PosteriorBlock]:
    """The blocks step_prior widens: all but those of the last block's module (the model's output layer, in its
    parameter order), but matrix-variate layers with more than AUTO_MAX_FEATURES inputs (the bias aside) or outputs
    (those that posterior="kronecker" makes matrix-variate beyond "auto"'s limit, `affordable_matrix_variate`: their
    eigendecompositions, even refreshed rarely, were not measured: STEP_PRIOR_MAX_FEATURES) and but
    nn.MultiheadAttention's own parameters (its query, key and value projections; its out_proj is a Linear of its own).
    The output layer's wider steps lost a class-incremental stream's first task: the suite's two-task example kept 84.7%
    with them, 93.2% without, 94.2% with no step prior; the attention projections' cost a one-layer Transformer encoder
    3.3 points on i.i.d. MNIST rows, over 3 seeds (docs/results/step_prior.md)."""
    output_layer = output_layer_blocks(blocks)

    def too_wide(block: PosteriorBlock) -> bool:
        return isinstance(block, KroneckerBlock) and max(block.in_features,
                                                         block.out_features) > STEP_PRIOR_MAX_FEATURES

    return [block for block in blocks if block not in output_layer and not too_wide(block)
            and not isinstance(block.module, nn.MultiheadAttention)]


def widen_step_prior(blocks: Sequence[PosteriorBlock], factor: float) -> None:
    """step_prior: every block's mean step takes a prior `factor` times its current prior variance per weight
    (calibrate_prior's two state entries, v0 and V = factor v0; `PosteriorBlock.mean_step_priors`); FOOVB passes the
    blocks `step_prior_blocks` picks, the others take the algorithm's step."""
    for block in blocks:
        prior = variance_per_weight(block)
        if not torch.isfinite(prior * factor):
            raise ValueError(f"step_prior={factor:g} times the prior's variance per weight ({float(prior):.3g}) "
                             f"overflows {prior.dtype}: pass a smaller step_prior")
        block.state["calibrated_prior_variance"] = prior
        block.state["uncalibrated_prior_variance"] = prior * factor


def variance_per_weight(block: PosteriorBlock) -> Tensor:
    """The mean of the diagonal of a block's covariance (0-dim, in the mean's dtype): its prior's variance per weight
    at the first step, where every family's covariance is a multiple of the identity (calibrate_prior's v0, and the
    divergence advice's first effective learning rate)."""
    if block.family == "kronecker":  # diag(A A^T (x) B B^T) = outer product of the factors' diagonals
        return (block.state["input_sqrt_cov"].square().sum(1).mean()
                * block.state["output_sqrt_cov"].square().sum(1).mean())
    if block.family == "diagonal":
        return block.state["std"].square().mean()
    return block.state["sqrt_cov"].square().sum(1).mean()


def covariances(blocks: Sequence[PosteriorBlock]) -> dict[PosteriorBlock, dict[str, Tensor]]:
    """Copies of every block's covariance (its state but the mean), for `restore_covariances`."""
    return {block: {key: value.clone() for key, value in block.state.items() if key != "mean"} for block in blocks}


@torch.no_grad()
def restore_covariances(saved: dict[PosteriorBlock, dict[str, Tensor]]) -> None:
    """The covariances `covariances` copied, in place, and the other entries as they were (the calibration's: none,
    or step_prior's): a first step that failed after the calibration leaves the prior as it was."""
    for block, entries in saved.items():
        for key in [key for key in block.state if key != "mean" and key not in entries]:
            del block.state[key]
        for key, value in entries.items():
            if key in block.state and key not in CALIBRATED:
                block.state[key].copy_(value)
            else:
                block.state[key] = value


def first_model_call(model: nn.Module, closure: Callable[[], Tensor]) -> tuple[tuple, dict] | None:
    """The arguments of the closure's first call of `model`, from one call of the closure at the mean (its
    gradients and batch-norm statistics dropped); None where it does not call the model itself."""
    calls: list[tuple[tuple, dict]] = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((args, kwargs)) if not calls else None, with_kwargs=True)
    running = RunningStatistics(model)
    try:
        with torch.enable_grad():
            closure()
    finally:
        handle.remove()
        running.restore()
        for p in model.parameters():
            p.grad = None
    return calls[0] if calls else None
