"""FOO-VB as a `torch.optim.Optimizer` (paper, Algorithm 1 with the families of Algorithms 2-4).

Each step draws K networks theta_k = mu + A eps_k from the current posterior (the prior of this mini-batch),
evaluates the gradients of the mini-batch loss L_n at each of them, and applies one fixed-point iteration.

The loss convention matters: L_n is the mini-batch's *summed* negative log-likelihood (the paper's cumulative
cost, footnote of Eq. "variational bayes"). With `loss_reduction="sum"` the closure must return a summed loss;
with `loss_reduction="mean"` it returns a mean and the optimizer multiplies the gradients by the batch size
(pass `batch_size=` to `step`). A mean loss with the "sum" setting would shrink every update by the batch
size; there is no silent default for it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .linalg import LowRank
from .posteriors import (
    FAMILIES,
    DiagonalBlock,
    FullBlock,
    KroneckerBlock,
    PosteriorBlock,
    PosteriorView,
    drop_autocast_cache,
    full_precision,
)
from .priors import XAVIER, fans, initial_std, xavier_std
from .reduction import LossSpy, loss_reduction_of, loss_scale
from .sampled import LinearCapture, SampledNetwork, UnseenUse, augmented_input, check_batched_support
from .validation import is_boolean, is_integer, is_real

__all__ = ["FOOVB", "PRESETS", "StatisticsReducer", "loss_reduction_of"]

_MASK64 = (1 << 64) - 1


def _mix(*values: int) -> int:
    """splitmix64 of a tuple: the seed of one (step, block, sample) noise stream."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 31
    return h & ((1 << 63) - 1)


INITS = ("paper", "bgd", "alpha", "keep")
STD_GROWTH = ("paper", "capped", "none")
MAX_STD_INIT = 1e3  # far above any useful prior std; the bound keeps sigma^2 finite in float32
LOSS_REDUCTIONS = ("auto", "sum", "mean")
# A sampled weight of this many elements (or more) in one layer makes step_batched's stacked samples slower than
# one network at a time (docs/performance.md: diagonal K=10, 784-400-400-10 1.08x, 784-1000-1000-10 1.37x)
WIDE_LAYER = 2**17

# Every hyperparameter left None takes its preset's value for the family. "paper": the paper's settings
# (Algorithms 2-4, its appendix's initialisation). "recommended": the best settings measured in this project
# (docs/results.md): Lemma 2's root for the diagonal sigma, antithetic pairs, beta < 1; the model's own weights
# as the prior mean with each layer's own prior std (std_init="xavier", priors.py). The full family's
# recommendation is the paper's with antithetic pairs and the per-layer std (not tuned further).
_PAPER = {"std_init": 0.047, "alpha": 0.5, "mean_step": 1.0, "cov_step": 1.0, "antithetic": False,
          "std_growth": "paper", "cov_momentum": 0.0, "init": "paper", "max_full_params": 4096}
PRESETS: dict[str, dict[str, dict]] = {
    "recommended": {
        "diagonal": {**_PAPER, "mean_step": 0.7, "cov_step": 0.3, "antithetic": True, "std_growth": "none",
                     "init": "keep", "std_init": XAVIER},
        "kronecker": {**_PAPER, "cov_step": 0.1, "antithetic": True, "std_growth": "none", "init": "keep",
                      "std_init": XAVIER},
        "full": {**_PAPER, "antithetic": True, "init": "keep", "std_init": XAVIER},
    },
    "paper": {family: dict(_PAPER) for family in FAMILIES},
}
# Hyperparameters that only some families read (the matrix families' fallback diagonal blocks take the
# preset's std_growth and cov_momentum); alpha also sets init="alpha" for any family.
FAMILY_ONLY = {"std_growth": ("diagonal",), "cov_momentum": ("diagonal",), "alpha": ("kronecker",),
               "max_full_params": ("full",)}
# Hyperparameters fixed at construction: the posterior's structure and the noise stream depend on them (the
# step sizes, param_groups' "lr" (eta) and "cov_step" (beta), are read at every step and may change)
FIXED = ("posterior", "mc_samples", "std_init", "alpha", "loss_reduction", "antithetic", "std_growth", "cov_momentum")


def _fixed_setting(key: str, doc: str) -> property:
    return property(lambda self: self._fixed[key], doc=f"{doc} Fixed at construction.")


def _step_size(key: str, doc: str) -> property:
    return property(lambda self: self.param_groups[0][key], doc=f"{doc} Read from param_groups[0] at every step.")


def _check_step_sizes(mean_step: object, cov_step: object, names: tuple[str, str] = ("mean_step", "cov_step")) -> None:
    """eta >= 0 (0: the mean stays, the covariance still updates, as a warm-up schedule from lr 0 or a cosine
    schedule down to eta_min = 0 asks), beta > 0; both finite Python or numpy scalars."""
    if not (is_real(mean_step) and math.isfinite(mean_step) and mean_step >= 0):
        raise ValueError(f"{names[0]} must be a finite number >= 0 (Python or numpy scalar), got {mean_step!r}")
    if not (is_real(cov_step) and math.isfinite(cov_step) and cov_step > 0):
        raise ValueError(f"{names[1]} must be a positive finite number (Python or numpy scalar), got {cov_step!r}")


class StatisticsReducer(Protocol):
    """Combines the Monte Carlo statistics of the processes that train one posterior together
    (`foovb.distributed.distribute` sets one on the optimizer)."""

    samples: range  # the sample indices this process evaluates

    def reduce(self, blocks: list[PosteriorBlock], stats: dict[PosteriorBlock, dict], num_samples: int,
               losses: list[float]) -> tuple[dict[PosteriorBlock, dict], int, list[float]]:
        """The statistics, sample count and per-sample losses summed over all processes."""
        ...


@dataclass
class _Sample:
    """What a `sampled_params` block sees: its sample index, and where `step(closure)` puts the loss."""

    index: int
    loss: float | None = None


@dataclass
class _PendingStep:
    """A step whose Monte Carlo samples are being evaluated: its noise seed, statistics and losses."""

    seed: int
    blocks: list[PosteriorBlock]  # those trained by this step (not frozen since construction)
    stats: dict
    running: _RunningStatistics
    batch_size: int | None
    grad_scale: float | None = None  # sequential samples: their loss's scale, applied to the sums at the update
    losses: list[float] = field(default_factory=list)
    count: int = 0
    noises: dict = field(default_factory=dict)  # the last sample's noise (an antithetic pair's first half)
    noise_of: int = -1  # its sample index
    factored_inputs: dict = field(default_factory=dict)  # block -> the caches of its captured input X (LinearCapture)


class _RunningStatistics:
    """Batch-norm running statistics updated once per step: each sampled network's forward starts from the
    statistics before the step, and the step leaves their average over the samples (the update the
    averaged batch statistics give; K updates per step would forget K times faster)."""

    def __init__(self, model: nn.Module):
        self.modules = [m for m in model.modules()
                        if isinstance(m, nn.modules.batchnorm._NormBase) and m.running_mean is not None]
        self.before = [(m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
                       for m in self.modules]
        self.sums = [(torch.zeros_like(mean), torch.zeros_like(var)) for mean, var, _ in self.before]
        self.count = 0

    @torch.no_grad()
    def restore(self) -> None:
        for module, (mean, var, tracked) in zip(self.modules, self.before, strict=True):
            module.running_mean.copy_(mean)
            module.running_var.copy_(var)
            module.num_batches_tracked.copy_(tracked)

    @torch.no_grad()
    def record(self) -> None:
        for module, (mean_sum, var_sum) in zip(self.modules, self.sums, strict=True):
            mean_sum.add_(module.running_mean)
            var_sum.add_(module.running_var)
        self.count += 1

    @torch.no_grad()
    def average(self) -> None:
        """Leave the average of the recorded statistics (num_batches_tracked as one sample left it)."""
        if not self.count:
            return
        for module, (mean_sum, var_sum) in zip(self.modules, self.sums, strict=True):
            module.running_mean.copy_(mean_sum / self.count)
            module.running_var.copy_(var_sum / self.count)


def _scale_statistics(stats: dict[PosteriorBlock, dict], factor: float) -> None:
    """Multiply every block's Monte Carlo sums by `factor` (in place where they are tensors)."""
    for block_stats in stats.values():
        for key, value in block_stats.items():
            block_stats[key] = value.scaled(factor) if isinstance(value, LowRank) else value.mul_(factor)


def _validate(*, mc_samples: object, loss_reduction: object, seed: object, std_init: object, alpha: object,
              mean_step: object, cov_step: object, antithetic: object, std_growth: object, cov_momentum: object,
              init: object, max_full_params: object) -> None:
    """ValueError for any hyperparameter out of its domain (booleans are booleans: "false" is not False)."""
    if not is_integer(mc_samples) or mc_samples < 1:
        raise ValueError(f"mc_samples must be a positive integer, got {mc_samples!r}")
    if not (std_init == XAVIER or is_real(std_init) and math.isfinite(std_init) and 0 < std_init <= MAX_STD_INIT):
        raise ValueError(f"std_init must be a number in (0, {MAX_STD_INIT}] or {XAVIER!r}, got {std_init!r}")
    for name, value in (("alpha", alpha), ("cov_momentum", cov_momentum)):
        if not is_real(value):
            raise ValueError(f"{name} must be a real number, got {value!r}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    _check_step_sizes(mean_step, cov_step)
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    if not is_boolean(antithetic):
        raise ValueError(f"antithetic must be True or False, got {antithetic!r}")
    if antithetic and mc_samples % 2:
        raise ValueError(f"antithetic sampling (on in the recommended preset) pairs the samples: mc_samples must be "
                         f"even, got {mc_samples}; pass antithetic=False for an odd K")
    if std_growth not in STD_GROWTH:
        raise ValueError(f"std_growth must be one of {STD_GROWTH}, got {std_growth!r}")
    if not 0 <= cov_momentum < 1:
        raise ValueError(f"cov_momentum must be in [0, 1), got {cov_momentum!r}")
    if not is_integer(max_full_params) or max_full_params < 1:
        raise ValueError(f"max_full_params must be a positive integer, got {max_full_params!r}")
    if seed is not None and not is_integer(seed):
        raise ValueError(f"seed must be an integer or None, got {seed!r}")


class FOOVB(torch.optim.Optimizer):
    """Fixed-point Operator for Online Variational Bayes (paper, Algorithm 1).

    The model's parameters hold the posterior mean mu (after every step); the posterior is
    theta = mu + A eps, eps ~ N(0, I), with A per family. One step on a mini-batch with summed loss L_n::

        for k in 1..K:                      # Monte Carlo samples (antithetic pairs: eps_2j+1 = -eps_2j)
            theta_k = mu + A eps_k          # load_sample
            g_k = grad L_n(theta_k)         # the closure (or one batched pass for all K)
        E[g] = mean_k g_k,  E[g eps^T] = mean_k g_k eps_k^T
        mu    <- mu - eta A A^T E[g]                        # Eq. "mean update" (eta = 1 in the paper)
        A     <- solution of the fixed point with beta E[g eps^T]   # Lemmas 1-2; diagonal: closed form

    Args:
        model: the network. Its parameters are the prior mean (init="keep") or are re-initialised
            (init="paper"); after every step they hold the posterior mean.
        posterior: "diagonal" (Algorithm 4, every parameter tensor), "kronecker" (matrix-variate,
            Algorithm 3, per nn.Linear / nn.Conv2d whose parameters are its weight and bias; other parameters,
            e.g. weight_norm's weight_g / weight_v, fall back to diagonal) or "full"
            (multivariate, Algorithm 2, one full covariance per module; small layers only).
        mc_samples: K, Monte Carlo samples per step (the paper uses 10; K <= 2 is unstable).
        preset: where the hyperparameters left None come from: "recommended" (the best settings measured in
            this project, per family: `PRESETS`) or "paper" (the paper's settings, its initialisation included).
        std_init: initial posterior std (the first mini-batch's prior) of the diagonal and full families, and of
            the matrix family's fallback tensors: one number for every parameter (the paper: 0.047 discrete,
            0.06 continuous permuted MNIST), or "xavier" (the recommended preset's): each layer's
            sqrt(2 / (fan_in + fan_out)), 0.047 on a 784 -> 100 layer, 0.135 on a 100 -> 10 head
            (`foovb.priors.xavier_std`; it depends on the shapes only, so pretrained weights get the same prior).
        alpha: matrix-variate initialisation split (Implementation details): the mean carries a fraction
            alpha of the initial weight variance 2 / (n_in + 2), the covariance factors the rest (posterior
            "kronecker", or init="alpha").
        mean_step: eta of the mean update mu <- mu - eta Sigma E[g] (the paper: 1). Held in
            param_groups[0]["lr"], so that torch LR schedulers scale it; 0 is allowed (a warm-up from 0: the
            mean stays while the covariance update of Lemmas 1-2 still runs).
        cov_step: beta, the multiplier of E[g eps^T] in the covariance update (Lemmas 1-2; diagonal:
            sigma <- sigma sqrt(1 + (beta sigma E[g eps] / 2)^2) - beta sigma^2 E[g eps] / 2): the fixed point
            of the covariance for the likelihood raised to the power beta (the paper: 1). With E passes over
            the same data, beta = 1/E counts each example once.
        antithetic: draw the Monte Carlo samples in antithetic pairs (eps, -eps) (needs an even mc_samples).
            The estimates stay unbiased and the noise linear in eps cancels within each pair: on a quadratic
            loss E[g] is exact (an extension; the paper draws the samples independently).
        std_growth: diagonal family: how sigma may grow. "paper": the closed form of Eq. "diagonal implicit
            solution", which raises sigma where E[g eps] < 0; "capped": the same, never above std_init;
            "none": Lemma 2's root, sigma <- sigma h(|sigma E[g eps]|), h(s) = sqrt(1 + s^2/4) - s/2, so
            sigma never grows (the matrix families' solution). "capped" and "none" are extensions.
        cov_momentum: diagonal family: rho in [0, 1) of an exponential moving average over steps of the
            E[g eps] estimates used by the sigma update (0: the paper; an extension).
        init: "keep" (the model's current weights are the prior mean: a pretrained model is kept);
            "paper" (Linear/Conv weights N(0, 2 / (fan_in + fan_out)), biases 0; matrix-variate: the alpha
            split of the appendix); "bgd" ("paper" with the BGD code's biases N(0, 2 / (1 + fan_out)));
            "alpha" (the matrix-variate split for the diagonal and full families: means
            N(0, 2 alpha / (n_in + 2)), prior std sqrt(2 (1 - alpha) / (n_in + 2)) per layer).
        max_full_params: full family: the largest block (its square root of the covariance is d x d).
        loss_reduction: how the loss that the closure calls backward() on relates to the paper's L_n, the
            batch's summed negative log-likelihood. "auto": read from the loss (`foovb.reduction`): a mean
            (F.cross_entropy's default, .mean(), label smoothing, a constant times a mean) is rescaled by its
            number of terms; a loss function's reduction="sum", or a .sum() over one term per row of the model's
            input, is taken as is; anything else (a mean plus a regulariser) is an error that names the fix,
            usually step(closure, batch_size=n). "sum": the loss is L_n (a loss that holds a mean is an error).
            "mean": the loss is L_n / n, n from step(closure, batch_size=n) or read from the loss.
        seed: seed of the Monte Carlo noise (and of the paper initialisation). None draws one from torch.
    """

    def __init__(
        self,
        model: nn.Module,
        posterior: str = "diagonal",
        mc_samples: int = 10,
        *,
        preset: str = "recommended",
        std_init: float | None = None,
        alpha: float | None = None,
        mean_step: float | None = None,
        cov_step: float | None = None,
        antithetic: bool | None = None,
        std_growth: str | None = None,
        cov_momentum: float | None = None,
        init: str | None = None,
        max_full_params: int | None = None,
        loss_reduction: str = "auto",
        seed: int | None = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if posterior not in FAMILIES:
            raise ValueError(f"posterior must be one of {FAMILIES}, got {posterior!r}")
        if preset not in PRESETS:
            raise ValueError(f"preset must be one of {tuple(PRESETS)}, got {preset!r}")
        given = {"std_init": std_init, "alpha": alpha, "mean_step": mean_step, "cov_step": cov_step,
                 "antithetic": antithetic, "std_growth": std_growth, "cov_momentum": cov_momentum, "init": init,
                 "max_full_params": max_full_params}
        given = {key: value for key, value in given.items() if value is not None}
        for key, families in FAMILY_ONLY.items():
            if key in given and posterior not in families and not (key == "alpha" and given.get("init") == "alpha"):
                raise ValueError(f"{key} applies to the {' and '.join(families)} family only, not to "
                                 f"posterior={posterior!r}")
        settings = {**PRESETS[preset][posterior], **given}
        _validate(mc_samples=mc_samples, loss_reduction=loss_reduction, seed=seed, **settings)
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model has no trainable parameters")
        # Python numbers in param_groups (numpy scalars would not load with torch.load's weights_only default)
        std_init = settings["std_init"] if settings["std_init"] == XAVIER else float(settings["std_init"])
        defaults = dict(posterior=posterior, mc_samples=int(mc_samples), std_init=std_init,
                        alpha=float(settings["alpha"]), lr=float(settings["mean_step"]),
                        cov_step=float(settings["cov_step"]), loss_reduction=loss_reduction,
                        antithetic=bool(settings["antithetic"]), std_growth=settings["std_growth"],
                        cov_momentum=float(settings["cov_momentum"]))
        super().__init__(params, defaults)
        self._fixed = {key: defaults[key] for key in FIXED}
        self.model = model
        self.steps_taken = 0
        # How the statistics of a step are combined across processes: None (one process), or the object that
        # foovb.distributed.distribute sets (its `samples` and `reduce`, see `StatisticsReducer`)
        self.statistics_reducer: StatisticsReducer | None = None
        self._pending: _PendingStep | None = None  # a step begun by sampled_params(train=True) blocks
        self.generator = torch.Generator()
        self.generator.manual_seed(int(torch.randint(2**62, (1,)).item()) if seed is None else int(seed))
        init, alpha = settings["init"], float(settings["alpha"])
        layer_std: dict[int, float] = {}  # id(module) -> its initial std, where init sets it per layer
        if posterior != "kronecker":  # the matrix-variate blocks initialise themselves
            if init == "alpha":
                layer_std = self._alpha_init(model, alpha)
            elif init != "keep":
                self._paper_init(model, random_bias=init == "bgd")
        self.blocks = self._make_blocks(model, posterior, std_init, alpha, init,
                                        int(settings["max_full_params"]), layer_std)
        # matrix-variate nn.Linear blocks, whose statistics step(closure) keeps low-rank (LinearCapture), and
        # whether step(closure) defers forming their sampled weights (off for good after an unseen use)
        self._linear_kronecker = [b for b in self.blocks if isinstance(b, KroneckerBlock) and b.params[0].ndim == 2]
        self._defer_linear_samples = True
        self.load_mean_into_model()

    # Read-only views of the construction-time settings (param_groups shows them too; changing them is refused)
    mc_samples = _fixed_setting("mc_samples", "K, Monte Carlo samples per step.")
    posterior_family = _fixed_setting("posterior", '"diagonal", "kronecker" or "full".')
    loss_reduction = _fixed_setting("loss_reduction", '"auto", "sum" or "mean".')
    antithetic = _fixed_setting("antithetic", "Whether the Monte Carlo samples come in pairs (eps, -eps).")
    std_growth = _fixed_setting("std_growth", 'How the diagonal family\'s sigma may grow: "paper", "capped", "none".')
    cov_momentum = _fixed_setting("cov_momentum", "rho of the diagonal family's average of E[g eps] over steps.")
    @property
    def sample_shard(self) -> range:
        """The Monte Carlo sample indices this process evaluates: all of them, or its share under MC-parallel
        training (the update always averages over all mc_samples, after the reducer's sum)."""
        return range(self.mc_samples) if self.statistics_reducer is None else self.statistics_reducer.samples

    # The step sizes, read from param_groups at every step (a schedule may change them there)
    mean_step = _step_size("lr", 'eta of the mean update mu <- mu - eta Sigma E[g] (param_groups[0]["lr"]).')
    cov_step = _step_size("cov_step", "beta, the multiplier of E[g eps^T] in the covariance update.")

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "blocks"):
            raise ValueError("FOOVB keeps one posterior over the model it was built with; parameter groups "
                             "cannot be added (build the optimizer on a model that holds all the parameters)")
        super().add_param_group(param_group)

    def _check_param_groups(self) -> None:
        """The hyperparameters a step reads: step sizes valid, structural ones unchanged since construction."""
        group = self.param_groups[0]
        for key, value in self._fixed.items():
            if group[key] != value:
                raise ValueError(f"param_groups[0][{key!r}] was changed from {value!r} to {group[key]!r}; it is "
                                 "fixed at construction (build a new FOOVB); only 'lr' (the mean step eta) and "
                                 "'cov_step' may change")
        _check_step_sizes(group["lr"], group["cov_step"], ("param_groups[0]['lr'] (mean_step)", "cov_step"))
        group["lr"], group["cov_step"] = float(group["lr"]), float(group["cov_step"])

    # -- construction ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def _paper_init(self, model: nn.Module, random_bias: bool) -> None:
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):  # frozen parameters are left alone
                std = xavier_std(module.weight)  # the appendix's variance 2 / (n_in + n_out)
                if module.weight.requires_grad:
                    module.weight.copy_(torch.randn(module.weight.shape, generator=self.generator) * std)
                if module.bias is not None and module.bias.requires_grad:
                    if random_bias:
                        bias_std = math.sqrt(2.0 / (1 + fans(module.weight)[1]))
                        module.bias.copy_(torch.randn(module.bias.shape, generator=self.generator) * bias_std)
                    else:
                        module.bias.zero_()

    @torch.no_grad()
    def _alpha_init(self, model: nn.Module, alpha: float) -> dict[int, float]:
        """The matrix-variate split of Var(W_ij) = 2 / (n_in + 2) (Implementation details) for any family:
        draws the means, returns each layer's prior std."""
        layer_std = {}
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)) and module.weight.requires_grad:
                fan_in = module.weight[0].numel()
                mean_std = math.sqrt(2 * alpha / (fan_in + 2))
                for param in (module.weight, module.bias):
                    if param is not None and param.requires_grad:
                        param.copy_(torch.randn(param.shape, generator=self.generator) * mean_std)
                layer_std[id(module)] = math.sqrt(2 * (1 - alpha) / (fan_in + 2))
        return layer_std

    def _make_blocks(self, model: nn.Module, posterior: str, std_init: float | str, alpha: float, init: str,
                     max_full_params: int, layer_std: dict[int, float]) -> list[PosteriorBlock]:
        blocks: list[PosteriorBlock] = []
        seen: set[int] = set()
        for name, module in model.named_modules():
            direct = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if not direct:
                continue
            if any(id(p) in seen for p in direct):
                raise ValueError(f"module {name!r} shares a parameter with another module (weight tying is "
                                 "not supported: each parameter needs one posterior)")
            seen.update(id(p) for p in direct)
            module_std = layer_std.get(id(module))  # init="alpha": one prior std per layer
            if (posterior == "kronecker" and isinstance(module, (nn.Linear, nn.Conv2d))
                    and isinstance(module.weight, nn.Parameter)  # not e.g. weight_norm's computed weight
                    and all(p is module.weight or p is module.bias for p in direct)
                    and module.weight.requires_grad):  # a frozen weight leaves a diagonal bias
                if module.bias is not None and not module.bias.requires_grad:
                    raise ValueError(f"module {name!r}: a frozen bias with a trainable weight is not supported")
                blocks.append(KroneckerBlock(module, self.state[module.weight], alpha, self.generator, init))
            elif posterior == "full":
                size = sum(p.numel() for p in direct)
                if size > max_full_params:
                    need = 3 * size * size * direct[0].element_size()
                    raise ValueError(
                        f"module {name!r} has {size} parameters: a full covariance needs a {size} x {size} "
                        f"square root (~{need / 2**30:.2f} GiB with the update's workspace), above "
                        f"max_full_params={max_full_params}; use posterior='kronecker' or 'diagonal', or "
                        "raise max_full_params"
                    )
                blocks.append(FullBlock(direct, self.state[direct[0]],
                                        module_std or initial_std(std_init, direct[0], module), module))
            else:
                blocks.extend(DiagonalBlock(p, self.state[p], module_std or initial_std(std_init, p, module), module,
                                            self.std_growth, self.cov_momentum) for p in direct)
        return blocks

    # -- the posterior ---------------------------------------------------------------------------------------
    def posterior(self, param: Tensor) -> PosteriorView:
        """Mean, marginal std and dense covariance of one model parameter."""
        self._adopt_model_weights()
        for block in self.blocks:
            for index, p in enumerate(block.params):
                if p is param:
                    return block.view(index)
        raise KeyError("parameter is not optimised by this FOOVB instance")

    @torch.no_grad()
    def load_mean_into_model(self) -> None:
        """Set every model parameter to its posterior mean."""
        for block in self.blocks:
            for param, mean in zip(block.params, block.mean_values(), strict=True):
                param.copy_(mean)
        drop_autocast_cache()

    def draw_noise(self, seed: int, samples: range, *, antithetic: bool = False,
                   blocks: list[PosteriorBlock] | None = None) -> dict[PosteriorBlock, Tensor]:
        """eps for the given sample indices, (len(samples), *noise_shape) per block (of `blocks`; None: all).

        The noise of sample k of block b is a pure function of (seed, b, k): the sequential and batched paths,
        any chunking and any split of the samples across processes see the same draws. With `antithetic`,
        sample 2j + 1 is the negative of sample 2j. (Drawing blocks in a thread pool made the training loop
        slower: the pool's threads keep OpenMP workers spinning against the main thread's.)
        """

        if self._pending is None:  # drawn for inspection or prediction: from the model's current weights
            self._adopt_model_weights()
        noises = {}
        generator = torch.Generator()
        for index, block in enumerate(self.blocks):
            if blocks is not None and block not in blocks:
                continue
            ref = block.state["mean"]
            out = torch.empty(len(samples), *block.noise_shape, dtype=ref.dtype)
            for row, k in enumerate(samples):
                if antithetic and k % 2 and row and samples[row - 1] == k - 1:  # the pair's first half is drawn
                    torch.neg(out[row - 1], out=out[row])
                    continue
                generator.manual_seed(_mix(seed, index, k // 2 if antithetic else k))
                torch.randn(block.noise_shape, generator=generator, dtype=ref.dtype, out=out[row])
                if antithetic and k % 2:
                    out[row].neg_()
            noises[block] = out.to(ref.device)
        return noises

    def _next_seed(self) -> int:
        return int(torch.randint(2**62, (1,), generator=self.generator).item())

    @torch.no_grad()
    def load_sample(self, noises: dict[PosteriorBlock, Tensor], row: int) -> None:
        """Load the network of row `row` of `noises` (from `draw_noise`) into the model."""
        with full_precision():
            for block, noise in noises.items():
                block.load_sample(noise[row])
        drop_autocast_cache()

    # -- training --------------------------------------------------------------------------------------------
    def _check_gradients(self) -> None:
        """After a closure: some parameter received a dense gradient (else the step would silently do nothing)."""
        grads = [p.grad for block in self.blocks for p in block.params if p.grad is not None]
        if not grads:
            raise RuntimeError("no parameter received a gradient: the closure must call loss.backward() "
                               "(and the loss must depend on the parameters)")
        if any(g.is_sparse for g in grads):
            raise ValueError("sparse gradients are not supported (e.g. nn.Embedding(sparse=True)); use dense ones")

    def _refuse_accumulated_gradients(self) -> None:
        """A step evaluates the batch's gradients at its own sampled networks: gradients already present (a
        backward() outside the step, e.g. gradient accumulation) would be lost, so they are an error."""
        grads = [p.grad for block in self.blocks for p in block.params if p.grad is not None]
        if grads and any(bool(g.any()) for g in grads):
            raise RuntimeError(
                "gradients were already computed when step() was called (gradient accumulation, e.g. Lightning's "
                "accumulate_grad_batches > 1, or a backward() outside the closure): FOO-VB evaluates each "
                "batch's gradients at its own sampled networks inside step(), so accumulated gradients cannot be "
                "used. Use one batch per step (a larger batch instead of accumulation), and call "
                "optimizer.zero_grad() before the first step if the model still holds gradients")

    def step(self, closure: Callable[[], Tensor] | None = None, *, batch_size: int | None = None) -> float:
        """One FOO-VB step with K sequential Monte Carlo samples (one network in memory at a time).

        `closure` runs forward and backward on the model's current weights and returns the loss; it is called
        K times, each time with a fresh sample loaded into the model. `batch_size`: the loss is a mean over
        this many terms (overrides what `loss_reduction` reads from the loss). Returns the mean loss over the
        samples, as the closure returned it. Batch-norm running statistics are updated once, with the
        average of the samples' batch statistics.

        Without a closure, applies the update of the K samples that `sampled_params(train=True)` blocks have
        evaluated since the last step (your own training loop).
        """
        if closure is None:
            if self._pending is None:
                raise ValueError("FOOVB.step needs a closure that runs forward + backward and returns the loss, "
                                 "or mc_samples `with optimizer.sampled_params(train=True):` blocks before it")
            return self._finish_step()
        return self._sequential_step(closure, batch_size)

    def _sequential_step(self, closure: Callable[[], Tensor], batch_size: int | None) -> float:
        if self._pending is not None:
            raise RuntimeError("step(closure) while sampled_params(train=True) blocks have started a step: "
                               "call step() without a closure to finish that one first")
        for _ in self.sample_shard:  # the next sample overwrites the weights: the mean is loaded by the update
            for defer in (self._defer_linear_samples, False):
                try:
                    with self._training_sample(batch_size, reports_loss=True, restore_mean=False,
                                               defer=defer) as sample:
                        loss = closure()
                        if not isinstance(loss, Tensor):
                            raise TypeError(f"the closure must return the loss tensor, got {type(loss).__name__}")
                        sample.loss = float(loss.detach())
                    break
                except UnseenUse:  # the closure read a deferred weight unseen: redo the sample with all loaded
                    if not defer:
                        raise
                    self._defer_linear_samples = False
        return self._finish_step()

    @contextlib.contextmanager
    def sampled_params(self, train: bool = False, *, seed: int | None = None,
                       batch_size: int | None = None) -> Iterator[_Sample]:
        """Load a sampled network into the model for the duration of the block (the mean is restored after).

        train=False: a draw from the posterior with its own noise (`seed`; None: a fresh one), not from the
        training stream, e.g. to inspect or evaluate it.
        train=True (IVON-style, for your own training loop): the block runs forward and backward on the
        batch, and its gradients become one of the step's K Monte Carlo samples; after mc_samples blocks,
        `step()` (no closure) applies the update::

            for _ in range(optimizer.mc_samples):
                with optimizer.sampled_params(train=True):
                    F.cross_entropy(model(x), y).backward()
            optimizer.step()

        `batch_size` as in `step`. `step(closure)` is this loop with the closure as the block.
        """
        if train:
            if seed is not None:
                raise ValueError("seed is for inspection (train=False): training samples come from the "
                                 "optimizer's noise stream")
            with self._training_sample(batch_size, reports_loss=False) as sample:
                yield sample
            return
        if seed is None:  # not from self.generator: inspecting samples must not change the training noise
            seed = int(torch.randint(2**62, (1,)).item())
        noises = self.draw_noise(seed, range(1))
        try:
            self.load_sample(noises, 0)
            yield _Sample(0)
        finally:
            self.load_mean_into_model()

    @contextlib.contextmanager
    def _training_sample(self, batch_size: int | None, reports_loss: bool, restore_mean: bool = True,
                         defer: bool = False) -> Iterator[_Sample]:
        """One Monte Carlo sample of the current step: load it, let the block run forward and backward, then
        accumulate its statistics (Algorithm 1's loop body). `reports_loss`: the caller sets `sample.loss`;
        else it is read from the loss that backward() is called on. `restore_mean=False`: leave the sample in
        the model after a successful block (the caller loads the next sample or updates); a failed one always
        restores the mean. `defer`: the matrix-variate nn.Linear samples are formed only where needed
        (`LinearCapture`); an unseen use raises `UnseenUse` and leaves the step's sample to be redone."""
        pending = self._pending if self._pending is not None else self._start_step(batch_size)
        if pending.count == len(self.sample_shard):
            raise RuntimeError(f"all {pending.count} Monte Carlo samples of this step were evaluated: call step()")
        k = self.sample_shard[pending.count]
        if self.antithetic and k % 2 and pending.noise_of == k - 1:  # the pair's second half: -eps, not redrawn
            noises = {block: noise.neg() for block, noise in pending.noises.items()}
        else:
            noises = self.draw_noise(pending.seed, range(k, k + 1), antithetic=self.antithetic, blocks=pending.blocks)
        pending.noises, pending.noise_of = noises, k
        sample = _Sample(k)
        linear_kronecker = [block for block in self._linear_kronecker if block in noises]
        deferred = {block: noises[block] for block in linear_kronecker} if defer else {}
        self.load_sample({block: noise for block, noise in noises.items() if block not in deferred}, 0)
        for p in self._params():
            p.grad = None
        pending.running.restore()
        spy = LossSpy(self.model) if pending.grad_scale is None or not reports_loss else contextlib.nullcontext()
        capture = LinearCapture(linear_kronecker, deferred, pending.factored_inputs) if linear_kronecker else None
        try:
            with torch.enable_grad(), spy, capture if capture is not None else contextlib.nullcontext():
                yield sample
            if deferred:
                capture.check_seen(sample.loss, list(self._params()))
            self._check_gradients()
            if pending.grad_scale is None:  # the batch is the same for every sample: read its scale once
                pending.grad_scale = spy.scale(self.loss_reduction, pending.batch_size)
            pending.running.record()
            pending.losses.append(sample.loss if reports_loss else spy.loss)
            with full_precision():
                for block in pending.blocks:
                    if capture is not None and self._accumulate_captured(capture, block, pending, noises[block]):
                        continue
                    grads = [torch.zeros_like(p)[None] if p.grad is None else p.grad[None] for p in block.params]
                    block.accumulate(pending.stats[block], noises[block], grads)
            pending.count += 1
        except UnseenUse:  # the sample is redone (the step goes on)
            pending.running.restore()
            restore_mean = True
            raise
        except BaseException:
            self._pending = None  # a failed sample abandons the step: the posterior is unchanged
            pending.running.restore()
            restore_mean = True
            raise
        finally:
            if capture is not None:
                capture.close()
            for p in self._params():
                p.grad = None
            if restore_mean:
                self.load_mean_into_model()

    @staticmethod
    def _accumulate_captured(capture: LinearCapture, block: PosteriorBlock, pending: _PendingStep,
                             noise: Tensor) -> bool:
        """Accumulate a matrix-variate nn.Linear block's statistics in low-rank form from its captured input X and
        errors Delta (as `step_batched` does, `KroneckerBlock.accumulate_factored`), where the gradient is
        exactly Delta^T X_aug and X has fewer rows than X_aug has columns (else the dense gradient is as cheap).
        An input equal to the previous sample's (the batch itself, for the first layer) reuses its X_aug and
        X_aug A, so sum_k Psi_k^T B Phi_k = X_aug^T (sum_k Delta_k B Phi_k) keeps rank r. False: use .grad."""
        if not capture.exact(block):
            return False
        x, delta = capture.inputs(block)
        if x.shape[0] >= block.in_features + int(block.has_bias):
            return False
        inputs, products = pending.factored_inputs.setdefault(block, ({}, {}))
        x_aug = augmented_input(block, x, inputs, keep_one=True)
        if products.get("x_aug") is not x_aug:
            products.clear()
            products.update(x_aug=x_aug, x_a=block.input_times_a(x))
        noise_pre = capture.noise_pre(block)  # X_aug A Phi^T, from a factored forward (the same X_aug) or here
        if noise_pre is None:
            noise_pre = products["x_a"] @ noise[0].T
        psi = block.join([p.grad[None] for p in block.params])[0]  # Delta^T X_aug, already computed by backward
        block.accumulate_factored(pending.stats[block], noise, delta[None], x_aug, noise_pre[None], psi)
        return True

    def _params(self) -> Iterator[nn.Parameter]:
        return (p for block in self.blocks for p in block.params)

    def _start_step(self, batch_size: int | None) -> _PendingStep:
        if batch_size is not None and (not is_integer(batch_size) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if batch_size is not None and self.loss_reduction == "sum":
            raise ValueError("batch_size rescales a mean loss: with loss_reduction='sum' the closure must return "
                             "the summed loss")
        self._check_param_groups()
        self._refuse_accumulated_gradients()
        self._adopt_model_weights()
        blocks = self._trainable_blocks()
        self._pending = _PendingStep(self._next_seed(), blocks, {block: block.new_statistics() for block in blocks},
                                     _RunningStatistics(self.model), batch_size)
        return self._pending

    def _adopt_model_weights(self) -> None:
        """The model's parameters are the posterior mean: values written into them since the last step
        (model.load_state_dict after the optimizer was built, a manual copy, an EMA swap) become the mean, as
        they would for any torch optimizer; the covariance is kept."""
        for block in self.blocks:
            block.adopt_params()

    def _trainable_blocks(self) -> list[PosteriorBlock]:
        """The blocks whose parameters require gradients now. A block frozen after construction
        (requires_grad_(False)) is left out of the step: its weights stay at its posterior mean, unsampled,
        and its posterior is unchanged until it is unfrozen."""
        blocks = []
        for block in self.blocks:
            trainable = {p.requires_grad for p in block.params}
            if len(trainable) > 1:
                raise ValueError(f"the {block.family} posterior of a {type(block.module).__name__} covers its "
                                 "weight and bias together: freeze or unfreeze both (one of them was changed with "
                                 "requires_grad_ after the optimizer was built)")
            if trainable == {True}:
                blocks.append(block)
        if not blocks:
            raise ValueError("every parameter is frozen (requires_grad=False): a step has nothing to train")
        return blocks

    def _finish_step(self) -> float:
        """UPDATE from the statistics of the step's K samples; batch-norm statistics as their average."""
        pending, self._pending = self._pending, None
        if pending.count != len(self.sample_shard):
            pending.running.restore()
            raise RuntimeError(f"FOO-VB averages over mc_samples={self.mc_samples} samples: {pending.count} of "
                               f"{len(self.sample_shard)} sampled_params(train=True) blocks ran before step()")
        if pending.grad_scale not in (None, 1.0):  # the sums are linear in the gradients: scaled once, here
            _scale_statistics(pending.stats, pending.grad_scale)
        try:
            mean_loss = self._apply_update(pending.stats, pending.losses, self.mc_samples)
        except BaseException:
            pending.running.restore()  # a refused update changes nothing
            self.load_mean_into_model()  # step(closure) leaves its last sample in the model until the update
            raise
        pending.running.average()
        return mean_loss

    def step_batched(self, inputs: Tensor, targets: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
                     *, chunk_size: int | None = None) -> float:
        """One FOO-VB step evaluating the K samples together (batched matmuls; nn.Linear / nn.Conv2d models).

        Args:
            inputs, targets: the mini-batch (r rows).
            loss_fn: loss_fn(outputs, targets), reduced as `loss_reduction` says (read from the loss with
                "auto"); it is applied
                to the K stacked outputs (K r rows) and targets repeated K times. Default: cross-entropy.
            chunk_size: samples evaluated per pass (bounds memory to chunk_size networks); default all K.
        Returns the mean loss over the samples. Gives the same update as `step` for the same seed.
        A model with a layer whose sampled weight has WIDE_LAYER elements or more (diagonal or full blocks, and
        matrix-variate convolutions: the blocks whose samples are built whole) is evaluated one sample at a time,
        as `step` does: stacking such samples was measured slower (docs/performance.md).
        """
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size!r}")
        check_batched_support(self.blocks, self.model)
        if loss_fn is None:
            default_reduction = "mean" if self.loss_reduction == "mean" else "sum"
            loss_fn = lambda out, y: F.cross_entropy(out, y, reduction=default_reduction)  # noqa: E731
        rows = inputs.shape[0]
        if targets.shape[0] != rows:
            raise ValueError(f"inputs have {rows} rows but targets {targets.shape[0]}")
        if rows == 0:
            raise ValueError("empty batch: step_batched needs at least one row")
        if self._pending is not None:
            raise RuntimeError("step_batched while sampled_params(train=True) blocks have started a step: call "
                               "step() without a closure to finish that one first")
        if any(not (isinstance(block, KroneckerBlock) and isinstance(block.module, nn.Linear))
               and sum(p.numel() for p in block.params) >= WIDE_LAYER for block in self.blocks):
            def closure() -> Tensor:
                loss = loss_fn(self.model(inputs), targets)
                loss.backward()
                return loss

            return self.step(closure)
        shard = self.sample_shard
        chunk = len(shard) if chunk_size is None else min(chunk_size, len(shard))
        pending = self._start_step(None)
        modules: dict[nn.Module, list[PosteriorBlock]] = {}
        for block in pending.blocks:
            modules.setdefault(block.module, []).append(block)
        shared_inputs: dict = {}
        try:
            for start in range(0, len(shard), chunk):
                samples = shard[start : start + chunk]
                c = len(samples)
                noises = self.draw_noise(pending.seed, samples, antithetic=self.antithetic, blocks=pending.blocks)
                with SampledNetwork(modules, noises, c, rows, track_grad=True) as network:
                    with torch.enable_grad():
                        outputs = self.model(inputs)
                        loss = loss_fn(outputs, targets.repeat(c, *([1] * (targets.ndim - 1))))
                        # sum: d(sum_k L_k)/d theta_k = g_k; a mean over the c stacked batches: back to the sum
                        reduction = loss_reduction_of(loss)
                        grad_scale = loss_scale(reduction, self.loss_reduction, None, frozenset({c * rows}))
                        loss.backward()
                    with full_precision():
                        network.accumulate(pending.stats, grad_scale, shared_inputs)
                value = float(loss.detach())
                pending.losses.extend([value if reduction.kind == "mean" else value / c] * c)
                pending.count += c
        except BaseException:
            self._pending = None
            raise
        # finished through step(), as an own loop's blocks are: LR schedulers see an optimizer step (no "scheduler
        # before optimizer" warning), and the step pre/post hooks run once, around the update
        return self.step()

    @torch.no_grad()
    def _apply_update(self, stats: dict[PosteriorBlock, dict], losses: list[float], num_samples: int) -> float:
        """All-reduce the statistics under torch.distributed, check them, then UPDATE every block.

        Returns the mean loss over all samples (of all processes)."""
        blocks = list(stats)  # the blocks this step trains (frozen ones are left out)
        if self.statistics_reducer is not None:
            stats, num_samples, losses = self.statistics_reducer.reduce(blocks, stats, num_samples, losses)

        def pieces(block: PosteriorBlock) -> list[Tensor]:
            return [t for v in stats[block].values() for t in (v.tensors() if isinstance(v, LowRank) else [v])]

        # NaN/Inf propagate through norms: one synchronisation for all blocks, then find the culprits
        norms = torch._foreach_norm([t for block in blocks for t in pieces(block)])
        bad = [] if torch.stack(norms).sum().isfinite() else [
            b for b in blocks if not all(torch.isfinite(t).all() for t in pieces(b))]
        if bad or not all(math.isfinite(v) for v in losses):
            where = "the loss" if not bad else f"the gradients of {len(bad)} parameter block(s)"
            raise FloatingPointError(
                f"non-finite values in {where} at step {self.steps_taken}; the posterior was left unchanged")
        before = {block: {key: value.clone() for key, value in block.state.items()} for block in blocks}
        with full_precision():
            for block in blocks:
                block.update(stats[block], num_samples, self.mean_step, self.cov_step)
        # finite statistics can still overflow (a sigma grown by the paper's closed form, squared): undo the step
        new_state = [value for block in blocks for value in block.state.values()]
        if not torch.stack(torch._foreach_norm(new_state)).sum().isfinite():
            for block in blocks:
                block.state.clear()  # entries that the failed update created (cov_momentum's average) go too
                block.state.update(before[block])
            raise FloatingPointError(
                f"the update at step {self.steps_taken} overflowed to non-finite posterior values (with "
                f"std_growth={self.std_growth!r}, a sigma that grew too large?); the posterior was left unchanged")
        self.load_mean_into_model()
        self.steps_taken += 1
        return sum(losses) / len(losses)

    # -- persistence -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The posterior, the noise generator and the hyperparameters. The tensors are copies: later steps do
        not change a saved state dict."""
        self._adopt_model_weights()
        state = super().state_dict()
        state["state"] = {index: {key: value.clone() for key, value in param_state.items()}
                          for index, param_state in state["state"].items()}
        state["foovb"] = {"generator": self.generator.get_state(), "steps_taken": self.steps_taken}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a `state_dict` of a FOOVB built with the same family, K and options on the same architecture
        (checked before anything changes). The step sizes ("lr", the mean step, and "cov_step") are taken from
        it, as torch optimizers do with their learning rates. The tensors are copied."""
        if not isinstance(state_dict, dict) or not {"state", "param_groups", "foovb"} <= state_dict.keys():
            raise ValueError("not a FOOVB state dict (it needs 'state', 'param_groups' and 'foovb' entries)")
        state_dict = dict(state_dict)
        self._check_loadable(state_dict)
        extra = state_dict.pop("foovb")
        super().load_state_dict(state_dict)
        self.generator.set_state(extra["generator"])
        self.steps_taken = extra["steps_taken"]
        for block in self.blocks:
            loaded = self.state[block.params[0]]
            block.state.clear()
            block.state.update({key: value.clone() for key, value in loaded.items()})
            self.state[block.params[0]] = block.state
        self.load_mean_into_model()

    def _check_loadable(self, state_dict: dict) -> None:
        groups = state_dict["param_groups"]
        if not isinstance(groups, list) or not all(isinstance(group, dict) for group in groups):
            raise ValueError("not a FOOVB state dict: 'param_groups' must be a list of dicts")
        if len(groups) != 1:
            raise ValueError(f"a FOOVB state dict has one parameter group, this one has {len(groups)}")
        if len(groups[0]["params"]) != len(self.param_groups[0]["params"]):
            raise ValueError("the state dict was saved for a model with another number of trainable parameters")
        changed = {key: (groups[0].get(key), value) for key, value in self._fixed.items()
                   if groups[0].get(key) != value}
        if changed:
            details = ", ".join(f"{key}: saved {saved!r}, here {here!r}" for key, (saved, here) in changed.items())
            raise ValueError(f"the state dict was saved by a FOOVB with other settings ({details}); "
                             "build the optimizer with the saved settings")
        _check_step_sizes(groups[0].get("lr"), groups[0].get("cov_step"), ("lr (mean_step)", "cov_step"))
        index = {id(p): i for i, p in enumerate(self.param_groups[0]["params"])}
        for block in self.blocks:
            saved = state_dict["state"].get(index[id(block.params[0])], {})
            for key, value in block.state.items():
                if key in block.optional_state:
                    continue
                if key not in saved or tuple(saved[key].shape) != tuple(value.shape):
                    found = tuple(saved[key].shape) if key in saved else "missing"
                    raise ValueError(f"the state dict does not fit this model: the {block.family} posterior of "
                                     f"a {tuple(block.params[0].shape)} parameter needs {key!r} of shape "
                                     f"{tuple(value.shape)}, found {found}")

