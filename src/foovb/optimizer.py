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
import inspect
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .advice import divergence_advice
from .calibration import (
    calibrate,
    covariances,
    first_model_call,
    first_tensor,
    restore_covariances,
    step_prior_blocks,
    variance_per_weight,
    widen_step_prior,
)
from .engine import (
    RunningStatistics,
    Sample,
    SkippedBatch,
    StatisticsReducer,
    Step,
    apply_update,
    check_batched_step,
    closure_of,
    deferred_closure_sample,
    draw_noise,
    mix,
    scale_statistics,
    stacking_is_slower,
)
from .persistence import Persistence
from .posteriors import KroneckerBlock, PosteriorBlock, PosteriorView, output_layer_blocks
from .precision import drop_autocast_cache, full_precision
from .presets import (
    FIXED,
    PRESETS,
    check_batch_size,
    check_param_group,
    param_group_defaults,
    resolve,
    validate,
)
from .priors import prior_blocks
from .reduction import hold_module_hooks, loss_reduction_of
from .secant import cut_mean_steps, mean_gradients, secant_fraction_at_new_mean
from .validation import (
    caller_stacklevel,
    check_same_parameters,
    inspection_seed,
    refuse_accumulated_gradients,
    refuse_training_closure,
    trainable_blocks,
    unknown_arguments,
)

__all__ = ["FOOVB", "PRESETS", "StatisticsReducer", "loss_reduction_of", "mix"]


def _fixed_setting(key: str, doc: str) -> property:
    return property(lambda self: self._fixed[key], doc=f"{doc} Fixed at construction.")


def _step_size(key: str, doc: str) -> property:
    return property(lambda self: self.param_groups[0][key], doc=f"{doc} Read from param_groups[0] at every step.")


@dataclass
class _Progress:
    """What changes from step to step besides the posterior, in one object that the optimizer's properties write
    to: a wrapper that forwards attribute reads to the optimizer but keeps the attributes written through it
    (Lightning's LightningOptimizer, on which a manual-optimization training_step runs sampled_params blocks)
    then shares it with the optimizer whose step() it calls."""

    statistics_reducer: StatisticsReducer | None = None  # how processes combine a step (foovb.distributed)
    steps_taken: int = 0
    pending: Step | None = None  # a step begun by sampled_params(train=True) blocks
    sample_loaded: bool = False  # the model holds a sampled network that the optimizer loaded, not the mean
    defer_linear_samples: bool = True  # step(closure) forms matrix-variate nn.Linear samples lazily (LinearCapture)
    prior_scale: float = 1.0  # calibrate_prior's factor on the prior's variance (foovb.calibration)
    uncalibrated: dict | None = None  # the covariances before calibrate_prior, until the first update succeeds
    warned_unchecked: bool = False  # a sampled_params step that secant_check cannot check has warned (once)
    # for a divergence's advice, read once per block at its first update: its mean variance before, its mean's norm
    # after
    prior_variances: dict = field(default_factory=dict)
    first_mean_norms: dict = field(default_factory=dict)


def _progress(key: str, doc: str) -> property:
    return property(lambda self: getattr(self._progress, key), lambda self, value: setattr(self._progress, key, value),
                    doc=doc)


class FOOVB(Persistence):
    """Fixed-point Operator for Online Variational Bayes (paper, Algorithm 1).

    The model's parameters hold the posterior mean mu (after every step); the posterior is
    theta = mu + A eps, eps ~ N(0, I), with A per family. One step on a mini-batch with summed loss L_n::

        for k in 1..K:                      # Monte Carlo samples (antithetic pairs: eps_2j+1 = -eps_2j)
            theta_k = mu + A eps_k          # load_sample
            g_k = grad L_n(theta_k)         # the closure (or one batched pass for all K)
        E[g] = mean_k g_k,  E[g eps^T] = mean_k g_k eps_k^T
        A'    <- solution of the fixed point with beta E[g eps^T]   # Lemmas 1-2; diagonal: closed form
        mu    <- mu - eta A' A'^T E[g]      # Eq. "Gaussian first order necessary conditions" with the updated
                                            # covariance (implicit_mean); the paper's Algorithm 1: A A^T, eta = 1

    Args (in full: `foovb.presets`' docstring and docs/api.md):
        model: its parameters are the prior mean (init="keep") and hold the posterior mean after every step.
        posterior: "auto" (matrix-variate for float nn.Linear / nn.Conv1d-3d and recurrent layers' weight matrices
            with at most 1024 inputs and outputs, diagonal elsewhere), "diagonal" (Algorithm 4), "kronecker"
            (Algorithm 3) or "full" (Algorithm 2).
        mc_samples: K (the paper: 10). preset: "recommended" or "paper", the source of the settings left None.
        std_init, alpha, init: the prior (`foovb.priors`). mean_step, cov_step: eta (param_groups[0]["lr"]) and beta.
        antithetic, std_growth, cov_momentum, implicit_mean, curvature_damping, diagonal_output_factor,
            secant_check, calibrate_prior, step_prior, max_full_params: `foovb.presets`.
        loss_reduction: "auto" (read from the loss, `foovb.reduction`), "sum" (the loss is L_n) or "mean" (L_n / n).
        seed: seed of the Monte Carlo noise and of the paper initialisation (None: one draw of torch's global generator,
            which shifts what it gives afterwards, e.g. a DataLoader's order: pass seed= to compare runs).
    """

    def __init__(
        self,
        model: nn.Module,
        posterior: str = "auto",
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
        implicit_mean: bool | None = None,
        curvature_damping: bool | None = None,
        diagonal_output_factor: bool | None = None,
        secant_check: bool | None = None,
        calibrate_prior: float | None = None,
        step_prior: float | None = None,
        init: str | None = None,
        max_full_params: int | None = None,
        loss_reduction: str = "auto",
        seed: int | None = None,
        **unknown: object,
    ):
        if unknown:
            raise unknown_arguments(unknown, list(inspect.signature(FOOVB.__init__).parameters)[1:-1])
        if not isinstance(model, nn.Module):
            groups = isinstance(model, (list, tuple)) and any(isinstance(group, dict) for group in model)
            raise TypeError(f"model must be an nn.Module (FOOVB(model), not FOOVB(model.parameters())), got "
                            f"{type(model).__name__}" + (
                                " of parameter groups: FOOVB takes no per-group learning rates, as each weight's "
                                "step is scaled by its own posterior variance (to freeze a layer: "
                                "requires_grad_(False))" if groups else ""))
        settings = resolve(posterior, preset, dict(
            std_init=std_init, alpha=alpha, mean_step=mean_step, cov_step=cov_step, antithetic=antithetic,
            std_growth=std_growth, cov_momentum=cov_momentum, implicit_mean=implicit_mean,
            curvature_damping=curvature_damping, diagonal_output_factor=diagonal_output_factor, init=init,
            max_full_params=max_full_params, secant_check=secant_check,
            calibrate_prior=calibrate_prior, step_prior=step_prior))
        validate(mc_samples=mc_samples, loss_reduction=loss_reduction, seed=seed, **settings)
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model has no trainable parameters")
        lazy = [name for name, p in model.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
        if lazy:
            raise ValueError(f"{', '.join(lazy[:3])}{' ...' if len(lazy) > 3 else ''}: not initialised yet (a lazy "
                             "module, e.g. nn.LazyLinear): run one forward pass of the model on a batch before "
                             "FOOVB(model), which needs every parameter's shape")
        defaults = param_group_defaults(posterior, mc_samples, loss_reduction, settings)
        super().__init__(params, defaults)
        self._fixed = {key: defaults[key] for key in FIXED}
        self.model = model
        self._progress = _Progress()
        self.generator = torch.Generator()
        self.generator.manual_seed(int(torch.randint(2**62, (1,)).item()) if seed is None else int(seed))
        self.blocks = prior_blocks(model, self.state, self.generator, posterior,  # the prior of the first step
                                   {**settings, "std_init": defaults["std_init"], "alpha": defaults["alpha"],
                                    "max_full_params": int(settings["max_full_params"])})
        if self.step_prior > 1:
            widen_step_prior(step_prior_blocks(self.blocks), self.step_prior)
        self.load_mean_into_model()
        for block in self.blocks:  # gradients of earlier training (another optimizer's last step): never a step's
            for param in block.params:
                param.grad = None
        hold_module_hooks(self)  # the loss spy's, removed with the last optimizer

    statistics_reducer = _progress("statistics_reducer", "How processes combine a step's statistics: None (one "
                                   "process), or what foovb.distributed.distribute sets (`StatisticsReducer`).")
    steps_taken = _progress("steps_taken", "Updates applied so far.")
    _pending = _progress("pending", "A step begun by sampled_params(train=True) blocks, or None.")
    _defer_linear_samples = _progress("defer_linear_samples", "step(closure)'s fast path (off after an unseen use).")

    # Read-only views of the construction-time settings (in param_groups too; changing them is refused)
    mc_samples = _fixed_setting("mc_samples", "K, Monte Carlo samples per step.")
    posterior_family = _fixed_setting("posterior", '"auto", "diagonal", "kronecker" or "full".')
    loss_reduction = _fixed_setting("loss_reduction", '"auto", "sum" or "mean".')
    antithetic = _fixed_setting("antithetic", "Whether the Monte Carlo samples come in pairs (eps, -eps).")
    std_growth = _fixed_setting("std_growth", 'How the diagonal family\'s sigma may grow: "paper", "capped", "none".')
    cov_momentum = _fixed_setting("cov_momentum", "rho of the diagonal family's average of E[g eps] over steps.")
    implicit_mean = _fixed_setting("implicit_mean", "Whether the mean step uses the updated covariance.")
    curvature_damping = _fixed_setting("curvature_damping", "Whether the diagonal mean step is damped by the "
                                       "curvature its samples measured.")
    diagonal_output_factor = _fixed_setting("diagonal_output_factor", "Whether the output layer's matrix-variate "
                                            "output factor (its outputs' covariance) is kept diagonal.")
    secant_check = _fixed_setting("secant_check", "Whether the mean step is cut back to the secant minimum along it "
                                  "(`foovb.secant`).")
    calibrate_prior = _fixed_setting("calibrate_prior", "The output noise the prior is calibrated to at the first "
                                     "step, or None (`foovb.calibration`).")
    step_prior = _fixed_setting("step_prior", "The mean step's prior variance over the sampling prior's (1: the "
                                "algorithm's step; `foovb.calibration`).")
    prior_scale = _progress("prior_scale", "The factor calibrate_prior scaled the prior's variance by (1.0: none); "
                            "the mean step keeps the uncalibrated prior's precision (`foovb.calibration`).")

    @property
    def sample_shard(self) -> range:
        """The sample indices this process evaluates: all, or its share under MC-parallel training."""
        return range(self.mc_samples) if self.statistics_reducer is None else self.statistics_reducer.samples

    # The step sizes, read from param_groups at every step (a schedule may change them there)
    mean_step = _step_size("lr", 'eta of the mean update mu <- mu - eta Sigma E[g] (param_groups[0]["lr"]).')
    cov_step = _step_size("cov_step", "beta, the multiplier of E[g eps^T] in the covariance update.")

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "blocks"):
            raise ValueError("FOOVB keeps one posterior over the model it was built with; parameter groups "
                             "cannot be added (build the optimizer on a model that holds all the parameters)")
        super().add_param_group(param_group)

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
        self._progress.sample_loaded = False
        drop_autocast_cache()

    def draw_noise(self, seed: int, samples: range, *, antithetic: bool = False,
                   blocks: list[PosteriorBlock] | None = None) -> dict[PosteriorBlock, Tensor]:
        """eps of the given samples, per block (of `blocks`; None: all): `engine.draw_noise`."""
        if self._pending is None:  # drawn for inspection or prediction: from the model's current weights
            self._adopt_model_weights()
        return draw_noise(self.blocks, seed, samples, antithetic=antithetic, only=blocks)

    def _next_seed(self) -> int:
        return int(torch.randint(2**62, (1,), generator=self.generator).item())

    @torch.no_grad()
    def load_sample(self, noises: dict[PosteriorBlock, Tensor], row: int) -> None:
        """Load the network of row `row` of `noises` (from `draw_noise`) into the model."""
        self._progress.sample_loaded = True
        with full_precision():
            for block, noise in noises.items():
                block.load_sample(noise[row])
        drop_autocast_cache()

    # -- training --------------------------------------------------------------------------------------------
    def step(self, closure: Callable[[], Tensor] | None = None, *, batch_size: int | None = None) -> Tensor | None:
        """One FOO-VB step (Algorithm 1) with K sequential Monte Carlo samples, one network in memory at a time.

        `closure` runs forward and backward on the model's current weights and returns the loss; it is called K
        times, each with a fresh sample loaded. `batch_size`: the loss is a mean over this many terms (overrides what
        `loss_reduction` reads). Returns the samples' mean loss as a 0-dim float64 tensor; None, with no step taken,
        where the closure returns None without calling backward() (a skipped batch: Lightning's training_step
        returning None; one that called backward() and returned None is a TypeError). Batch-norm running
        statistics are updated once, by a forward of the new mean: in a model with batch norm in training mode the
        closure is called once more where the secant check did not call it at that mean.

        Without a closure: the update of the K `sampled_params(train=True)` blocks run since the last step (a closure
        then is called once and must not train: Lightning's manual optimization passes one that runs its hooks).
        """
        if closure is None or self._pending is not None:
            return self._finish_own_loop(closure)
        if self.calibrate_prior is not None and not self.steps_taken:
            refuse_accumulated_gradients(self.blocks)  # before the calibration's closure call drops them
            self._calibrate_prior(first_model_call(self.model, closure))
        generator_state = self.generator.get_state()  # a skipped batch leaves the noise stream too as it was
        pending = self._start_step(batch_size)
        pending.recheck = closure
        try:
            for k in self.sample_shard:  # Algorithm 1's loop over the K Monte Carlo samples
                noises = pending.noise(k)  # eps_k
                if self._defer_linear_samples and pending.linear_kronecker:  # the fast path, the same numbers
                    self._defer_linear_samples = deferred_closure_sample(pending, k, noises, closure, self.load_sample)
                else:
                    self.load_sample(noises, 0)  # theta_k = mu + A eps_k
                    pending.closure_sample(k, noises, closure)  # g_k = grad L_n(theta_k), added to the sums
        except BaseException as error:  # a failed sample abandons the step: the posterior is unchanged
            self._pending = None
            pending.running.restore()
            self.load_mean_into_model()
            self._undo_calibration()
            if not isinstance(error, SkippedBatch):
                raise
            if self.statistics_reducer is not None:  # its peers would wait for it in the step's all-reduce
                raise TypeError("the closure returned None without calling backward(): a skipped batch, but under "
                                "foovb.distributed every process takes every step together") from None
            self.generator.set_state(generator_state)  # no step, as a torch optimizer takes none without gradients
            return None
        return self._finish_step()  # E[g], E[g eps^T] -> the UPDATE of every block, the new mean loaded

    def _finish_own_loop(self, closure: Callable[[], Tensor] | None) -> Tensor:
        """step() after sampled_params(train=True) blocks: their update (a closure must not train)."""
        if self._pending is None:
            raise ValueError("FOOVB.step needs a closure that runs forward + backward and returns the loss, "
                             "or mc_samples `with optimizer.sampled_params(train=True):` blocks before it")
        if closure is not None and self._pending.count == len(self.sample_shard):  # else _finish_step says how many
            refuse_training_closure(closure, self.blocks)
        return self._finish_step()

    @contextlib.contextmanager
    def sampled_params(self, train: bool = False, *, seed: int | None = None,
                       batch_size: int | None = None) -> Iterator[Sample]:
        """Load a sampled network into the model for the duration of the block (the mean is restored after).

        train=False: a draw from the posterior with its own noise (`seed`; None: a fresh one), e.g. to inspect it.
        train=True (IVON-style, your own training loop): the block runs forward and backward on the batch, and its
        gradients become one of the step's K samples; after mc_samples blocks, `step()` applies the update::

            for _ in range(optimizer.mc_samples):
                with optimizer.sampled_params(train=True):
                    F.cross_entropy(model(x), y).backward()
            optimizer.step()
        """
        self._check_ready_to_sample("sampled_params()")
        if train:
            if seed is not None:
                raise ValueError("seed is for inspection (train=False): training samples come from the "
                                 "optimizer's noise stream")
            if self._pending is not None and batch_size is not None and batch_size != self._pending.batch_size:
                raise ValueError(f"batch_size={batch_size!r}, but this step's first sampled_params(train=True) "
                                 f"block had batch_size={self._pending.batch_size!r}: the step's samples share one "
                                 "batch")
            if self._pending is None and self.calibrate_prior is not None and not self.steps_taken:
                warnings.warn("FOOVB: calibrate_prior needs the step's batch before its samples, which "
                              "sampled_params(train=True) blocks do not give: the prior was not calibrated (use "
                              "step(closure) or step_batched for the first step)", stacklevel=3)
            pending = self._pending if self._pending is not None else self._start_step(batch_size)
            if pending.count == len(self.sample_shard):
                raise RuntimeError(f"all {pending.count} Monte Carlo samples of this step were evaluated: call step()")
            k = self.sample_shard[pending.count]
            noises = pending.noise(k)  # eps_k
            try:
                self.load_sample(noises, 0)  # theta_k = mu + A eps_k
                with pending.gradients(k, noises, reports_loss=False) as sample:  # g_k, added to the sums
                    yield sample
            except BaseException:  # a failed sample abandons the step: the posterior is unchanged
                self._pending = None
                pending.running.restore()
                raise
            finally:
                self.load_mean_into_model()
            return
        # not from self.generator: inspecting samples must not change the training noise
        noises = self.draw_noise(inspection_seed(seed), range(1))
        try:
            self.load_sample(noises, 0)
            yield Sample(0)
        finally:
            self.load_mean_into_model()

    def _check_ready_to_sample(self, what: str) -> None:
        """`what` needs the posterior mean in the model (not a sample it would replace) and the model's parameters."""
        if self._progress.sample_loaded:
            raise RuntimeError(f"{what} inside a step's closure or a sampled_params block: the model holds a sampled "
                               "network there, which it would replace (or predict from); call it between steps")
        check_same_parameters(self.model, self.blocks, training=False)

    def _start_step(self, batch_size: int | None) -> Step:
        try:
            if batch_size is not None:
                check_batch_size(batch_size, self.loss_reduction)
            check_param_group(self.param_groups[0], self._fixed)
            refuse_accumulated_gradients(self.blocks)
            check_same_parameters(self.model, self.blocks)
            self._adopt_model_weights()
        except BaseException:  # a refused step changes nothing: neither does its calibration
            self._undo_calibration()
            raise
        blocks = trainable_blocks(self.blocks)
        self._pending = Step(self._next_seed(), blocks, self.blocks, self.model, self.antithetic, self.loss_reduction,
                             {block: block.new_statistics() for block in blocks}, RunningStatistics(self.model),
                             batch_size, watch_layers=self.steps_taken == 0 and self._output_layer_matters())
        return self._pending

    def _output_layer_matters(self) -> bool:
        """Whether a setting treats the output layer apart: step_prior (every other layer's mean step widened) or
        diagonal_output_factor on a matrix-variate output layer."""
        return self.step_prior > 1 or (self.diagonal_output_factor and any(
            isinstance(block, KroneckerBlock) for block in output_layer_blocks(self.blocks)))

    def _check_output_layer(self, last_layer: nn.Module | None) -> None:
        """Warn where the layer the model called last in the first step is not the one taken as the output layer
        (the last registered with trainable parameters, `posteriors.output_layer_blocks`): a head defined before
        the body got the step prior's wider steps, and the body's last layer none."""
        taken = output_layer_blocks(self.blocks)
        if last_layer is None or not taken or any(block.module is last_layer for block in taken):
            return
        names = {id(module): name for name, module in self.model.named_modules()}
        ran, registered = names.get(id(last_layer), "?"), names.get(id(taken[0].module), "?")
        top = ran.split(".")[0]  # the model's child that holds it: moving that moves it
        move = (f" (`layer = model.{top}; del model.{top}; model.{top} = layer` moves "
                f"{'it' if top == ran else repr(top) + ', which holds it,'} last)" if top.isidentifier() else "")
        warnings.warn(
            f"FOOVB: the model called {ran!r} last, but the output layer that FOOVB treats apart (no step_prior "
            f"widening; the diagonal output factor) is the last layer registered with trainable parameters, "
            f"{registered!r}. If {ran!r} computes the outputs, register it last{move} and build FOOVB again: wider "
            "steps on the output layer cost retention (docs/api.md)", stacklevel=caller_stacklevel())

    def _adopt_model_weights(self) -> None:
        """Values written into the parameters since the last step become the mean (not a loaded sample)."""
        if self._progress.sample_loaded:
            return
        for block in self.blocks:
            block.adopt_params()

    _NONFINITE_AT_MEAN = ("The closure gives non-finite gradients at the posterior mean too, with no sampling noise: "
                          "check the batch (inputs and targets), the model and the loss for NaN or inf, e.g. with "
                          "torch.isfinite(x).all()")

    @staticmethod
    def _nonfinite_at_mean(pending: Step) -> bool:
        """After a refused update (the mean in the model): whether the step's closure, run once more at the mean, gives
        non-finite gradients too (then the data, model or loss are the cause, not the sampling). Batch-norm running
        statistics are left as the step found them; False where the step has no closure or the closure raises."""
        if pending.recheck is None:
            return False
        try:  # element-wise: a norm of finite gradients overflows where the mean has diverged (1e20 and more)
            return not all(bool(torch.isfinite(grad).all()) for grad in pending.run_at_mean())
        except Exception:  # noqa: BLE001 - the refused update's error is the one to report
            return False
        finally:
            pending.running.restore()

    def _finish_step(self) -> Tensor:
        """UPDATE from the statistics of the step's K samples; batch-norm statistics as the new mean's."""
        pending, self._pending = self._pending, None
        if pending.count != len(self.sample_shard):
            pending.running.restore()
            raise RuntimeError(f"FOO-VB averages over mc_samples={self.mc_samples} samples: {pending.count} of "
                               f"{len(self.sample_shard)} sampled_params(train=True) blocks ran before step()")
        if pending.grad_scale not in (None, 1.0):  # the sums are linear in the gradients: scaled once, here
            scale_statistics(pending.stats, pending.grad_scale)
        if self.secant_check:  # the means before the update, for the cut after it
            means_before = [block.state["mean"].clone() for block in pending.stats]
        first = [block for block in pending.stats if block not in self._progress.first_mean_norms]
        self._progress.prior_variances.update({block: float(variance_per_weight(block)) for block in first})  # advice
        try:
            mean_loss, applied, num_samples = apply_update(
                pending.stats, pending.losses, pending.loss_rows, self.mc_samples, self.mean_step, self.cov_step,
                self.statistics_reducer, self.steps_taken, self.std_growth, pending.seed)
        except BaseException as error:
            pending.running.restore()  # a refused update changes nothing
            self.load_mean_into_model()  # step(closure) leaves its last sample in the model until the update
            self._undo_calibration()
            if isinstance(error, FloatingPointError):
                advice = divergence_advice(self, pending.grad_scale)
                if self._nonfinite_at_mean(pending):  # at step 0 the mean is the user's model as it was given
                    advice = self._NONFINITE_AT_MEAN + ("" if not self.steps_taken else
                                                        f". If the batch is finite, the mean itself went too far: "
                                                        f"{advice}")
                raise FloatingPointError(f"{error}. {advice}") from error
            raise
        self._progress.first_mean_norms.update({block: float(block.state["mean"].norm()) for block in first})
        if pending.watch_layers:
            self._check_output_layer(pending.last_layer)
        self.load_mean_into_model()
        self.steps_taken += 1
        self._progress.uncalibrated = None
        # batch-norm running statistics as one forward of the new mean leaves them, the network that predicts in eval
        # mode: the samples' average is biased for it (sampled networks spread their pre-normalisation activations
        # wider; on a residual CNN the first task was learned to 39% in eval mode, 69% with the mean's statistics:
        # docs/results/matrix_variate_layers.md, "A residual CNN"). The secant check's forward where it ran at the
        # final mean (an uncut step), else the closure once more (batch norm in training mode only); the samples'
        # average where the step has no closure (sampled_params(train=True) blocks) or that forward fails
        at_mean = False
        try:
            if self.secant_check:
                at_mean = self._cut_at_secant(pending, means_before, mean_gradients(applied, num_samples))
            if not at_mean and pending.recheck is not None and pending.running.updated_in_training():
                at_mean = self._statistics_at_mean(pending)
        finally:
            if not at_mean:
                pending.running.average()
        return torch.tensor(mean_loss, dtype=torch.float64)

    def _statistics_at_mean(self, pending: Step) -> bool:
        """Batch norm's running statistics from the closure run once more at the new mean; False (the samples'
        average is left, with a warning) where it fails: the update is applied already, and a step that raised would
        be taken twice by a caller that retries it."""
        try:
            pending.run_at_mean()
        except Exception as error:  # noqa: BLE001 - the user's closure; Ctrl-C and the like propagate
            warnings.warn(f"FOOVB: the closure failed at the new mean ({type(error).__name__}: {error}), where it "
                          "runs once more for batch norm's running statistics: they are the average of the step's "
                          "samples' this step (the update was applied)", stacklevel=caller_stacklevel())
            return False
        return True

    def _calibrate_prior(self, call: tuple[tuple, dict] | None) -> None:
        """calibrate_prior, before the first step: the prior's variance scaled to the output noise asked for on the
        model's inputs of `call` (`foovb.calibration`), the model in eval mode."""
        if call is None:
            warnings.warn("FOOVB: calibrate_prior needs the model's output on the step's batch, and the closure did "
                          "not call the model given to FOOVB: the prior was not calibrated",
                          stacklevel=caller_stacklevel())
            return
        args, kwargs = call

        def outputs(seed: int | None) -> Tensor | None:
            if seed is None:
                return first_tensor(self.model(*args, **kwargs))
            with self.sampled_params(seed=seed):
                return first_tensor(self.model(*args, **kwargs))

        self._progress.uncalibrated = covariances(self.blocks)
        was_training = self.model.training
        self.model.eval()
        try:
            self.prior_scale *= calibrate(self.blocks, outputs, self.calibrate_prior)
        except BaseException:  # the model's forward failed on a sampled network: the prior as it was
            self._undo_calibration()
            raise
        finally:
            self.model.train(was_training)

    def _cut_at_secant(self, pending: Step, means_before: list[Tensor], grads_before: list[Tensor]) -> bool:
        """secant_check: the mean step cut back to the secant minimum along it where it passes it (`foovb.secant`).
        Returns whether the check ran the closure at the mean the step leaves (a step it did not cut)."""
        if pending.recheck is None:
            if not self._progress.warned_unchecked:  # _cut_at_secant runs only where secant_check is on
                self._progress.warned_unchecked = True
                warnings.warn("FOOVB: secant_check (on in the recommended presets) needs the step's batch, which "
                              "sampled_params(train=True) blocks do not give the optimizer: these steps are not "
                              "checked and differ from step(closure)'s (use step(closure) or step_batched, or "
                              "build the optimizer with secant_check=False to take unchecked steps knowingly)",
                              stacklevel=caller_stacklevel())
            return False
        fraction = secant_fraction_at_new_mean(pending, means_before, grads_before, self.statistics_reducer)
        if fraction < 1:
            cut_mean_steps(list(pending.stats), means_before, fraction)
            self.load_mean_into_model()
        return fraction >= 1

    def _undo_calibration(self) -> None:
        """The prior as it was before calibrate_prior, where the first step failed after the calibration."""
        if self._progress.uncalibrated is not None:
            restore_covariances(self._progress.uncalibrated)
            self._progress.uncalibrated, self.prior_scale = None, 1.0

    def step_batched(self, inputs: Tensor, targets: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
                     *, chunk_size: int | None = None) -> Tensor:
        """One FOO-VB step evaluating the K samples stacked (batched matmuls; nn.Linear / nn.Conv1d-3d models): the same
        update as `step` for the same seed. loss_fn(outputs, targets) (default: cross-entropy, reduced as
        `loss_reduction` says) sees the K r stacked rows and the targets repeated K times: a sum or a mean over rows;
        `chunk_size` samples per pass bound the memory. On the CPU a convolution or a WIDE_LAYER makes the step go one
        sample at a time, as `step` does (faster there: docs/performance.md). Returns the mean loss."""
        if self._pending is not None:
            raise RuntimeError("step_batched while sampled_params(train=True) blocks have started a step: call "
                               "step() without a closure to finish that one first")
        loss_fn, chunk = check_batched_step(self.blocks, self.model, self.loss_reduction, self.sample_shard, inputs,
                                            targets, loss_fn, chunk_size)
        if stacking_is_slower(self.blocks):
            return self.step(closure_of(self.model, inputs, targets, loss_fn))
        if self.calibrate_prior is not None and not self.steps_taken:
            self._calibrate_prior(((inputs,), {}))
        pending = self._start_step(None)
        pending.recheck = closure_of(self.model, inputs, targets, loss_fn)
        try:
            pending.evaluate_stacked(self.sample_shard, inputs, targets, loss_fn, chunk)
        except BaseException:  # the posterior is unchanged
            self._pending = None
            self._undo_calibration()
            raise
        return self.step()  # through step(), as an own loop: LR schedulers and step hooks see one optimizer step
