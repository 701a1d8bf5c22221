"""calibrate_prior (foovb/calibration.py): the prior's variance scaled at the first step to an output noise, the mean
step taken with the uncalibrated prior's precision. Checked against closed forms (the ratio of a linear model is
linear in the prior's variance), against an optimizer built with the calibrated prior by hand and a dense covariance,
and on each path of a first step."""

import math
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import ce_closure
from torch import nn

from foovb import FOOVB
from foovb.calibration import calibrate, noise_ratio
from foovb.distributed import distribute

pytestmark = pytest.mark.usefixtures("single_thread")


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(64, 10, generator=generator), torch.randint(0, 3, (64,), generator=generator)


def closure_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    return ce_closure(model, x, y, reduction="mean")


def linear(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(10, 3)


def test_the_noise_ratio():
    mean = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])  # spread over the batch: 2
    samples = [mean + torch.tensor([[0.0, 1.0], [0.0, 1.0]]), mean + torch.tensor([[0.0, 3.0], [0.0, 0.0]])]
    assert noise_ratio(mean, samples) == pytest.approx((2.0 / 2 + 9.0 / 2) / 2)


@pytest.mark.parametrize("target", [0.5, 3.0])
def test_a_linear_model_is_calibrated_to_the_target(target):
    """For a linear model the output noise is linear in the prior's variance: the calibrated ratio lands in
    [target / 1.1, 1.1 target] after the rounds, and the diagonal std shrank by the square root of the factor."""
    model = linear()
    x, _ = data()
    opt = FOOVB(model, "diagonal", std_init=1.0, seed=0)
    std_before = opt.posterior(model.weight).std.clone()

    def outputs(seed):
        if seed is None:
            return model(x)
        with opt.sampled_params(seed=seed):
            return model(x)

    with torch.no_grad():
        before = noise_ratio(outputs(None), [outputs(seed) for seed in range(10)])
        factor = calibrate(opt.blocks, outputs, target)
        after = noise_ratio(outputs(None), [outputs(seed) for seed in range(10)])
    assert before > 10 * target
    assert target / 1.1 <= after <= 1.1 * target
    assert after / before == pytest.approx(factor, rel=1e-6)  # the same draws, scaled
    torch.testing.assert_close(opt.posterior(model.weight).std, std_before * math.sqrt(factor))


@pytest.mark.parametrize("family", ["diagonal", "kronecker", "full"])
def test_the_first_step_has_the_uncalibrated_priors_precision(family):
    """The same samples as an optimizer built by hand with the calibrated prior v0 = f V (the calibration draws from
    its own seeds), so the same E[g] and the same updated covariance Sigma; the mean step is
    (Sigma^-1 - 1/v0 + 1/V)^-1 E[g] against the reference's Sigma E[g], computed here from a dense Sigma."""
    x, y = data()
    model = linear()
    undamped = {"curvature_damping": False, "secant_check": False} if family == "diagonal" else {}  # its default's
    opt = FOOVB(model, family, mean_step=0.7, calibrate_prior=0.2 if family == "kronecker" else 2.0, seed=5,
                **({"alpha": 0.5} if family == "kronecker" else {"std_init": 0.5}), **undamped)
    start = [block.state["mean"].clone() for block in opt.blocks]
    opt.step(closure_of(model, x, y))
    factor = opt.prior_scale
    assert 0 < factor < 0.5
    # the reference's prior is the calibrated one (matrix-variate: 2 (1 - alpha') / (n_in + 2) = f 2 (1 - 0.5) / ...)
    reference = FOOVB(linear(), family, mean_step=0.7, seed=5,
                      **({"alpha": 1 - factor * 0.5} if family == "kronecker" else {"std_init": 0.5 * factor**0.5}),
                      **undamped)
    reference.step(closure_of(reference.model, x, y))
    uncalibrated = 0.5**2 if family != "kronecker" else 2 * 0.5 / (10 + 2)
    for block, reference_block, mean in zip(opt.blocks, reference.blocks, start, strict=True):
        assert float(block.state["calibrated_prior_variance"]) == pytest.approx(uncalibrated * factor, rel=1e-5)
        assert float(block.state["uncalibrated_prior_variance"]) == pytest.approx(uncalibrated, rel=1e-5)
        for key, value in reference_block.state.items():  # the same updated covariance
            if key != "mean":
                torch.testing.assert_close(block.state[key], value)
        if family == "kronecker":  # the mean (p x n) row-major: Sigma = B B^T (x) A A^T
            a, b = block.state["input_sqrt_cov"].double(), block.state["output_sqrt_cov"].double()
            sigma = torch.kron(b @ b.T, a @ a.T)
        elif family == "full":
            a = block.state["sqrt_cov"].double()
            sigma = a @ a.T
        else:
            sigma = torch.diag(block.state["std"].double().flatten().square())
        swapped = torch.linalg.inv(torch.linalg.inv(sigma) - torch.eye(len(sigma), dtype=torch.float64)
                                   * (1 / (uncalibrated * factor) - 1 / uncalibrated))
        reference_step = (reference_block.state["mean"] - mean).double().flatten()
        expected = swapped @ torch.linalg.solve(sigma, reference_step)  # E[g] from the reference's Sigma E[g]
        step = (block.state["mean"] - mean).double().flatten()
        torch.testing.assert_close(step, expected, rtol=1e-4, atol=1e-7)
        assert step.norm() > 1.5 * reference_step.norm()  # the swap is not negligible here
    assert opt.mean_step == 0.7  # the user's step size is left as given (a schedule still scales it)


def test_a_prior_under_the_target_is_left_as_it_is():
    x, y = data()
    results = []
    for calibrate_prior in (None, 1e9):
        model = linear()
        opt = FOOVB(model, "kronecker", calibrate_prior=calibrate_prior, seed=1)
        opt.step(closure_of(model, x, y))
        assert opt.prior_scale == 1.0
        results.append([p.detach().clone() for p in model.parameters()])
    for plain, calibrated in zip(*results, strict=True):
        torch.testing.assert_close(calibrated, plain, rtol=0, atol=0)


def test_step_batched_calibrates_as_step_does_and_later_steps_do_not():
    x, y = data()
    scales = []
    for batched in (False, True):
        model = nn.Sequential(linear(), nn.Tanh(), nn.Linear(3, 3))
        opt = FOOVB(model, "kronecker", calibrate_prior=0.5, seed=2)
        for _ in range(3):
            if batched:
                opt.step_batched(x, y)
            else:
                opt.step(closure_of(model, x, y))
            scales.append(opt.prior_scale)
    assert scales[0] < 1 and scales[0] == scales[1] == scales[2]  # once, at the first step
    assert scales[3:] == pytest.approx(scales[:3], rel=1e-6)


def test_batch_norm_statistics_and_gradients_are_left_as_the_step_leaves_them():
    x, y = data()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    opt = FOOVB(model, "kronecker", calibrate_prior=1.0, seed=0)
    opt.step(closure_of(model, x, y))
    assert opt.prior_scale < 1
    assert int(model[1].num_batches_tracked) == 1  # one sample's count, as without calibration
    assert model.training and all(p.grad is None for p in model.parameters())
    accumulated = FOOVB(linear(), "diagonal", calibrate_prior=1.0, seed=0)
    loss = F.cross_entropy(accumulated.model(x), y)
    loss.backward()  # a gradient left from outside the closure: refused, not dropped by the calibration's call
    with pytest.raises(RuntimeError, match="gradients were already computed"):
        accumulated.step(closure_of(accumulated.model, x, y))


def test_the_calibration_is_saved_and_loaded():
    x, y = data()
    model = linear()
    opt = FOOVB(model, "diagonal", std_init=1.0, calibrate_prior=2.0, seed=0)
    opt.step(closure_of(model, x, y))
    saved = opt.state_dict()
    loaded = FOOVB(linear(), "diagonal", std_init=1.0, calibrate_prior=2.0, seed=0)
    loaded.load_state_dict(saved)
    assert loaded.prior_scale == opt.prior_scale < 1
    for optimizer in (opt, loaded):  # the raise travels with the state: the next steps are the same
        optimizer.step(closure_of(optimizer.model, x, y))
    for p, q in zip(opt.model.parameters(), loaded.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    negative = {**saved, "state": {i: {**entry, "calibrated_prior_variance": -entry["calibrated_prior_variance"]}
                                   for i, entry in saved["state"].items()}}
    with pytest.raises(ValueError, match="'calibrated_prior_variance' is not positive"):
        loaded.load_state_dict(negative)
    legacy = {**saved, "foovb": {k: v for k, v in saved["foovb"].items() if k != "prior_scale"}}
    loaded.load_state_dict(legacy)
    assert loaded.prior_scale == 1.0
    with pytest.raises(ValueError, match="prior_scale"):
        loaded.load_state_dict({**saved, "foovb": {**saved["foovb"], "prior_scale": 2.0}})


def test_paths_without_the_batch_say_so_and_bad_values_are_refused(tmp_path: Path):
    x, y = data()
    model = linear()
    opt = FOOVB(model, "diagonal", 2, std_init=1.0, calibrate_prior=2.0, seed=0)
    with pytest.warns(UserWarning, match="the prior was not calibrated"):
        for _ in range(2):
            with opt.sampled_params(train=True):
                F.cross_entropy(model(x), y).backward()
    opt.step()
    assert opt.prior_scale == 1.0
    layers = nn.Sequential(linear(), nn.Tanh(), nn.Linear(3, 3))
    by_parts = FOOVB(layers, "diagonal", std_init=1.0, calibrate_prior=2.0, seed=0)

    def closure() -> torch.Tensor:  # calls the layers one by one, never the model given to FOOVB
        loss = F.cross_entropy(layers[2](layers[1](layers[0](x))), y)
        loss.backward()
        return loss

    with pytest.warns(UserWarning, match="did not call the model"):
        by_parts.step(closure)
    assert by_parts.prior_scale == 1.0
    for value in (0, -1.0, math.inf, "150", True):
        with pytest.raises(ValueError, match="calibrate_prior must be None or a positive finite number"):
            FOOVB(linear(), calibrate_prior=value)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        with pytest.raises(ValueError, match="calibrate_prior"):
            distribute(FOOVB(linear(), "diagonal", 4, calibrate_prior=2.0, curvature_damping=False), "data")
    finally:
        dist.destroy_process_group()


class AsDict(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, inputs: torch.Tensor) -> dict:
        return {"logits": self.net(inputs)}


@pytest.mark.parametrize("case", ["one row", "zero head", "dict output"])
def test_nothing_to_compare_with_is_said_and_leaves_the_prior(case):
    """The ratio's denominator is how the mean's outputs vary over the batch: for a batch of one row or a constant
    output there is none (the variance used to shrink 20x in each of the 10 rounds), for a dict output no tensor."""
    x, y = data()
    model = nn.Sequential(linear(), nn.Tanh(), nn.Linear(3, 3))
    if case == "zero head":
        with torch.no_grad():
            model[2].weight.zero_()
            model[2].bias.zero_()
    if case == "one row":
        x, y = x[:1], y[:1]
    wrapped = AsDict(model) if case == "dict output" else model
    opt = FOOVB(wrapped, "kronecker", calibrate_prior=0.5, step_prior=1, seed=0)  # step_prior: the same entries
    before = [block.state["input_sqrt_cov"].clone() for block in opt.blocks]
    with pytest.warns(UserWarning, match="not a tensor" if case == "dict output" else "do not vary"):
        opt.step(closure_of(lambda inputs: model(inputs) if wrapped is model else wrapped(inputs)["logits"], x, y))
    assert opt.prior_scale == 1.0
    for block, factor in zip(opt.blocks, before, strict=True):
        assert "calibrated_prior_variance" not in block.state
        assert block.state["input_sqrt_cov"].abs().max() > 0.5 * factor.abs().max()  # not shrunk 10^13-fold


def test_a_target_out_of_reach_is_said():
    x, y = data()
    model = linear()
    opt = FOOVB(model, "diagonal", std_init=1.0, calibrate_prior=1e-300, seed=0)
    with pytest.warns(UserWarning, match="calibrate_prior=1e-300 was not reached"):
        opt.step(closure_of(model, x, y))
    assert opt.prior_scale == pytest.approx(0.05**10)


@pytest.mark.parametrize("family", ["diagonal", "kronecker"])
def test_a_first_step_that_fails_after_the_calibration_leaves_the_prior_as_it_was(family):
    """The calibration runs before the samples: a sample that raises undoes it, and the next step calibrates from
    the uncalibrated prior (its V was once taken from the already calibrated one)."""
    x, y = data()
    model = nn.Sequential(linear(), nn.Tanh(), nn.Linear(3, 3))
    opt = FOOVB(model, family, calibrate_prior=0.5, seed=0)
    prior = {key: value.clone() for block in opt.blocks for key, value in block.state.items() if key != "mean"}
    calls = []

    def failing() -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:  # the calibration's call, then the first sample's, then this one
            raise RuntimeError("a data loader's error")
        return closure_of(model, x, y)()

    with pytest.raises(RuntimeError, match="data loader"):
        opt.step(failing)
    assert opt.prior_scale == 1.0 and opt.steps_taken == 0
    after = {key: value for block in opt.blocks for key, value in block.state.items() if key != "mean"}
    assert after.keys() == prior.keys()
    for key, value in prior.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)
    opt.step(closure_of(model, x, y))
    fresh = FOOVB(nn.Sequential(linear(), nn.Tanh(), nn.Linear(3, 3)), family, calibrate_prior=0.5, seed=0)
    fresh.step(closure_of(fresh.model, x, y))
    assert opt.prior_scale == pytest.approx(fresh.prior_scale)
    for block, fresh_block in zip(opt.blocks, fresh.blocks, strict=True):
        torch.testing.assert_close(block.state["uncalibrated_prior_variance"],
                                   fresh_block.state["uncalibrated_prior_variance"])


def test_a_refused_first_step_leaves_the_prior_as_it_was():
    """The calibration runs before the step's checks; a step they refuse (here a batch_size of 0) undoes it."""
    x, y = data()
    model = linear()
    opt = FOOVB(model, "diagonal", std_init=1.0, calibrate_prior=2.0, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        opt.step(closure_of(model, x, y), batch_size=0)
    assert opt.prior_scale == 1.0
    assert all(float(block.state["std"].min()) == 1.0 and "calibrated_prior_variance" not in block.state
               for block in opt.blocks)



def test_a_forward_that_fails_during_the_calibration_leaves_the_prior_as_it_was():
    x, y = data()
    model = linear()
    opt = FOOVB(model, "diagonal", std_init=1.0, calibrate_prior=2.0, seed=0)
    forwards = []

    def failing_forward(module, inputs, output):
        forwards.append(1)
        if len(forwards) == 4:  # the closure's call, the mean's output, then inside the calibration's samples
            raise RuntimeError("out of memory")

    handle = model.register_forward_hook(failing_forward)
    with pytest.raises(RuntimeError, match="out of memory"):
        opt.step(closure_of(model, x, y))
    handle.remove()
    assert opt.prior_scale == 1.0
    assert all(float(block.state["std"].min()) == 1.0 for block in opt.blocks)
    opt.step(closure_of(model, x, y))
    assert float(opt.blocks[0].state["uncalibrated_prior_variance"]) == pytest.approx(1.0)
