"""The suite's models (the paper's MLP, the vision mix's LeNet; `model.kind` of a config) and the heads of a
multi-head (task-aware) model.

A multi-head model returns all heads' logits concatenated ``(r, num_heads * C)``; a learner reads one task's head
with :func:`head_logits`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import Tensor, nn

__all__ = ["MODELS", "head_logits", "lenet", "make_model", "mlp"]


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


def mlp(input_size: int, hidden: Sequence[int] = (100, 100), num_classes: int = 10,
        bias: bool = True) -> nn.Sequential:
    """The paper's fully connected ReLU network (784-100-100-10 discrete, 1024-200-200-10 continuous); MESU's
    comparison uses one without biases."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = input_size
    for size in hidden:
        layers += [nn.Linear(width, size, bias=bias), nn.ReLU()]
        width = size
    layers.append(nn.Linear(width, num_classes, bias=bias))
    return nn.Sequential(*layers)


def lenet(input_shape: Sequence[int] = (3, 32, 32), num_heads: int = 5, num_classes: int = 10) -> nn.Sequential:
    """LeNet-like network of the vision-datasets mix: conv 20 and 50 channels (kernel 5, ReLU, max-pool),
    fully connected 500, and one 10-way head per task (all heads in one Linear, sliced by task)."""
    channels, height, width = input_shape
    out_height, out_width = ((height - 4) // 2 - 4) // 2, ((width - 4) // 2 - 4) // 2
    features = 50 * out_height * out_width
    return nn.Sequential(
        nn.Conv2d(channels, 20, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(20, 50, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(features, 500), nn.ReLU(), nn.Linear(500, num_heads * num_classes),
    )


MODELS = ("mlp", "lenet")


def make_model(kind: str, input_shape: Sequence[int], num_classes: int, num_heads: int = 1,
               hidden: Sequence[int] = (100, 100), bias: bool = True) -> nn.Module:
    if kind == "mlp":
        return mlp(int(np.prod(input_shape)), hidden, num_classes * num_heads, bias)
    if not bias:
        raise ValueError(f"model.bias: false is supported by the mlp model only, not {kind!r}")
    if kind == "lenet":
        return lenet(input_shape, num_heads, num_classes)
    raise ValueError(f"unknown model {kind!r}; known: {', '.join(MODELS)}")
