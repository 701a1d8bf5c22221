"""The output anchor: a Gaussian pseudo-likelihood on the network's outputs, centred where the posterior mean puts
them, added to the loss so that the covariance contracts where the outputs are sensitive, also on a task that is
already solved (an extension of the paper; docs/theory.md, "The output anchor").

On a solved classification task the loss's curvature vanishes (softmax saturates), so FOO-VB's statistic
E[g eps^T] (Stein: Sigma times the Hessian) stops contracting the covariance, and later tasks move those weights
freely. The anchor adds strength/2 ||f(theta_k, x) - f(mu, x)||^2 per row: its gradient at theta_k = mu + A eps_k is
J^T (f(theta_k) - f(mu)) ~ J^T J A eps_k, whose E[g eps^T] is strength J^T J A (the Gauss-Newton matrix of the
outputs, MAS's sensitivity), and whose E[g] vanishes to first order: it shrinks the covariance, not the mean's
target. Use::

    reference = output_reference(optimizer, x)   # f(mu, x), before the step
    def closure():
        optimizer.zero_grad()
        outputs = model(x)
        loss = F.cross_entropy(outputs, y) + output_anchor(outputs, reference, strength=5.0)
        loss.backward()
        return loss
    optimizer.step(closure)

(the same in `step_batched`'s loss_fn: `output_anchor` repeats the reference for the K stacked samples).
"""

from __future__ import annotations

import math
from numbers import Real

import torch
from torch import Tensor

from .optimizer import FOOVB
from .sampled import stacked_samples

__all__ = ["output_anchor", "output_reference", "solved_fraction"]


@torch.no_grad()
def output_reference(optimizer: FOOVB, *inputs: Tensor) -> Tensor:
    """f(mu, inputs): the model's output at the posterior mean, detached, computed before `optimizer.step` (the
    model holds the mean between steps). Buffers that the forward updates (BatchNorm's running statistics) are put
    back, so the extra forward leaves the model as it was. It runs in the model's current mode: dropout draws its
    own mask here, and the anchor then also penalises the difference between two masks' outputs."""
    if optimizer._pending is not None or optimizer._progress.sample_loaded:
        raise RuntimeError("output_reference needs the posterior mean in the model: call it before optimizer.step "
                           "(or step_batched), not inside the closure, where the model holds a sample")
    model = optimizer.model
    buffers = [buffer.clone() for buffer in model.buffers()]
    try:
        outputs = model(*inputs)
    finally:
        for buffer, saved in zip(model.buffers(), buffers, strict=True):
            buffer.copy_(saved)
    if not isinstance(outputs, Tensor):
        raise TypeError(f"output_reference: the model returned a {type(outputs).__name__}; the anchor needs one "
                        "output tensor (anchor the tensor you compute the loss from)")
    low_precision = outputs.dtype in (torch.float16, torch.bfloat16)  # made under autocast: not a rounded target
    return outputs.detach().float() if low_precision else outputs.detach()


def output_anchor(outputs: Tensor, reference: Tensor, strength: float, reduction: str = "mean",
                  targets: Tensor | None = None) -> Tensor:
    """strength/2 w_row ||outputs_row - reference_row||^2, summed over each row's outputs and reduced over the rows
    like the loss it is added to ("mean", as F.cross_entropy's default, or "sum"). `outputs` may hold c stacked
    samples of the reference's r rows (c r rows, sample-major, as in `step_batched`); the reference is repeated for
    them. w_row is 1, or with class-index `targets` (reference = logits of C classes) how far the mean has solved
    the row: max(0, (p_mu(target) - 1/C) / (1 - 1/C)), 0 at chance and 1 when certain and right, so that the anchor
    keeps what was learned and leaves an untrained network (and a row it gets wrong) free."""
    if not isinstance(strength, Real) or isinstance(strength, bool) or not 0 <= strength < math.inf:
        raise ValueError(f"strength must be a finite number >= 0, got {strength!r}")
    if not isinstance(outputs, Tensor) or not isinstance(reference, Tensor):
        raise TypeError(f"outputs and reference must be tensors, got {type(outputs).__name__} and "
                        f"{type(reference).__name__}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum' (that of the loss the anchor is added to), got "
                         f"{reduction!r}")
    rows = reference.shape[0] if reference.ndim else 0
    samples = stacked_samples() or 1  # step_batched stacks c samples of the batch's rows
    if outputs.shape[1:] != reference.shape[1:] or outputs.shape[0] != rows * samples:
        stacked = f" ({samples} stacked samples of its rows)" if samples > 1 else ""
        raise ValueError(f"outputs {tuple(outputs.shape)} do not match the reference {tuple(reference.shape)}"
                         f"{stacked}: compute the reference with output_reference on this batch's inputs (not a "
                         "reference kept from another batch)")
    if targets is not None and targets.shape[:1] != (rows,):
        raise ValueError(f"targets must hold one class index per row of the batch ({rows}), got "
                         f"{tuple(targets.shape)}: in step_batched's loss_fn pass the batch's own targets, not the "
                         "repeated ones loss_fn receives")
    weights = None if targets is None else solved_fraction(reference, targets)
    if outputs.shape[0] != rows:
        weights = None if weights is None else weights.repeat(outputs.shape[0] // rows)
        reference = reference.repeat(outputs.shape[0] // rows, *([1] * (reference.ndim - 1)))
    squares = (outputs - reference).square()
    per_row = squares.flatten(1).sum(1) if squares.ndim > 1 else squares
    if weights is not None:
        per_row = per_row * weights
    reduced = per_row.mean() if reduction == "mean" else per_row.sum()
    return 0.5 * strength * reduced


def solved_fraction(logits: Tensor, targets: Tensor) -> Tensor:
    """Per row, max(0, (p(target) - 1/C) / (1 - 1/C)) for logits (rows, C) and class indices (rows,): 0 at chance
    or worse, 1 when the softmax puts all its mass on the target."""
    if logits.ndim != 2 or targets.shape != logits.shape[:1] or targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be class indices, one per row of (rows, classes) logits; got logits "
                         f"{tuple(logits.shape)} and targets {tuple(targets.shape)} of {targets.dtype}")
    classes = logits.shape[1]
    if targets.numel() and not 0 <= int(targets.min()) <= int(targets.max()) < classes:
        raise ValueError(f"targets must be class indices in [0, {classes}), got values from {int(targets.min())} "
                         f"to {int(targets.max())} (an ignore_index has no solved fraction: drop those rows)")
    chance = 1.0 / classes
    probability = logits.detach().softmax(1).gather(1, targets[:, None].long()).squeeze(1)
    return ((probability - chance) / (1.0 - chance)).clamp_min(0.0)
