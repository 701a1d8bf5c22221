"""Point-estimate baseline learners for the continual-learning comparison (paper, "Applications and
Experiments" and appendix "Implementation details").

All learners implement the ``Learner`` protocol of docs/ARCHITECTURE.md: ``observe(x, y, task=None)`` takes
one optimiser step on the batch and returns its cross-entropy, ``predict(x, task=None)`` returns softmax
probabilities (``Predictions.mean`` only), ``state_dict()`` / ``load_state_dict()`` round-trip the model,
the optimiser and the method's own state exactly, so an interrupted run resumes bit-for-bit.

Multi-head (task-aware) models return all heads' logits concatenated ``(r, num_heads * C)``, the heads being the
rows of the model's last ``nn.Linear``; with ``num_heads > 1`` the learner uses the slice
``[:, task * C:(task + 1) * C]`` of the given task for both the loss and the prediction, and a step moves only
that head's rows (``BaselineLearner._step_task_head``), as if each head were a parameter of its own.

* ``SGDLearner``, ``AdamLearner``, ``AdagradLearner``: plain optimisers (defaults: the paper's best learning
  rates on discrete permuted MNIST, appendix table "Adam, SGD and Adagrad").
* ``OnlineEWCLearner``, ``MASLearner``: consolidation taken at every iteration instead of at task switches,
  the task-agnostic adaptation used in the paper (paragraph "Inapplicability of other CL algorithms").
* ``SILearner``: Synaptic Intelligence, task-aware (consolidates when the task id changes).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from foovb.predict import Predictions
from foovb.validation import is_integer, is_real

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


def head_logits(logits: Tensor, task: int | None, num_heads: int, classes_per_head: int | None) -> Tensor:
    """The logits of ``task``'s head of a multi-head model (all logits for a single head).

    ``classes_per_head=None`` infers ``logits.shape[1] // num_heads``.
    """
    if num_heads == 1:
        return logits
    if task is None:
        raise ValueError(f"a multi-head model (num_heads={num_heads}) needs the task id")
    if not 0 <= task < num_heads:
        raise ValueError(f"task {task} out of range for num_heads={num_heads}")
    width = classes_per_head or logits.shape[1] // num_heads
    if width * num_heads != logits.shape[1]:
        raise ValueError(
            f"model returns {logits.shape[1]} logits, expected num_heads * classes_per_head = {num_heads} * {width}"
        )
    return logits[:, task * width : (task + 1) * width]


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


class SGDLearner(BaselineLearner):
    """Plain SGD (default lr 0.001, best on discrete permuted MNIST in the paper's search)."""

    name = "sgd"

    def __init__(
        self, model: nn.Module, lr: float = 0.001, num_heads: int = 1, classes_per_head: int | None = None
    ) -> None:
        super().__init__(model, lr, "sgd", num_heads, classes_per_head)


class AdamLearner(BaselineLearner):
    """Adam, betas (0.9, 0.999), eps 1e-8 (default lr 0.0001, best on discrete permuted MNIST)."""

    name = "adam"

    def __init__(
        self, model: nn.Module, lr: float = 0.0001, num_heads: int = 1, classes_per_head: int | None = None
    ) -> None:
        super().__init__(model, lr, "adam", num_heads, classes_per_head)


class AdagradLearner(BaselineLearner):
    """Adagrad (default lr 0.001, best on discrete permuted MNIST)."""

    name = "adagrad"

    def __init__(
        self, model: nn.Module, lr: float = 0.001, num_heads: int = 1, classes_per_head: int | None = None
    ) -> None:
        super().__init__(model, lr, "adagrad", num_heads, classes_per_head)


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


class OnlineEWCLearner(PerIterationConsolidationLearner):
    """Online EWC in Schwarz et al. 2018's form ("Progress & Compress": the running sum below; EWC++, Chaudhry et
    al. 2018, "Riemannian Walk", normalises it as a moving average, the same up to a rescaled `reg` for a fixed
    gamma) with the consolidation taken at every iteration (the paper's task-agnostic adaptation).

    Penalty ``reg/2 * sum_k F_k (theta_k - theta*_k)^2`` (``curvature_scale = reg``), applied by the
    per-iteration proximal rule of ``PerIterationConsolidationLearner``; running Fisher
    ``F <- gamma * F + F_batch``, anchor ``theta* <- theta`` after every step.

    ``F_batch`` is the diagonal Fisher information *per sample*, estimated from one backward pass: labels
    ``y_hat_n ~ p(. | x_n, theta_t)`` are sampled from the model (true Fisher, not the empirical one) and
    ``F_batch = B * (grad_theta (1/B) sum_n log p(y_hat_n | x_n, theta_t))^2``. Sampled labels make the scores
    zero-mean and independent across samples, so this is an unbiased estimate of the mean per-sample squared
    score ``(1/B) sum_n (grad log p(y_hat_n | x_n))^2``. Normalising per sample makes ``F`` independent of the
    batch size: after ``n`` iterations ``F`` is about ``n`` single-sample Fishers, and ``reg`` scales that
    evidence (the paper's best values were 10 with lr 0.001 on discrete permuted MNIST, whose numbers this
    reproduces with ``optimizer="adam"``, and 0.1 with lr 0.01 and SGD on continuous permuted MNIST).
    The Continual-Learning-Benchmark implementation (Hsu et al. 2018) penalises
    ``reg * sum_k F_k (theta_k - theta*_k)^2`` (no 1/2, so its ``reg`` ``c`` is ``2 c`` here) and labels the
    Fisher samples with the model's argmax. Here the labels are drawn from the learner's own generator (seeded
    by ``seed``, saved in ``state_dict``), so the global random stream is untouched and resumed runs are exact.
    """

    name = "ewc_online"

    def __init__(
        self,
        model: nn.Module,
        lr: float = 0.001,
        reg: float = 10.0,
        gamma: float = 1.0,
        optimizer: str = "sgd",
        num_heads: int = 1,
        classes_per_head: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(model, lr, reg, gamma, optimizer, num_heads, classes_per_head)
        # on the CPU whatever the model's device: the same labels, and checkpoints that load on either device
        self.label_generator = torch.Generator().manual_seed(seed)

    @property
    def curvature_scale(self) -> float:
        return self.reg

    def _batch_importance(self, logits: Tensor, x: Tensor, task: int | None) -> dict[str, Tensor]:
        probabilities = torch.softmax(logits.detach(), dim=1).cpu()
        sampled_labels = torch.multinomial(probabilities, 1, generator=self.label_generator).squeeze(1)
        sampled_labels = sampled_labels.to(logits.device)
        mean_log_likelihood = -F.cross_entropy(logits, sampled_labels)
        batch_size = logits.shape[0]
        return {
            name: batch_size * gradient.square()
            for name, gradient in self._gradients_keeping_graph(mean_log_likelihood).items()
        }

    def _method_state(self) -> dict[str, Any]:
        return {**super()._method_state(), "label_generator": self.label_generator.get_state()}

    def _check_method_state(self, state: dict[str, Any]) -> None:
        super()._check_method_state(state)
        expected = self.label_generator.get_state().numel()
        if state["label_generator"].numel() != expected:  # e.g. a CUDA generator's state
            raise ValueError("this online EWC checkpoint's Fisher-label generator state is not a CPU generator's "
                             f"({state['label_generator'].numel()} bytes, expected {expected}); it cannot be resumed")

    def _load_method_state(self, state: dict[str, Any]) -> None:
        super()._load_method_state(state)
        self.label_generator.set_state(state["label_generator"])


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


BASELINES: dict[str, type[BaselineLearner]] = {
    "sgd": SGDLearner,
    "adam": AdamLearner,
    "adagrad": AdagradLearner,
    "ewc_online": OnlineEWCLearner,
    "mas": MASLearner,
    "si": SILearner,
}


def make_baseline(name: str, model: nn.Module, **hyperparameters: Any) -> BaselineLearner:
    """Build the baseline ``name`` (one of ``BASELINES``) on ``model`` with keyword ``hyperparameters``.

    Raises:
        ValueError: unknown baseline name, unknown hyper-parameter name, or invalid hyper-parameter value.
    """
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; known baselines: {', '.join(BASELINES)}")
    learner_class = BASELINES[name]
    accepted = [argument for argument in inspect.signature(learner_class).parameters if argument != "model"]
    unknown = sorted(set(hyperparameters) - set(accepted))
    if unknown:
        raise ValueError(
            f"unknown hyper-parameter(s) {', '.join(unknown)} for baseline {name!r}; "
            f"accepted: {', '.join(accepted)}"
        )
    return learner_class(model, **hyperparameters)
