"""Evaluate many Monte Carlo samples of a network in one batched forward/backward pass.

The paper's complexity appendix names two strategies: sequential samples (one network in memory) and
parallel samples. This module is the parallel one. While `SampledNetwork` is active, every covered
`nn.Linear` / `nn.Conv1d`-`3d` computes the outputs of `c` sampled networks at once:

* activations are stacked sample-major, (c * r, ...) for a batch of r rows; the input of the first layer is
  the plain batch (r, ...) and is shared by all samples, so that layer is one GEMM/convolution against the
  c stacked weights: (r x n) @ (n x c p);
* diagonal / full / convolutional matrix-variate samples are materialised (c, *weight.shape) leaf tensors,
  whose gradients are the per-sample gradients g_k;
* matrix-variate Linear layers never form W_k = M + B Phi_k A^T (design note "Making the matrix-variate
  update cheap"): X W_k^T = X M^T + ((X A) Phi_k^T) B^T, and the update statistics come from the layer
  errors Delta_k = dL/dY_k, since Psi_k = Delta_k^T X:
      sum_k Psi_k              = sum_k Delta_k^T X
      sum_k Psi_k^T B Phi_k    = X^T (sum_k Delta_k B Phi_k)          (rank <= rows: a `LowRank`)
      sum_k Psi_k A Phi_k^T    = sum_k Delta_k^T (X A Phi_k^T).
  These are K times Algorithm 3's E1 and (up to 1/p, 1/n) E2 and E3, with E3 in the appendix's form
  E[Psi A Phi^T] ("Derivation of the fixed-point equations for the matrix variate Gaussian").
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .posteriors import KroneckerBlock, PosteriorBlock
from .precision import full_precision

__all__ = ["SampledNetwork", "augmented_input", "check_batched_support", "stacked_samples"]

CONVOLUTIONS = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}
SUPPORTED = (nn.Linear, *CONVOLUTIONS)
_STACKED = ContextVar("stacked_samples", default=0)


def stacked_samples() -> int:
    """The number of samples stacked in the batched pass running now (`SampledNetwork` active), else 0."""
    return _STACKED.get()


def check_batched_support(blocks: Sequence[PosteriorBlock], model: nn.Module | None = None) -> None:
    """Raise a clear error if the batched path would compute something else than the sequential one: a
    parameter outside nn.Linear / nn.Conv1d-3d or other than their weight and bias (weight_norm's), a forward of
    such a module other than torch's own (it is replaced by the batched one), or a module of `model` that
    mixes the rows of a batch (batch norm using batch statistics: the stacked samples would share them)."""
    bad = sorted({type(b.module).__name__ if b.module is not None else "<no module>" for b in blocks
                  if not isinstance(b.module, SUPPORTED)})
    if bad:
        raise ValueError(
            f"the batched Monte Carlo path supports parameters of nn.Linear and nn.Conv1d-3d only, found "
            f"parameters in {', '.join(bad)}; use the sequential path FOOVB.step(closure) for this model"
        )
    for block in blocks:
        if any(p is not block.module.weight and p is not block.module.bias for p in block.params):
            raise ValueError(f"{type(block.module).__name__} has parameters other than its weight and bias (e.g. "
                             "weight_norm's weight_g / weight_v), which the batched Monte Carlo path would not "
                             "sample; use FOOVB.step(closure) for this model")
    for module in {b.module for b in blocks}:
        base = next(kind for kind in SUPPORTED if isinstance(module, kind))
        own = [name for name in ("forward", "_conv_forward") if hasattr(base, name)
               and (getattr(type(module), name) is not getattr(base, name) or name in vars(module))]
        if own:  # ConvNd.forward calls _conv_forward, which subclasses override (weight standardisation)
            raise ValueError(f"{type(module).__name__} has its own {own[0]}, which the batched Monte Carlo path "
                             f"would replace by {base.__name__}'s; use FOOVB.step(closure) for this model")
        if base is not nn.Linear and module.padding_mode != "zeros":
            raise ValueError(f"the batched Monte Carlo path supports {base.__name__} with padding_mode='zeros' only")
    for module in [] if model is None else model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and (module.training or not module.track_running_stats):
            raise ValueError(f"{type(module).__name__} normalises with batch statistics, which the stacked samples "
                             "of the batched Monte Carlo path would share; use FOOVB.step(closure) for this model")


def _unstack(y: Tensor, c: int, r: int) -> Tensor:
    """(r, c * p, ...) -> (c * r, p, ...): from the shared-input layout to sample-major rows."""
    return y.unflatten(1, (c, -1)).transpose(0, 1).flatten(0, 1)


class _Layer:
    """Patched forward of one module with its blocks' samples for the current chunk."""

    def __init__(self, module: nn.Module, blocks: list[PosteriorBlock], noises: list[Tensor], c: int, r: int,
                 track_grad: bool, calls: list[nn.Module]):
        self.module, self.blocks, self.noises, self.c, self.r = module, blocks, noises, c, r
        self.calls = calls  # the layers called so far in this pass, shared by all layers of the network
        self.factored = isinstance(module, nn.Linear) and isinstance(blocks[0], KroneckerBlock)
        self.conv = next((conv for kind, conv in CONVOLUTIONS.items() if isinstance(module, kind)), None)
        self.saved: dict[str, Tensor] = {}
        if not self.factored:
            values = {}
            with torch.no_grad(), full_precision():
                for block, noise in zip(blocks, noises, strict=True):
                    for param, value in zip(block.params, block.sample(noise), strict=True):
                        values[param] = value.requires_grad_(track_grad)
            # frozen parameters have no block: every sample shares them
            self.weight, self.bias = (
                None if p is None else values.get(p, p.detach().expand(c, *p.shape))
                for p in (module.weight, module.bias))
            self.values = values
        self.track_grad = track_grad

    def layout_is_shared(self, x: Tensor) -> bool:
        first = not self.calls
        self.calls.append(self.module)
        if first and x.shape[0] != self.r:  # nothing sampled has run yet: this must be the batch itself
            raise ValueError(f"the first layer got {x.shape[0]} rows, the batch has {self.r}: the batched Monte "
                             "Carlo path tells shared from stacked activations by their rows, so the model must "
                             "keep the batch dimension; use FOOVB.step(closure) for this model")
        if x.shape[0] == self.c * self.r:
            return False
        if x.shape[0] == self.r:
            return True
        raise ValueError(f"{type(self.module).__name__} got {x.shape[0]} rows; expected the batch ({self.r}) "
                         f"or {self.c} stacked samples of it ({self.c * self.r})")

    def forward(self, x: Tensor) -> Tensor:
        shared = self.layout_is_shared(x) and self.c > 1
        if self.factored:
            return self._kronecker_linear(x, shared)
        if isinstance(self.module, nn.Linear):
            return self._linear(x, shared)
        return self._conv(x, shared)

    def _linear(self, x: Tensor, shared: bool) -> Tensor:
        c, r = self.c, self.r
        if x.ndim != 2:
            raise ValueError("the batched path supports 2-D inputs to nn.Linear; use FOOVB.step(closure)")
        w, b = self.weight, self.bias
        if shared:
            y = x @ w.flatten(0, 1).T
            if b is not None:
                y = y + b.flatten()
            return _unstack(y, c, r)
        y = x.view(c, r, -1) @ w.transpose(1, 2)
        if b is not None:
            y = y + b[:, None, :]
        return y.flatten(0, 1)

    def _conv(self, x: Tensor, shared: bool) -> Tensor:
        c, r, m = self.c, self.r, self.module
        w, b, conv = self.weight.flatten(0, 1), None if self.bias is None else self.bias.flatten(), self.conv
        if shared and m.groups == 1:
            y = conv(x, w, b, m.stride, m.padding, m.dilation, 1)
        else:
            stacked = x.expand(c, *x.shape) if shared else x.view(c, r, *x.shape[1:])
            grouped = stacked.transpose(0, 1).flatten(1, 2)  # (r, c * C, *spatial)
            y = conv(grouped, w, b, m.stride, m.padding, m.dilation, c * m.groups)
        return _unstack(y, c, r)

    def _kronecker_linear(self, x: Tensor, shared: bool) -> Tensor:
        block: KroneckerBlock = self.blocks[0]
        (phi,) = self.noises
        c, r = self.c, self.r
        if x.ndim != 2:
            raise ValueError("the batched path supports 2-D inputs to nn.Linear; use FOOVB.step(closure)")
        mean, b = block.state["mean"], block.state["output_sqrt_cov"]
        n_in = block.in_features
        bias_mean = mean[:, n_in] if block.has_bias else None
        rows = x if shared else x.view(c, r, n_in)
        mean_out = F.linear(rows, mean[:, :n_in], bias_mean)
        x_a = block.input_times_a(rows)  # X_aug A
        if shared:  # (r, n) @ (n, c p): one GEMM for all samples
            noise_pre = (x_a @ phi.flatten(0, 1).T).unflatten(1, (c, -1)).transpose(0, 1)
        else:
            noise_pre = x_a @ phi.transpose(1, 2)
        y = mean_out + noise_pre @ b.T  # (c, r, p)
        if self.track_grad:
            if self.saved:
                raise ValueError("a matrix-variate nn.Linear was called twice in one forward pass (shared weights): "
                                 "the batched path cannot attribute its statistics; use FOOVB.step(closure)")
            dtype = mean.dtype  # under autocast the forward runs in low precision; the statistics do not
            self.saved = {"x": rows.detach().to(dtype), "noise_pre": noise_pre.detach().to(dtype)}
            if not y.requires_grad:  # first layer: nothing upstream needs gradients, but Delta_k does
                y.requires_grad_()
            y.register_hook(self._save_delta)
        return y.flatten(0, 1)

    def _save_delta(self, grad: Tensor) -> None:
        self.saved["delta"] = grad.to(self.blocks[0].state["mean"].dtype)

    def accumulate(self, stats: dict[PosteriorBlock, dict], grad_scale: float, shared_inputs: dict) -> None:
        if not self.factored:
            for block, noise in zip(self.blocks, self.noises, strict=True):
                grads = []
                for param in block.params:
                    grad = self.values[param].grad
                    grads.append(torch.zeros_like(self.values[param]) if grad is None else grad * grad_scale)
                block.accumulate(stats[block], noise, grads)
            return
        block: KroneckerBlock = self.blocks[0]
        if not self.saved:  # not called in this forward (a head of another task): zero gradients, as step(closure)
            (phi,) = self.noises
            block.accumulate(stats[block], phi, [p.new_zeros((phi.shape[0], *p.shape), dtype=block.state["mean"].dtype)
                                                 for p in block.params])
            return
        if "delta" not in self.saved:
            raise RuntimeError(f"no gradient reached {type(self.module).__name__}: is its output used by the loss?")
        (phi,) = self.noises
        delta, x = self.saved["delta"] * grad_scale, self.saved["x"]
        x_aug = augmented_input(block, x, shared_inputs) if x.ndim == 2 else block.augment(x)
        block.accumulate_factored(stats[block], phi, delta, x_aug, self.saved["noise_pre"])


def augmented_input(block: KroneckerBlock, x: Tensor, cache: dict, *, keep_one: bool = False) -> Tensor:
    """X_aug of an input (r, n_in) that may be shared by several samples or chunks: the same input gets the same
    X_aug object, so `LowRank` sums its right factors (the statistic keeps rank r). The key has the strides
    (x[:, :n] and x[:, ::2] share address and shape), and a hit is checked by value: an input recomputed later
    may reuse a freed address (the cache does not keep inputs alive), or be overwritten in place (a buffer the
    closure refills for every sample). X_aug is never the input itself (without a bias: a copy), so neither the
    check nor the statistics that keep X_aug as a factor see such a write. `keep_one`: a miss empties the cache
    first (it then holds the latest input only)."""
    x_aug = cached_augmented_input(block, x, cache)
    if x_aug is None:
        if keep_one:
            cache.clear()
        x_aug = cache[_input_key(block, x)] = block.augment(x) if block.has_bias else x.clone()
    return x_aug


def _input_key(block: KroneckerBlock, x: Tensor) -> tuple:
    return x.data_ptr(), tuple(x.shape), x.stride(), block.has_bias


def cached_augmented_input(block: KroneckerBlock, x: Tensor, cache: dict) -> Tensor | None:
    """The X_aug that `augmented_input` cached for this input, or None."""
    x_aug = cache.get(_input_key(block, x))
    return x_aug if x_aug is not None and torch.equal(x_aug[..., : x.shape[-1]], x) else None


class SampledNetwork:
    """Context manager: inside it, `model(x)` returns the outputs of c sampled networks, stacked (c * r, ...).

    Args:
        modules: module -> the posterior blocks covering its parameters.
        noises: block -> noise (c, *block.noise_shape).
        c: number of samples in this pass; r: batch rows.
        track_grad: record what the update statistics need (training); False for prediction.
    """

    def __init__(self, modules: dict[nn.Module, list[PosteriorBlock]], noises: dict[PosteriorBlock, Tensor],
                 c: int, r: int, track_grad: bool):
        calls: list[nn.Module] = []
        self.samples, self.token = c, None
        self.layers = [_Layer(module, blocks, [noises[b] for b in blocks], c, r, track_grad, calls)
                       for module, blocks in modules.items()]

    def __enter__(self) -> SampledNetwork:
        for layer in self.layers:
            layer.module.forward = layer.forward
        self.token = _STACKED.set(self.samples)
        return self

    def __exit__(self, *exc: object) -> None:
        _STACKED.reset(self.token)
        for layer in self.layers:
            del layer.module.forward  # back to the class's forward

    def accumulate(self, stats: dict[PosteriorBlock, dict], grad_scale: float, shared_inputs: dict) -> None:
        for layer in self.layers:
            layer.accumulate(stats, grad_scale, shared_inputs)
