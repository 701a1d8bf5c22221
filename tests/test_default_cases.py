"""FOOVB(model)'s defaults on the small models users bring, where a step with the prior's covariance overshoots: a
1-64-64-1 tanh regression net, a 20-8-20 autoencoder (a mean over 20 outputs per row) and a Gaussian-NLL head. The
bars are the shared default cases' (../shared/checks/default_cases.py); the previous default fails each of them.
FOOVB(model)'s posterior "auto" is the kronecker family on these models (its steps are the kronecker family's:
tests/test_priors.py); the diagonal family is checked too."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from foovb import FOOVB

_spec = importlib.util.spec_from_file_location(
    "small_models", Path(__file__).resolve().parents[1] / "benchmarks" / "small_models.py")
small_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(small_models)
sine_data = small_models.sine


def fit(model: nn.Module, make_optimizer, loss_fn, x: torch.Tensor, y: torch.Tensor, epochs: int, batch: int) -> None:
    small_models.train(model, make_optimizer(model), loss_fn, x, y, epochs, batch)


# single-threaded as benchmarks/small_models.py measured the bars (two threads on a busy 2-core box: 20-38 min)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

FAMILIES = ("diagonal", "kronecker")
PREVIOUS_DEFAULT = {"diagonal": {"implicit_mean": False, "cov_step": 0.3},
                    "kronecker": {"implicit_mean": False, "cov_step": 0.1}}


def sine_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def sine_error(make_optimizer) -> float:
    x, y = sine_data()
    model = sine_net()
    fit(model, make_optimizer, F.mse_loss, x, y, epochs=60, batch=32)
    with torch.no_grad():
        return F.mse_loss(model(x), torch.sin(x)).item()


@pytest.fixture(scope="module")
def adam_error() -> float:
    return sine_error(lambda model: torch.optim.Adam(model.parameters(), lr=1e-3))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_sine_net_fits_as_well_as_adam(family, adam_error):
    assert sine_error(lambda model: FOOVB(model, family, seed=0)) <= max(2 * adam_error, 0.01)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_previous_default_misses_the_sine(family, adam_error):
    error = sine_error(lambda model: FOOVB(model, family, seed=0, **PREVIOUS_DEFAULT[family]))
    assert error > 10 * max(2 * adam_error, 0.01)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_autoencoder_and_the_gaussian_nll_head_train(family):
    torch.manual_seed(0)
    data = torch.randn(256, 20)
    torch.manual_seed(0)
    autoencoder = nn.Sequential(nn.Linear(20, 8), nn.ReLU(), nn.Linear(8, 20))
    with torch.no_grad():
        before = F.mse_loss(autoencoder(data), data).item()
    fit(autoencoder, lambda model: FOOVB(model, family, seed=0), F.mse_loss, data, data, epochs=25, batch=64)
    with torch.no_grad():  # an 8-unit bottleneck on 20 isotropic dimensions: 12/20 of the variance is the floor
        assert F.mse_loss(autoencoder(data), data).item() < 0.7 * before

    x, y = sine_data()
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 2))

    def nll(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.gaussian_nll_loss(out[:, :1], target, F.softplus(out[:, 1:]) + 1e-4)

    fit(head, lambda model: FOOVB(model, family, seed=0), nll, x, y, epochs=30, batch=32)
    with torch.no_grad():
        out = head(x)
        assert nll(out, y).item() < -1.0  # the noise is 0.1: a fitted head reaches about -1.4 to -1.7
        assert F.mse_loss(out[:, :1], torch.sin(x)).item() < 0.01
