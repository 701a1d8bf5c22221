"""Predictions from a FOO-VB posterior.

Three ways to predict, all reported by the evaluation (`metrics.accuracy` modes):
* "mean": the network at the posterior mean (appendix "Implementation details": the diagonal experiments
  test with the learned mean);
* "bma": the Bayesian model average, the mean of the softmax outputs of K sampled networks;
* "single": the mean accuracy of the K sampled networks taken one at a time (appendix "Implementation
  details": the matrix-variate experiments average the accuracy of 2500 sampled networks).

`uncertainty` splits the Bayesian model average's entropy into its aleatoric and epistemic parts (the mutual
information of BALD: Houlsby et al. 2011, "Bayesian active learning for classification and preference learning";
Depeweg et al. 2018, "Decomposition of uncertainty in Bayesian deep learning for efficient and risk-sensitive
learning").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .engine import stacking_is_slower
from .optimizer import FOOVB
from .sampled import SampledNetwork, check_batched_support
from .validation import inspection_seed, is_integer

__all__ = ["Predictions", "Uncertainty", "predict", "sample_probabilities", "uncertainty",
           "uncertainty_from_samples"]

OutputFn = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class Predictions:
    """Class probabilities (or whatever `output_fn` makes of the outputs) of a learner on ``r`` inputs.

    Attributes:
        mean: ``(r, C)`` probabilities of the point estimate (or posterior mean) network; any shape with the
            inputs' rows first, e.g. ``(r,)`` for a regression, ``(r, T, V)`` for a sequence model.
        samples: ``(K, *mean.shape)`` those of K sampled networks (Bayesian learners), or ``None``.
    """

    mean: Tensor
    samples: Tensor | None = None

    def __post_init__(self) -> None:
        if self.mean.dim() == 0:
            raise ValueError("Predictions.mean must have the inputs' rows first, got a 0-dim tensor")
        if self.samples is not None and (
            self.samples.dim() != self.mean.dim() + 1 or self.samples.shape[1:] != self.mean.shape
        ):
            raise ValueError(
                f"Predictions.samples must have shape (K, {', '.join(map(str, self.mean.shape))}), "
                f"got {tuple(self.samples.shape)}"
            )


def _softmax(logits: Tensor) -> Tensor:
    """The default output_fn: class probabilities. One output per row is refused: its softmax is 1 whatever the
    model says (a regression net, or a binary classifier's single logit)."""
    if not isinstance(logits, Tensor):
        raise ValueError(f"the model returns a {type(logits).__name__}, not a tensor of class logits: pass output_fn, "
                         "which maps its output to what to predict, e.g. output_fn=lambda out: "
                         "out['logits'].softmax(-1) for a dict, lambda out: out[0].softmax(-1) for a tuple")
    if logits.shape[-1] == 1:
        raise ValueError("the model has one output per row, whose softmax is always 1: these predictions are class "
                         "probabilities. Pass output_fn: lambda out: out.squeeze(-1) for a regression net's values, "
                         "torch.sigmoid for a binary classifier's logit (uncertainty() needs two or more classes)")
    return torch.softmax(logits, -1)


class _EvalMode:
    """Eval mode inside the block; every submodule's own mode restored after it."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self) -> None:
        self.modes = [(module, module.training) for module in self.model.modules()]
        self.model.eval()

    def __exit__(self, *exc: object) -> None:
        for module, training in self.modes:
            module.training = training


def _stacks_samples(optimizer: FOOVB) -> bool:
    """Whether the sampled networks are evaluated stacked: the model supports it and it is not slower here."""
    if stacking_is_slower(optimizer.blocks):
        return False
    try:
        check_batched_support(optimizer.blocks, optimizer.model)
    except ValueError:
        return False
    return True


@torch.no_grad()
def sample_probabilities(optimizer: FOOVB, inputs: Tensor, num_samples: int, *, seed: int | None = 0,
                         chunk_size: int | None = None, output_fn: OutputFn = _softmax) -> Tensor:
    """Class probabilities of `num_samples` networks drawn from the posterior, (K, r, C).

    Uses the batched path when the model allows it (nn.Linear / nn.Conv1d-3d parameters) and, on the CPU, has
    neither a convolution nor a wide layer (`engine.stacking_is_slower`: stacked, conv nets' predictions were
    measured 1.3-2x slower than one network at a time, a 784-1000-1000-10 MLP's 1.2x); else, or when the stacked
    forward fails (a skip connection from the input, inputs of more than 2 dimensions), loads the samples one at
    a time. `seed` fixes the draws (independent of the training noise stream), the same on both routes; None:
    fresh draws (from torch's global generator, as `sampled_params()`).
    """
    _check_optimizer(optimizer, "sample_probabilities")
    _check_count("num_samples", num_samples, minimum=1)
    if chunk_size is not None:
        _check_count("chunk_size", chunk_size, minimum=1)
    seed = inspection_seed(seed)
    optimizer._check_ready_to_sample("sample_probabilities()")
    with _EvalMode(optimizer.model):
        if isinstance(inputs, Tensor) and _stacks_samples(optimizer):  # else (a tuple of inputs) one at a time
            try:
                return _stacked_probabilities(optimizer, inputs, num_samples, seed, chunk_size, output_fn)
            except (RuntimeError, ValueError):  # a forward the stacked layers cannot follow: one at a time
                pass
        noises = optimizer.draw_noise(seed, range(num_samples))
        outputs = []
        try:
            for k in range(num_samples):
                optimizer.load_sample(noises, k)
                outputs.append(output_fn(optimizer.model(inputs)))
        finally:
            optimizer.load_mean_into_model()
        return torch.stack(outputs)


def _stacked_probabilities(optimizer: FOOVB, inputs: Tensor, num_samples: int, seed: int, chunk_size: int | None,
                           output_fn: OutputFn) -> Tensor:
    """`sample_probabilities` with the samples of a chunk stacked in one forward (`SampledNetwork`)."""
    modules: dict[nn.Module, list] = {}
    for block in optimizer.blocks:
        modules.setdefault(block.module, []).append(block)
    chunk = num_samples if chunk_size is None else chunk_size
    outputs = []
    for start in range(0, num_samples, chunk):
        samples = range(start, min(start + chunk, num_samples))
        noises = optimizer.draw_noise(seed, samples)
        with SampledNetwork(modules, noises, len(samples), inputs.shape[0], track_grad=False):
            out = output_fn(optimizer.model(inputs))
        outputs.append(out.unflatten(0, (len(samples), inputs.shape[0])))
    return torch.cat(outputs)


def _check_optimizer(optimizer: object, what: str) -> None:
    if not isinstance(optimizer, FOOVB):
        raise TypeError(f"{what} takes the FOOVB optimizer (which holds the model and its posterior) first, got "
                        f"{type(optimizer).__name__}")


def _check_count(name: str, value: object, minimum: int) -> None:
    if not is_integer(value):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be {'positive' if minimum == 1 else f'>= {minimum}'}, got {value}")


@torch.no_grad()
def predict(optimizer: FOOVB, inputs: Tensor, num_samples: int = 0, *, seed: int | None = 0,
            chunk_size: int | None = None, output_fn: OutputFn = _softmax) -> Predictions:
    """Posterior-mean probabilities, plus those of `num_samples` sampled networks if num_samples > 0
    (`sample_probabilities`; `seed` None: fresh draws). The outputs are read as class logits (a softmax over the
    last dimension) unless `output_fn` says otherwise: a regression net with several outputs per row (a mean and a
    log-variance) needs it, e.g. `output_fn=lambda out: out` (one column is refused; two or more cannot be told from
    logits)."""
    _check_optimizer(optimizer, "predict")
    _check_count("num_samples", num_samples, minimum=0)
    optimizer._check_ready_to_sample("predict()")
    model = optimizer.model
    with _EvalMode(model):
        mean = output_fn(model(inputs))
    samples = (sample_probabilities(optimizer, inputs, num_samples, seed=seed, chunk_size=chunk_size,
                                    output_fn=output_fn).to(mean.dtype) if num_samples > 0 else None)
    return Predictions(mean=mean, samples=samples)  # one dtype (under autocast the routes' outputs differ)


@dataclass(frozen=True)
class Uncertainty:
    """Per-input uncertainty of a classifier's K sampled networks, with class probabilities p_k = p(y | x, θ_k).

    With the Bayesian model average p̄ = (1/K) Σ_k p_k and the entropy H(p) = −Σ_c p_c log p_c (in nats,
    0 log 0 = 0):

    Attributes:
        probabilities: ``(r, C)`` the Bayesian model average p̄ (any leading shape, classes last).
        predictive_entropy: ``(r,)`` the total uncertainty H(p̄), at most log C.
        expected_entropy: ``(r,)`` the aleatoric part (1/K) Σ_k H(p_k): the noise each network sees in the input.
        mutual_information: ``(r,)`` the epistemic part (BALD), the mutual information between the label and the
            weights, I = H(p̄) − (1/K) Σ_k H(p_k) >= 0 (Jensen; the rounding below 0 is clipped): how much the
            sampled networks disagree. 0 when they agree, whatever their entropy; at most min(log C, log K).
    """

    probabilities: Tensor
    predictive_entropy: Tensor
    expected_entropy: Tensor
    mutual_information: Tensor


def _entropy(probabilities: Tensor) -> Tensor:
    """H(p) = −Σ_c p_c log p_c over the last dimension, with 0 log 0 = 0."""
    return -torch.special.xlogy(probabilities, probabilities).sum(-1)


_PROBABILITY_TOLERANCE = 1e-2  # of Σ_c p_c = 1: bfloat16 softmax outputs (autocast) were off by up to 3e-3


def uncertainty_from_samples(samples: Tensor) -> Uncertainty:
    """`Uncertainty` of the class probabilities of K networks, ``(K, r, C)`` (any shape: samples first, classes
    last), e.g. ``predict(opt, x, K).samples``. With K = 1 (one network: a point estimate's softmax) the
    predictive and the expected entropy are that network's and the mutual information is 0.

    Computed in float64 (the mutual information is a difference of two entropies near log C), returned in the
    probabilities' dtype. Raises ValueError for tensors that are not probabilities (negative entries, or rows
    that do not sum to 1: logits, log-probabilities).
    """
    if samples.dim() < 2 or samples.shape[0] == 0 or samples.shape[-1] == 0:
        raise ValueError(f"samples must have shape (K, ..., C) with K >= 1 samples and C >= 1 classes, "
                         f"got {tuple(samples.shape)}")
    probabilities = samples.double()
    if bool((probabilities < 0).any()) or not torch.allclose(
            probabilities.sum(-1), torch.ones((), dtype=torch.float64), rtol=0, atol=_PROBABILITY_TOLERANCE):
        raise ValueError("samples must be class probabilities (non-negative, summing to 1 over the "
                         "last dimension), e.g. softmax outputs; got logits, log-probabilities or NaN?")
    model_average = probabilities.mean(0)
    predictive_entropy = _entropy(model_average)
    expected_entropy = _entropy(probabilities).mean(0)
    mutual_information = (predictive_entropy - expected_entropy).clamp_min(0)
    dtype = samples.dtype
    return Uncertainty(probabilities=model_average.to(dtype), predictive_entropy=predictive_entropy.to(dtype),
                       expected_entropy=expected_entropy.to(dtype), mutual_information=mutual_information.to(dtype))


@torch.no_grad()
def uncertainty(optimizer: FOOVB, inputs: Tensor, num_samples: int = 10, *, seed: int | None = 0,
                chunk_size: int | None = None, output_fn: OutputFn = _softmax) -> Uncertainty:
    """Predictive entropy, expected entropy and mutual information of the softmax outputs of `num_samples`
    networks drawn from the posterior (`uncertainty_from_samples` of `sample_probabilities`: the same draws as
    ``predict(optimizer, inputs, num_samples, seed=seed).samples``), per input. `output_fn` maps the model's output
    to class probabilities where it is not a tensor of logits (a dict, a tuple: ``lambda out: out[0].softmax(-1)``)
    or is one binary logit (``lambda out: torch.cat([1 - out.sigmoid(), out.sigmoid()], -1)``).

    All inputs in one pass per sampled network (or per chunk of `chunk_size` stacked networks), under no_grad
    and in eval mode; each module's mode is restored and the model holds the posterior mean afterwards. `seed`
    None: fresh draws.
    """
    _check_optimizer(optimizer, "uncertainty")
    return uncertainty_from_samples(sample_probabilities(optimizer, inputs, num_samples, seed=seed,
                                                         chunk_size=chunk_size, output_fn=output_fn))
