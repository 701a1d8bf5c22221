"""The wide matrix-variate factors' cached eigendecompositions (`foovb.linalg.refreshed_factor_eigh`): exact where a
factor is narrow or has just been refreshed, refreshed exactly when the factor moved by more than the tolerance, the
same decompositions after a checkpoint is loaded or an update undone, and checked when a state dict is loaded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from foovb import FOOVB
from foovb.calibration import covariances, restore_covariances
from foovb.linalg import (
    REFRESH_TOLERANCE,
    WIDE_FACTOR,
    EighCache,
    factor_eigh,
    refreshed_factor_eigh,
    spectral_norm,
)
from foovb.posteriors import AT_REFRESH

KEY = "input_sqrt_cov_at_refresh"


def wide_factor(seed: int = 0, n: int = WIDE_FACTOR + 9) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.eye(n) + 0.01 * torch.randn(n, n, generator=generator)


def test_spectral_norm_is_the_largest_singular_value():
    matrix = torch.randn(40, 30, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert spectral_norm(matrix, iterations=200) == pytest.approx(float(torch.linalg.matrix_norm(matrix, 2)), rel=1e-6)
    assert spectral_norm(matrix) <= float(torch.linalg.matrix_norm(matrix, 2)) * (1 + 1e-12)  # from below


def test_a_narrow_factor_is_decomposed_every_time_and_keeps_no_reference():
    factor, state = wide_factor(n=WIDE_FACTOR), {}
    values, vectors = refreshed_factor_eigh(factor, state, KEY, EighCache())
    exact_values, exact_vectors = factor_eigh(factor)
    assert torch.equal(values, exact_values) and torch.equal(vectors, exact_vectors) and state == {}


def test_a_wide_factor_is_refreshed_when_it_moves_by_more_than_the_tolerance():
    factor, state, cache = wide_factor(), {}, EighCache()
    first = refreshed_factor_eigh(factor, state, KEY, cache)
    assert torch.equal(state[KEY], factor) and state[KEY] is not factor  # a copy: the factor is replaced in place
    assert all(torch.equal(a, b) for a, b in zip(first, factor_eigh(factor), strict=True))
    norm = float(torch.linalg.matrix_norm(factor.double(), 2))
    direction = torch.zeros_like(factor)
    direction[0, 0] = 1.0  # a rank-one move of spectral norm 1, which the power iteration sees from the ones vector
    small = factor + 0.5 * REFRESH_TOLERANCE * norm * direction
    assert refreshed_factor_eigh(small, state, KEY, cache) is first  # kept: the reference's decomposition
    assert torch.equal(state[KEY], factor)
    moved = factor + 2 * REFRESH_TOLERANCE * norm * torch.ones_like(factor) / len(factor)  # ||.||_2 = 0.2 norm
    refreshed = refreshed_factor_eigh(moved, state, KEY, cache)
    assert torch.equal(state[KEY], moved)
    assert all(torch.equal(a, b) for a, b in zip(refreshed, factor_eigh(moved), strict=True))


def test_a_lost_or_replaced_cache_gives_the_same_decomposition():
    """A new cache (a loaded checkpoint), a reference replaced by a copy (an undone update) or changed in place:
    decomposed anew from the reference, the decomposition the warm cache held."""
    factor, state, cache = wide_factor(), {}, EighCache()
    warm = refreshed_factor_eigh(factor, state, KEY, cache)
    nearby = factor + 1e-4
    cold = refreshed_factor_eigh(nearby, state, KEY, EighCache())
    assert all(torch.equal(a, b) for a, b in zip(warm, cold, strict=True))
    state[KEY] = state[KEY].clone()
    assert all(torch.equal(a, b) for a, b in zip(warm, refreshed_factor_eigh(nearby, state, KEY, cache), strict=True))
    state[KEY].mul_(0.5)  # in place: the cache must not answer for the old values
    halved = refreshed_factor_eigh(state[KEY], state, KEY, cache)
    torch.testing.assert_close(halved[0], warm[0] / 4)


def wide_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDE_FACTOR + 8, 16), nn.Tanh(), nn.Linear(16, 3))


def steps(opt: FOOVB, model: nn.Module, count: int, seed: int = 0) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(count):
        x = 0.03 * torch.randn(32, WIDE_FACTOR + 8, generator=generator)  # small: the input factor moves slowly
        y = torch.randint(0, 3, (32,), generator=generator)

        def closure(x=x, y=y) -> torch.Tensor:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss

        losses.append(float(opt.step(closure)))
    return losses


def test_a_resumed_run_takes_the_same_steps():
    """The reference is state: a run resumed from a state dict takes the same steps as one that went on."""
    model = wide_model()
    opt = FOOVB(model, "kronecker", step_prior=16, mc_samples=2)
    steps(opt, model, 3)
    block = opt.blocks[0]
    assert AT_REFRESH[0] in block.state and AT_REFRESH[1] not in block.state  # 16 outputs: exact every step
    saved = opt.state_dict()
    resumed_model = wide_model()
    resumed = FOOVB(resumed_model, "kronecker", step_prior=16, mc_samples=2)
    resumed.load_state_dict(saved)
    del saved["state"][0][AT_REFRESH[0]]  # without the reference: refreshed at once, other steps
    forgetful_model = wide_model()
    forgetful = FOOVB(forgetful_model, "kronecker", step_prior=16, mc_samples=2)
    forgetful.load_state_dict(saved)
    losses = steps(opt, model, 4, seed=1)
    assert losses == steps(resumed, resumed_model, 4, seed=1)
    for key, value in opt.blocks[0].state.items():
        assert torch.equal(value, resumed.blocks[0].state[key]), key
    assert losses != steps(forgetful, forgetful_model, 4, seed=1)


def test_a_state_dict_with_a_bad_reference_is_refused():
    model = wide_model()
    opt = FOOVB(model, "kronecker", step_prior=16, mc_samples=2)
    steps(opt, model, 1)
    saved = opt.state_dict()
    saved["state"][0][AT_REFRESH[0]] = saved["state"][0][AT_REFRESH[0]][:-1]
    with pytest.raises(ValueError, match="input_sqrt_cov_at_refresh' of shape"):
        FOOVB(wide_model(), "kronecker", step_prior=16, mc_samples=2).load_state_dict(saved)
    saved = opt.state_dict()
    saved["state"][0][AT_REFRESH[0]][3] = 0.0
    with pytest.raises(ValueError, match="zero rows"):
        FOOVB(wide_model(), "kronecker", step_prior=16, mc_samples=2).load_state_dict(saved)


def test_restoring_the_covariances_drops_entries_made_since():
    """A first step that failed after calibrate_prior restores the covariances; a reference taken since goes."""
    model = wide_model()
    opt = FOOVB(model, "kronecker", step_prior=16, mc_samples=2)
    saved = covariances(opt.blocks)
    steps(opt, model, 1)
    assert AT_REFRESH[0] in opt.blocks[0].state
    restore_covariances(saved)
    assert AT_REFRESH[0] not in opt.blocks[0].state
    assert torch.equal(opt.blocks[0].state["input_sqrt_cov"], saved[opt.blocks[0]]["input_sqrt_cov"])


def test_a_non_tensor_entry_is_named_by_its_type():
    """A state dict that went through JSON holds lists: the refusal names the type, not the values."""
    model = wide_model()
    opt = FOOVB(model, "kronecker", step_prior=16, mc_samples=2)
    steps(opt, model, 1)
    saved = opt.state_dict()
    saved["state"][0][AT_REFRESH[0]] = saved["state"][0][AT_REFRESH[0]].tolist()
    with pytest.raises(ValueError, match=r"of shape \(521, 521\), found a list, not a tensor$") as error:
        FOOVB(wide_model(), "kronecker", step_prior=16, mc_samples=2).load_state_dict(saved)
    assert len(str(error.value)) < 300
