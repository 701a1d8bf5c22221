"""Synaptic Intelligence, task-aware (consolidates when the task id changes)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .base import BaselineLearner, _copy_tensors_into, _require_non_negative, _require_positive


class SILearner(BaselineLearner):
    """Synaptic Intelligence (Zenke et al. 2017), task-aware: needs the task id in ``observe``.

    Per step (the discretised path integral): ``omega_k -= g_k * delta_theta_k`` with ``g`` the gradient of
    the *unregularised* cross-entropy and ``delta_theta`` the parameter update. When the task id
    differs from the previous call's, the finished task is consolidated (eq. 5):
    ``Omega_k += max(0, omega_k / (Delta_k^2 + xi))`` with ``Delta`` the parameter change over that task,
    then ``omega <- 0`` and the anchor ``theta~ <-`` the current parameters. The loss is (eq. 4)
    ``L + c * sum_k Omega_k (theta~_k - theta_k)^2``. Negative per-task contributions (possible when the
    penalty or the optimiser's momentum oppose the loss gradient) are clipped to zero so that the quadratic
    penalty never rewards moving away from the anchor.
    """

    name = "si"
    needs_task_ids = True

    def __init__(
        self,
        model: nn.Module,
        lr: float = 0.001,
        c: float = 0.1,
        xi: float = 0.1,
        optimizer: str = "sgd",
        num_heads: int = 1,
        classes_per_head: int | None = None,
    ) -> None:
        super().__init__(model, lr, optimizer, num_heads, classes_per_head)
        _require_non_negative("c", c)
        _require_positive("xi", xi)
        self.c = c
        self.xi = xi
        self.current_task: int | None = None
        self.importance = {name: torch.zeros_like(p) for name, p in self.trainable_parameters.items()}
        self.path_integral = {name: torch.zeros_like(p) for name, p in self.trainable_parameters.items()}
        self.anchor = self._parameter_snapshot()

    def penalty(self) -> Tensor:
        """``c * sum_k Omega_k (theta_k - theta~_k)^2`` at the current parameters (differentiable)."""
        return self.c * sum(
            (self.importance[name] * (parameter - self.anchor[name]).square()).sum()
            for name, parameter in self.trainable_parameters.items()
        )

    def _consolidate(self) -> None:
        """End of a task: fold the path integral into the importance (eq. 5) and move the anchor."""
        with torch.no_grad():
            for name, parameter in self.trainable_parameters.items():
                task_change = parameter - self.anchor[name]
                self.importance[name].add_(
                    (self.path_integral[name] / (task_change.square() + self.xi)).clamp_min(0)
                )
                self.path_integral[name].zero_()
                self.anchor[name].copy_(parameter)

    def observe(self, x: Tensor, y: Tensor, task: int | None = None) -> float:
        """One step on ``cross-entropy + penalty``; consolidates first if ``task`` changed."""
        if task is None:
            raise ValueError("SILearner is task-aware: observe() needs the task id")
        if task != self.current_task:
            self._consolidate()
            self.current_task = task
        _, data_loss = self._training_loss(x, y, task)
        parameters_before = self._parameter_snapshot()
        self.optimizer.zero_grad()
        data_loss.backward()
        data_gradients: dict[str, Tensor] = {}
        with torch.no_grad():
            for name, parameter in self.trainable_parameters.items():
                if parameter.grad is not None:  # unused heads keep no gradient and are not stepped
                    data_gradients[name] = parameter.grad.clone()
                    parameter.grad.add_(2 * self.c * self.importance[name] * (parameter - self.anchor[name]))
        self._step_task_head(task)
        with torch.no_grad():
            for name, gradient in data_gradients.items():
                update = self.trainable_parameters[name] - parameters_before[name]
                self.path_integral[name].sub_(gradient * update)
        return data_loss.item()

    def _method_state(self) -> dict[str, Any]:
        return {
            "current_task": self.current_task,
            "importance": self.importance,
            "path_integral": self.path_integral,
            "anchor": self.anchor,
        }

    def _load_method_state(self, state: dict[str, Any]) -> None:
        for key in ("importance", "path_integral", "anchor"):
            _copy_tensors_into(getattr(self, key), state[key], key)
        self.current_task = state["current_task"]
