"""secant_check (foovb/secant.py): the mean step cut back to the secant minimum along it. Checked on quadratic losses
whose blocks are coupled (six one-weight layers that multiply the same input and add up), where antithetic pairs make
E[g] exact and the secant minimum is the exact minimum of the loss along the step; then on the paths that provide the
batch (step(closure), step_batched) and those that cannot (sampled_params blocks, torch.distributed)."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from foovb import FOOVB
from foovb.secant import secant_fraction

pytestmark = pytest.mark.usefixtures("single_thread")


class Paths(nn.Module):
    """f(x) = (w_1 + ... + w_n) x, each w_i a module of its own: the loss's Hessian couples the n blocks."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.paths = nn.ModuleList(nn.Linear(1, 1, bias=False) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(path(x) for path in self.paths)


def coupled_problem(posterior: str, secant_check: bool, mean_step: float = 1.0):
    torch.manual_seed(0)
    model = Paths(6).double()
    inputs = 0.2 * torch.randn(16, 1, dtype=torch.float64)
    targets = 1.5 * inputs
    prior = {"std_init": 1.0} if posterior == "diagonal" else {"alpha": 0.2}  # a prior wide against the likelihood
    opt = FOOVB(model, posterior, 4, mean_step=mean_step, secant_check=secant_check, seed=3, **prior)

    def loss_at_mean() -> torch.Tensor:
        return F.mse_loss(model(inputs), targets, reduction="sum")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_at_mean()
        loss.backward()
        return loss

    return model, opt, closure, loss_at_mean


def gradient_at_mean(model: nn.Module, loss_at_mean) -> list[torch.Tensor]:
    return torch.autograd.grad(loss_at_mean(), list(model.parameters()))


@pytest.mark.parametrize("posterior", ["diagonal", "kronecker"])
def test_the_checked_step_ends_at_the_minimum_along_it(posterior):
    """On a quadratic the secant is exact: after the cut the gradient at the new mean is orthogonal to the step.
    Unchecked, each block's step corrects the shared residual by itself and the pair passes the minimum."""
    for secant_check in (False, True):
        model, opt, closure, loss_at_mean = coupled_problem(posterior, secant_check)
        before = [p.detach().clone() for p in model.parameters()]
        grad_before = gradient_at_mean(model, loss_at_mean)
        opt.step(closure)
        step = [p.detach() - q for p, q in zip(model.parameters(), before, strict=True)]
        along_before = sum(float((g * d).sum()) for g, d in zip(grad_before, step, strict=True))
        along_after = sum(float((g * d).sum()) for g, d in zip(gradient_at_mean(model, loss_at_mean), step,
                                                                strict=True))
        assert along_before < 0  # a descent direction
        if secant_check:
            assert abs(along_after) < 1e-8 * abs(along_before)
        else:
            assert along_after > 0.5 * abs(along_before)  # past the minimum: the loss rises again along the step


@pytest.mark.parametrize("posterior", ["diagonal", "kronecker"])
def test_a_step_short_of_the_minimum_is_kept_whole(posterior):
    results = []
    for secant_check in (False, True):
        model, opt, closure, _ = coupled_problem(posterior, secant_check, mean_step=0.1)
        for _ in range(3):
            opt.step(closure)
        results.append([p.detach().clone() for p in model.parameters()])
    for unchecked, checked in zip(*results, strict=True):
        torch.testing.assert_close(checked, unchecked, rtol=0, atol=0)


def test_the_secant_fraction():
    step, grad = [torch.tensor([1.0, 0.0])], [torch.tensor([-2.0, 1.0])]
    assert secant_fraction(step, grad, [torch.tensor([2.0, 5.0])]) == pytest.approx(0.5)  # curvature 4, descent 2
    assert secant_fraction(step, grad, [torch.tensor([-1.0, 0.0])]) == 1.0  # short of the minimum
    assert secant_fraction(step, grad, [torch.tensor([-3.0, 0.0])]) == 1.0  # negative curvature along the step
    assert secant_fraction(step, [torch.tensor([2.0, 0.0])], [torch.tensor([9.0, 0.0])]) == 1.0  # an ascent
    assert secant_fraction(step, grad, [torch.tensor([math.nan, 0.0])]) == 1.0


def closure_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn=F.mse_loss):
    def closure() -> torch.Tensor:
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    return closure


def regression_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def test_step_batched_checks_as_step_does():
    x = torch.linspace(-2, 2, 32)[:, None]
    y = torch.sin(2 * x)
    means = []
    for batched in (False, True):
        model = regression_net()
        opt = FOOVB(model, "kronecker", secant_check=True, seed=1)
        for _ in range(4):
            if batched:
                opt.step_batched(x, y, F.mse_loss)
            else:
                opt.step(closure_of(model, x, y))
        means.append([p.detach().clone() for p in model.parameters()])
    for sequential, batched in zip(*means, strict=True):
        torch.testing.assert_close(batched, sequential, rtol=1e-4, atol=1e-6)


def test_the_check_tames_the_first_steps_of_a_small_tanh_regression_net():
    """The grid's regression net and first region (docs/results/robustness_grid.md): every layer corrects the same
    residual and the mean's loss climbs 40-fold within 8 steps; with the check it never doubles and ends 6x lower."""
    generator = torch.Generator().manual_seed(0)
    x = -3 + 2 * torch.rand(64, 1, generator=generator)
    y = torch.sin(2 * x)
    curves = {}
    for secant_check in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
        opt = FOOVB(model, "kronecker", secant_check=secant_check, seed=0)
        losses = [float(F.mse_loss(model(x), y).detach())]
        for _ in range(8):
            opt.step(closure_of(model, x, y))
            losses.append(float(F.mse_loss(model(x), y).detach()))
        curves[secant_check] = losses
    assert max(curves[False]) > 10 * curves[False][0]
    assert max(curves[True]) < 2 * curves[True][0] and curves[True][-1] < curves[True][0] / 4


def test_batch_norm_statistics_are_the_new_means_either_way(monkeypatch):
    """The secant check's forward at the new mean leaves batch norm its statistics; without the check the closure
    runs there once more: the same statistics (the step is not cut here: the same means)."""
    import foovb.optimizer as optimizer

    real = optimizer.secant_fraction_at_new_mean
    monkeypatch.setattr(optimizer, "secant_fraction_at_new_mean", lambda *args: max(real(*args), 1.0))  # no cut
    x = torch.randn(32, 4)
    y = torch.randint(3, (32,))
    results = []
    for secant_check in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
        opt = FOOVB(model, "kronecker", secant_check=secant_check, seed=0)
        calls = []
        closure = closure_of(model, x, y, F.cross_entropy)
        opt.step(lambda closure=closure, calls=calls: calls.append(1) or closure())
        bn = model[1]
        with torch.no_grad():
            hidden = model[0](x)
        expected = (bn.momentum * hidden.mean(0), (1 - bn.momentum) + bn.momentum * hidden.var(0, unbiased=True))
        torch.testing.assert_close(bn.running_mean, expected[0])
        torch.testing.assert_close(bn.running_var, expected[1])
        assert int(bn.num_batches_tracked) == 1 and len(calls) == opt.mc_samples + 1
        results.append([p.detach().clone() for p in model.parameters()] + [bn.running_mean.clone()])
    for unchecked, checked in zip(*results, strict=True):
        torch.testing.assert_close(checked, unchecked)


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def _counting(closure):
    calls = []

    def counted():
        calls.append(1)
        return closure()

    return counted, calls


def _assert_statistics_of_the_mean(model: nn.Module, x: torch.Tensor) -> None:
    bn = model[1]
    with torch.no_grad():
        hidden = model[0](x)
    torch.testing.assert_close(bn.running_mean, bn.momentum * hidden.mean(0))
    torch.testing.assert_close(bn.running_var, (1 - bn.momentum) + bn.momentum * hidden.var(0, unbiased=True))
    assert int(bn.num_batches_tracked) == 1


def test_a_cut_step_takes_batch_norm_statistics_at_the_cut_mean(monkeypatch):
    """The check's forward is at the uncut mean: where it cuts, the closure runs once more at the mean it leaves."""
    import foovb.optimizer as optimizer

    real = optimizer.secant_fraction_at_new_mean
    monkeypatch.setattr(optimizer, "secant_fraction_at_new_mean", lambda *args: min(real(*args), 0.5))
    x, y = torch.randn(32, 4), torch.randint(3, (32,))
    model = _bn_net()
    opt = FOOVB(model, "kronecker", secant_check=True, seed=0)
    closure, calls = _counting(closure_of(model, x, y, F.cross_entropy))
    opt.step(closure)
    assert len(calls) == opt.mc_samples + 2
    _assert_statistics_of_the_mean(model, x)


def test_batch_norm_in_eval_mode_costs_no_forward_at_the_mean():
    """Frozen batch norm (eval mode, e.g. fine-tuning) keeps its statistics: no closure call for them."""
    x, y = torch.randn(32, 4), torch.randint(3, (32,))
    model = _bn_net()
    model[1].eval()
    before = (model[1].running_mean.clone(), model[1].running_var.clone())
    opt = FOOVB(model, "kronecker", secant_check=False, seed=0)
    closure, calls = _counting(closure_of(model, x, y, F.cross_entropy))
    opt.step(closure)
    assert len(calls) == opt.mc_samples
    assert torch.equal(model[1].running_mean, before[0]) and torch.equal(model[1].running_var, before[1])


def test_a_closure_failing_at_the_mean_leaves_the_samples_average_and_warns():
    """The update is applied before the forward at the mean: a failure there warns and keeps the step (a raise would
    have a retrying caller take it twice); the statistics are the samples' average, num_batches_tracked once."""
    x, y = torch.randn(32, 4), torch.randint(3, (32,))
    model = _bn_net()
    opt = FOOVB(model, "diagonal", 4, secant_check=False, seed=0)
    inner = closure_of(model, x, y, F.cross_entropy)
    calls = []

    def closure():
        calls.append(1)
        if len(calls) > opt.mc_samples:
            raise RuntimeError("out of memory at the mean")  # before batch norm: its count was restored to 0
        return inner()

    with pytest.warns(UserWarning, match="the closure failed at the new mean .*RuntimeError: out of memory"):
        opt.step(closure)
    assert opt.steps_taken == 1 and len(calls) == opt.mc_samples + 1
    assert int(model[1].num_batches_tracked) == 1
    assert all(p.grad is None for p in model.parameters())


def test_sampled_params_steps_are_not_checked_and_say_so():
    """A check, asked for or the preset's (FOOVB(model)'s), warns at the first unchecked step, once: those steps are not
    step(closure)'s (a user trial found a regression net's loss at 30 against 0.07); secant_check=False is silent."""
    x, y = torch.randn(8, 1), torch.randn(8, 1)
    means = []
    for secant_check in (False, True, None):
        model = regression_net()
        opt = FOOVB(model, "kronecker", 2, secant_check=secant_check, step_prior=1, seed=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                for _ in range(opt.mc_samples):
                    with opt.sampled_params(train=True):
                        F.mse_loss(model(x), y).backward()
                opt.step()
        said = [w for w in caught if "needs the step's batch" in str(w.message)]
        assert len(said) == (0 if secant_check is False else 1)
        assert all(w.filename == __file__ for w in said)  # the caller's opt.step() line
        means.append([p.detach().clone() for p in model.parameters()])
    for unchecked, checked, preset in zip(*means, strict=True):
        torch.testing.assert_close(checked, unchecked, rtol=0, atol=0)
        torch.testing.assert_close(preset, unchecked, rtol=0, atol=0)


def test_secant_check_is_validated_fixed_and_legacy_false():
    layer = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="secant_check must be True or False"):
        FOOVB(layer, secant_check="yes")
    saved = FOOVB(layer, secant_check=False).state_dict()
    del saved["param_groups"][0]["secant_check"]  # a state dict saved before the setting existed
    FOOVB(layer, secant_check=False).load_state_dict(saved)
    with pytest.raises(ValueError, match="secant_check: saved False, here True"):
        FOOVB(layer, secant_check=True).load_state_dict(saved)
