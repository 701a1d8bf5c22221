"""MESU, Metaplasticity from Synaptic Uncertainty (Bonnet, Cottart et al. 2025, "Bayesian continual learning and
forgetting in neural networks", arXiv 2504.13569): a task-free diagonal Gaussian learner, the baseline of the
newer literature that FOO-VB is compared with on MESU's own protocol (docs/results.md).

Every weight has a mean ``mu`` and a standard deviation ``sigma``. Each step draws K networks
``w_k = mu + sigma * eps_k`` (``eps_k ~ N(0, I)``), estimates the gradients of the expected loss
``C = (1/K) sum_k L(w_k)`` (``L`` the summed cross-entropy of the batch)

    dC/dmu = (1/K) sum_k g_k,        dC/dsigma = (1/K) sum_k g_k * eps_k,

optionally clips both to ``[-c / sigma, c / sigma]`` elementwise, and moves each weight by

    mu    <- mu    + eta_mu        * ( -sigma^2 dC/dmu    + sigma^2 (mu_prior - mu)         / (N sigma_prior^2) )
    sigma <- sigma + eta_sigma / 2 * ( -sigma^2 dC/dsigma + sigma (sigma_prior^2 - sigma^2) / (N sigma_prior^2) ).

``N`` (the memory window) counts batches: on a quadratic loss of curvature ``h`` per batch the update's fixed
point is the Gaussian posterior after ``N`` batches under the prior ``N(mu_prior, sigma_prior^2)``,
``1 / sigma^2 = N h + 1 / sigma_prior^2`` (``tests/test_mesu.py`` checks it), so older batches are forgotten
at the rate at which new ones arrive. A step that takes some sigma past zero (the prior term when sigma is
far above sigma_prior, or a clipped gradient with ``std_step > 2``) keeps ``|sigma|``: ``N(mu, sigma^2)``
depends on ``sigma^2`` only (the authors' code keeps the negative value; ``sigma_reflections`` counts them).
This module is written from the paper's update rule; the defaults are the
settings of the authors' 10-task permuted-MNIST comparison (784-200-200-10 without biases, batch 100, K=10,
configuration ``supp-presynaptic/mlp-bayesian-mesu`` of kellian-cottart/mesu-pmnist).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from foovb.predict import Predictions
from foovb.validation import is_integer, is_real

from .models import head_logits

__all__ = ["mesu_update", "MESULearner"]


def mesu_update(mean: Tensor, std: Tensor, grad_mean: Tensor, grad_std: Tensor, *, mean_step: float,
                std_step: float, prior_mean: float, prior_std: float, memory: float,
                clip: float = 0.0) -> tuple[Tensor, Tensor]:
    """One MESU step of one weight tensor (module docstring); returns the new ``(mean, std)``.

    ``grad_mean``, ``grad_std``: estimates of dC/dmu and dC/dsigma. ``clip > 0`` clips them to
    ``[-clip / std, clip / std]`` first (the authors' ``clamp_grad``); 0 leaves them as they are.
    """
    if clip > 0:
        bound = clip / std
        grad_mean = torch.maximum(torch.minimum(grad_mean, bound), -bound)
        grad_std = torch.maximum(torch.minimum(grad_std, bound), -bound)
    variance = std * std
    prior_precision_per_batch = 1.0 / (memory * prior_std**2)
    new_mean = mean + mean_step * variance * (-grad_mean + (prior_mean - mean) * prior_precision_per_batch)
    new_std = std + 0.5 * std_step * (-variance * grad_std
                                      + std * (prior_std**2 - variance) * prior_precision_per_batch)
    return new_mean, new_std


def _fan_in(parameter: Tensor, module: nn.Module) -> int:
    """Inputs feeding one output of the layer that owns ``parameter`` (its weight's fan-in; biases share it)."""
    weight = getattr(module, "weight", None)
    reference = weight if isinstance(weight, Tensor) and weight.dim() >= 2 else parameter
    return int(np.prod(reference.shape[1:])) if reference.dim() >= 2 else reference.numel()


class MESULearner:
    """MESU as a continual learner (``Learner`` protocol): one MESU step per batch.

    Args:
        model: the network; its parameters hold the means ``mu``.
        mc_samples: K, networks sampled per step.
        mean_step, std_step: eta_mu and eta_sigma (the authors' ``lr_mu``, ``lr_sigma``).
        prior_mean, prior_std: the prior ``N(mu_prior, sigma_prior^2)`` every weight is pulled back to.
        memory: N, the memory window in batches.
        clip: elementwise gradient bound ``clip / sigma`` (0: none).
        init: ``"mesu"``: the authors' initialisation, ``mu ~ U(-4/sqrt(fan_in), 4/sqrt(fan_in))`` and
            ``sigma = 2/sqrt(fan_in)`` per layer; ``"keep"``: the model's weights as means and ``sigma = std_init``.
        std_init: the initial sigma with ``init="keep"``.
        eval_samples: sampled networks for the "bma" and "single" predictions (0: the mean network only).
        num_heads, classes_per_head: multi-head (task-aware) models.
        seed: seed of the initialisation and of the sampling noise.
    """

    name = "mesu"

    def __init__(self, model: nn.Module, mc_samples: int = 10, *, mean_step: float = 0.46, std_step: float = 1.58,
                 prior_mean: float = 0.0, prior_std: float = 0.02, memory: float = 5.8e6, clip: float = 1.0,
                 init: str = "mesu", std_init: float | None = None, eval_samples: int = 10, num_heads: int = 1,
                 classes_per_head: int = 10, seed: int = 0) -> None:
        if not (is_integer(mc_samples) and mc_samples >= 1):
            raise ValueError(f"mc_samples must be an integer >= 1, got {mc_samples!r}")
        if not (is_integer(eval_samples) and eval_samples >= 0):
            raise ValueError(f"eval_samples must be an integer >= 0, got {eval_samples!r}")
        for name, value in (("mean_step", mean_step), ("std_step", std_step), ("prior_std", prior_std),
                            ("memory", memory)):
            if not (is_real(value) and 0 < value < math.inf):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not (is_real(clip) and 0 <= clip < math.inf):
            raise ValueError(f"clip must be a finite number >= 0, got {clip!r}")
        if not (is_real(prior_mean) and math.isfinite(prior_mean)):
            raise ValueError(f"prior_mean must be a finite number, got {prior_mean!r}")
        if init not in ("mesu", "keep"):
            raise ValueError(f"init must be 'mesu' or 'keep', got {init!r}")
        if (init == "keep") != (std_init is not None):
            raise ValueError("std_init is the initial sigma of init='keep' (and only of it): "
                             f"got init={init!r}, std_init={std_init!r}")
        if std_init is not None and not (is_real(std_init) and 0 < std_init < math.inf):
            raise ValueError(f"std_init must be a finite number > 0, got {std_init!r}")
        self.model = model
        self.mc_samples, self.eval_samples = int(mc_samples), int(eval_samples)
        self.hyperparameters = dict(mean_step=float(mean_step), std_step=float(std_step),
                                    prior_mean=float(prior_mean), prior_std=float(prior_std),
                                    memory=float(memory), clip=float(clip))
        self.num_heads, self.classes_per_head, self.seed = num_heads, classes_per_head, seed
        self.means: dict[str, nn.Parameter] = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.generator = torch.Generator().manual_seed(seed)  # on the CPU: the same draws, and checkpoints, anywhere
        self.stds = self._initial_stds(init, std_init)
        self.sigma_reflections = 0
        """how many times a step took some sigma past zero (module docstring)"""

    def _initial_stds(self, init: str, std_init: float | None) -> dict[str, Tensor]:
        if init == "keep":
            return {name: torch.full_like(mean, float(std_init)) for name, mean in self.means.items()}
        owners = {f"{module_name}.{name}" if module_name else name: module
                  for module_name, module in self.model.named_modules()
                  for name, _ in module.named_parameters(recurse=False)}
        stds = {}
        with torch.no_grad():
            for name, mean in self.means.items():
                limit = 4.0 / math.sqrt(_fan_in(mean, owners[name]))
                noise = torch.rand(mean.shape, generator=self.generator, dtype=mean.dtype).to(mean.device)
                mean.copy_((2 * noise - 1) * limit)
                stds[name] = torch.full_like(mean, limit / 2)
        return stds

    def _sampled(self, generator: torch.Generator) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """One sampled network ``mu + sigma * eps``: ``(weights, eps)``."""
        noise = {name: torch.randn(mean.shape, generator=generator, dtype=mean.dtype).to(mean.device)
                 for name, mean in self.means.items()}
        return {name: self.means[name].detach() + self.stds[name] * noise[name] for name in noise}, noise

    def _logits(self, weights: dict[str, Tensor], x: Tensor, task: int | None) -> Tensor:
        return head_logits(functional_call(self.model, weights, (x,)), task, self.num_heads, self.classes_per_head)

    def observe(self, x: Tensor, y: Tensor, task: int | None = None) -> float:
        """One MESU step on the batch; returns the mean (per example) cross-entropy over the K samples."""
        self.model.train()
        grad_mean = {name: torch.zeros_like(mean) for name, mean in self.means.items()}
        grad_std = {name: torch.zeros_like(mean) for name, mean in self.means.items()}
        total_loss = 0.0
        for _ in range(self.mc_samples):
            weights, noise = self._sampled(self.generator)
            for weight in weights.values():
                weight.requires_grad_(True)
            loss = F.cross_entropy(self._logits(weights, x, task), y, reduction="sum")
            gradients = torch.autograd.grad(loss, list(weights.values()))
            for name, gradient in zip(weights, gradients, strict=True):
                grad_mean[name] += gradient / self.mc_samples
                grad_std[name] += gradient * noise[name] / self.mc_samples
            total_loss += loss.item()
        mean_loss = total_loss / (self.mc_samples * len(y))
        if not math.isfinite(mean_loss):
            raise FloatingPointError(f"MESU: non-finite loss {mean_loss}")
        updates: dict[str, tuple[Tensor, Tensor]] = {}
        with torch.no_grad():
            for name, mean in self.means.items():
                new_mean, new_std = mesu_update(mean, self.stds[name], grad_mean[name], grad_std[name],
                                                **self.hyperparameters)
                if not (torch.isfinite(new_mean).all() and torch.isfinite(new_std).all()):
                    raise FloatingPointError(f"MESU: a non-finite update of {name} (nothing was changed); a "
                                             "larger memory, a smaller std_step or clip > 0 keep it finite")
                updates[name] = (new_mean, new_std)
            for name, (new_mean, new_std) in updates.items():
                self.means[name].copy_(new_mean)
                # a step past zero: N(mu, sigma^2) depends on sigma^2 only, so |sigma| is the same posterior
                self.sigma_reflections += int((new_std < 0).sum())
                self.stds[name] = new_std.abs()
        return mean_loss

    @torch.no_grad()
    def predict(self, x: Tensor, task: int | None = None) -> Predictions:
        """Softmax of the mean network and of ``eval_samples`` sampled ones (the same draws at every call)."""
        was_training = self.model.training
        self.model.eval()
        try:
            def probabilities(weights: dict[str, Tensor]) -> Tensor:
                return torch.softmax(self._logits(weights, x, task), -1)

            mean = probabilities({name: p.detach() for name, p in self.means.items()})
            generator = torch.Generator().manual_seed(self.seed + 1)
            samples = ([probabilities(self._sampled(generator)[0]) for _ in range(self.eval_samples)]
                       if self.eval_samples else None)
        finally:
            self.model.train(was_training)
        return Predictions(mean=mean, samples=torch.stack(samples) if samples else None)

    def posterior_std(self) -> np.ndarray:
        """sigma of every weight (the STD histograms)."""
        return torch.cat([std.flatten() for std in self.stds.values()]).cpu().numpy()

    def posterior_stds(self) -> dict[str, Tensor]:
        """sigma of each parameter tensor, by parameter name (the TensorBoard log)."""
        return dict(self.stds)

    def state_dict(self) -> dict[str, Any]:
        return {"learner": self.name, "model": self.model.state_dict(), "stds": dict(self.stds),
                "generator": self.generator.get_state(), "sigma_reflections": self.sigma_reflections}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("learner") != self.name:
            raise ValueError(f"state of learner {state.get('learner')!r} cannot be loaded into {self.name!r}")
        if state["stds"].keys() != self.stds.keys():
            raise ValueError(f"stds: parameter names {sorted(state['stds'])} do not match {sorted(self.stds)}")
        self.model.load_state_dict(state["model"])
        self.stds = {name: std.to(self.means[name]).clone() for name, std in state["stds"].items()}
        self.generator.set_state(state["generator"])
        self.sigma_reflections = int(state["sigma_reflections"])
