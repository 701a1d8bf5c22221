"""The hyperparameters of FOOVB: the presets ("recommended", "paper") per posterior family, which settings a family
reads, which are fixed at construction, and their validation (a ValueError naming the argument).

The arguments of FOOVB:
    model: the network. Its parameters are the prior mean (init="keep") or are re-initialised
        (init="paper"); after every step they hold the posterior mean.
    posterior: "auto" (the default): "kronecker" for every nn.Linear / nn.Conv1d-3d and every recurrent layer (its
        weight matrices; since session 55) in float32 or float64 with at most AUTO_MAX_FEATURES (1024) inputs
        (fan_in) and outputs, "diagonal" for every other tensor, with the
        kronecker family's settings (on the robustness grid the matrix-variate family beat the diagonal one in most
        cells: docs/results.md, "A default that holds");
        "diagonal" (Algorithm 4, every parameter tensor), "kronecker" (matrix-variate,
        Algorithm 3, per nn.Linear / nn.Conv1d-3d whose parameters are its weight and bias, and per weight matrix of
        a recurrent layer or cell with its bias; other parameters,
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
    implicit_mean: the covariance of the mean step. False (the paper, Algorithm 1): the prior's,
        mu <- m - eta V E[g]; True: the covariance just updated from the same samples, mu <- m - eta Sigma E[g].
        Eq. "Gaussian first order necessary conditions" takes E[g] under the new posterior q_n; expanding it to
        first order about m, E_{q_n}[g] = E_{q_{n-1}}[g] + H (mu - m), gives mu - m = -(V^{-1} + H)^{-1} E[g],
        and (V^{-1} + H)^{-1} is the covariance's fixed point: Sigma. Each step is then bounded by the curvature
        the step measured (eta Sigma H <= 2 eta / (3 sqrt(3) beta) ~ 0.385 eta / beta per diagonal entry of a
        quadratic: docs/theory.md), where the prior's V moves a weight by eta V H, unbounded for a prior wide
        against the likelihood (an extension). Where beta < 0.385 eta the step takes the covariance for the
        likelihood raised to gamma = 0.385 eta instead (the posterior kept is beta's), so that a step never passes a
        quadratic's measured minimum (`posteriors.step_tempering`).
    curvature_damping: diagonal family, with implicit_mean: scale each block's mean step by min(1, 1 / (eta rho)),
        rho a Rayleigh quotient of sigma' H sigma' estimated from the step's samples (sum_k ||sigma' (g_k - E[g])||^2
        over sum_k (sigma eps_k) . (g_k - E[g])), which sees the coupling between the weights of a block that mean
        field misses (inputs with a large common mean make H nearly rank one). Costs one more running sum per
        parameter; refused in data-parallel training, whose shards cannot sum squared gradients (an extension). On in
        the recommended diagonal preset where implicit_mean is (implicit_mean=False turns the preset's damping off).
    diagonal_output_factor: matrix-variate family: the output layer (the last module with trainable parameters,
        `posteriors.output_layer_blocks`) keeps its output factor B (the covariance between its outputs) diagonal:
        Lemma 2 solved with the diagonal of E3 = (1/n) E[Psi A Phi^T], whose off-diagonal entries, p (p - 1) of them
        from K samples of a batch, were mostly noise where the outputs do not share their errors (a regression or an
        autoencoder's pixels). The hidden layers keep the full factor: kept diagonal there, it lost up to 15 points
        on the robustness grid's narrow MLPs (an extension; docs/results/output_factor.md). On in the recommended
        matrix-variate preset (since session 49); False: Algorithm 3's full factor.
    init: "keep" (the model's current weights are the prior mean: a pretrained model is kept);
        "paper" (Linear/Conv weights N(0, 2 / (fan_in + fan_out)), biases 0; matrix-variate: the alpha
        split of the appendix); "bgd" ("paper" with the BGD code's biases N(0, 2 / (1 + fan_out)));
        "alpha" (the matrix-variate split for the diagonal and full families: means
        N(0, 2 alpha / (n_in + 2)), prior std sqrt(2 (1 - alpha) / (n_in + 2)) per layer).
    secant_check: (on in the recommended presets of both families) after the update, evaluate the batch once more at the
        new mean and cut the mean step back to the secant minimum along it where the step passes it (`foovb.secant`):
        each block's implicit step is bounded by its own curvature, but the blocks' steps add up (the layers of a small
        regression net each correcting the same residual). One more forward and backward per step (two in a model with
        batch norm in training mode where the check cuts the step: batch norm's statistics are the final mean's); needs
        the step's batch (step(closure) or step_batched; sampled_params(train=True) steps are not checked); under
        foovb.distributed, one more scalar all-reduce (an extension).
    calibrate_prior: None, or the output noise a prior may make (e.g. 150): before the first step every block's
        prior variance is scaled down by one factor until the sampled networks' outputs on the step's batch differ
        from the mean network's by at most about this many times the spread of the mean's outputs over the batch
        (summed squares; 143 for the paper's MLP as torch initialises it, 1,188 for the LeNet); the samples come from
        the calibrated posterior, the mean step takes the uncalibrated prior's precision, (Sigma^-1 - 1/v0 + 1/V)^-1:
        the uncalibrated prior's step V where the posterior is still the prior (Sigma = v0), the algorithm's Sigma where
        the likelihood has taken over (`foovb.calibration`). Needs the step's batch (step(closure) or
        step_batched) and is refused in data-parallel training (an extension).
    step_prior: K >= 1 (1: off, the algorithm's step; 64 in the matrix-variate family's recommended preset, its fallback
        diagonal tensors included, 16 in the diagonal family's): the mean step's prior variance is K times that of the
        prior the samples are drawn from (v0, after calibrate_prior where it acts), every mean step taken with (Sigma^-1
        - 1/v0 + 1/(K v0))^-1: K times the prior's step in the directions no batch has measured yet, the algorithm's
        Sigma where the likelihood has taken over, the samples' noise unchanged (`foovb.calibration`; with
        calibrate_prior, K times the uncalibrated prior). Every layer except the output layer (the last parameter
        block's module), nn.MultiheadAttention's own projections and matrix-variate layers wider than posterior="auto"
        makes them (more than 1,024 inputs or outputs; `calibration.step_prior_blocks`); those take the algorithm's
        step. The matrix-variate family takes the step in the eigenbases of the layer's two factors, a factor wider than
        512 decomposed anew only when it has moved by more than a tenth since (an extension).
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

from __future__ import annotations

import math
from collections.abc import Collection

import torch
from torch import Tensor

from .posteriors import AT_REFRESH, CALIBRATED, FAMILIES, PosteriorBlock
from .priors import AUTO, XAVIER
from .validation import TORCH_ARGUMENTS, is_boolean, is_integer, is_real

__all__ = ["FAMILY_ONLY", "POSTERIORS", "FIXED", "LEGACY_FIXED", "PRESETS", "check_batch_size", "check_param_group",
           "check_block_state", "check_state_dict", "check_step_sizes", "resolve", "validate"]

INITS = ("paper", "bgd", "alpha", "keep")
STD_GROWTH = ("paper", "capped", "none")
MAX_STD_INIT = 1e3  # far above any useful prior std; the bound keeps sigma^2 finite in float32
LOSS_REDUCTIONS = ("auto", "sum", "mean")
POSTERIORS = (AUTO, *FAMILIES)  # AUTO: the matrix-variate family where affordable, with its settings

# Every hyperparameter left None takes its preset's value for the family. "paper": the paper's settings (Algorithms 2-4,
# its appendix's initialisation). "recommended": the best settings measured in this project (docs/results.md): Lemma 2's
# root for the diagonal sigma, antithetic pairs, the mean step with the updated covariance (implicit_mean: bounded by
# the curvature each step measures, eta Sigma H <= 0.385 eta / beta), beta 0.5 for both families: the smallest that keep
# the regression nets measured stable (the diagonal family at beta 0.4 throws a 1-64-64-1 net off in its first epoch;
# the matrix-variate one at 0.3 misses a regression cell of the grid 190-fold) while keeping most of the plasticity
# multi-pass streams need (beta 1 loses 3-5 points on permuted MNIST at 2 passes per task); the model's own weights as
# the prior mean with each layer's own prior std (std_init="xavier", priors.py). docs/results.md, "A default that
# holds". The matrix-variate family's mean step also takes (since session 45) a prior 16 times wider on every layer but
# the output layer (step_prior) and the secant check: on the robustness grid's tuning half they kept the first task 10
# points above the best baseline in 19 and 16 of 23 drift cells (seeds 0, 1) against 11 and 12, with 1 and 0 of 26 cells
# more than 2 points below it against 5 and 4 (docs/results/step_prior.md); since session 49 the family also keeps the
# output layer's output factor diagonal: the autoencoder cells' errors halved, the classifier cells unchanged
# (docs/results/output_factor.md); since session 54 the step prior is 64 times wider: on both halves every target held
# or gained (held-out: 7 of 19 first tasks kept against 6, median +6.2 points against +4.9), the GRUs most, a narrow MLP
# lost up to 4.6 points there (5.3 on the tuning half) (docs/results/step_prior_64.md). The diagonal family takes a step
# prior (16) and the check too, with curvature_damping (since session 48): alone the step prior threw its autoencoders
# off, alone the damping slowed its classifiers; together on the tuning half (seed 0) no cell diverged (2 before), 12 of
# 26 accuracy cells were more than 2 points below the best baseline (16) and 3 of 7 errors above 1.5x its error (5),
# median -0.75 points (-6.9) (docs/results/robustness_grid.md, "The diagonal family"). The full family's recommendation
# is the paper's with antithetic pairs and the per-layer std (not tuned further).
_PAPER = {"std_init": 0.047, "alpha": 0.5, "mean_step": 1.0, "cov_step": 1.0, "antithetic": False,
          "std_growth": "paper", "cov_momentum": 0.0, "implicit_mean": False, "curvature_damping": False,
          "diagonal_output_factor": False, "init": "paper", "max_full_params": 4096, "secant_check": False,
          "calibrate_prior": None, "step_prior": 1.0}
PRESETS: dict[str, dict[str, dict]] = {
    "recommended": {
        "diagonal": {**_PAPER, "mean_step": 0.7, "cov_step": 0.5, "antithetic": True, "std_growth": "none",
                     "implicit_mean": True, "init": "keep", "std_init": XAVIER, "step_prior": 16.0,
                     "secant_check": True, "curvature_damping": True},
        "kronecker": {**_PAPER, "cov_step": 0.5, "antithetic": True, "std_growth": "none", "implicit_mean": True,
                      "init": "keep", "std_init": XAVIER, "step_prior": 64.0, "secant_check": True,
                      "diagonal_output_factor": True},
        "full": {**_PAPER, "antithetic": True, "implicit_mean": True, "init": "keep", "std_init": XAVIER},
    },
    "paper": {family: dict(_PAPER) for family in POSTERIORS},
}
PRESETS["recommended"][AUTO] = dict(PRESETS["recommended"]["kronecker"])
# Hyperparameters that only some families read (the matrix families' fallback diagonal blocks take the
# preset's std_growth and cov_momentum); alpha also sets init="alpha" for any family.
FAMILY_ONLY = {"std_growth": ("diagonal",), "cov_momentum": ("diagonal",), "curvature_damping": ("diagonal",),
               "alpha": ("kronecker", AUTO), "diagonal_output_factor": ("kronecker", AUTO),
               "max_full_params": ("full",)}
# Hyperparameters fixed at construction: the posterior's structure and the noise stream depend on them (the
# step sizes, param_groups' "lr" (eta) and "cov_step" (beta), are read at every step and may change)
FIXED = ("posterior", "mc_samples", "std_init", "alpha", "loss_reduction", "antithetic", "std_growth", "cov_momentum",
         "implicit_mean", "curvature_damping", "diagonal_output_factor", "secant_check", "calibrate_prior",
         "step_prior")
# The value of a FIXED setting in a state dict saved before the setting existed
LEGACY_FIXED = {"implicit_mean": False, "curvature_damping": False, "diagonal_output_factor": False,
                "secant_check": False, "calibrate_prior": None, "step_prior": 1.0}


def check_step_sizes(mean_step: object, cov_step: object, names: tuple[str, str] = ("mean_step", "cov_step")) -> None:
    """eta >= 0 (0: the mean stays, the covariance still updates, as a warm-up schedule from lr 0 or a cosine
    schedule down to eta_min = 0 asks), beta > 0; both finite Python or numpy scalars."""
    if not (is_real(mean_step) and math.isfinite(mean_step) and mean_step >= 0):
        raise ValueError(f"{names[0]} must be a finite number >= 0 (Python or numpy scalar), got {mean_step!r}")
    if not (is_real(cov_step) and math.isfinite(cov_step) and cov_step > 0):
        raise ValueError(f"{names[1]} must be a positive finite number (Python or numpy scalar), got {cov_step!r}")



def validate(*, mc_samples: object, loss_reduction: object, seed: object, std_init: object, alpha: object,
              mean_step: object, cov_step: object, antithetic: object, std_growth: object, cov_momentum: object,
              implicit_mean: object, curvature_damping: object, diagonal_output_factor: object, init: object,
              max_full_params: object, secant_check: object, calibrate_prior: object, step_prior: object) -> None:
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
    check_step_sizes(mean_step, cov_step)
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    for name, value in (("antithetic", antithetic), ("implicit_mean", implicit_mean),
                        ("curvature_damping", curvature_damping), ("diagonal_output_factor", diagonal_output_factor),
                        ("secant_check", secant_check)):
        if not is_boolean(value):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    if calibrate_prior is not None and not (is_real(calibrate_prior) and math.isfinite(calibrate_prior)
                                            and calibrate_prior > 0):
        raise ValueError(f"calibrate_prior must be None or a positive finite number (the output noise allowed), got "
                         f"{calibrate_prior!r}")
    if not (is_real(step_prior) and math.isfinite(step_prior) and step_prior >= 1):
        raise ValueError(f"step_prior must be a finite number >= 1 (the mean step's prior variance over the sampling "
                         f"prior's; 1: off), got {step_prior!r}")
    if curvature_damping and not implicit_mean:
        raise ValueError("curvature_damping damps the implicit mean step: it needs implicit_mean=True")
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


def resolve(posterior: object, preset: object, given: dict[str, object]) -> dict[str, object]:
    """The settings of a FOOVB: the preset's values for the family, overridden by those `given` (not None);
    a ValueError for an unknown family or preset, or a setting that the family does not read."""
    if posterior not in POSTERIORS:
        raise ValueError(f"posterior must be one of {POSTERIORS}, got {posterior!r}")
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {tuple(PRESETS)}, got {preset!r}")
    given = {key: value for key, value in given.items() if value is not None}
    for key, families in FAMILY_ONLY.items():
        if key in given and posterior not in families and not (key == "alpha" and given.get("init") == "alpha"):
            named = " and ".join(family for family in families if family != AUTO)
            also = f" (and posterior={AUTO!r})" if AUTO in families else ""
            raise ValueError(f"{key} applies to the {named} family{also} only, not to posterior={posterior!r}")
    settings = {**PRESETS[preset][posterior], **given}
    if "curvature_damping" not in given and not settings["implicit_mean"]:
        settings["curvature_damping"] = False  # the preset's damping acts on the implicit mean step only
    return settings


# The matrix square roots of covariances in a block's state (KroneckerBlock's factors, FullBlock's); DiagonalBlock's
# elementwise one is its "std"
SQRT_COVS = ("input_sqrt_cov", "output_sqrt_cov", "sqrt_cov", *AT_REFRESH)


def param_group_defaults(posterior: str, mc_samples: int, loss_reduction: str, settings: dict) -> dict:
    """The optimizer's param_groups[0] from the resolved settings, as Python numbers (numpy scalars would not load
    with torch.load's weights_only default); "lr" is the mean step."""
    std_init = settings["std_init"] if settings["std_init"] == XAVIER else float(settings["std_init"])
    return dict(posterior=posterior, mc_samples=int(mc_samples), std_init=std_init, alpha=float(settings["alpha"]),
                lr=float(settings["mean_step"]), cov_step=float(settings["cov_step"]), loss_reduction=loss_reduction,
                antithetic=bool(settings["antithetic"]), std_growth=settings["std_growth"],
                cov_momentum=float(settings["cov_momentum"]), implicit_mean=bool(settings["implicit_mean"]),
                curvature_damping=bool(settings["curvature_damping"]),
                diagonal_output_factor=bool(settings["diagonal_output_factor"]),
                secant_check=bool(settings["secant_check"]),
                calibrate_prior=None if settings["calibrate_prior"] is None else float(settings["calibrate_prior"]),
                step_prior=float(settings["step_prior"]))


def check_state_dict(state_dict: dict, fixed: dict, num_params: int, blocks: list[PosteriorBlock],
                     index: dict[int, int], generator: torch.Generator,
                     widened: Collection[PosteriorBlock] = (), names: dict[int, str] | None = None) -> None:
    """ValueError unless `state_dict` was saved by a FOOVB with the `fixed` settings on the same architecture
    (`num_params` trainable tensors; each block's state of the same shapes and values it could hold:
    `check_block_state`, with step_prior's entries in the `widened` blocks; `index`: id(param) -> its position,
    `names`: id(param) -> its name in the model, for the errors),
    with a state that a generator like `generator` accepts and a step count. Nothing is changed: a load that passes
    cannot be refused half-way."""
    progress = state_dict["foovb"]
    generator_state = generator.get_state()
    if not (isinstance(progress, dict) and isinstance(progress.get("generator"), Tensor)
            and progress["generator"].dtype == generator_state.dtype
            and progress["generator"].shape == generator_state.shape
            and is_integer(progress.get("steps_taken")) and progress["steps_taken"] >= 0):
        raise ValueError("not a FOOVB state dict: its 'foovb' entry must hold the noise generator's state (a "
                         f"{tuple(generator_state.shape)} uint8 tensor, 'generator') and the steps taken (an int "
                         "'steps_taken' >= 0)")
    try:  # on a scratch generator: set_state is the only full check of a state
        torch.Generator(device=generator.device).set_state(progress["generator"])
    except RuntimeError as error:
        raise ValueError(f"cannot load the noise generator's state (state_dict['foovb']['generator']): torch "
                         f"refused it ({str(error).splitlines()[0]}); nothing was loaded") from None
    scale = progress.get("prior_scale", 1.0)
    if not (is_real(scale) and math.isfinite(scale) and 0 < scale <= 1):
        raise ValueError("state_dict['foovb']['prior_scale'] (calibrate_prior's factor on the prior's variance) "
                         f"must be a number in (0, 1], got {scale!r}")
    if not isinstance(state_dict["state"], dict):
        raise ValueError("not a FOOVB state dict: its 'state' must be a dict, got "
                         f"{type(state_dict['state']).__name__}")
    groups = state_dict["param_groups"]
    if not isinstance(groups, list) or not all(isinstance(group, dict) for group in groups):
        raise ValueError("not a FOOVB state dict: 'param_groups' must be a list of dicts")
    if len(groups) != 1:
        raise ValueError(f"a FOOVB state dict has one parameter group, this one has {len(groups)}")
    if len(groups[0]["params"]) != num_params:
        raise ValueError("the state dict was saved for a model with another number of trainable parameters")
    changed = {key: (groups[0].get(key, LEGACY_FIXED.get(key)), value) for key, value in fixed.items()
               if groups[0].get(key, LEGACY_FIXED.get(key)) != value}
    if changed:
        details = ", ".join(f"{key}: saved {saved!r}, here {here!r}" for key, (saved, here) in changed.items())
        keywords = ", ".join(f"{key}={saved!r}" for key, (saved, _) in changed.items())
        raise ValueError(f"the state dict was saved by a FOOVB with other settings ({details}); build the "
                         f"optimizer with the saved settings: FOOVB(model, ..., {keywords}) (a preset's defaults "
                         "can change between versions: docs/CHANGELOG.md)")
    check_step_sizes(groups[0].get("lr"), groups[0].get("cov_step"), ("lr (mean_step)", "cov_step"))
    for block in blocks:
        position = index[id(block.params[0])]
        check_block_state(block, position, state_dict["state"].get(position, {}),
                          required=CALIBRATED if block in widened else (),
                          param_name=(names or {}).get(id(block.params[0])))


FAMILY_KEYS = {"std": "diagonal", "input_sqrt_cov": "kronecker", "sqrt_cov": "full"}  # the entry only it keeps


def check_block_state(block: PosteriorBlock, position: int, saved: dict, required: tuple[str, ...] = (),
                      param_name: str | None = None) -> None:
    """ValueError unless `saved` could be the state of `block` (its first parameter at `position`): every tensor
    the block keeps (and each optional entry present, or `required`: step_prior's v0 and V) of its shape, floating
    point (another float dtype than the parameter's is cast to it, as torch's optimizers do); all of them finite, also
    once cast; a diagonal "std" >= 0, and > 0 wherever the block's
    own is (0 only where this optimizer has it 0: an nn.Embedding's padding row, `priors._fix_padding_row`); a
    matrix square root of a covariance not all zero unless the block's own is (the matrix-variate factors never
    are: Lemma 2 keeps them nonsingular), and diagonal where the block keeps it so (diagonal_output_factor). O(size):
    no decomposition."""
    named = f"{param_name!r}, " if param_name else ""
    name = f"the {block.family} posterior of parameter {position} ({named}shape {tuple(block.params[0].shape)})"
    saved_family = next((family for key, family in FAMILY_KEYS.items() if key in saved), block.family)
    if saved_family != block.family:
        raise ValueError(
            f"the state dict holds a {saved_family} posterior where this FOOVB keeps {name}: it was saved with "
            "another `posterior`, or by a foovb whose FOOVB(model) chose another family for the layer (before "
            "2026-11-29 it made nn.Conv1d / nn.Conv3d diagonal, and, before the entry 'FOOVB(model) makes recurrent "
            "layers matrix-variate', nn.RNN / nn.GRU / nn.LSTM layers and their cells: docs/CHANGELOG.md); build the "
            "optimizer with the "
            "posterior it was saved with, resume with the foovb that saved it, or load only the model's weights into "
            "a new FOOVB (its covariance starts from the prior); nothing was loaded")
    own_state = {key: value for key, value in block.state.items() if key not in block.optional_state}
    own_state.update({key: block.state["mean"].new_zeros(()) if like is None else block.state[like]
                      for key, like in block.optional_state.items() if key in saved or key in required})
    for key, own in own_state.items():
        value = saved.get(key)
        if key in CALIBRATED and value is None:
            raise ValueError(f"the state dict has no {key!r} for {name}, which this FOOVB's step_prior widens: the "
                             "entry was removed, or an earlier foovb saved it, whose step_prior left out layers wider "
                             "than 512; this version cannot resume it: resume with the foovb that saved it, or load "
                             "only the model's weights into a new FOOVB (its covariance starts from the prior)")
        if not isinstance(value, Tensor) or value.shape != own.shape:
            found = (tuple(value.shape) if isinstance(value, Tensor) else "missing" if key not in saved
                     else f"a {type(value).__name__}, not a tensor")
            raise ValueError(f"the state dict does not fit this model: {name} needs {key!r} of shape "
                             f"{tuple(own.shape)}, found {found}")
        problem = _value_problem(key, value, own)
        if not problem and key == "output_sqrt_cov" and getattr(block, "diagonal_output_factor", False) \
                and not torch.equal(value, torch.diag(value.diagonal())):
            problem = "is not diagonal, as this FOOVB's diagonal_output_factor keeps it"
        if problem:
            raise ValueError(f"cannot load {name}: its {key!r} {problem}; nothing was loaded")


def _value_problem(key: str, value: Tensor, own: Tensor) -> str | None:
    """What is wrong with `value`, to be loaded as the block's `key` whose current tensor is `own`, or None."""
    if value.dtype != own.dtype:
        if not (value.is_floating_point() and own.is_floating_point()):
            return f"is {value.dtype}, this optimizer keeps {own.dtype} (the parameter's dtype)"
        cast = value.to(own.dtype)  # as torch.optim.Optimizer.load_state_dict casts it (the model was cast since)
        overflow = int((torch.isfinite(value) & ~torch.isfinite(cast)).sum())
        if overflow:
            entries = value.numel()
            return f"overflows {own.dtype} (the parameter's, it is cast to) in {overflow} of its {entries} entries"
        value = cast
    non_finite = int((~torch.isfinite(value)).sum())
    if non_finite:
        return f"has NaN or Inf in {non_finite} of its {value.numel()} entries"
    if key == "std":
        not_positive = int(((value < 0) | ((value == 0) & (own != 0).to(value.device))).sum())
        if not_positive:
            return (f"is negative, or 0 where this optimizer's is not, in {not_positive} of its {value.numel()} "
                    "entries (a posterior std is > 0; 0 only on an nn.Embedding's padding row)")
    if key in CALIBRATED and not value > 0:
        return "is not positive (calibrate_prior's prior variance per weight, for the mean step)"
    if key in SQRT_COVS:  # a zero row or column makes the factor singular: one direction's variance collapsed
        zero_rows = int((~value.any(1) & own.any(1).to(value.device)).sum())
        zero_columns = int((~value.any(0) & own.any(0).to(value.device)).sum())
        if zero_rows or zero_columns:
            return (f"has {zero_rows} zero rows and {zero_columns} zero columns where this optimizer's has none (a "
                    "square root of a covariance, singular)")
    return None


def check_param_group(group: dict, fixed: dict) -> None:
    """The hyperparameters a step reads: step sizes valid (made Python floats), the `fixed` ones unchanged
    since construction, and no torch optimizer's weight_decay, momentum or betas written in (silently unused)."""
    for key in TORCH_ARGUMENTS:  # a torch optimizer's, written in by hand: never read here ('lr' is eta)
        if key != "lr" and group.get(key):
            raise ValueError(f"param_groups[0][{key!r}] = {group[key]!r}, but FOOVB has no {key}: "
                             f"{TORCH_ARGUMENTS[key]}")
    for key, value in fixed.items():
        if group[key] != value:
            raise ValueError(f"param_groups[0][{key!r}] was changed from {value!r} to {group[key]!r}; it is "
                             "fixed at construction (build a new FOOVB); only 'lr' (the mean step eta) and "
                             "'cov_step' may change")
    check_step_sizes(group["lr"], group["cov_step"], ("param_groups[0]['lr'] (mean_step)", "cov_step"))
    group["lr"], group["cov_step"] = float(group["lr"]), float(group["cov_step"])


def check_batch_size(batch_size: object, loss_reduction: str) -> None:
    """step(closure, batch_size=n): a positive integer, for a mean loss."""
    if not is_integer(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if loss_reduction == "sum":
        raise ValueError("batch_size rescales a mean loss: with loss_reduction='sum' the closure must return "
                         "the summed loss")
