"""The closure path's capture of matrix-variate nn.Linear layers (step(closure) and own-loop samples).

`LinearCapture`, a TorchFunctionMode, watches what the closure does with the weights of matrix-variate nn.Linear
blocks, so that their statistics are built in low-rank form from each layer's input X and errors Delta (as the
batched path does, `sampled.SampledNetwork`) and, where the first layer's input is the batch itself, its sampled
weight W = M + B Phi A^T is never formed (`_FactoredLinear`). It relies on two things torch does not document as
an interface, kept here and nowhere else: TorchFunctionMode sees every torch function the closure calls on a
parameter, and a deferred weight filled with NaN makes any unseen read show in the loss (`UnseenUse`, then the
sample is redone with every weight loaded). tests/test_capture.py checks both on every torch release the
project runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .posteriors import KroneckerBlock
from .precision import full_precision
from .sampled import augmented_input, cached_augmented_input

__all__ = ["LinearCapture", "UnseenUse"]


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
    gradients, Delta^T X and the column sums of Delta, and, where X needs one (a layer inside the network), X's,
    Delta W[:, :n_in] = Delta M[:, :n_in] + ((Delta B) Phi) A[:n_in]^T, also without forming W."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, mean_out: Tensor, noise_pre: Tensor,  # noqa: ANN001
                output_sqrt_cov: Tensor, given: list, input_factors: tuple[Tensor, Tensor, Tensor] | None) -> Tensor:
        ctx.save_for_backward(x)
        ctx.has_bias, ctx.given, ctx.output_sqrt_cov, ctx.input_factors = (bias is not None, given, output_sqrt_cov,
                                                                            input_factors)
        return torch.addmm(mean_out, noise_pre, output_sqrt_cov.T)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple:  # noqa: ANN001
        if torch.is_grad_enabled():  # backward(create_graph=True): the graph of this backward would miss W
            raise UnseenUse("a backward pass that builds a graph (a gradient penalty) through a deferred weight")
        (x,) = ctx.saved_tensors
        grads = [grad.T @ x] + ([grad.sum(0)] if ctx.has_bias else [])
        # what the parameters' .grad must equal if nothing else used them (summed over backward passes)
        ctx.given[:] = grads if not ctx.given else [a + b for a, b in zip(ctx.given, grads, strict=True)]
        grad_x = None
        if ctx.needs_input_grad[0]:  # (input_factors: M[:, :n_in], Phi, A[:n_in])
            mean_weight, noise, input_sqrt_cov = ctx.input_factors
            grad_x = torch.addmm(grad @ mean_weight, (grad @ ctx.output_sqrt_cov) @ noise, input_sqrt_cov.T)
        return grad_x, grads[0], grads[1] if ctx.has_bias else None, None, None, None, None, None


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
    wide input); their parameters hold NaN instead. The first F.linear on such a weight is evaluated in factored
    form, X_aug M^T + (X_aug A Phi^T) B^T, where that is cheaper (`_factorable`), reusing the step's X_aug A for
    the batch (`caches`, the same that the statistics use), and its input's gradient, if it needs one, without W
    either; a backward pass that builds a graph through it raises `UnseenUse`. Any other use of the weight or bias
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
        self.compiled = False  # the closure ran torch.compile'd code (unsafe too)
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
            self.unsafe = self.compiled = True
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
            factorable, x_aug = self._factorable(block, x, weight) if own else (False, None)
            if factorable:
                y = self._factored(block, x, weight, bias, x_aug)
            else:
                self._load(block)
                y = func(*args, **kwargs)
        else:
            y = func(*args, **kwargs)
        if own and y.requires_grad:
            captured.x, captured.version = x.detach(), x._version
            # on the output's node, not the tensor: Node pre-hooks run after the tensor hooks, so Delta is the
            # gradient that reaches the layer after any hook the user puts on its output (h.register_hook(...))
            self.handles.append(y.grad_fn.register_prehook(self._save_delta(captured)))
        return y

    def _factorable(self, block: KroneckerBlock, x: Tensor, weight: Tensor) -> tuple[bool, Tensor | None]:
        """Whether the factored form gives this call's output and the gradients: a plain float input in the
        posterior's dtype and device, outside autocast; and it is cheaper than forming W: the input is the one whose
        X_aug A the step has (the batch, from the previous sample; its X_aug is returned too), or the flops of the
        factored forward (and of its input's gradient) are fewer than forming W = M + B Phi A^T (p n (p + n)) and
        using it."""
        if (not weight.requires_grad or not torch.is_grad_enabled()
                or x.dtype != block.state["mean"].dtype or x.device != block.state["mean"].device
                or any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))):
            return False, None
        rows = x.detach().reshape(-1, block.in_features)
        inputs, products = self.caches.get(block, ({}, {}))
        x_aug = cached_augmented_input(block, rows, inputs)
        if x_aug is not None and products.get("x_aug") is x_aug:
            return True, x_aug  # X_aug A and X_aug M^T are at hand
        r, (p, n) = rows.shape[0], block.state["mean"].shape
        factored = r * n * (n + p) + r * p * p  # X_aug A, then (X_aug A) Phi^T, then B^T (X_aug M^T: r n p)
        formed = p * n * (p + n)
        if x.requires_grad:  # Delta M + ((Delta B) Phi) A^T against Delta W
            factored += r * p * n + r * p * p + r * p * n + r * n * n
            formed += r * p * n
        return factored < formed, None

    def _factored(self, block: KroneckerBlock, x: Tensor, weight: Tensor, bias: Tensor | None,
                  x_aug: Tensor | None) -> Tensor:
        """The factored F.linear; `x_aug`: the input's X_aug where `_factorable` found it cached."""
        n_in = block.in_features
        rows = x.detach().reshape(-1, n_in)
        inputs, products = self.caches.setdefault(block, ({}, {}))
        if x_aug is None:
            x_aug = augmented_input(block, rows, inputs, keep_one=True)
        if products.get("x_aug") is not x_aug:
            products.clear()
            products.update(x_aug=x_aug, x_a=block.input_times_a(rows))
        mean = block.state["mean"]
        if "mean_out" not in products:  # X_aug M^T: M is fixed during the step
            products["mean_out"] = F.linear(rows, mean[:, :n_in], mean[:, n_in] if block.has_bias else None)
        captured = self.captured[block]
        noise = self.noises[block][0]
        captured.noise_pre = products["x_a"] @ noise.T  # X_aug A Phi^T (r, p)
        input_factors = (mean[:, :n_in], noise, block.state["input_sqrt_cov"][:n_in]) if x.requires_grad else None
        y = _FactoredLinear.apply(x.reshape(-1, n_in), weight, bias, products["mean_out"], captured.noise_pre,
                                  block.state["output_sqrt_cov"], captured.factored_grads, input_factors)
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
        def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
            grad = grad_outputs[0]
            if grad is not None:
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
