"""Type checks shared by the argument validation of the optimizer, the learners and the baselines (numpy scalars
count: np.float32 is a `numbers.Real`; booleans do not, although Python makes them integers), and the checks of
the model's state when a step starts (its parameters, their gradients, which of them train)."""

from __future__ import annotations

import difflib
import numbers
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from .posteriors import PosteriorBlock

__all__ = ["caller_stacklevel", "check_same_parameters", "inspection_seed", "is_boolean", "is_integer", "is_real",
           "refuse_accumulated_gradients", "refuse_training_closure", "trainable_blocks", "unknown_arguments"]

# what a torch optimizer's arguments become in FOOVB (a user porting from SGD or Adam)
TORCH_ARGUMENTS = {
    "lr": "each weight's step is its posterior covariance times the gradient; mean_step (eta, the recommended 1 or "
          "0.7) scales it and is param_groups[0]['lr'], which LR schedulers scale",
    "weight_decay": "the prior regularises: std_init (or alpha) sets its width",
    "momentum": "the step has none; the covariance carries what the past batches measured",
    "betas": "the step has none; the covariance carries what the past batches measured",
}


LIBRARY_PACKAGES = ("foovb", "torch", "lightning", "pytorch_lightning", "lightning_fabric")


def caller_stacklevel() -> int:
    """The `stacklevel` for `warnings.warn` in the calling function that names the user's line: the first frame up the
    stack outside foovb, torch (its optimizer's step wrapper) and Lightning (its optimizer_step chain)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in LIBRARY_PACKAGES:
        frame, level = frame.f_back, level + 1
    return level


def is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_boolean(value: object) -> bool:
    """True or False (Python's, or numpy's): not the strings "false"/"true", not 0/1."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def inspection_seed(seed: object) -> int:
    """The seed of draws made to inspect or evaluate the posterior (not the training noise): an int (numpy's
    too), or None for a fresh one from torch's global generator; TypeError otherwise."""
    if seed is None:
        return int(torch.randint(2**62, (1,)).item())
    if not is_integer(seed):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    return int(seed)


def refuse_accumulated_gradients(blocks: list[PosteriorBlock]) -> None:
    """A step evaluates the batch's gradients at its own sampled networks: gradients already present (a
    backward() outside the step, e.g. gradient accumulation) would be lost, so they are an error."""
    grads = [p.grad for block in blocks for p in block.params if p.grad is not None]
    if grads and any(bool(g.any()) for g in grads):
        raise RuntimeError(
            "gradients were already computed when step() was called (gradient accumulation, e.g. Lightning's "
            "accumulate_grad_batches > 1, or a backward() outside the closure): FOO-VB evaluates each "
            "batch's gradients at its own sampled networks inside step(), so accumulated gradients cannot be "
            "used. Use one batch per step: a larger batch, or, for memory, the micro-batches' backward() calls "
            "inside the closure (equal micro-batches with a mean loss, or reduction='sum'; that is the one-batch "
            "step), and call optimizer.zero_grad() before the first step if the model still holds gradients")


def refuse_training_closure(closure: Callable[[], Tensor], blocks: list[PosteriorBlock]) -> None:
    """step(closure) after the sampled_params(train=True) blocks of a step: the closure (Lightning's manual
    optimization passes one that runs its hooks) is called once and must not train."""
    params = [p for block in blocks for p in block.params]
    if closure() is not None or any(p.grad is not None for p in params):
        for p in params:
            p.grad = None
        raise RuntimeError("step(closure) after sampled_params(train=True) blocks: the closure trained (it returned a "
                           "loss or left gradients), and its samples cannot join those of the blocks; call step() "
                           "without a closure to apply the blocks' update")


def check_same_parameters(model: nn.Module, blocks: list[PosteriorBlock], training: bool = True) -> None:
    """The model still holds the parameter tensors the optimizer was built on (not replaced by
    load_state_dict(assign=True), a new module, or a cast that makes new parameters); `training`: and no
    parameter trains that the optimizer has no posterior for."""
    held = {id(p) for p in model.parameters()}
    covered = {id(p) for block in blocks for p in block.params}
    if not covered <= held:
        raise ValueError("the model's parameters were replaced after the optimizer was built (a new module, "
                         "load_state_dict(assign=True), a cast with overwritten parameters): the optimizer would "
                         f"{'train' if training else 'sample'} the old ones; build a new FOOVB on the model as it "
                         "is now (its state_dict loads into the new one if the shapes are the same)")
    if training and any(p.requires_grad and id(p) not in covered for p in model.parameters()):
        raise ValueError("a parameter that was frozen (requires_grad=False) when the optimizer was built, or added "
                         "to the model since, requires gradients now: FOOVB keeps a posterior only for the "
                         "parameters trainable at construction. Build FOOVB with every parameter you will train "
                         "trainable and freeze layers after building (a frozen layer is left out of the step), or "
                         "freeze that parameter again")


def trainable_blocks(blocks: list[PosteriorBlock]) -> list[PosteriorBlock]:
    """The blocks whose parameters require gradients now. A block frozen after construction
    (requires_grad_(False)) is left out of the step: its weights stay at its posterior mean, unsampled,
    and its posterior is unchanged until it is unfrozen."""
    trainable_now = []
    for block in blocks:
        trainable = {p.requires_grad for p in block.params}
        if len(trainable) > 1:
            names = {id(p): name for name, p in (block.module.named_parameters(recurse=False)
                                                  if block.module is not None else ())}
            pair = " and ".join(names.get(id(p), "?") for p in block.params)
            raise ValueError(f"the {block.family} posterior of a {type(block.module).__name__} covers its {pair} "
                             "together: freeze or unfreeze both (one of them was changed with requires_grad_ after "
                             "the optimizer was built)")
        if trainable == {True}:
            trainable_now.append(block)
    if not trainable_now:
        raise ValueError("every parameter is frozen (requires_grad=False): a step has nothing to train")
    return trainable_now


def unknown_arguments(unknown: dict[str, object], valid: list[str]) -> TypeError:
    """The TypeError for keyword arguments FOOVB does not take: what a torch optimizer's argument becomes here, or
    the closest valid name."""
    lines = []
    for name in unknown:
        close = difflib.get_close_matches(name, valid, n=1)
        hint = TORCH_ARGUMENTS.get(name) or (f"did you mean {close[0]!r}?" if close else "see docs/api.md")
        lines.append(f"{name!r} ({hint})")
    return TypeError(f"FOOVB got unexpected keyword argument{'s' if len(lines) > 1 else ''} {', '.join(lines)}")
