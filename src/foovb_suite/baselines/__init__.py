"""Point-estimate baseline learners for the continual-learning comparison (paper, "Applications and
Experiments" and appendix "Implementation details").

All learners implement the ``Learner`` protocol of docs/ARCHITECTURE.md: ``observe(x, y, task=None)`` takes
one optimiser step on the batch and returns its cross-entropy, ``predict(x, task=None)`` returns softmax
probabilities (``Predictions.mean`` only), ``state_dict()`` / ``load_state_dict()`` round-trip the model,
the optimiser and the method's own state exactly, so an interrupted run resumes bit-for-bit.

Multi-head (task-aware) models: one head per task, each step moving only the task's head (:mod:`.base`).

One baseline a module; what they share, :class:`BaselineLearner`, in :mod:`.base`:

* ``SGDLearner``, ``AdamLearner``, ``AdagradLearner`` (:mod:`.plain`): plain optimisers (defaults: the paper's
  best learning rates on discrete permuted MNIST, appendix table "Adam, SGD and Adagrad").
* ``OnlineEWCLearner`` (:mod:`.ewc_online`), ``MASLearner`` (:mod:`.mas`): consolidation taken at every iteration
  instead of at task switches, the task-agnostic adaptation used in the paper (paragraph "Inapplicability of other
  CL algorithms"; their shared base, :mod:`.consolidation`).
* ``SILearner`` (:mod:`.si`): Synaptic Intelligence, task-aware (consolidates when the task id changes).

``BASELINES`` names them for ``learner.kind``; :func:`make_baseline` builds one by name.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from .base import BaselineLearner
from .ewc_online import OnlineEWCLearner
from .mas import MASLearner
from .plain import AdagradLearner, AdamLearner, SGDLearner
from .si import SILearner

__all__ = ["BASELINES", "AdagradLearner", "AdamLearner", "BaselineLearner", "MASLearner", "OnlineEWCLearner",
           "SGDLearner", "SILearner", "make_baseline"]

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
            f"accepted: {', '.join(accepted)} (after --set learner.kind=..., the config's learner.params "
            f"stay: replace them too, e.g. --set \"learner.params={{{accepted[0]}: ...}}\")"
        )
    return learner_class(model, **hyperparameters)
