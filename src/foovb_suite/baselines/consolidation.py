"""Quadratic-penalty consolidation taken at every iteration instead of at task switches, the task-agnostic
adaptation used in the paper (paragraph "Inapplicability of other CL algorithms"): the shared base of online EWC
(:mod:`.ewc_online`) and MAS (:mod:`.mas`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor, nn

from .base import BaselineLearner, _copy_tensors_into, _require_non_negative


class PerIterationConsolidationLearner(BaselineLearner, ABC):
    """Quadratic-penalty method whose consolidation is taken at every iteration (task-agnostic adaptation: the
    paper's paragraph "Inapplicability of other CL algorithms" takes the core action at every iteration; the
    proximal form of step 3 below is this project's choice, explained after the list).

    The regulariser is ``1/2 * sum_k curvature_scale * I_k * (theta_k - anchor_k)^2`` with a running
    importance ``I`` and the anchor set to the current parameters after every step. Each ``observe``, with
    ``theta_t`` the parameters before the step and ``s`` the optimiser's per-parameter step size
    (``_step_sizes``: ``lr`` for SGD, ``lr / (sqrt(v_hat) + eps)`` for Adam, ``lr / (sqrt(sum g^2) + eps)`` for
    Adagrad):

    1. ``I_batch`` = the method's importance of this batch at ``theta_t`` (same forward pass);
    2. ``theta'`` = optimiser step on the batch cross-entropy, ``theta' - theta_t = -s * direction``;
    3. ``theta_{t+1} = theta' - (theta' - theta_t) * a / (1 + a)`` with ``a = s * curvature_scale * I``;
    4. ``I <- gamma * I + I_batch``; anchor ``<- theta_{t+1}``.

    Why step 3: since the anchor equals the current parameters, the penalty's gradient at the start of every
    step is exactly zero, and adding the penalty to the loss would leave the plain optimiser. The penalty is
    instead applied through its proximal operator in the optimiser's own metric (forward-backward splitting).
    Step 3 is the exact minimiser of ``direction.(theta - theta_t) + sum (theta - theta_t)^2 / (2 s) +
    penalty(theta)``, i.e. ``theta_{t+1} = theta_t - s * direction / (1 + s * curvature_scale * I)``; for SGD
    ``theta_t - lr * g / (1 + lr * curvature_scale * I)``: important weights move less, and the step tends to
    an online-Newton step as the importance accumulates. With ``reg = 0`` (or before any importance has
    accumulated) step 3 changes nothing, exactly. For Adam and Adagrad ``s`` is ``lr`` divided by the
    gradient scale, so the penalty acts on the step the optimiser actually takes (with ``lr`` in place of
    ``s`` it would be weaker by that scale).

    Args:
        reg: regularisation coefficient (>= 0).
        gamma: decay of the running importance per iteration, in ``(0, 1]`` (1: plain accumulation).
        Other arguments as ``BaselineLearner``.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        reg: float,
        gamma: float = 1.0,
        optimizer: str = "sgd",
        num_heads: int = 1,
        classes_per_head: int | None = None,
    ) -> None:
        super().__init__(model, lr, optimizer, num_heads, classes_per_head)
        _require_non_negative("reg", reg)
        if not 0 < gamma <= 1:
            raise ValueError(f"gamma must be in (0, 1], got {gamma!r}")
        self.reg = reg
        self.gamma = gamma
        self.importance: dict[str, Tensor] = {
            name: torch.zeros_like(parameter) for name, parameter in self.trainable_parameters.items()
        }

    @property
    @abstractmethod
    def curvature_scale(self) -> float:
        """Factor ``s`` of the penalty ``1/2 * s * sum_k I_k (theta_k - anchor_k)^2``."""

    @abstractmethod
    def _batch_importance(self, logits: Tensor, x: Tensor, task: int | None) -> dict[str, Tensor]:
        """This batch's importance per parameter name, from the train-mode head ``logits`` of ``x`` at ``theta_t``."""

    def _gradients_keeping_graph(self, objective: Tensor) -> dict[str, Tensor]:
        """Gradient of ``objective`` per parameter name (zeros where unused); the graph is kept."""
        gradients = torch.autograd.grad(
            objective, list(self.trainable_parameters.values()), retain_graph=True, allow_unused=True
        )
        return {
            name: torch.zeros_like(parameter) if gradient is None else gradient
            for (name, parameter), gradient in zip(self.trainable_parameters.items(), gradients, strict=True)
        }

    def observe(self, x: Tensor, y: Tensor, task: int | None = None) -> float:
        """One proximal consolidation step (class docstring, steps 1-4); returns the batch cross-entropy."""
        logits, data_loss = self._training_loss(x, y, task)
        batch_importance = self._batch_importance(logits, x, task)
        anchor = self._parameter_snapshot()
        self.optimizer.zero_grad()
        data_loss.backward()
        self._step_task_head(task)
        step_sizes = self._step_sizes()
        with torch.no_grad():
            for name, parameter in self.trainable_parameters.items():
                stiffness = step_sizes[name] * self.curvature_scale * self.importance[name]
                parameter.sub_((parameter - anchor[name]) * (stiffness / (1 + stiffness)))
                self.importance[name].mul_(self.gamma).add_(batch_importance[name])
        return data_loss.item()

    def _method_state(self) -> dict[str, Any]:
        return {"importance": self.importance}

    def _load_method_state(self, state: dict[str, Any]) -> None:
        _copy_tensors_into(self.importance, state["importance"], "importance")
