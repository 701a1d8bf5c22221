"""Evaluate many Monte Carlo samples of a network in one batched forward/backward pass.

The paper's complexity appendix names two strategies: sequential samples (one network in memory) and
parallel samples. This module is the parallel one. While `SampledNetwork` is active, every covered
`nn.Linear` / `nn.Conv2d` computes the outputs of `c` sampled networks at once:

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

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .posteriors import KroneckerBlock, PosteriorBlock, full_precision

__all__ = ["LinearCapture", "SampledNetwork", "UnseenUse", "augmented_input", "check_batched_support"]

SUPPORTED = (nn.Linear, nn.Conv2d)


def check_batched_support(blocks: Sequence[PosteriorBlock], model: nn.Module | None = None) -> None:
    """Raise a clear error if the batched path would compute something else than the sequential one: a
    parameter outside nn.Linear / nn.Conv2d or other than their weight and bias (weight_norm's), a forward of
    such a module other than torch's own (it is replaced by the batched one), or a module of `model` that
    mixes the rows of a batch (batch norm using batch statistics: the stacked samples would share them)."""
    bad = sorted({type(b.module).__name__ if b.module is not None else "<no module>" for b in blocks
                  if not isinstance(b.module, SUPPORTED)})
    if bad:
        raise ValueError(
            f"the batched Monte Carlo path supports parameters of nn.Linear and nn.Conv2d only, found "
            f"parameters in {', '.join(bad)}; use the sequential path FOOVB.step(closure) for this model"
        )
    for block in blocks:
        if any(p is not block.module.weight and p is not block.module.bias for p in block.params):
            raise ValueError(f"{type(block.module).__name__} has parameters other than its weight and bias (e.g. "
                             "weight_norm's weight_g / weight_v), which the batched Monte Carlo path would not "
                             "sample; use FOOVB.step(closure) for this model")
    for module in {b.module for b in blocks}:
        base = nn.Linear if isinstance(module, nn.Linear) else nn.Conv2d
        if type(module).forward is not base.forward or "forward" in vars(module):
            raise ValueError(f"{type(module).__name__} has its own forward, which the batched Monte Carlo path "
                             f"would replace by {base.__name__}'s; use FOOVB.step(closure) for this model")
        if isinstance(module, nn.Conv2d) and module.padding_mode != "zeros":
            raise ValueError("the batched Monte Carlo path supports Conv2d with padding_mode='zeros' only")
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
        w, b = self.weight.flatten(0, 1), None if self.bias is None else self.bias.flatten()
        if shared and m.groups == 1:
            y = F.conv2d(x, w, b, m.stride, m.padding, m.dilation, 1)
        else:
            stacked = x.expand(c, *x.shape) if shared else x.view(c, r, *x.shape[1:])
            grouped = stacked.transpose(0, 1).flatten(1, 2)  # (r, c * C, H, W)
            y = F.conv2d(grouped, w, b, m.stride, m.padding, m.dilation, c * m.groups)
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
    may reuse a freed address (the cache does not keep inputs alive). `keep_one`: a miss empties the cache first
    (it then holds the latest input only)."""
    key = (x.data_ptr(), tuple(x.shape), x.stride(), block.has_bias)
    x_aug = cache.get(key)
    if x_aug is None or not torch.equal(x_aug[..., : x.shape[-1]], x):
        if keep_one:
            cache.clear()
        x_aug = cache[key] = block.augment(x)
    return x_aug

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
        self.layers = [_Layer(module, blocks, [noises[b] for b in blocks], c, r, track_grad, calls)
                       for module, blocks in modules.items()]

    def __enter__(self) -> SampledNetwork:
        for layer in self.layers:
            layer.module.forward = layer.forward
        return self

    def __exit__(self, *exc: object) -> None:
        for layer in self.layers:
            del layer.module.forward  # back to the class's forward

    def accumulate(self, stats: dict[PosteriorBlock, dict], grad_scale: float, shared_inputs: dict) -> None:
        for layer in self.layers:
            layer.accumulate(stats, grad_scale, shared_inputs)


# Tensor attributes and methods that read a parameter without making the loss depend on it
_HARMLESS_GETTERS = frozenset({"grad", "shape", "dtype", "device", "requires_grad", "is_leaf", "ndim", "layout",
                               "is_cuda", "is_sparse", "is_meta", "is_quantized", "_version", "grad_fn", "data",
                               "output_nr", "itemsize", "nbytes", "names"})
_HARMLESS_METHODS = frozenset({"size", "dim", "numel", "stride", "data_ptr", "element_size", "is_contiguous",
                               "detach", "nelement", "storage_offset", "__len__"})
_VALUE_READERS = frozenset({"data", "detach"})  # harmless for the gradient, but they read the parameter's values


def _name(func: object) -> str:
    name = getattr(func, "__name__", "")
    return getattr(getattr(func, "__self__", None), "__name__", "") if name == "__get__" else name


def _is_harmless(func: object) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") in _HARMLESS_GETTERS
    return name in _HARMLESS_METHODS


class UnseenUse(RuntimeError):
    """A deferred parameter (its sampled value not loaded, NaN in its place) was read where LinearCapture could
    not see it (another thread, a backward hook, checkpoint recomputation, torch.func): the sample must be
    redone with every sampled weight loaded."""


class _FactoredLinear(torch.autograd.Function):
    """F.linear(X, W, b) of a sampled matrix-variate layer without forming W = M + B Phi A^T: the output is
    X_aug M^T + (X_aug A Phi^T) B^T (as in `SampledNetwork`), and backward gives the weight and bias F.linear's
    gradients, Delta^T X and the column sums of Delta. X must not need a gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, mean_out: Tensor, noise_pre: Tensor,  # noqa: ANN001
                output_sqrt_cov: Tensor, given: list) -> Tensor:
        ctx.save_for_backward(x)
        ctx.has_bias, ctx.given = bias is not None, given
        return torch.addmm(mean_out, noise_pre, output_sqrt_cov.T)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple:  # noqa: ANN001
        (x,) = ctx.saved_tensors
        grads = [grad.T @ x] + ([grad.sum(0)] if ctx.has_bias else [])
        # what the parameters' .grad must equal if nothing else used them (summed over backward passes)
        ctx.given[:] = grads if not ctx.given else [a + b for a, b in zip(ctx.given, grads, strict=True)]
        return None, grads[0], grads[1] if ctx.has_bias else None, None, None, None, None


class _Captured:
    """What one Kronecker nn.Linear block's parameters went through during one sample."""

    def __init__(self) -> None:
        self.uses = 0  # torch functions that took the weight or the bias (F.linear's call included)
        self.x: Tensor | None = None  # the input of its one F.linear call (detached), and its version then
        self.version = 0
        self.delta: Tensor | None = None  # dL/dY of that call, summed over backward passes
        self.grads: dict[int, tuple[Tensor, int]] = {}  # id(param) -> (its .grad, version) after accumulation
        self.noise_pre: Tensor | None = None  # X_aug A Phi^T, where the call was evaluated in factored form
        self.factored_grads: list[Tensor] = []  # the weight's and bias's gradients from that factored call
        self.explained: dict[int, tuple[Tensor, bool]] = {}  # id(param) -> (.grad, it equalled those) at accumulation


class LinearCapture(TorchFunctionMode):
    """The sequential path's counterpart of `SampledNetwork`'s statistics (issue 30): while active (one Monte Carlo
    sample of `FOOVB.step(closure)`), it records the input X and the output errors Delta = dL/dY of every
    F.linear call on the weight of a matrix-variate nn.Linear block, so that the block's statistics can be
    built in low-rank form (`KroneckerBlock.accumulate_factored`) instead of from the dense p x n gradient.

    `exact(block)` says whether the block's gradients are exactly Delta^T X_aug: its weight and bias were used
    by exactly one torch function, F.linear(x, weight, bias), whose output received gradients; no backward
    pass built a graph or was restricted to some inputs, no autograd.grad ran (its errors would not reach
    .grad); the parameters have no gradient hooks of their own, and their .grad was not changed or replaced
    after backward (clipping, weight decay added by hand); no torch.compile'd code ran under it. Otherwise the
    caller uses the dense .grad.
    Functions are seen at the top level only (torch runs a function's internals with the mode off), which is
    where a parameter enters the computation. `close()` removes the hooks.

    Deferred sampling (`noises`, the blocks' noise of this sample): those blocks' sampled weights W = M + B Phi
    A^T are not loaded before the closure runs (forming W costs p n (p + n) flops, several forward passes for a
    wide input); their parameters hold NaN instead. The first F.linear on such a weight whose input needs no
    gradient (the batch: the first layer) is evaluated in factored form, X_aug M^T + (X_aug A Phi^T) B^T,
    reusing the step's X_aug A (`caches`, the same that the statistics use); any other use of the weight or bias
    that the mode sees (including .data and .detach()) loads W first. A read the mode cannot see (another
    thread, a backward hook, checkpoint recomputation during backward, torch.func's wrapped parameters) reads
    NaN: `check_seen` raises `UnseenUse` when the loss or a gradient is not finite, or when a still-deferred
    parameter's gradient was not exactly the factored call's, and `FOOVB.step` redoes the sample with every
    weight loaded (and stops deferring). Such a read that reaches neither the loss nor a gradient (a value
    only logged) sees NaN.
    """

    def __init__(self, blocks: Sequence[KroneckerBlock], noises: dict[KroneckerBlock, Tensor] | None = None,
                 caches: dict | None = None):
        super().__init__()
        self.captured = {block: _Captured() for block in blocks}
        self.owner = {id(p): block for block in blocks for p in block.params}
        self.noises = noises or {}
        self.unloaded = set(self.noises)  # deferred blocks whose sampled weights are not in the parameters yet
        with torch.no_grad():
            for block in self.unloaded:
                for p in block.params:
                    p.fill_(math.nan)  # a read of a deferred weight that the mode does not see must not pass
        self.caches = caches if caches is not None else {}  # block -> (X_aug cache, {x_aug, x_a, mean_out})
        self.unsafe = False  # a backward pass that .grad does not see as Delta^T X: every block falls back
        self.handles = []
        for block in blocks:
            if any(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None) for p in block.params):
                self.captured[block].uses = -1  # the user's hooks may change the gradient: never exact
                continue
            for p in block.params:
                self.handles.append(p.register_post_accumulate_grad_hook(self._record_grad(block)))

    def _record_grad(self, block: KroneckerBlock):  # noqa: ANN202
        def hook(param: Tensor) -> None:
            captured = self.captured[block]
            captured.grads[id(param)] = (param.grad, param.grad._version)
            if block in self.unloaded:  # before any change by the closure (clipping): only its factored gradient?
                index = next(i for i, own in enumerate(block.params) if own is param)
                given = captured.factored_grads
                captured.explained[id(param)] = (param.grad, index < len(given) and torch.equal(param.grad,
                                                                                                  given[index]))
        return hook

    def _touched(self, args: tuple, kwargs: dict) -> set[KroneckerBlock]:
        found = set()
        for value in (*args, *kwargs.values()):
            for item in value if isinstance(value, (list, tuple)) else (value,):
                block = self.owner.get(id(item)) if isinstance(item, Tensor) else None
                if block is not None:
                    found.add(block)
        return found

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # traced by torch.compile: no hooks in the graph, the dense gradients
            self.unsafe = True
        elif func is torch.autograd.grad:
            self.unsafe = True
        elif func is Tensor.backward or func is torch.autograd.backward:
            create_graph, inputs = (3, 4) if func is Tensor.backward else (3, 5)
            if (kwargs.get("create_graph", len(args) > create_graph and args[create_graph])
                    or kwargs.get("inputs", args[inputs] if len(args) > inputs else None) is not None):
                self.unsafe = True
        else:
            harmless = _is_harmless(func)
            if not harmless or (self.unloaded and _name(func) in _VALUE_READERS):
                touched = self._touched(args, kwargs)
                if not harmless:
                    for block in touched:
                        self.captured[block].uses += 1
                    if len(touched) == 1 and func is F.linear:
                        return self._linear(next(iter(touched)), func, args, kwargs)
                for block in touched & self.unloaded:
                    self._load(block)
        return func(*args, **kwargs)

    def _load(self, block: KroneckerBlock) -> None:
        with torch.no_grad(), full_precision():
            block.load_sample(self.noises[block][0])
        torch.clear_autocast_cache()
        self.unloaded.discard(block)

    def _linear(self, block: KroneckerBlock, func, args: tuple, kwargs: dict) -> Tensor:  # noqa: ANN001
        x = args[0] if args else kwargs.get("input")
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        captured = self.captured[block]
        own = (weight is block.params[0] and bias is (block.params[1] if block.has_bias else None)
               and captured.uses == 1 and x.shape[-1] == block.in_features)
        if block in self.unloaded:
            if own and self._factorable(block, x, weight):
                y = self._factored(block, x, weight, bias)
            else:
                self._load(block)
                y = func(*args, **kwargs)
        else:
            y = func(*args, **kwargs)
        if own and y.requires_grad:
            captured.x, captured.version = x.detach(), x._version
            self.handles.append(y.register_hook(self._save_delta(captured)))
        return y

    def _factorable(self, block: KroneckerBlock, x: Tensor, weight: Tensor) -> bool:
        """The factored form gives this call's output and the parameters' gradients: a plain float input that
        needs no gradient, in the posterior's dtype and device, outside autocast; and it is cheaper: the input is
        the one whose X_aug A the step has (the batch, from the previous sample) or has at most p rows."""
        if (x.requires_grad or not weight.requires_grad or not torch.is_grad_enabled()
                or x.dtype != block.state["mean"].dtype or x.device != block.state["mean"].device
                or any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))):
            return False
        products = self.caches.get(block, ({}, {}))[1]
        cached = products.get("x_aug")
        rows = x.reshape(-1, block.in_features)
        return (cached is not None and cached.shape[0] == rows.shape[0]) or rows.shape[0] <= block.out_features

    def _factored(self, block: KroneckerBlock, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        rows = x.detach().reshape(-1, block.in_features)
        inputs, products = self.caches.setdefault(block, ({}, {}))
        x_aug = augmented_input(block, rows, inputs, keep_one=True)
        if products.get("x_aug") is not x_aug:
            products.clear()
            products.update(x_aug=x_aug, x_a=block.input_times_a(rows))
        mean = block.state["mean"]
        if "mean_out" not in products:  # X_aug M^T: M is fixed during the step
            n_in = block.in_features
            products["mean_out"] = F.linear(rows, mean[:, :n_in], mean[:, n_in] if block.has_bias else None)
        captured = self.captured[block]
        captured.noise_pre = products["x_a"] @ self.noises[block][0].T  # X_aug A Phi^T (r, p)
        y = _FactoredLinear.apply(rows, weight, bias, products["mean_out"], captured.noise_pre,
                                  block.state["output_sqrt_cov"], captured.factored_grads)
        return y.reshape(*x.shape[:-1], block.out_features)

    def check_seen(self, loss: float, params: Sequence[Tensor]) -> None:
        """After a sample with deferred blocks: raise `UnseenUse` if a deferred weight may have been read unseen
        (class docstring): a non-finite loss or gradient (a NaN read, or a genuine overflow that the redone
        sample then reports), or a still-deferred parameter whose gradient at accumulation was not the factored
        call's (or, for a gradient set by other means, is not now)."""
        if not self.noises:
            return
        grads = [p.grad for p in params if p.grad is not None]
        if not math.isfinite(loss) or (grads and not torch.stack(torch._foreach_norm(grads)).sum().isfinite()):
            raise UnseenUse("non-finite loss or gradients in a sample with deferred weights")
        for block in self.unloaded:
            captured = self.captured[block]
            for index, p in enumerate(block.params):
                if p.grad is None:
                    continue
                seen = captured.explained.get(id(p))
                if seen is not None and seen[0] is p.grad:
                    explained = seen[1]
                else:
                    given = captured.factored_grads
                    explained = index < len(given) and torch.equal(p.grad, given[index])
                if not explained:
                    raise UnseenUse(f"a parameter of {type(block.module).__name__} was used where FOOVB's capture "
                                    "could not see it")

    def noise_pre(self, block: KroneckerBlock) -> Tensor | None:
        """X_aug A Phi^T of the block's factored F.linear call, if it had one."""
        return self.captured[block].noise_pre

    @staticmethod
    def _save_delta(captured: _Captured):  # noqa: ANN205
        def hook(grad: Tensor) -> None:
            grad = grad.detach()
            captured.delta = grad if captured.delta is None else captured.delta + grad
        return hook

    def exact(self, block: KroneckerBlock) -> bool:
        captured = self.captured.get(block)
        if self.unsafe or captured is None or captured.uses != 1 or captured.delta is None:
            return False
        if captured.x._version != captured.version:
            return False
        for p in block.params:
            seen = captured.grads.get(id(p))
            if seen is None or p.grad is not seen[0] or p.grad._version != seen[1]:
                return False
        return True

    def inputs(self, block: KroneckerBlock) -> tuple[Tensor, Tensor]:
        """The captured X (r, n_in) and Delta (r, p), rows flattened, in the posterior's dtype."""
        captured, dtype = self.captured[block], block.state["mean"].dtype
        return (captured.x.reshape(-1, block.in_features).to(dtype),
                captured.delta.reshape(-1, block.out_features).to(dtype))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
