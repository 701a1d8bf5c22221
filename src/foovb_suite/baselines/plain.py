"""The plain optimisers as baselines: SGD, Adam and Adagrad (defaults: the paper's best learning rates on discrete
permuted MNIST, appendix table "Adam, SGD and Adagrad")."""

from __future__ import annotations

from torch import nn

from .base import BaselineLearner


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
