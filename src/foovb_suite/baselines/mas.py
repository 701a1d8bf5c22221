"""Memory Aware Synapses with the consolidation taken at every iteration (the paper's task-agnostic adaptation)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .consolidation import PerIterationConsolidationLearner


class MASLearner(PerIterationConsolidationLearner):
    """Memory Aware Synapses (Aljundi et al. 2018) with per-iteration consolidation.

    Importance: the sensitivity of the squared L2 norm of the (task-head) logits ``f``. With
    ``importance="batch"`` (default) ``Omega_batch = | grad_theta (1/B) sum_n ||f(x_n; theta_t)||_2^2 |``, from
    the batch-mean gradient, as in the Continual-Learning-Benchmark implementation of Hsu et al. 2018 (which
    also averages over the ``C`` outputs, so its importance is ``1/C`` of this one and its ``reg`` ``c`` is
    ``c / C`` here). With ``importance="per_sample"`` it is the MAS paper's definition,
    ``Omega_batch = (1/B) sum_n | grad_theta ||f(x_n; theta_t)||_2^2 |``, from per-sample gradients (larger, by
    the triangle inequality, wherever the samples' gradients disagree in sign); supported for models whose
    trainable parameters all belong to ``nn.Linear`` layers (``ValueError`` otherwise), computed exactly at the
    cost of one extra forward and backward pass.
    ``Omega <- gamma * Omega + Omega_batch`` every iteration, anchor ``theta* <- theta`` after every step;
    penalty ``reg * sum_k Omega_k (theta_k - theta*_k)^2`` (``curvature_scale = 2 * reg``), applied by the
    proximal rule of ``PerIterationConsolidationLearner``. The labels do not enter the importance (MAS is
    unsupervised).
    """

    name = "mas"

    def __init__(
        self,
        model: nn.Module,
        lr: float = 0.001,
        reg: float = 0.1,
        gamma: float = 1.0,
        optimizer: str = "sgd",
        num_heads: int = 1,
        classes_per_head: int | None = None,
        importance: str = "batch",
    ) -> None:
        super().__init__(model, lr, reg, gamma, optimizer, num_heads, classes_per_head)
        if importance not in ("batch", "per_sample"):
            raise ValueError(f"importance must be 'batch' or 'per_sample', got {importance!r}")
        self.importance_estimate = importance
        self.linear_layers: dict[str, nn.Linear] = {}
        if importance == "per_sample":
            self.linear_layers = {
                name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)
            }
            in_linear_layers = {id(p) for layer in self.linear_layers.values() for p in layer.parameters(recurse=False)}
            others = sorted(name for name, p in self.trainable_parameters.items() if id(p) not in in_linear_layers)
            if others:
                raise ValueError(
                    f"importance='per_sample' supports models whose trainable parameters all belong to nn.Linear "
                    f"layers (each applied at most once per forward pass); these do not: {others}"
                )

    @property
    def curvature_scale(self) -> float:
        return 2.0 * self.reg

    def _batch_importance(self, logits: Tensor, x: Tensor, task: int | None) -> dict[str, Tensor]:
        if self.importance_estimate == "per_sample":
            return self._per_sample_importance(x, task)
        mean_squared_output_norm = logits.square().sum(dim=1).mean()
        return {
            name: gradient.abs()
            for name, gradient in self._gradients_keeping_graph(mean_squared_output_norm).items()
        }

    def _per_sample_importance(self, x: Tensor, task: int | None) -> dict[str, Tensor]:
        """``(1/B) sum_n | grad_theta ||f(x_n; theta_t)||^2 |`` (the MAS paper's importance) without per-sample passes.

        A linear layer's per-sample weight gradient is the outer product ``delta_n a_n^T`` of the gradient
        w.r.t. its output and its input, so ``(1/B) sum_n |delta_n a_n^T| = |delta|^T |a| / B``: one forward and
        one backward pass of ``sum_n ||f(x_n)||^2`` (samples do not interact), then one matrix product per layer.
        """
        layer_inputs: dict[str, Tensor] = {}
        layer_outputs: dict[str, Tensor] = {}

        def capture(name: str) -> Callable[[nn.Module, tuple[Tensor, ...], Tensor], None]:
            def hook(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
                if name in layer_outputs:  # a shared layer's per-sample gradient sums outer products
                    raise ValueError(f"importance='per_sample': linear layer {name!r} is applied more than once")
                layer_inputs[name], layer_outputs[name] = args[0], output

            return hook

        hooks = [layer.register_forward_hook(capture(name)) for name, layer in self.linear_layers.items()]
        try:
            squared_output_norms = self._head_logits(self.model(x), task).square().sum()
        finally:
            for hook in hooks:
                hook.remove()
        used_layers = {name: layer for name, layer in self.linear_layers.items() if name in layer_outputs}
        output_gradients = torch.autograd.grad(squared_output_norms, [layer_outputs[name] for name in used_layers])
        importance_of: dict[int, Tensor] = {}  # by id of the parameter
        for (name, layer), output_gradient in zip(used_layers.items(), output_gradients, strict=True):
            if output_gradient.dim() != 2:
                raise ValueError(
                    f"importance='per_sample' needs each linear layer applied to (batch, features) inputs; "
                    f"layer {name!r} got shape {tuple(layer_inputs[name].shape)}"
                )
            abs_output_gradient = output_gradient.abs()
            importance_of[id(layer.weight)] = abs_output_gradient.T @ layer_inputs[name].detach().abs() / len(x)
            if layer.bias is not None:
                importance_of[id(layer.bias)] = abs_output_gradient.mean(dim=0)
        return {  # unused layers: zero
            name: importance_of.get(id(parameter), torch.zeros_like(parameter))
            for name, parameter in self.trainable_parameters.items()
        }
