"""foovb.persistence: FOOVB.state_dict / load_state_dict (an exact resume, copies in both directions, numpy
hyperparameters saved as Python numbers, every refusal of another setting, architecture, entry or value leaving the
optimizer as it was, valid state dicts still loading, no load during a step) and the refusal to copy or pickle."""

import io
import math
import re

import numpy as np
import pytest
import torch
from conftest import (
    F64,
    FAMILIES,
    PAPER,
    all_equal,
    ce_closure,
    mlp,
    mlp_batch,
    params_snapshot,
    posterior_snapshot,
)
from conftest import take_steps as _steps
from torch import nn

from foovb import FOOVB

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize(("family", "options"), [(f, {}) for f in FAMILIES] + [("diagonal", {"cov_momentum": 0.9})])
def test_state_dict_round_trip_resumes_exactly(family, options):
    model_a = mlp(seed=0)
    opt_a = FOOVB(model_a, family, 3, seed=5, **options, **PAPER)
    _steps(model_a, opt_a, 0, 6)

    model_b = mlp(seed=0)
    opt_b = FOOVB(model_b, family, 3, seed=5, **options, **PAPER)
    _steps(model_b, opt_b, 0, 3)
    buffer = io.BytesIO()
    torch.save({"model": model_b.state_dict(), "opt": opt_b.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)

    model_c = mlp(seed=1)
    opt_c = FOOVB(model_c, family, 3, seed=999, **options, **PAPER)
    model_c.load_state_dict(saved["model"])
    opt_c.load_state_dict(saved["opt"])
    assert opt_c.steps_taken == 3
    assert all_equal(posterior_snapshot(opt_c), posterior_snapshot(opt_b))
    _steps(model_c, opt_c, 3, 3)
    assert opt_c.steps_taken == 6
    assert all_equal(posterior_snapshot(opt_c), posterior_snapshot(opt_a))
    assert all_equal(params_snapshot(model_c), params_snapshot(model_a))


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_is_a_copy_in_both_directions(family):
    """A state dict kept in memory is not changed by later steps, and two optimizers loaded from one dict
    do not share their posteriors: resuming from it equals resuming from a file."""
    model_a = mlp(seed=0)
    opt_a = FOOVB(model_a, family, 3, seed=5, **PAPER)
    _steps(model_a, opt_a, 0, 2)
    saved, before = opt_a.state_dict(), posterior_snapshot(opt_a)
    _steps(model_a, opt_a, 2, 2)
    resumed = []
    for _ in range(2):
        model = mlp(seed=0)
        opt = FOOVB(model, family, 3, seed=1, **PAPER)
        opt.load_state_dict(saved)
        assert all_equal(posterior_snapshot(opt), before)
        resumed.append((model, opt))
    _steps(*resumed[0], 2, 2)
    assert all_equal(posterior_snapshot(resumed[0][1]), posterior_snapshot(opt_a))
    assert all_equal(posterior_snapshot(resumed[1][1]), before)  # untouched by its twin's steps


@pytest.mark.parametrize(
    ("saved_by", "loaded_by", "match"),
    [
        (("diagonal", 3), ("kronecker", 3), "posterior: saved 'diagonal', here 'kronecker'"),
        (("full", 3), ("diagonal", 3), "posterior"),
        (("diagonal", 4), ("diagonal", 2), "mc_samples: saved 4, here 2"),
        (("diagonal", 4, {"antithetic": False}), ("diagonal", 4, {"antithetic": True}), "antithetic: saved False"),
    ],
)
def test_load_state_dict_refuses_other_settings_and_changes_nothing(saved_by, loaded_by, match):
    def build(family, k, options=None):
        model = mlp(seed=0)
        return model, FOOVB(model, family, k, seed=0, **(options or {}), **PAPER)

    saved = build(*saved_by)[1].state_dict()
    model, opt = build(*loaded_by)
    x, y = mlp_batch()
    opt.step(ce_closure(model, x, y))
    posterior, params = posterior_snapshot(opt), params_snapshot(model)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(saved)
    assert all_equal(posterior_snapshot(opt), posterior)
    assert all_equal(params_snapshot(model), params)
    opt.step(ce_closure(model, x, y))  # still usable


def test_hyperparameters_may_be_numpy_scalars():
    opt = FOOVB(mlp(), "diagonal", np.int64(3), std_init=np.float32(0.05), mean_step=np.float32(0.5),
                seed=np.int64(2), **PAPER)
    opt.param_groups[0]["cov_step"] = np.float32(0.5)  # as a schedule computed with numpy might write it
    x, y = mlp_batch()
    opt.step_batched(x, y)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # weights_only (the default): plain Python numbers only
    assert loaded["param_groups"][0]["cov_step"] == 0.5 and type(loaded["param_groups"][0]["std_init"]) is float


@pytest.mark.parametrize("family", FAMILIES)
def test_load_state_dict_refuses_another_architecture(family):
    small = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    saved = FOOVB(small, family, 3, seed=0, **PAPER).state_dict()
    with pytest.raises(ValueError, match="does not fit this model"):
        FOOVB(mlp(), family, 3, seed=0, **PAPER).load_state_dict(saved)
    with pytest.raises(ValueError, match="number of trainable parameters"):
        FOOVB(nn.Linear(4, 3), family, 3, seed=0, **PAPER).load_state_dict(saved)
    with pytest.raises(ValueError, match="not a FOOVB state dict"):
        FOOVB(mlp(), family, 3, **PAPER).load_state_dict(torch.optim.SGD(mlp().parameters(), lr=0.1).state_dict())
    for bad in (None, [], "state", {**saved, "param_groups": [None]}):
        with pytest.raises(ValueError, match="not a FOOVB state dict"):
            FOOVB(mlp(), family, 3, **PAPER).load_state_dict(bad)


@pytest.mark.parametrize("progress", [
    {"steps_taken": 1}, {"generator": torch.zeros(3, dtype=torch.uint8), "steps_taken": 1},
    {"generator": None, "steps_taken": 1}, {"steps_taken": -1}, {"steps_taken": 1.5}, None])
def test_load_state_dict_refuses_a_bad_foovb_entry_and_changes_nothing(progress):
    """The 'foovb' entry was read after the posterior was replaced: a KeyError or TypeError left the optimizer
    training its old posterior while state_dict() saved the loaded tensors."""
    model = mlp(seed=0)
    opt = FOOVB(model, "diagonal", 3, seed=0, **PAPER)
    saved = opt.state_dict()
    if progress is not None and "generator" not in progress and "steps_taken" in progress and \
            progress["steps_taken"] != 1:
        progress = {"generator": saved["foovb"]["generator"], **progress}
    x, y = mlp_batch()
    opt.step(ce_closure(model, x, y))
    posterior, params = posterior_snapshot(opt), params_snapshot(model)
    with pytest.raises(ValueError, match="its 'foovb' entry must hold"):
        opt.load_state_dict({**saved, "foovb": progress})
    assert all_equal(posterior_snapshot(opt), posterior) and all_equal(params_snapshot(model), params)
    opt.step(ce_closure(model, x, y))  # the posterior the optimizer trains is the one it saves
    assert all_equal(list(opt.state_dict()["state"][0].values()),
                     [opt.blocks[0].state[key] for key in opt.state_dict()["state"][0]])


def _poke(value, position, new):
    """A copy of `value` with its entry at flat `position` set to `new` (or `new` of the entry's value)."""
    value = value.clone()
    value.view(-1)[position] = new(value.view(-1)[position]) if callable(new) else new
    return value


NON_FINITE = "has NaN or Inf in 1 of its"


NOT_POSITIVE = "is negative, or 0 where this optimizer's is not, in 1 of its"


# (family, options, parameter index, key, corruption of the saved tensor, the refusal's message after the key)
BAD_VALUES = [
    ("diagonal", {}, 0, "mean", lambda v: _poke(v, 1, math.nan), NON_FINITE),
    ("diagonal", {}, 1, "mean", lambda v: _poke(v, 0, -math.inf), NON_FINITE),
    ("diagonal", {}, 0, "std", lambda v: _poke(v, 3, math.nan), NON_FINITE),
    ("diagonal", {}, 2, "std", lambda v: _poke(v, 0, 0.0), NOT_POSITIVE),
    ("diagonal", {}, 0, "std", lambda v: _poke(v, 5, lambda x: -x), NOT_POSITIVE),
    ("diagonal", {}, 0, "std", lambda v: v.to(torch.int64), "is torch.int64, this optimizer keeps torch.float32"),
    ("diagonal", {}, 0, "mean", lambda v: v.to(torch.bool), "is torch.bool, this optimizer keeps torch.float32"),
    ("diagonal", {}, 0, "mean", lambda v: _poke(v.double(), 2, 1e300),
     "overflows torch.float32 (the parameter's, it is cast to) in 1 of its 24 entries"),
    ("diagonal", {"cov_momentum": 0.9}, 0, "grad_noise_average", lambda v: _poke(v, 0, math.nan), NON_FINITE),
    ("kronecker", {}, 0, "input_sqrt_cov", lambda v: _poke(v, 2, math.nan), NON_FINITE),
    ("kronecker", {}, 2, "output_sqrt_cov", torch.zeros_like, "has 3 zero rows and 3 zero columns"),
    ("kronecker", {}, 0, "input_sqrt_cov", lambda v: v.index_fill(0, torch.tensor([1]), 0.0),
     "has 1 zero rows and 0 zero columns where this optimizer's has none"),
    ("full", {}, 0, "sqrt_cov", lambda v: _poke(v, 7, math.inf), NON_FINITE),
]


SHAPES = {0: (6, 4), 1: (6,), 2: (3, 6)}  # mlp()'s parameters by index


def _same_state_dicts(a: dict, b: dict) -> bool:
    """Equal param_groups, generator state, steps taken and state tensors (values and dtypes)."""
    return (a["param_groups"] == b["param_groups"] and a["foovb"]["steps_taken"] == b["foovb"]["steps_taken"]
            and torch.equal(a["foovb"]["generator"], b["foovb"]["generator"]) and a["state"].keys() == b["state"].keys()
            and all(a["state"][i].keys() == b["state"][i].keys()
                    and all(x.dtype == b["state"][i][key].dtype and torch.equal(x, b["state"][i][key])
                            for key, x in a["state"][i].items()) for i in a["state"]))


def _refused_load_changes_nothing(opt: FOOVB, model: nn.Module, bad: dict, match: str) -> None:
    before, params = opt.state_dict(), params_snapshot(model)
    with pytest.raises(ValueError, match=match) as refusal:
        opt.load_state_dict(bad)
    assert "\n" not in str(refusal.value)  # one line
    assert _same_state_dicts(opt.state_dict(), before) and all_equal(params_snapshot(model), params)


@pytest.mark.parametrize(("family", "options", "index", "key", "corrupt", "match"), BAD_VALUES,
                         ids=[f"{case[0]}-{case[3]}-{i}" for i, case in enumerate(BAD_VALUES)])
def test_load_state_dict_refuses_bad_values_and_changes_nothing(family, options, index, key, corrupt, match):
    """NaN / Inf / non-positive stds, singular or non-finite factors and other dtypes were loaded (or cast
    silently); the next step then blamed values written into the model. Refused before anything changes, with
    the parameter, the family and the key named; the optimizer state that was there is kept."""
    model = mlp(seed=0)
    opt = FOOVB(model, family, 4, seed=0, **options, **PAPER)
    _steps(model, opt, 0, 1)
    saved = opt.state_dict()
    saved["param_groups"][0]["lr"] = 0.5  # differs from the optimizer's, as the generator and steps_taken do
    _steps(model, opt, 1, 1)
    saved["state"][index][key] = corrupt(saved["state"][index][key])
    name = [name for name, _ in model.named_parameters()][index]  # named since session 55 (it said "parameter 7")
    named = re.escape(f"the {family} posterior of parameter {index} ({name!r}, shape {SHAPES[index]})")
    _refused_load_changes_nothing(opt, model, saved, f"^cannot load {named}: its {key!r} {re.escape(match)}")
    _steps(model, opt, 2, 1)  # still usable


@pytest.mark.parametrize("family", FAMILIES)
def test_a_state_dict_loads_into_the_model_cast_to_another_dtype(family):
    """A user's trial (session 56): model.double() after FOOVB(model) is refused with the advice to load a saved state
    dict into a new FOOVB built after the cast, but the load refused the float32 state ("a state dict is not cast").
    Floating-point state is cast to the parameters' dtype, as torch's optimizers do: the posterior is the saved one in
    float64, and training goes on."""
    model = mlp(seed=0)
    opt = FOOVB(model, family, 4, seed=0)
    _steps(model, opt, 0, 2)
    saved = opt.state_dict()
    model.double()
    x, y = mlp_batch(seed=300)
    with pytest.raises(ValueError, match="load_state_dict a saved one into a new FOOVB built after it"):
        opt.step(ce_closure(model, x.double(), y))
    again = FOOVB(model, family, 4, seed=0)
    again.load_state_dict(saved)
    for got, want in zip(posterior_snapshot(again), posterior_snapshot(opt), strict=True):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want.double())
    again.step(ce_closure(model, x.double(), y))
    assert all(p.dtype == torch.float64 and bool(torch.isfinite(p).all()) for p in model.parameters())


def test_load_state_dict_refuses_a_state_entry_that_is_not_a_dict():
    model = mlp()
    opt = FOOVB(model, seed=0)
    saved = opt.state_dict()
    with pytest.raises(ValueError, match="its 'state' must be a dict, got NoneType"):
        opt.load_state_dict({**saved, "state": None})


def test_load_state_dict_refuses_a_generator_state_torch_refuses_and_changes_nothing():
    """A generator state of the right shape and dtype that torch.Generator refuses was set after the posterior
    was replaced: a RuntimeError, and state_dict() then saved the refused posterior."""
    model = mlp(seed=0)
    opt = FOOVB(model, "diagonal", 4, seed=0, **PAPER)
    saved = opt.state_dict()
    _steps(model, opt, 0, 1)
    saved["foovb"]["generator"] = torch.zeros_like(saved["foovb"]["generator"])
    _refused_load_changes_nothing(opt, model, saved, r"^cannot load the noise generator's state .*Invalid mt19937")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["float32", "float64"])
def test_valid_state_dicts_still_load_padding_rows_included(family, dtype):
    """The checks refuse nothing a FOOVB saves: an nn.Embedding's padding row has std 0 (its weights stay), a
    float64 model keeps float64 tensors, and the loaded state is the saved one."""
    def build(seed: int) -> tuple[nn.Module, FOOVB]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Embedding(5, 4, padding_idx=1), nn.Linear(4, 3)).to(dtype)
        return model, FOOVB(model, family, 4, seed=seed, **PAPER)

    model_a, opt_a = build(0)
    tokens, labels = torch.tensor([0, 1, 2, 3, 4, 1]), torch.tensor([0, 1, 2, 0, 1, 2])
    opt_a.step(ce_closure(model_a, tokens, labels))
    saved = opt_a.state_dict()
    scale = saved["state"][0]["sqrt_cov" if family == "full" else "std"]  # the embedding's (first) block
    assert not scale.reshape(5, 4, -1)[1].any() and scale.reshape(5, 4, -1)[0].any()  # the padding row's is 0
    model_b, opt_b = build(1)
    opt_b.load_state_dict(saved)
    assert _same_state_dicts(opt_b.state_dict(), saved)
    assert all_equal(params_snapshot(model_b), params_snapshot(model_a))


def test_load_state_dict_during_a_step_is_refused():
    """A step begun by sampled_params(train=True) blocks holds samples of the current posterior: loading
    another under it mixed the two in the update."""
    model = mlp(seed=0)
    opt = FOOVB(model, "diagonal", 2, seed=0, **PAPER)
    saved = opt.state_dict()
    x, y = mlp_batch()
    with opt.sampled_params(train=True):
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    with pytest.raises(RuntimeError, match="while a step is under way"):
        opt.load_state_dict(saved)
    with opt.sampled_params(train=True):
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    opt.step()
    opt.load_state_dict(saved)  # between steps
    assert opt.steps_taken == 0


def test_copying_or_pickling_the_optimizer_is_refused_and_its_state_dict_round_trips():
    """copy.deepcopy kept only torch's param_groups and state: the copy had no model and failed at its first step
    with an AttributeError."""
    import copy
    import pickle

    model = mlp()
    opt = FOOVB(model, mc_samples=2, seed=0)
    for attempt in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be copied or pickled.*opt.state_dict"):
            attempt(opt)
    twin = copy.deepcopy(model)
    restored = FOOVB(twin, mc_samples=2, seed=1)
    restored.load_state_dict(opt.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
