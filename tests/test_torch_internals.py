"""The undocumented torch behaviour the library relies on, each in one place (issue 37), checked here so that a
torch release that changes it fails loudly, with the module to fix named:

- foovb.reduction reads how a loss was reduced from autograd nodes' `_saved_*` attributes;
- foovb.reduction (LossSpy) and foovb.capture (LinearCapture) intercept torch functions with TorchFunctionMode,
  Tensor.backward included;
- foovb.capture fills deferred weights with NaN, so that a read it does not see poisons the loss;
- foovb.engine checks a step's statistics and update for NaN / Inf through `torch._foreach_norm`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def _leaf():
    return torch.randn(4, 3, requires_grad=True), torch.tensor([0, 1, 2, 0])


def test_autograd_nodes_keep_the_attributes_that_foovb_reduction_reads():
    x, y = _leaf()
    nll = F.cross_entropy(x, y).grad_fn
    assert type(nll).__name__ == "NllLossBackward0", "foovb.reduction: cross_entropy's last node changed"
    assert nll._saved_reduction == 1 and float(nll._saved_total_weight) == 4.0
    assert F.cross_entropy(x, y, reduction="sum").grad_fn._saved_reduction == 2
    mean = x.square().mean().grad_fn
    assert type(mean).__name__ == "MeanBackward0" and tuple(mean._saved_self_sym_sizes) == (4, 3)
    total = x.square().sum().grad_fn
    assert type(total).__name__ == "SumBackward0" and tuple(total._saved_self_sym_sizes) == (4, 3)
    for scaled in (F.cross_entropy(x, y) / 2, F.cross_entropy(x, y) * 2):
        node = scaled.grad_fn
        assert node.next_functions[1][0] is None and float(node._saved_other) == 2.0
    smoothed = F.cross_entropy(x, y, label_smoothing=0.1).grad_fn
    assert type(smoothed).__name__ == "AddBackward0", "foovb.reduction: label smoothing's graph changed"


def test_torch_function_mode_sees_backward_and_linear():
    seen = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x, y = _leaf()
    weight = torch.randn(3, 3, requires_grad=True)
    with Spy():
        F.cross_entropy(F.linear(x, weight), y).backward()
    assert F.linear in seen, "foovb.capture: TorchFunctionMode no longer sees F.linear"
    assert torch.Tensor.backward in seen, "foovb.reduction: TorchFunctionMode no longer sees Tensor.backward"


def test_a_nan_weight_poisons_the_loss_that_reads_it():
    x, y = _leaf()
    weight = torch.full((3, 3), math.nan, requires_grad=True)
    assert torch.isnan(F.cross_entropy(x @ weight, y)), "foovb.capture: an unseen read would go unnoticed"


def test_foreach_norm_gives_each_tensors_norm_and_propagates_non_finite_values():
    """foovb.engine._norms: one norm per tensor, of mixed shapes and dtypes, NaN / Inf kept."""
    tensors = [torch.tensor([3.0, 4.0]), torch.ones(2, 2, dtype=torch.float64), torch.tensor([1.0, math.inf])]
    norms = torch._foreach_norm(tensors)
    assert [float(n) for n in norms[:2]] == [5.0, 2.0] and math.isinf(float(norms[2]))
    assert math.isnan(float(torch._foreach_norm([torch.tensor([math.nan, 1.0])])[0]))
