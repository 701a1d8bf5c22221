"""The mean step's covariance (implicit_mean, foovb/posteriors.py): the prior's (Algorithm 1) or the one just updated
from the same samples. Checked against closed forms on quadratic losses, where antithetic pairs make E[g] exact and
E[g eps] = sigma H for a diagonal curvature H."""

import math

import pytest
import torch
from torch import nn

from foovb import FOOVB
from foovb.linalg import root_scale

pytestmark = pytest.mark.usefixtures("single_thread")


def quadratic_step(curvature: torch.Tensor, target: torch.Tensor, implicit_mean: bool, steps: int = 1,
                   std_init: float = 0.5, mean_step: float = 1.0, cov_step: float = 1.0) -> tuple[FOOVB, nn.Linear]:
    """A bias-free Linear(d, 1) whose weight w has the summed loss sum_i c_i (w_i - t_i)^2 / 2 (diagonal curvature)."""
    layer = nn.Linear(len(curvature), 1, bias=False)
    with torch.no_grad():
        layer.weight.zero_()
    opt = FOOVB(layer, "diagonal", mc_samples=2, std_init=std_init, mean_step=mean_step, cov_step=cov_step,
                antithetic=True, std_growth="none", implicit_mean=implicit_mean, loss_reduction="sum", seed=0,
                secant_check=False, curvature_damping=False)  # the algorithm's step, without the preset's checks

    def closure() -> torch.Tensor:
        loss = (0.5 * curvature * (layer.weight[0] - target).square()).sum()
        loss.backward()
        return loss

    for _ in range(steps):
        opt.step(closure)
    return opt, layer


@pytest.mark.parametrize("implicit_mean", [False, True])
def test_one_step_on_a_quadratic_is_the_closed_form(implicit_mean):
    curvature = torch.tensor([0.5, 4.0, 40.0, 400.0])
    target = torch.tensor([1.0, -2.0, 0.5, 3.0])
    opt, layer = quadratic_step(curvature, target, implicit_mean)
    grad = curvature * (0 - target)  # E[g]: exact with antithetic pairs on a quadratic
    prior_std = torch.full_like(curvature, 0.5)
    new_std = opt.posterior(layer.weight).std[0]  # Lemma 2's root of sigma E[g eps] = sigma^2 c eps^2 (K = 2)
    assert bool(((new_std > 0) & (new_std < prior_std)).all())
    step_std = new_std if implicit_mean else prior_std
    torch.testing.assert_close(layer.weight[0].detach(), -step_std.square() * grad)


def test_the_implicit_step_is_bounded_by_the_measured_curvature_where_the_paper_step_overshoots():
    """eta Sigma_new H <= 2 eta / (3 sqrt(3) beta) per diagonal entry: a prior wide against the likelihood cannot
    overshoot, however large the curvature, where the prior's V moves the weight by eta V H times its distance."""
    curvature = torch.tensor([1e2, 1e4, 1e6])
    target = torch.ones(3)
    _, explicit = quadratic_step(curvature, target, implicit_mean=False)
    _, implicit = quadratic_step(curvature, target, implicit_mean=True)
    bound = 2 / (3 * math.sqrt(3))
    assert (explicit.weight[0].detach() - target).abs().min() > 20  # overshot by eta V H = 25 .. 250,000 times
    move = implicit.weight[0].detach()  # from 0 towards 1: a fraction of the distance, at most the bound
    assert bool(((move > 0) & (move <= bound + 1e-6)).all())


@pytest.mark.parametrize("cov_step", [0.05, 0.1, 0.3])
def test_a_small_beta_steps_with_the_tempered_covariance_and_never_overshoots(cov_step):
    """With beta below 0.385 eta the implicit step takes the covariance of the likelihood raised to
    gamma = 0.385 eta (`step_tempering`): at most the distance to the minimum of the quadratic the step measured,
    where beta's own covariance moves a weight up to 0.385 / beta of it (3.9 times at beta 0.1); the posterior kept
    is beta's."""
    curvature = torch.tensor([1.0, 10.0, 1e2, 1e4])
    target = torch.ones(4)
    opt, layer = quadratic_step(curvature, target, implicit_mean=True, cov_step=cov_step)
    new_std = opt.posterior(layer.weight).std[0] / 0.5  # h(x), x = beta sigma E[g eps] = beta sigma^2 c eps^2
    measured = (1 - new_std.square()) / new_std / (cov_step * 0.25)  # c eps^2 (K = 2): the curvature measured
    gamma = 2 / (3 * math.sqrt(3))  # eta = 1
    step_var = (0.5 * root_scale(gamma * 0.25 * measured)).square()
    torch.testing.assert_close(layer.weight[0].detach(), step_var * curvature * target, rtol=1e-4, atol=1e-6)
    assert bool((step_var * measured <= 1 + 1e-5).all())  # at most the distance, on the measured quadratic
    own_var = (0.5 * new_std).square()  # beta's covariance: a step of 0.385 / beta of the distance for large s
    assert (own_var * measured).max() > 1.2


def test_the_implicit_step_approaches_a_stiff_quadratic_where_the_paper_step_overshoots():
    curvature = torch.tensor([1.0, 50.0, 5000.0])
    target = torch.tensor([0.3, -0.7, 0.2])
    distance = target.abs()
    for steps in (1, 10, 200):  # every entry moves towards its target, never past it
        _, implicit = quadratic_step(curvature, target, implicit_mean=True, steps=steps)
        error = (implicit.weight[0].detach() - target).abs()
        assert bool((error < distance).all())
        distance = error
    assert error.max() < 0.6 * target.abs().max()
    # the prior's V throws the stiff entry 1249 times its distance past the target at the first step; its sigma has
    # collapsed by then, and it stays there
    _, explicit = quadratic_step(curvature, target, implicit_mean=False, steps=200)
    assert (explicit.weight[0, 2].detach() - target[2]).abs() > 100


@pytest.mark.parametrize("posterior", ["kronecker", "full"])
def test_the_matrix_families_step_with_the_updated_factors(posterior):
    """M <- M - eta Sigma_out' E[g] Sigma_in' (kronecker) or mu <- mu - eta Sigma' E[g] (full), Sigma' the updated
    covariance: checked on a linear least-squares layer, where E[g] is the gradient at the mean (antithetic)."""
    torch.manual_seed(0)
    layer = nn.Linear(5, 3)
    x, y = torch.randn(32, 5), torch.randn(32, 3)
    opt = FOOVB(layer, posterior, mc_samples=4, implicit_mean=True, mean_step=0.8, loss_reduction="sum", seed=1)
    mean_before = [p.detach().clone() for p in layer.parameters()]
    grad = torch.autograd.grad(0.5 * (layer(x) - y).square().sum(), list(layer.parameters()))

    def closure() -> torch.Tensor:
        loss = 0.5 * (layer(x) - y).square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    (block,) = opt.blocks
    if posterior == "kronecker":
        a, b = block.state["input_sqrt_cov"], block.state["output_sqrt_cov"]
        e1 = torch.cat([grad[0], grad[1][:, None]], 1)
        step = block.split(b @ b.T @ e1 @ a @ a.T)
    else:
        a = block.state["sqrt_cov"]
        step = block.split(a @ a.T @ torch.cat([g.flatten() for g in grad]))
    for param, before, delta in zip(layer.parameters(), mean_before, step, strict=True):
        torch.testing.assert_close(param.detach(), before - 0.8 * delta, atol=1e-5, rtol=1e-4)


def test_implicit_mean_is_validated_fixed_and_read_from_legacy_state_dicts():
    layer = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="implicit_mean must be True or False"):
        FOOVB(layer, implicit_mean="yes")
    saved = FOOVB(layer, implicit_mean=False).state_dict()
    del saved["param_groups"][0]["implicit_mean"]  # a state dict saved before the setting existed
    FOOVB(layer, implicit_mean=False).load_state_dict(saved)
    with pytest.raises(ValueError, match="implicit_mean: saved False, here True"):
        FOOVB(layer, implicit_mean=True).load_state_dict(saved)
    opt = FOOVB(layer, implicit_mean=True)
    opt.param_groups[0]["implicit_mean"] = False
    with pytest.raises(ValueError, match="implicit_mean"):
        opt.step(lambda: layer(torch.randn(4, 3)).square().mean().backward())


def test_a_divergence_names_the_layer_its_effective_rate_and_the_fix():
    """The issue's 20-8-20 autoencoder with the prior's covariance in the mean step (an earlier default; without the
    secant check, which would cut the steps back) overflows within a few steps; the error names the layer that moved
    most, its effective learning rate and what to pass.
    With the default (implicit_mean) the same run trains."""
    torch.manual_seed(0)
    data = torch.randn(256, 20)

    def train(**settings) -> list[float]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(20, 8), nn.ReLU(), nn.Linear(8, 20))
        opt = FOOVB(model, seed=0, **settings)
        losses = []
        for i in range(100):
            batch = data[(i * 64) % 256:(i * 64) % 256 + 64]

            def closure(batch: torch.Tensor = batch, model: nn.Module = model) -> torch.Tensor:
                loss = nn.functional.mse_loss(model(batch), batch)
                loss.backward()
                return loss

            losses.append(opt.step(closure))
        return losses

    with pytest.raises(FloatingPointError) as error:
        train(implicit_mean=False, cov_step=0.3, secant_check=False)
    message = str(error.value)
    assert "\n" not in message
    assert "Layer '0'" in message or "Layer '2'" in message
    assert "first effective learning rate on the loss" in message and "1280 terms" in message
    assert "pass implicit_mean=True" in message
    assert "at the posterior mean too" not in message  # finite gradients of 1e30 at the mean: not the data
    losses = train()
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("corrupt", ["input", "target"])
def test_non_finite_data_is_named_not_the_step_sizes(corrupt):
    """One NaN in the inputs (or an inf target) at the first step: the error says that the closure's gradients at the
    mean, with no sampling noise, are non-finite too, and gives no step-size advice (a user's trial, session 55: it
    blamed the step prior with an 'effective learning rate of 171'); at a later step it gives both."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 10), torch.randn(32, 3)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = FOOVB(model, seed=0)
    bad_x, bad_y = x.clone(), y.clone()
    if corrupt == "input":
        bad_x[3, 2] = float("nan")
    else:
        bad_y[0, 0] = float("inf")

    def closure(x: torch.Tensor, y: torch.Tensor):
        def run() -> torch.Tensor:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss
        return run

    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(FloatingPointError) as error:
        opt.step(closure(bad_x, bad_y))
    message = str(error.value)
    assert "at the posterior mean too" in message and "check the batch" in message
    assert "effective learning rate" not in message and "step_prior" not in message
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    opt.step(closure(x, y))  # a clean batch trains; then the corrupted one again
    with pytest.raises(FloatingPointError) as error:
        opt.step(closure(bad_x, bad_y))
    message = str(error.value)
    assert "at the posterior mean too" in message and "If the batch is finite, the mean itself went too far" in message
    assert "effective learning rate" in message


def rank_one_step(curvature_damping: bool, steps: int, rows: int = 1, mean: bool = False):
    """A bias-free Linear(50, 1) whose weight has the loss c/2 (a.w - t)^2 per row, a = ones: a rank-one Hessian
    c a a^T, the coupling of 50 weights that see the same input, which mean field sees as 50 curvatures c."""
    torch.manual_seed(0)
    layer = nn.Linear(50, 1, bias=False)
    with torch.no_grad():
        layer.weight.zero_()
    opt = FOOVB(layer, "diagonal", mc_samples=4, std_init=0.5, cov_step=0.3, curvature_damping=curvature_damping,
                secant_check=False, loss_reduction="auto" if mean else "sum", seed=0)  # the damping alone
    inputs = torch.ones(rows, 50)

    def closure() -> torch.Tensor:
        per_row = 0.5 * 2.0 * (layer(inputs)[:, 0] - 1.0).square()
        loss = per_row.mean() if mean else per_row.sum()
        loss.backward()
        return loss

    errors = []
    for _ in range(steps):
        before = layer.weight.detach().clone()
        opt.step(closure)
        errors.append(abs(float(layer.weight.detach().sum()) - 1.0))
    return opt, layer, before, errors


def test_curvature_damping_bounds_the_step_by_the_coupled_curvature():
    """With a rank-one Hessian the Rayleigh quotient is its largest eigenvalue: the damped step is the implicit step
    times min(1, 1 / (eta lambda_max(sigma' H sigma'))), lambda_max = c ||sigma'||^2, exactly."""
    opt, layer, before, _ = rank_one_step(True, steps=1)
    std = opt.posterior(layer.weight).std[0]
    grad = 2.0 * (before.sum() - 1.0) * torch.ones(50)  # E[g]: exact with antithetic pairs on a quadratic
    eta = opt.mean_step
    damping = min(1.0, 1.0 / (eta * 2.0 * float(std.square().sum())))
    assert damping < 0.1  # the coupling is 50 times what each weight's own curvature says
    torch.testing.assert_close(layer.weight[0].detach(), before[0] - eta * damping * std.square() * grad)


def test_curvature_damping_converges_where_mean_field_overshoots():
    _, _, _, undamped = rank_one_step(False, steps=30)
    _, _, _, damped = rank_one_step(True, steps=30)
    assert undamped[0] > 1.0  # the first step throws a.w past the target by more than its distance
    assert all(later <= earlier + 1e-6 for earlier, later in zip(damped, damped[1:], strict=False))
    assert damped[-1] < 0.05 and damped[0] < 1.0


def test_curvature_damping_reads_a_mean_loss_as_its_sum():
    """The sum of squared gradients scales with the square of the loss's rescaling: 8 rows as a mean give the sum's
    update."""
    _, summed, _, _ = rank_one_step(True, steps=3, rows=8)
    _, averaged, _, _ = rank_one_step(True, steps=3, rows=8, mean=True)
    torch.testing.assert_close(averaged.weight, summed.weight)


def test_curvature_damping_needs_the_diagonal_family_and_the_implicit_step():
    with pytest.raises(ValueError, match="diagonal family only"):
        FOOVB(nn.Linear(3, 2), "kronecker", curvature_damping=True)
    with pytest.raises(ValueError, match="needs implicit_mean=True"):
        FOOVB(nn.Linear(3, 2), "diagonal", curvature_damping=True, implicit_mean=False)
    # the diagonal default damps; asking for the paper's explicit step turns the preset's damping off with it
    assert FOOVB(nn.Linear(3, 2), "diagonal").curvature_damping is True
    assert FOOVB(nn.Linear(3, 2), "diagonal", implicit_mean=False).curvature_damping is False
    assert FOOVB(nn.Linear(3, 2), "diagonal", preset="paper").curvature_damping is False
