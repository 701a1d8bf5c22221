"""Hyperparameter validation (foovb/validation.py and its callers): booleans are not real numbers,
NaN is not a positive number."""

import math

import numpy as np
import pytest
import torch
from conftest import mlp

from foovb import FOOVB
from foovb.validation import is_integer, is_real
from foovb_suite.baselines import make_baseline


def test_is_real_and_is_integer_refuse_booleans_and_accept_numpy_scalars():
    for value in (True, False, np.bool_(True), "1.0", None):
        assert not is_real(value), value
        assert not is_integer(value), value
    for value in (1, 0.5, math.nan, np.float32(0.5), np.float64(2.0), np.int64(3)):
        assert is_real(value), value
    for value in (1, np.int64(3), np.int32(-2)):
        assert is_integer(value), value
    assert not is_integer(2.0) and not is_integer(np.float32(2.0))


@pytest.mark.parametrize("name", ["mean_step", "cov_step", "std_init", "cov_momentum"])
def test_foovb_refuses_boolean_real_hyperparameters(name):
    with pytest.raises(ValueError, match=name):
        FOOVB(mlp(), "diagonal", 2, **{name: True})


@pytest.mark.parametrize(("name", "parameter", "value"), [
    ("sgd", "lr", True), ("sgd", "lr", math.nan), ("si", "xi", math.nan), ("si", "c", math.nan),
    ("ewc_online", "reg", math.nan), ("ewc_online", "reg", True),
])
def test_baselines_refuse_boolean_and_nan_hyperparameters(name, parameter, value):
    with pytest.raises(ValueError, match=parameter):
        make_baseline(name, mlp(), **{parameter: value})


@pytest.mark.parametrize("posterior", ["kronecker", "full"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_parameters_are_refused_where_covariance_factors_live_in_them(posterior, dtype):
    """Issue 39: with bfloat16 parameters the matrix-variate factors A, B were bfloat16 too (their updates round
    away; the step ran 18x slower on CPU). The error names the fix: float32 parameters under torch.autocast."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).to(dtype)
    with pytest.raises(ValueError, match=r"module '0' has torch\.\w*16 parameters.*torch\.autocast"):
        FOOVB(model, posterior, mc_samples=2)


def test_half_precision_parameters_keep_the_diagonal_family_and_float32_works_under_autocast():
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    FOOVB(model.to(torch.bfloat16), "diagonal", mc_samples=2)  # elementwise state: as torch's optimizers do
    model = model.float()
    opt = FOOVB(model, "kronecker", mc_samples=2, seed=0)
    x, y = torch.randn(4, 6), torch.randint(3, (4,))

    def closure():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        return loss

    opt.step(closure)
    assert all(value.dtype == torch.float32 for block in opt.blocks for value in block.state.values())
