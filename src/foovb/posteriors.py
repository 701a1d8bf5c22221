"""The three Gaussian posterior families of FOO-VB (paper, Section 4, "Proposed Theoretical Approach"; their
updates are Algorithms 2-4), one object per block of parameters.

A *block* is the unit whose posterior is independent of the others (the paper factors the covariance between
layers): a single parameter tensor (diagonal), a Linear/Conv1d-3d layer's weight with its bias as an extra input
column (matrix-variate), or all parameters of one module flattened (full covariance).

Each block implements the two methods of Algorithm 1: `sample` (TRANSFORM: theta = mu + A eps) and `update`
(UPDATE, from the Monte Carlo sums accumulated by `accumulate`). Its tensors live in a dict that the optimizer
keeps in `Optimizer.state`, so `state_dict()` saves them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .linalg import (
    EighCache,
    LowRank,
    diagonal_sqrt_covariance_update,
    prior_swapped,
    prior_swapped_in_eigenbases,
    prior_swapped_product,
    refreshed_factor_eigh,
    root_scale,
    signed_root_scale,
    sqrt_covariance_update,
)

__all__ = ["PosteriorBlock", "DiagonalBlock", "KroneckerBlock", "FullBlock", "PosteriorView", "FAMILIES"]

FAMILIES = ("diagonal", "kronecker", "full")
CALIBRATED = ("calibrated_prior_variance", "uncalibrated_prior_variance")  # the mean step's priors (calibration)
AT_REFRESH = ("input_sqrt_cov_at_refresh", "output_sqrt_cov_at_refresh")  # wide factors at their last eigh (linalg)


@dataclass(frozen=True)
class PosteriorView:
    """The posterior of one parameter tensor: `mean` and marginal `std` in its shape, `covariance()` the dense
    covariance of `param.flatten()` (numel x numel). A snapshot: copies, unchanged by later steps."""

    mean: Tensor
    std: Tensor
    _covariance: object

    def covariance(self) -> Tensor:
        return self._covariance()


# On a quadratic the implicit mean step moves a weight by eta sigma_new^2 h of its distance to the minimum, and
# sigma_new^2 h = s h(s)^2 / beta with s h(s)^2 <= 2 / (3 sqrt(3)) (docs/theory.md, "The implicit mean step")
IMPLICIT_STEP_BOUND = 2 / (3 * math.sqrt(3))


def step_tempering(mean_step: float, cov_step: float) -> float:
    """gamma / beta for the implicit mean step's covariance: the posterior's fixed point for the likelihood raised to
    gamma = max(beta, eta 2 / (3 sqrt(3))) instead of beta, so that on a quadratic a step moves each weight at most
    its distance to the minimum (eta sigma_gamma^2 h <= 0.385 eta / gamma <= 1), whatever beta. Where beta is the
    larger (the recommended preset: beta 0.5, eta <= 1) it is 1. Once the likelihood dominates the prior,
    sigma_gamma^-2 ~ n beta h + gamma h ~ sigma^-2: later steps are unchanged."""
    return max(1.0, IMPLICIT_STEP_BOUND * mean_step / cov_step) if cov_step > 0 else 1.0


class PosteriorBlock(ABC):
    """One independent Gaussian block q(theta_block) = N(mean, Sigma)."""

    family: str
    # entries not every block holds (v0 and V: foovb.calibration) -> the entry whose shape they have (None: 0-dim)
    optional_state: dict[str, str | None] = dict.fromkeys(CALIBRATED)
    # how each Monte Carlo sum scales with the loss: 1 (linear in the gradients, the default), 2 (a sum of squared
    # gradients) or 0 (a sum of the noise alone); `engine.scale_statistics` rescales a mean loss's sums by these
    statistic_powers: dict[str, int] = {}
    # `accumulate` keeps no reference to the noise: a sequential step may draw the next sample's into the same tensors
    noise_reusable = False

    def __init__(self, params: Sequence[nn.Parameter], state: dict, module: nn.Module | None = None,
                 implicit_mean: bool = False):
        self.params = tuple(params)
        self.state = state
        self.module = module
        # The mean step's covariance: False, the prior's V (Algorithm 1: mu <- m - eta V E[g]); True, the updated
        # Sigma, mu <- m - eta Sigma E[g]: the first-order solution of the implicit Eq. "Gaussian first order
        # necessary conditions", whose expectation is under the new posterior (docs/theory.md, "The implicit
        # mean step"). It bounds each step by the curvature it has just measured.
        self.implicit_mean = implicit_mean

    def mean_step_priors(self) -> tuple[Tensor, Tensor] | tuple[()]:
        """calibrate_prior's or step_prior's (v0, V): the mean step takes the covariance with the prior v0 swapped for V
        (`linalg.prior_swapped`, `foovb.calibration`); () where neither acts."""
        return tuple(self.state[key] for key in CALIBRATED) if CALIBRATED[0] in self.state else ()

    def updated_and_step_factor(self, sqrt_cov: Tensor, t: LowRank | Tensor,
                                tempering: float) -> tuple[Tensor, Tensor]:
        """A covariance factor after Lemma 2's update for T, and the factor the mean step uses: the prior's
        (Algorithm 1), the updated one (implicit_mean), or, where `step_tempering` > 1, the one for tempering x T
        (from the same decomposition). A vector `t` is the diagonal of T for a diagonal factor
        (`diagonal_sqrt_covariance_update`)."""
        update = diagonal_sqrt_covariance_update if isinstance(t, Tensor) else sqrt_covariance_update
        if self.implicit_mean and tempering > 1:
            return update(sqrt_cov, t, also_scaled=tempering)
        updated = update(sqrt_cov, t)
        return updated, updated if self.implicit_mean else sqrt_cov

        # -- Algorithm 1, step 1 & 2 -----------------------------------------------------------------------
    @property
    @abstractmethod
    def noise_shape(self) -> tuple[int, ...]:
        """Shape of one draw of eps."""

    @abstractmethod
    def sample(self, noise: Tensor) -> list[Tensor]:
        """TRANSFORM: per-parameter sampled values, each (K, *param.shape), from noise (K, *noise_shape)."""

    def load_sample(self, noise: Tensor) -> None:
        """Write the sample of one noise draw (shape `noise_shape`) into the parameters (no autograd)."""
        for param, value in zip(self.params, self.sample(noise[None]), strict=True):
            param.copy_(value[0])

    # -- Algorithm 1, step 4 -----------------------------------------------------------------------------
    @abstractmethod
    def new_statistics(self) -> dict:
        """Empty Monte Carlo sums."""

    @abstractmethod
    def accumulate(self, stats: dict, noise: Tensor, grads: Sequence[Tensor]) -> None:
        """Add K samples' contributions; grads[i] is (K, *params[i].shape), the gradient of L_n at theta_k."""

    def accumulate_one(self, stats: dict, noise: Tensor, grads: Sequence[Tensor]) -> None:
        """`accumulate` for one sample: noise in `noise_shape`, grads[i] in params[i]'s shape."""
        self.accumulate(stats, noise[None], [grad[None] for grad in grads])

    @abstractmethod
    def update(self, stats: dict, num_samples: int, mean_step: float, cov_step: float) -> None:
        """UPDATE: one fixed-point iteration from the sums over num_samples draws; mean_step scales E[g] in
        the mean update, cov_step scales E[g eps^T] in the covariance update (1 and 1 in the paper); the mean
        step uses the prior's covariance, or the updated one where `implicit_mean` is set."""

    # -- the posterior -------------------------------------------------------------------------------------
    @abstractmethod
    def mean_values(self) -> list[Tensor]:
        """Posterior means in the parameters' shapes."""

    @abstractmethod
    def params_as_mean(self) -> Tensor:
        """The parameters' current values in the layout of state["mean"] (a new tensor or a detached view)."""

    @torch.no_grad()
    def adopt_params(self) -> bool:
        """Take values written into the parameters since the mean was loaded (model.load_state_dict, a manual
        copy) as the posterior mean; the covariance is kept. Returns whether the mean changed.
        A parameter moved to another device or dtype, or holding non-finite values, is a ValueError."""
        means = self.mean_values()
        for param, mean in zip(self.params, means, strict=True):
            if param.device != mean.device or param.dtype != mean.dtype:
                raise ValueError(f"a {tuple(param.shape)} parameter was moved or cast to {param.device}/"
                                 f"{param.dtype} after the optimizer was built on {mean.device}/{mean.dtype}: "
                                 "build FOOVB after model.to(...), or load_state_dict a saved one into a new "
                                 "FOOVB built after it")
        if all(torch.equal(param, mean) for param, mean in zip(self.params, means, strict=True)):
            return False
        if not all(bool(torch.isfinite(param).all()) for param in self.params):
            raise ValueError(f"a {tuple(self.params[0].shape)} parameter holds non-finite values written into "
                             "the model since the last step; the posterior was left unchanged")
        self.state["mean"].copy_(self.params_as_mean())
        return True

    @abstractmethod
    def view(self, index: int) -> PosteriorView:
        """The posterior of params[index]."""


class DiagonalBlock(PosteriorBlock):
    """Diagonal Gaussian over one parameter tensor (Algorithm 4; Eq. "diagonal implicit solution")."""

    family = "diagonal"
    optional_state = {"grad_noise_average": "mean", **dict.fromkeys(CALIBRATED)}
    noise_reusable = True

    def __init__(self, param: nn.Parameter, state: dict, std_init: float, module: nn.Module | None = None,
                 std_growth: str = "paper", cov_momentum: float = 0.0, implicit_mean: bool = False,
                 curvature_damping: bool = False):
        super().__init__([param], state, module, implicit_mean)
        self.std_growth = std_growth
        self.cov_momentum = cov_momentum
        self.curvature_damping = curvature_damping
        if curvature_damping:
            self.statistic_powers = {"grad_square_sum": 2, "noise_sum": 0}
        self.std_init = std_init
        if not state:
            state["mean"] = param.detach().clone()
            state["std"] = torch.full_like(param, std_init)

    @property
    def noise_shape(self) -> tuple[int, ...]:
        return tuple(self.params[0].shape)

    def sample(self, noise: Tensor) -> list[Tensor]:
        return [torch.addcmul(self.state["mean"], self.state["std"], noise)]

    def load_sample(self, noise: Tensor) -> None:
        torch.addcmul(self.state["mean"], self.state["std"], noise, out=self.params[0].data)  # one pass, no copy

    def new_statistics(self) -> dict:
        zeros = torch.zeros_like(self.state["mean"])
        stats = {"grad_sum": zeros, "grad_noise_sum": zeros.clone()}
        if self.curvature_damping:
            stats.update(grad_square_sum=zeros.clone(), noise_sum=zeros.clone())
        return stats

    def accumulate(self, stats: dict, noise: Tensor, grads: Sequence[Tensor]) -> None:
        (grad,) = grads
        if grad.device.type != "cpu":  # a GPU: one reduction per sum, not 2-4 kernel launches per sample
            self.accumulate_reduced(stats, noise, grad)
            return
        for k in range(len(grad)):  # on the CPU in place: much faster than einsum or a sum; indexing, than unbind
            self.accumulate_one(stats, noise[k], [grad[k]])

    def accumulate_reduced(self, stats: dict, noise: Tensor, grad: Tensor) -> None:
        """`accumulate`'s sums over the samples (the leading dimension of noise and grad) as reductions: a few
        kernels per block where a GPU step is bound by their launches (docs/performance.md, "On a GPU"); the same
        sums, added in another order."""
        stats["grad_sum"].add_(grad.sum(0))
        stats["grad_noise_sum"].add_(torch.linalg.vecdot(grad, noise, dim=0))
        if self.curvature_damping:
            stats["grad_square_sum"].add_(torch.linalg.vecdot(grad, grad, dim=0))
            stats["noise_sum"].add_(noise.sum(0))

    def accumulate_one(self, stats: dict, noise: Tensor, grads: Sequence[Tensor]) -> None:
        (grad,) = grads
        stats["grad_sum"].add_(grad)
        stats["grad_noise_sum"].addcmul_(grad, noise)
        if self.curvature_damping:
            stats["grad_square_sum"].addcmul_(grad, grad)
            stats["noise_sum"].add_(noise)

    def curvature_spread(self, stats: dict, num_samples: int) -> tuple[Tensor, Tensor]:
        """(sum_k (sigma eps_k) . (g_k - E[g]), sum_k (g_k - E[g])^2 elementwise) from the step's sums: on a quadratic
        g_k - E[g] = H sigma eps_k, so the first is sum_k (sigma eps_k)^T H (sigma eps_k)."""
        grad_mean = stats["grad_sum"] / num_samples
        centred = torch.addcmul(stats["grad_noise_sum"], stats["noise_sum"], grad_mean, value=-1)  # one pass each
        curvature = torch.linalg.vecdot(self.state["std"].flatten(), centred.flatten())
        spread = torch.addcmul(stats["grad_square_sum"], grad_mean, grad_mean, value=-num_samples).clamp_min_(0)
        return curvature, spread

    def damping(self, curvature: Tensor, spread: Tensor, mean_step: float) -> Tensor:
        """The factor t = min(1, 1 / (eta rho)) of the mean step (`curvature_damping`), rho = sum_k ||sigma'
        (g_k - E[g])||^2 / sum_k (sigma eps_k) . (g_k - E[g]), sigma' the updated std. With g_k - E[g] = H sigma eps_k
        it is ||P w||^2 / w^T P w for P = sigma' H sigma' and w = (sigma / sigma') eps: a Rayleigh quotient of P, at
        most its largest eigenvalue and equal to it when H is rank one, as in a layer whose inputs share a large
        mean; the per-weight bound of the implicit mean step does not see that coupling (docs/theory.md). 1 where
        the samples show no positive curvature."""
        rho = (self.state["std"].square() * spread).sum() / curvature.clamp_min(torch.finfo(curvature.dtype).tiny)
        damped = (1.0 / (mean_step * rho)).clamp(max=1.0) if mean_step else torch.ones_like(rho)
        return torch.where(curvature > 0, damped, torch.ones_like(rho))

    def update(self, stats: dict, num_samples: int, mean_step: float, cov_step: float) -> None:
        std = self.state["std"]
        if self.curvature_damping:  # read before the sums are scaled in place, with the prior's sigma
            curvature, spread = self.curvature_spread(stats, num_samples)
        grad_noise_mean = stats["grad_noise_sum"].mul_(cov_step / num_samples)  # beta E2 (the step's own sums)
        if self.cov_momentum:  # beta E2 averaged over steps, m <- rho m + (1 - rho) beta E2, from the first one
            average = self.state.get("grad_noise_average")
            if average is None:
                self.state["grad_noise_average"] = grad_noise_mean
            else:
                grad_noise_mean = average.lerp_(grad_noise_mean, 1 - self.cov_momentum)
        # Eq. "diagonal implicit solution": sigma <- sigma sqrt(1 + (sigma beta E[g eps] / 2)^2) - sigma^2 beta
        # E[g eps] / 2, then mu <- mu - eta sigma^2 E[g] (E1 = sum_k g_k / K) with the prior's sigma (Algorithm 4)
        # or the updated one (implicit_mean)
        tempering = step_tempering(mean_step, cov_step)
        if not self.implicit_mean:
            variance = std.square()
        elif tempering > 1:  # the mean step's sigma, for gamma E[g eps] (step_tempering)
            variance = (std * self.root(std * grad_noise_mean * tempering)).square_()
        else:
            variance = None  # the updated sigma, below
        std.mul_(self.root(std * grad_noise_mean))
        if self.std_growth == "capped":  # never wider than the initial prior
            std.clamp_(max=self.std_init)
        if variance is None:
            variance = std.square()
        if priors := self.mean_step_priors():  # calibrate_prior or step_prior (foovb.calibration)
            variance = prior_swapped(variance, *priors)
        if self.curvature_damping:  # (validated: with implicit_mean only)
            variance.mul_(self.damping(curvature, spread, mean_step))
        self.state["mean"].addcmul_(variance, stats["grad_sum"], value=-mean_step / num_samples)

    def root(self, scaled: Tensor) -> Tensor:
        """sigma_new / sigma for `scaled` = sigma beta E[g eps]: Lemma 2's root h(|x|) (std_growth "none", as the
        matrix families; sigma never grows), else the closed form of Eq. "diagonal implicit solution", which grows
        sigma where E[g eps] < 0."""
        return root_scale(scaled.abs_()) if self.std_growth == "none" else signed_root_scale(scaled)

    def mean_values(self) -> list[Tensor]:
        return [self.state["mean"]]

    def params_as_mean(self) -> Tensor:
        return self.params[0].detach()

    def view(self, index: int) -> PosteriorView:
        std = self.state["std"].clone()
        return PosteriorView(self.state["mean"].clone(), std, lambda: torch.diag(std.flatten().square()))


def output_layer_blocks(blocks: Sequence[PosteriorBlock]) -> list[PosteriorBlock]:
    """The blocks of the model's output layer: those of the last block's module (the last module with trainable
    parameters, in the model's parameter order), or the last block alone where it has no module."""
    if not blocks or blocks[-1].module is None:
        return list(blocks[-1:])
    return [block for block in blocks if block.module is blocks[-1].module]


class KroneckerBlock(PosteriorBlock):
    """Matrix-variate Gaussian over a Linear / Conv1d / Conv2d / Conv3d layer, or one weight matrix of a recurrent
    layer (Algorithm 3).

    The weight, reshaped to p x n_in (conv: out x in*kh*kw), with the bias appended as an extra input column,
    is W = M + B Phi A^T: `input_sqrt_cov` A (n x n, Sigma_1 = A A^T) and `output_sqrt_cov` B (p x p,
    Sigma_2 = B B^T). Layers without bias use n = n_in.
    """

    family = "kronecker"
    optional_state = {**dict.fromkeys(CALIBRATED), AT_REFRESH[0]: "input_sqrt_cov", AT_REFRESH[1]: "output_sqrt_cov"}

    def __init__(self, module: nn.Module, state: dict, alpha: float, generator: torch.Generator | None,
                 init: str, implicit_mean: bool = False,
                 matrix: tuple[nn.Parameter, nn.Parameter | None] | None = None):
        """`matrix`: the (weight, bias or None) that the block covers (`priors.weight_matrices`); None: the module's
        `weight` and `bias`."""
        weight, bias = matrix if matrix is not None else (module.weight, module.bias)
        params = [weight] + ([bias] if bias is not None else [])
        super().__init__(params, state, module, implicit_mean)
        self.diagonal_output_factor = False  # set on the output layer's block by priors.make_blocks
        self.out_features = weight.shape[0]
        self.in_features = weight[0].numel()
        self.has_bias = bias is not None
        self.eigh_caches = {key: EighCache() for key in AT_REFRESH}
        n = self.in_features + int(self.has_bias)
        if not state:
            if init != "keep":  # "paper", "bgd", "alpha": the bias is a column of the mean matrix here
                # Implementation details: M_ij ~ N(0, 2 alpha / (n_in + 2)); diagonal factors with
                # (A_ii B_jj)^2 = 2 (1 - alpha) / (n_in + 2), so that Var(W_ij) = 2 / (n_in + 2).
                mean = torch.randn(self.out_features, n, generator=generator, dtype=weight.dtype)
                mean = mean.to(weight.device) * math.sqrt(2 * alpha / (self.in_features + 2))
            else:
                mean = self.params_as_mean()
            scale = (2 * (1 - alpha) / (self.in_features + 2)) ** 0.25
            state["mean"] = mean
            state["input_sqrt_cov"] = scale * torch.eye(n, dtype=weight.dtype, device=weight.device)
            state["output_sqrt_cov"] = scale * torch.eye(self.out_features, dtype=weight.dtype,
                                                         device=weight.device)

    def params_as_mean(self) -> Tensor:
        weight = self.params[0].detach().reshape(self.out_features, -1)
        return torch.cat([weight, self.params[1].detach()[:, None]], 1) if self.has_bias else weight.clone()

    def split(self, matrix: Tensor) -> list[Tensor]:
        """(..., p, n) -> [weight (..., *weight.shape), bias (..., p)]."""
        lead = matrix.shape[:-2]
        out = [matrix[..., : self.in_features].reshape((*lead, *self.params[0].shape))]
        if self.has_bias:
            out.append(matrix[..., self.in_features])
        return out

    def join(self, tensors: Sequence[Tensor]) -> Tensor:
        """Inverse of `split`: [(K, *weight.shape), (K, p)] -> (K, p, n)."""
        weight = tensors[0].reshape(tensors[0].shape[0], self.out_features, self.in_features)
        return torch.cat([weight, tensors[1][..., None]], -1) if self.has_bias else weight

    @property
    def noise_shape(self) -> tuple[int, ...]:
        return tuple(self.state["mean"].shape)

    def output_factor_times(self, matrix: Tensor) -> Tensor:
        """B @ matrix (..., p, m); a diagonal B (diagonal_output_factor) scales the rows instead of a p x p product."""
        b = self.state["output_sqrt_cov"]
        return b.diagonal()[:, None] * matrix if self.diagonal_output_factor else b @ matrix

    def sample(self, noise: Tensor) -> list[Tensor]:
        a = self.state["input_sqrt_cov"]
        return self.split(self.state["mean"] + self.output_factor_times(noise) @ a.T)  # W = M + B Phi A^T

    def new_statistics(self) -> dict:
        mean = self.state["mean"]
        return {"psi_sum": torch.zeros_like(mean), "psi_b_phi": LowRank(),  # sum_k Psi_k^T B Phi_k (n x n)
                # sum_k Psi_k A Phi_k^T (p x p), or its diagonal (p) where the output factor is kept diagonal
                "psi_a_phi": mean.new_zeros(len(mean)) if self.diagonal_output_factor
                else mean.new_zeros(len(mean), len(mean))}

    def accumulate(self, stats: dict, noise: Tensor, grads: Sequence[Tensor]) -> None:
        psi = self.join(grads)  # (K, p, n)
        a = self.state["input_sqrt_cov"]
        stats["psi_sum"] += psi.sum(0)
        stats["psi_b_phi"].add(psi.flatten(0, 1), self.output_factor_times(noise).flatten(0, 1))
        if self.diagonal_output_factor:
            stats["psi_a_phi"] += ((psi @ a) * noise).sum((0, 2))
            return
        for psi_a_k, noise_k in zip(psi @ a, noise, strict=True):
            stats["psi_a_phi"].addmm_(psi_a_k, noise_k.T)

    # -- the factored (low-rank) statistics of an nn.Linear layer, from its input X and output errors Delta -----
    def augment(self, x: Tensor) -> Tensor:
        """X -> X_aug = [X, 1] (the bias column), or X itself without a bias."""
        return torch.cat([x, torch.ones_like(x[..., :1])], -1) if self.has_bias else x

    def input_times_a(self, x: Tensor) -> Tensor:
        """X_aug A without forming X_aug: X A[:n_in] + A[n_in] (the bias row)."""
        a = self.state["input_sqrt_cov"]
        x_a = x @ a[: self.in_features]
        return x_a + a[self.in_features] if self.has_bias else x_a

    def accumulate_factored(self, stats: dict, noise: Tensor, delta: Tensor, x_aug: Tensor, noise_pre: Tensor,
                            psi_sum: Tensor | None = None) -> None:
        """`accumulate` for an nn.Linear layer from the pieces of its gradients Psi_k = Delta_k^T X_aug (design note
        "Making the matrix-variate update cheap"), without forming Psi_k:
            sum_k Psi_k = sum_k Delta_k^T X_aug,   sum_k Psi_k^T B Phi_k = X_aug^T (sum_k Delta_k B Phi_k),
            sum_k Psi_k A Phi_k^T = sum_k Delta_k^T (X_aug A Phi_k^T).
        The second stays a `LowRank` of rank r (rows) when X_aug (r, n) is shared by the samples, K r when
        it is per sample (c, r, n).

        Args: noise Phi (c, p, n); delta (c, r, p), the errors dL/dY_k (times the scale to L_n, or the sums scaled
        later: they are linear in delta); x_aug (r, n) or (c, r, n); noise_pre = X_aug A Phi_k^T (c, r, p); psi_sum:
        sum_k Psi_k where the caller has it (the dense gradient of the sequential path), else from Delta and X_aug."""
        b = self.state["output_sqrt_cov"]
        delta_b = delta * b.diagonal() if self.diagonal_output_factor else delta @ b
        delta_b_phi = delta_b @ noise  # (c, r, n)
        if psi_sum is not None:
            stats["psi_sum"] += psi_sum
        elif x_aug.ndim == 2:
            stats["psi_sum"] += delta.sum(0).T @ x_aug
        else:
            stats["psi_sum"] += delta.flatten(0, 1).T @ x_aug.flatten(0, 1)
        if x_aug.ndim == 2:
            stats["psi_b_phi"].add(x_aug, delta_b_phi.sum(0))
        else:
            stats["psi_b_phi"].add(x_aug.flatten(0, 1), delta_b_phi.flatten(0, 1))
        if self.diagonal_output_factor:
            stats["psi_a_phi"] += (delta * noise_pre).sum((0, 1))
        else:
            stats["psi_a_phi"].addmm_(delta.flatten(0, 1).T, noise_pre.flatten(0, 1))

    def update(self, stats: dict, num_samples: int, mean_step: float, cov_step: float) -> None:
        a, b, mean = self.state["input_sqrt_cov"], self.state["output_sqrt_cov"], self.state["mean"]
        p, n = mean.shape
        e1 = stats["psi_sum"] / num_samples
        e2 = stats["psi_b_phi"].scaled(cov_step / (p * num_samples))  # mean (1/p) Psi^T B Phi
        # mean (1/n) Psi A Phi^T (p x p; its diagonal, p, with diagonal_output_factor), as in the appendix
        # "Derivation of the fixed-point equations for the matrix variate Gaussian"; Algorithm 3 prints Psi^T A Phi,
        # which has no consistent shape (a typo)
        e3 = stats["psi_a_phi"] * (cov_step / (n * num_samples))
        # A, B <- solutions of X X^T + V E X^T - V = 0 (Lemmas 1-2); Eq. "Kronecker-factored necessary conditions":
        # M <- M - eta B B^T E1 A A^T, with the prior's factors (Algorithm 3) or the updated ones (implicit_mean)
        tempering = step_tempering(mean_step, cov_step)
        self.state["input_sqrt_cov"], a = self.updated_and_step_factor(a, e2, tempering)
        self.state["output_sqrt_cov"], b = self.updated_and_step_factor(  # a vector e3: B kept diagonal
            b, e3 if self.diagonal_output_factor else LowRank(dense=e3), tempering)
        if priors := self.mean_step_priors():  # calibrate_prior or step_prior (foovb.calibration), in the factors'
            eighs = [refreshed_factor_eigh(factor, self.state, key, self.eigh_caches[key])  # eigenbases (a wide one's
                     for key, factor in zip(AT_REFRESH, (a, b), strict=True)]  # refreshed as it moves: linalg)
            mean.sub_(mean_step * prior_swapped_in_eigenbases(e1, *eighs, *priors))
        else:
            mean.sub_(mean_step * (b @ (b.T @ e1 @ a) @ a.T))

    def mean_values(self) -> list[Tensor]:
        return self.split(self.state["mean"])

    def view(self, index: int) -> PosteriorView:
        a, b = self.state["input_sqrt_cov"], self.state["output_sqrt_cov"]
        variance = torch.outer(b.square().sum(1), a.square().sum(1))  # Var(W_ij) = Sigma2_ii Sigma1_jj
        std = self.split(variance.sqrt())[index]
        mean = self.mean_values()[index].clone()

        def covariance() -> Tensor:
            sigma_in, sigma_out = a @ a.T, b @ b.T
            if index == 0:  # row-major flattening of W (p x n_in): Cov(W_ij, W_kl) = Sigma2_ik Sigma1_jl
                n_in = self.in_features
                return torch.kron(sigma_out, sigma_in[:n_in, :n_in])
            return sigma_out * sigma_in[-1, -1]

        return PosteriorView(mean, std, covariance)


class FullBlock(PosteriorBlock):
    """Multivariate Gaussian with full covariance over a module's parameters (Algorithm 2)."""

    family = "full"

    def __init__(self, params: Sequence[nn.Parameter], state: dict, std_init: float,
                 module: nn.Module | None = None, implicit_mean: bool = False):
        super().__init__(params, state, module, implicit_mean)
        self.sizes = [p.numel() for p in self.params]
        if not state:
            flat = self.params_as_mean()
            state["mean"] = flat
            state["sqrt_cov"] = std_init * torch.eye(flat.numel(), dtype=flat.dtype, device=flat.device)

    @property
    def noise_shape(self) -> tuple[int, ...]:
        return (self.state["mean"].numel(),)

    def split(self, flat: Tensor) -> list[Tensor]:
        lead = flat.shape[:-1]
        return [chunk.reshape((*lead, *p.shape)) for chunk, p in zip(flat.split(self.sizes, -1), self.params,
                                                                     strict=True)]

    def sample(self, noise: Tensor) -> list[Tensor]:
        return self.split(self.state["mean"] + noise @ self.state["sqrt_cov"].T)  # theta = mu + A eps

    def new_statistics(self) -> dict:
        return {"grad_sum": torch.zeros_like(self.state["mean"]), "grad_noise": LowRank()}

    def accumulate(self, stats: dict, noise: Tensor, grads: Sequence[Tensor]) -> None:
        flat = torch.cat([g.reshape(g.shape[0], -1) for g in grads], 1)  # (K, d)
        stats["grad_sum"] += flat.sum(0)
        stats["grad_noise"].add(flat, noise)  # sum_k g_k eps_k^T

    def update(self, stats: dict, num_samples: int, mean_step: float, cov_step: float) -> None:
        a = self.state["sqrt_cov"]
        # A <- X with X X^T + A A^T E2 X^T - A A^T = 0 (Lemmas 1-2); Eq. "Gaussian first order necessary
        # conditions": mu <- mu - eta A A^T E1, with the prior's A (Algorithm 2) or the updated one (implicit_mean)
        grad_noise = stats["grad_noise"].scaled(cov_step / num_samples)
        self.state["sqrt_cov"], a = self.updated_and_step_factor(a, grad_noise, step_tempering(mean_step, cov_step))
        if priors := self.mean_step_priors():  # calibrate_prior or step_prior (foovb.calibration)
            step = prior_swapped_product(stats["grad_sum"], a, *priors)
        else:
            step = a @ (a.T @ stats["grad_sum"])
        self.state["mean"].sub_(mean_step * step / num_samples)

    def mean_values(self) -> list[Tensor]:
        return self.split(self.state["mean"])

    def params_as_mean(self) -> Tensor:
        return torch.cat([p.detach().flatten() for p in self.params])

    def view(self, index: int) -> PosteriorView:
        a = self.state["sqrt_cov"]
        start = sum(self.sizes[:index])
        rows = slice(start, start + self.sizes[index])
        shape = self.params[index].shape
        std = a[rows].square().sum(1).sqrt().reshape(shape)
        return PosteriorView(self.mean_values()[index].clone(), std, lambda: a[rows] @ a[rows].T)
