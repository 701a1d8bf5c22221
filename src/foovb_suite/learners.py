"""Learners (Avalanche's "strategies"): FOO-VB, MESU and the baselines behind one `Learner` protocol, and
`make_learner`, which builds one by name (`learner.kind` of a config).

A learner sees batches only: `observe(x, y, task)`, where `task` is None in task-agnostic scenarios.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from foovb import FOOVB
from foovb.anchor import output_anchor, output_reference
from foovb.optimizer import PRESETS
from foovb.predict import Predictions, predict
from foovb.validation import is_boolean, is_integer

from .baselines import BASELINES, make_baseline
from .mesu import MESULearner
from .models import head_logits

__all__ = ["Learner", "FOOVBLearner", "MESULearner", "learner_hyperparameters", "make_learner", "LEARNERS"]


class Learner(Protocol):
    name: str
    model: nn.Module

    def observe(self, x: Tensor, y: Tensor, task: int | None = None) -> float: ...
    def predict(self, x: Tensor, task: int | None = None) -> Predictions: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FOOVBLearner:
    """FOO-VB as a continual learner: one optimizer step per batch, with the summed cross-entropy as L_n.

    Args:
        model: the network; trained in place (its parameters hold the posterior mean).
        posterior, mc_samples, preset: see `FOOVB`.
        eval_samples: sampled networks used for the "bma" and "single" prediction modes (0: mean only).
        batched: evaluate the MC samples in one batched pass (`FOOVB.step_batched`) or sequentially.
        chunk_size: samples per batched pass (memory bound).
        num_heads, classes_per_head: multi-head (task-aware) models.
        seed: seed of the optimizer's noise and initialisation.
        output_anchor: strength of `foovb.anchor.output_anchor` (weighted by how far each row is solved) added to
            each batch's summed loss (0: none; an extension of the paper, docs/theory.md "The output anchor").
        **options: the optimizer's hyperparameters (std_init, alpha, mean_step, cov_step, antithetic,
            std_growth, cov_momentum, init, max_full_params): see `FOOVB`; those not given take the preset's value.
    """

    name = "foovb"

    def __init__(self, model: nn.Module, posterior: str = "auto", mc_samples: int = 10, *,
                 preset: str = "recommended", eval_samples: int = 10, batched: bool = True,
                 chunk_size: int | None = None, num_heads: int = 1, classes_per_head: int = 10, seed: int = 0,
                 output_anchor: float = 0.0, **options: Any):
        if not is_integer(eval_samples) or eval_samples < 0:
            raise ValueError(f"eval_samples must be an integer >= 0, got {eval_samples!r}")
        if chunk_size is not None and (not is_integer(chunk_size) or chunk_size < 1):
            raise ValueError(f"chunk_size must be None or a positive integer, got {chunk_size!r}")
        if not is_boolean(batched):
            raise ValueError(f"batched must be true or false, got {batched!r}")
        if isinstance(output_anchor, bool) or not isinstance(output_anchor, (int, float)) or not output_anchor >= 0:
            raise ValueError(f"output_anchor must be a number >= 0, got {output_anchor!r}")
        unknown = sorted(set(options) - set(OPTIMIZER_OPTIONS))
        if unknown:
            raise ValueError(f"unknown FOO-VB hyperparameter(s) {', '.join(map(repr, unknown))}; known: "
                             f"posterior, mc_samples, preset, {', '.join(OPTIMIZER_OPTIONS)}, eval_samples, "
                             "batched, chunk_size, output_anchor")
        self.model = model
        self.output_anchor = float(output_anchor)
        self.optimizer = FOOVB(model, posterior, mc_samples, preset=preset, loss_reduction="sum", seed=seed,
                               **options)
        self.eval_samples = eval_samples
        self.batched = bool(batched)
        self.chunk_size = chunk_size
        self.num_heads = num_heads
        self.classes_per_head = classes_per_head
        self.name = f"foovb-{posterior}"

    def observe(self, x: Tensor, y: Tensor, task: int | None = None) -> float:
        """One FOO-VB step; returns the mean (per example) loss averaged over the MC samples: the cross-entropy, plus
        the output anchor where it is set."""
        def head(logits: Tensor) -> Tensor:
            return head_logits(logits, task, self.num_heads, self.classes_per_head)

        self.model.train()
        reference = output_reference(self.optimizer, x) if self.output_anchor else None

        def loss_fn(out: Tensor, target: Tensor) -> Tensor:
            loss = F.cross_entropy(head(out), target, reduction="sum")
            if reference is None:
                return loss
            return loss + output_anchor(head(out), head(reference), self.output_anchor, reduction="sum", targets=y)

        if self.batched:
            loss = self.optimizer.step_batched(x, y, loss_fn, chunk_size=self.chunk_size)
        else:
            def closure() -> Tensor:
                loss = loss_fn(self.model(x), y)
                loss.backward()
                return loss

            loss = self.optimizer.step(closure)
        return loss.item() / len(y)

    def predict(self, x: Tensor, task: int | None = None) -> Predictions:
        return predict(self.optimizer, x, self.eval_samples, chunk_size=self.chunk_size,
                       output_fn=lambda logits: torch.softmax(
                           head_logits(logits, task, self.num_heads, self.classes_per_head), -1))

    def posterior_std(self) -> np.ndarray:
        """Marginal posterior STD of every weight (the paper's STD histograms)."""
        return torch.cat([std.flatten() for std in self.posterior_stds().values()]).cpu().numpy()

    def posterior_stds(self) -> dict[str, Tensor]:
        """Marginal posterior STDs of each trained parameter tensor, by parameter name (the TensorBoard log)."""
        return {name: self.optimizer.posterior(p).std for name, p in self.model.named_parameters() if p.requires_grad}

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])  # also loads the means into the model


LEARNERS = ("foovb", "mesu", *BASELINES)
OPTIMIZER_OPTIONS = tuple(PRESETS["paper"]["diagonal"])  # the hyperparameters a preset sets


# Arguments with defaults that the runner sets itself (heads, seed), and the FOO-VB arguments that change how
# a step is computed, not what (the batched and sequential paths give the same update, tested).
_NOT_HYPERPARAMETERS = ("num_heads", "classes_per_head", "seed", "batched", "chunk_size")


def learner_hyperparameters(kind: str, hyperparameters: dict[str, Any]) -> dict[str, Any]:
    """`hyperparameters` completed with the defaults of learner `kind` (for FOO-VB: its preset's values), without
    the arguments that only say how a step is computed (so that leaving a default out and setting it
    explicitly compare equal)."""
    if kind not in LEARNERS:
        raise ValueError(f"unknown learner {kind!r}; known: {', '.join(LEARNERS)}")
    signature = inspect.signature({"foovb": FOOVBLearner, "mesu": MESULearner}.get(kind) or BASELINES[kind])
    defaults = {name: p.default for name, p in signature.parameters.items()
                if p.default is not p.empty and p.kind is not p.VAR_KEYWORD}
    if kind == "foovb":
        posterior = hyperparameters.get("posterior", defaults["posterior"])
        preset = hyperparameters.get("preset", defaults["preset"])
        defaults.update(PRESETS.get(preset, {}).get(posterior, {}))
    return {name: value for name, value in {**defaults, **hyperparameters}.items()
            if name not in _NOT_HYPERPARAMETERS}


def make_learner(kind: str, model: nn.Module, num_heads: int = 1, classes_per_head: int = 10,
                 seed: int = 0, **hyperparameters: Any) -> Learner:
    """Build a learner by name ("foovb", "mesu" or a baseline of `foovb_suite.baselines`); bad names/arguments ->
    ValueError."""
    if kind == "mesu":
        accepted = [name for name in inspect.signature(MESULearner).parameters
                    if name not in ("model", "num_heads", "classes_per_head", "seed")]
        unknown = sorted(set(hyperparameters) - set(accepted))
        if unknown:
            raise ValueError(f"unknown hyper-parameter(s) {', '.join(unknown)} for learner 'mesu'; "
                             f"accepted: {', '.join(accepted)}")
        return MESULearner(model, num_heads=num_heads, classes_per_head=classes_per_head, seed=seed,
                           **hyperparameters)
    if kind == "foovb":
        try:
            return FOOVBLearner(model, num_heads=num_heads, classes_per_head=classes_per_head, seed=seed,
                                **hyperparameters)
        except TypeError as error:  # an unknown keyword
            raise ValueError(f"learner foovb: {error}") from error
    if kind not in BASELINES:
        raise ValueError(f"unknown learner {kind!r}; known: {', '.join(LEARNERS)}")
    if "seed" in inspect.signature(BASELINES[kind]).parameters:  # e.g. online EWC's Fisher labels
        hyperparameters = {"seed": seed, **hyperparameters}
    return make_baseline(kind, model, num_heads=num_heads, classes_per_head=classes_per_head, **hyperparameters)
