"""MESU (foovb_suite.mesu): the update against its equations and the Gaussian posterior it converges to, the
learner's gradient estimates against autograd on the same draws, exact resume, and learning on real data."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from foovb_suite.config import ConfigError, apply_overrides, config_from_dict
from foovb_suite.learners import make_learner
from foovb_suite.mesu import MESULearner, mesu_update
from foovb_suite.models import make_model, mlp
from foovb_suite.runner import run

UNIT_STEPS = dict(mean_step=1.0, std_step=1.0)


@pytest.mark.parametrize("memory, curvature, prior_std", [(50.0, 2.0, 1.0), (1e3, 0.5, 0.1), (5.0, 10.0, 0.3)])
def test_fixed_point_is_the_gaussian_posterior_of_memory_batches(memory, curvature, prior_std) -> None:
    # Quadratic loss (h/2)(w - w*)^2 per batch: E[dL/dmu] = h (mu - w*), E[dL/dsigma] = E[h (mu + sigma eps - w*) eps]
    # = h sigma. The posterior of N such batches under the prior N(mu_p, sigma_p^2) has precision N h + 1/sigma_p^2
    # and mean (N h w* + mu_p / sigma_p^2) / precision.
    target, prior_mean = torch.tensor([1.5, -0.7], dtype=torch.float64), 0.25
    mean, std = torch.zeros(2, dtype=torch.float64), torch.full((2,), 0.05, dtype=torch.float64)
    for _ in range(20000):
        mean, std = mesu_update(mean, std, curvature * (mean - target), curvature * std, **UNIT_STEPS,
                                prior_mean=prior_mean, prior_std=prior_std, memory=memory)
    precision = memory * curvature + 1 / prior_std**2
    torch.testing.assert_close(std, torch.full_like(std, precision**-0.5), rtol=1e-7, atol=0)
    expected_mean = (memory * curvature * target + prior_mean / prior_std**2) / precision
    torch.testing.assert_close(mean, expected_mean, rtol=1e-7, atol=1e-10)


def test_one_update_matches_the_paper_equations_term_by_term() -> None:
    generator = torch.Generator().manual_seed(0)
    mean, grad_mean, grad_std = (torch.randn(5, generator=generator, dtype=torch.float64) for _ in range(3))
    std = torch.rand(5, generator=generator, dtype=torch.float64) + 0.1
    settings = dict(mean_step=0.46, std_step=1.58, prior_mean=0.1, prior_std=0.02, memory=300.0)
    new_mean, new_std = mesu_update(mean, std, grad_mean, grad_std, **settings)
    for i in range(5):
        m, s, gm, gs = (float(t[i]) for t in (mean, std, grad_mean, grad_std))
        n_sp2 = 300.0 * 0.02**2
        assert float(new_mean[i]) == pytest.approx(m + 0.46 * (-s * s * gm + s * s * (0.1 - m) / n_sp2), rel=1e-12)
        assert float(new_std[i]) == pytest.approx(
            s + 1.58 / 2 * (-s * s * gs + s * (0.02**2 - s * s) / n_sp2), rel=1e-12)


def test_clipping_bounds_each_gradient_by_clip_over_sigma() -> None:
    std = torch.tensor([0.5, 0.1, 0.2], dtype=torch.float64)
    huge = torch.tensor([1e6, -1e6, 1e-3], dtype=torch.float64)
    no_prior = dict(prior_mean=0.0, prior_std=1.0, memory=1e300)
    mean, new_std = mesu_update(torch.zeros(3, dtype=torch.float64), std, huge, huge, **UNIT_STEPS, clip=2.0,
                                **no_prior)
    # |grad| capped at 2/sigma: the mean moves by sigma^2 * 2/sigma = 2 sigma, sigma by sigma^2 * 2/sigma / 2
    torch.testing.assert_close(mean, torch.tensor([-1.0, 0.2, -0.2 * 0.2 * 1e-3], dtype=torch.float64))
    torch.testing.assert_close(new_std, std - torch.tensor([0.5, -0.1, 0.2 * 0.2 * 1e-3 / 2], dtype=torch.float64))
    unclipped, _ = mesu_update(torch.zeros(3, dtype=torch.float64), std, huge, huge, **UNIT_STEPS, **no_prior)
    assert unclipped[0] == -0.25 * 1e6


def _tiny_model(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5, bias=bias), nn.Tanh(), nn.Linear(5, 3, bias=bias))


def _expected_step(learner: MESULearner, x, y) -> tuple[dict, dict, float]:
    """The means, sigmas and mean loss that one `observe(x, y)` should give: autograd on the learner's own draws
    (eps for every parameter in order, then the sampled network), then `mesu_update`."""
    model, k = learner.model, learner.mc_samples
    means = {name: p.detach().clone() for name, p in model.named_parameters()}
    replay = torch.Generator().manual_seed(0)
    replay.set_state(learner.generator.get_state())
    grad_mean = {name: torch.zeros_like(m) for name, m in means.items()}
    grad_std = {name: torch.zeros_like(m) for name, m in means.items()}
    losses = []
    for _ in range(k):
        noise = {name: torch.randn(m.shape, generator=replay) for name, m in means.items()}
        weights = {name: (means[name] + learner.stds[name] * noise[name]).requires_grad_() for name in means}
        loss = F.cross_entropy(functional_call(model, weights, (x,)), y, reduction="sum")  # L: summed over the batch
        for name, gradient in zip(weights, torch.autograd.grad(loss, list(weights.values())), strict=True):
            grad_mean[name] += gradient / k
            grad_std[name] += gradient * noise[name] / k
        losses.append(loss.item())
    updated = {name: mesu_update(means[name], learner.stds[name], grad_mean[name], grad_std[name],
                                 **learner.hyperparameters) for name in means}
    return ({n: m for n, (m, _) in updated.items()}, {n: s for n, (_, s) in updated.items()},
            sum(losses) / (k * len(y)))


def test_observe_is_the_update_of_the_monte_carlo_gradients_of_its_draws() -> None:
    learner = MESULearner(_tiny_model(), mc_samples=3, memory=40.0, prior_std=0.5, clip=0.0, init="keep",
                          std_init=0.05, seed=4)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    expected_means, expected_stds, expected_loss = _expected_step(learner, x, y)
    assert learner.observe(x, y) == pytest.approx(expected_loss, rel=1e-6)
    for name, parameter in learner.model.named_parameters():
        torch.testing.assert_close(parameter.detach(), expected_means[name])
        torch.testing.assert_close(learner.stds[name], expected_stds[name])
    assert learner.sigma_reflections == 0


def test_a_step_past_zero_keeps_the_same_posterior_with_positive_sigma() -> None:
    # sigma 0.82 (fan-in 6) against a prior sigma of 0.02 remembered over 10 batches: the prior term alone
    # moves sigma by 0.79 * 0.82 * (0.0004 - 0.67) / 0.004, far below -sigma
    learner = MESULearner(_tiny_model(), mc_samples=2, memory=10.0, prior_std=0.02, clip=1.0)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    _, expected_stds, _ = _expected_step(learner, x, y)
    learner.observe(x, y)
    negative = sum(int((s < 0).sum()) for s in expected_stds.values())
    assert negative > 0 and learner.sigma_reflections == negative
    for name, std in learner.stds.items():
        torch.testing.assert_close(std, expected_stds[name].abs())


def test_mesu_initialisation_scales_with_the_fan_in() -> None:
    model = mlp(784, (200,), 10, bias=False)
    learner = MESULearner(model, seed=1)
    first, second = model[1].weight, model[3].weight
    for weight, fan_in in ((first, 784), (second, 200)):
        limit = 4 / fan_in**0.5
        assert weight.abs().max() <= limit and weight.abs().max() > 0.95 * limit
        assert weight.std().item() == pytest.approx(limit / 3**0.5, rel=0.05)  # uniform on [-limit, limit]
    assert torch.all(learner.stds["1.weight"] == 2 / 784**0.5) and torch.all(learner.stds["3.weight"] == 2 / 200**0.5)
    kept = _tiny_model()
    before = [p.detach().clone() for p in kept.parameters()]
    learner = MESULearner(kept, init="keep", std_init=0.01)
    assert all(torch.equal(b, p) for b, p in zip(before, kept.parameters(), strict=True))
    assert all(torch.all(s == 0.01) for s in learner.stds.values())


def test_state_dict_resumes_bit_for_bit() -> None:
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    straight = MESULearner(_tiny_model(), mc_samples=2, memory=100.0, prior_std=1.0, seed=3)
    for _ in range(6):
        straight.observe(x, y)
    first = MESULearner(_tiny_model(), mc_samples=2, memory=100.0, prior_std=1.0, seed=3)
    for _ in range(3):
        first.observe(x, y)
    saved = torch.load(_saved(first.state_dict()), weights_only=True)
    resumed = MESULearner(_tiny_model(), mc_samples=2, memory=100.0, prior_std=1.0, seed=99)
    resumed.load_state_dict(saved)
    for _ in range(3):
        resumed.observe(x, y)
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(straight.stds[n], resumed.stds[n]) for n in straight.stds)
    predictions = resumed.predict(x)
    assert predictions.samples.shape == (10, 16, 3)
    assert torch.equal(predictions.samples, resumed.predict(x).samples)  # the same draws at every call


def _saved(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("arguments, match", [
    (dict(mc_samples=0), "mc_samples"), (dict(memory=0), "memory"), (dict(prior_std=-1.0), "prior_std"),
    (dict(clip=-1.0), "clip"), (dict(prior_std=float("inf")), "prior_std"), (dict(memory=float("nan")), "memory"),
    (dict(init="paper"), "init"), (dict(init="keep"), "std_init"),
    (dict(std_init=0.1), "std_init"), (dict(mean_step="1"), "mean_step"), (dict(eval_samples=-1), "eval_samples"),
])
def test_bad_hyperparameters_are_refused(arguments, match) -> None:
    with pytest.raises(ValueError, match=match):
        MESULearner(_tiny_model(), **arguments)
    with pytest.raises(ValueError, match="unknown hyper-parameter.*lr.*accepted: mc_samples, mean_step"):
        make_learner("mesu", _tiny_model(), lr=0.1)


MESU_QUICK = {
    "name": "mesu_quick",
    "scenario": {"kind": "discrete_permuted_mnist", "num_tasks": 2, "epochs_per_task": 1, "train_subset": 6000,
                 "batch_size": 100},
    "model": {"kind": "mlp", "hidden": [200, 200], "bias": False},
    "learner": {"kind": "mesu", "params": {"mc_samples": 10, "eval_samples": 4}},
    "evaluation": {"test_subset": 1000},
    "device": "cpu",
}


@pytest.mark.slow
def test_mesu_learns_permuted_mnist_far_above_chance(tmp_path) -> None:
    summary = run(config_from_dict(json.loads(json.dumps(MESU_QUICK))), tmp_path / "run", progress=False)
    assert summary["learner"] == "mesu"
    # MESU's protocol on 2 tasks of 60 batches: far above the 10% of chance on both
    assert summary["modes"]["bma"]["average_accuracy"] > 0.65
    assert summary["modes"]["mean"]["first_task_accuracy"] > 0.55
    assert "bias: false" in (tmp_path / "run" / "config.yaml").read_text()


def test_scientific_notation_in_configs_and_overrides_is_a_number() -> None:
    config = config_from_dict(apply_overrides(json.loads(json.dumps(MESU_QUICK)), ["learner.params.memory=1e6"]))
    assert config.learner.params["memory"] == 1e6
    from foovb_suite.config import load_config

    assert load_config(Path(__file__).parents[1] / "configs" / "mesu_protocol_mesu.yaml").learner.params["memory"] \
        == 5.8e6


def test_model_bias_option() -> None:
    layers = [layer for layer in mlp(10, (4,), 2, bias=False) if isinstance(layer, nn.Linear)]
    assert len(layers) == 2 and all(layer.bias is None for layer in layers)
    with pytest.raises(ConfigError, match="model.bias"):
        config_from_dict(apply_overrides(json.loads(json.dumps(MESU_QUICK)), ["model.kind=lenet",
                                                                         "model.hidden=[100,100]"]))
    with pytest.raises(ValueError, match="bias"):
        make_model("lenet", (3, 32, 32), 10, 5, bias=False)
