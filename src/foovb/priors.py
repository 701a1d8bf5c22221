"""The initial posterior (the prior of the first mini-batch) of the diagonal and full families: its std per tensor.

`std_init` is either one number for every parameter (the paper's sigma_init, 0.047 on discrete permuted MNIST) or
"xavier": each layer's own std, sqrt(2 / (fan_in + fan_out)). That is the std of Xavier-normal initialisation and of
the paper's initialisation of the diagonal family's means (appendix "Implementation details": variance
2 / (n_input + n_output)); on the paper's 784 -> 100 first layer it is 0.0476, the paper's sigma_init 0.047. Unlike one
global number it follows the layer: a 100 -> 10 head gets 0.135 (docs/results.md, "The default prior").
It depends on the shapes only, never on the values: a pretrained or an all-zero weight gets the same prior as a
freshly initialised one, and the means are the model's weights (init="keep") whatever their scale.
"""

from __future__ import annotations

import math

from torch import Tensor, nn

XAVIER = "xavier"
PAPER_STD_INIT = 0.047  # the paper's sigma_init (appendix, "Discrete permuted MNIST")


def fans(tensor: Tensor) -> tuple[int, int]:
    """(fan_in, fan_out) of a weight of two or more dimensions, torch's convention: Linear (out, in) gives
    (in, out); a convolution (out, in / groups, *kernel) gives (in / groups, out) times the kernel's size."""
    receptive_field = math.prod(tensor.shape[2:])
    return tensor.shape[1] * receptive_field, tensor.shape[0] * receptive_field


def xavier_std(param: Tensor, module: nn.Module | None = None) -> float:
    """sqrt(2 / (fan_in + fan_out)) of `param`, the prior std that std_init="xavier" gives it.

    The fans are the tensor's own when it has two or more dimensions, else those of the first parameter of two or
    more dimensions of its module (a Linear/Conv bias takes its weight's). A parameter with neither (the scale and
    shift of a norm layer, a scalar) or with no elements takes the paper's sigma_init, 0.047.
    """
    candidates = [param] if param.ndim >= 2 else [p for p in (module.parameters(recurse=False) if module else ())
                                                   if p.ndim >= 2]
    if not candidates or candidates[0].numel() == 0:
        return PAPER_STD_INIT
    fan_in, fan_out = fans(candidates[0])
    return math.sqrt(2.0 / (fan_in + fan_out))


def initial_std(std_init: float | str, param: Tensor, module: nn.Module | None = None) -> float:
    """The initial posterior std of `param`: std_init itself, or its `xavier_std` for std_init="xavier"."""
    return xavier_std(param, module) if std_init == XAVIER else float(std_init)
