"""What every baseline shares (:class:`BaselineLearner`): the optimiser, the cross-entropy step, prediction, the
state dict, and the heads of a multi-head model.

Multi-head (task-aware) models return all heads' logits concatenated ``(r, num_heads * C)``, the heads being the
rows of the model's last ``nn.Linear``; with ``num_heads > 1`` the learner uses the slice
``[:, task * C:(task + 1) * C]`` of the given task for both the loss and the prediction, and a step moves only
that head's rows (``BaselineLearner._step_task_head``), as if each head were a parameter of its own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from foovb.predict import Predictions
from foovb.validation import is_integer, is_real

from ..models import head_logits

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adagrad": torch.optim.Adagrad,
}


def _require_positive(name: str, value: float) -> None:
    if not (is_real(value) and value > 0):
        raise ValueError(f"{name} must be a number > 0, got {value!r}")


def _require_non_negative(name: str, value: float) -> None:
    if not (is_real(value) and value >= 0):
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")


def _copy_tensors_into(target: dict[str, Tensor], source: dict[str, Tensor], what: str) -> None:
    """Copy ``source`` into the existing tensors of ``target`` (same names and shapes required)."""
    if source.keys() != target.keys():
        raise ValueError(
            f"{what}: parameter names {sorted(source)} do not match the model's {sorted(target)}"
        )
    for name, tensor in target.items():
        if source[name].shape != tensor.shape:
            raise ValueError(f"{what}[{name!r}]: shape {tuple(source[name].shape)} != {tuple(tensor.shape)}")
        tensor.copy_(source[name])


def _head_layer(model: nn.Module, num_heads: int, classes_per_head: int | None) -> nn.Linear:
    """The last ``nn.Linear`` of a multi-head model, whose rows are the heads (module docstring)."""
    linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
    outputs = linears[-1].out_features if linears else 0
    if not outputs or outputs % num_heads or (classes_per_head and outputs != num_heads * classes_per_head):
        expected = f"{num_heads} * {classes_per_head}" if classes_per_head else f"a multiple of {num_heads}"
        found = f"its last nn.Linear has {outputs} outputs" if linears else "it has no nn.Linear"
        raise ValueError(f"a multi-head model needs its heads as the rows of its last nn.Linear ({expected} "
                         f"logits); {found}")
    return linears[-1]


class BaselineLearner:
    """Shared machinery: head slicing, cross-entropy loss, optimiser step, prediction and state.

    Args:
        model: maps inputs to logits ``(r, num_heads * classes_per_head)``.
        lr: learning rate of the optimiser.
        optimizer: one of ``OPTIMIZERS`` ("sgd", "adam", "adagrad"), torch defaults otherwise.
        num_heads: number of task heads of a multi-head model (1: a single shared head).
        classes_per_head: classes of each head; ``None`` infers ``logits.shape[1] // num_heads``.
    """

    name = "baseline"
    needs_task_ids = False  # True for task-aware methods, which need the task id in observe()

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        optimizer: str = "sgd",
        num_heads: int = 1,
        classes_per_head: int | None = None,
    ) -> None:
        _require_positive("lr", lr)
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
        if not (is_integer(num_heads) and num_heads >= 1):
            raise ValueError(f"num_heads must be an integer >= 1, got {num_heads!r}")
        if classes_per_head is not None and not (is_integer(classes_per_head) and classes_per_head >= 1):
            raise ValueError(f"classes_per_head must be None or an integer >= 1, got {classes_per_head!r}")
        self.model = model
        self.num_heads = num_heads
        self.classes_per_head = classes_per_head
        self.trainable_parameters: dict[str, nn.Parameter] = {
            name: parameter for name, parameter in model.named_parameters() if parameter.requires_grad
        }
        self.optimizer = OPTIMIZERS[optimizer](self.trainable_parameters.values(), lr=float(lr))
        self.head_layer = _head_layer(model, num_heads, classes_per_head) if num_heads > 1 else None

    def _head_logits(self, logits: Tensor, task: int | None) -> Tensor:
        """The logits of ``task``'s head (all logits for a single-head model)."""
        return head_logits(logits, task, self.num_heads, self.classes_per_head)

    def _training_loss(self, x: Tensor, y: Tensor, task: int | None) -> tuple[Tensor, Tensor]:
        """Train-mode forward pass: ``(head logits, mean cross-entropy over the batch)``."""
        self.model.train()
        logits = self._head_logits(self.model(x), task)
        return logits, F.cross_entropy(logits, y)

    def _step_sizes(self) -> dict[str, Tensor | float]:
        """Per-parameter step size ``s`` of the optimiser's last step, whose update is ``-s * direction``.

        SGD: ``s = lr``, direction the gradient. Adagrad: ``s = lr_t / (sqrt(sum g^2) + eps)``, direction the
        gradient. Adam: ``s = lr / (sqrt(v_hat) + eps)``, direction the bias-corrected first moment ``m_hat``.
        ``1 / s`` is the diagonal metric in which the step is a proximal (trust-region) step:
        ``-s * direction = argmin_d direction . d + sum d^2 / (2 s)``.
        """
        sizes: dict[str, Tensor | float] = {}
        group_of = {id(p): group for group in self.optimizer.param_groups for p in group["params"]}
        for name, parameter in self.trainable_parameters.items():
            group, state = group_of[id(parameter)], self.optimizer.state.get(parameter, {})
            if isinstance(self.optimizer, torch.optim.Adam) and state:
                step = float(state["step"])
                bias_correction2 = 1 - group["betas"][1] ** step
                sizes[name] = group["lr"] / (state["exp_avg_sq"].sqrt() / bias_correction2**0.5 + group["eps"])
            elif isinstance(self.optimizer, torch.optim.Adagrad) and state:
                decayed_lr = group["lr"] / (1 + (float(state["step"]) - 1) * group["lr_decay"])
                sizes[name] = decayed_lr / (state["sum"].sqrt() + group["eps"])
            else:
                sizes[name] = group["lr"]
        return sizes

    def _step_task_head(self, task: int | None) -> None:
        """``optimizer.step()``, with the rows of the heads other than ``task``'s (parameters and optimiser state)
        as they were. Their gradient is zero, not None (all heads are one ``nn.Linear``), so Adam's momentum
        would go on moving an old head for about ten steps after a task switch, which a head of its own (no
        gradient, no step) is spared; SGD, MAS and the joint oracle with SGD are unchanged by this."""
        if self.head_layer is None or task is None:
            self.optimizer.step()
            return
        width = self.head_layer.out_features // self.num_heads
        others = torch.ones(self.head_layer.out_features, dtype=torch.bool, device=self.head_layer.weight.device)
        others[task * width:(task + 1) * width] = False
        tensors = [p for p in (self.head_layer.weight, self.head_layer.bias) if p is not None and p.requires_grad]
        tensors += [value for p in tensors for value in self.optimizer.state.get(p, {}).values()
                    if isinstance(value, Tensor) and value.shape[:1] == (self.head_layer.out_features,)]
        kept = [tensor[others].clone() for tensor in tensors]
        self.optimizer.step()
        with torch.no_grad():
            for tensor, rows in zip(tensors, kept, strict=True):
                tensor[others] = rows

    def _parameter_snapshot(self) -> dict[str, Tensor]:
        return {name: parameter.detach().clone() for name, parameter in self.trainable_parameters.items()}

    def observe(self, x: Tensor, y: Tensor, task: int | None = None) -> float:
        """One optimiser step on the batch's mean cross-entropy; returns that cross-entropy."""
        _, data_loss = self._training_loss(x, y, task)
        self.optimizer.zero_grad()
        data_loss.backward()
        self._step_task_head(task)
        return data_loss.item()

    def predict(self, x: Tensor, task: int | None = None) -> Predictions:
        """Softmax probabilities of the (task head of the) model, in eval mode without gradients."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                logits = self._head_logits(self.model(x), task)
        finally:
            self.model.train(was_training)
        return Predictions(mean=torch.softmax(logits, dim=1))

    def _method_state(self) -> dict[str, Any]:
        """State of the continual-learning method beyond model and optimiser (none for plain optimisers)."""
        return {}

    def _load_method_state(self, state: dict[str, Any]) -> None:
        """Inverse of ``_method_state``."""

    def _check_method_state(self, state: dict[str, Any]) -> None:
        """Raise ValueError if ``state`` (from ``_method_state``) cannot be loaded; called before anything changes."""

    def state_dict(self) -> dict[str, Any]:
        """Model, optimiser and method state; tensors are live references, as in ``torch``'s state dicts."""
        return {
            "learner": self.name,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "method": self._method_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict`` of a learner of the same kind on the same architecture."""
        if state.get("learner") != self.name:
            raise ValueError(f"state of learner {state.get('learner')!r} cannot be loaded into {self.name!r}")
        self._check_method_state(state["method"])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._load_method_state(state["method"])
