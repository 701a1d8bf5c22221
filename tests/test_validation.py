"""Hyperparameter validation (foovb/validation.py and its callers): booleans are not real numbers,
NaN is not a positive number."""

import math

import numpy as np
import pytest
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
