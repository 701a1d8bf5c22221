"""foovb.posteriors: the updates of the three families (Algorithms 2-4) against the paper's formulas and closed
forms (recorded samples, quadratic losses, the matrix-variate expectations), the diagonal family's cov_momentum and
std_growth, the monotonicity of sigma in the curvature, the posterior views (PosteriorView, covariance) and a 0-dim
parameter in every family. Exact Bayes on linear regression: tests/test_exact_bayes.py."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    F64,
    FAMILIES,
    PAPER,
    ce_closure,
    make_generator,
    mlp,
    mlp_batch,
    random_sqrt,
    randomize_factors,
)
from conftest import take_steps as _steps
from torch import nn

from foovb import FOOVB, solve_fixed_point
from foovb.linalg import LowRank, root_scale, sqrt_covariance_update
from foovb.predict import predict

pytestmark = pytest.mark.usefixtures("single_thread")


def quadratic_closure(param, c, h, sign=1.0):
    """L(theta) = sign * 1/2 sum_i h_i (theta_i - c_i)^2: gradient sign * h * (theta - c)."""

    def closure():
        loss = sign * 0.5 * (h * (param - c) ** 2).sum()
        loss.backward()
        return loss

    return closure


def diag_formula(sigma, e2):
    """Paper, Algorithm 4: sigma sqrt(1 + (sigma E2 / 2)^2) - sigma^2 E2 / 2."""
    return sigma * torch.sqrt(1 + (sigma * e2 / 2) ** 2) - sigma**2 * e2 / 2


def recording_closure(model, x, y, records):
    """A summed cross-entropy closure that appends each sample's (theta_k, g_k) per parameter to `records`."""

    def closure():
        loss = F.cross_entropy(model(x), y, reduction="sum")
        loss.backward()
        records.append([(p.detach().clone(), p.grad.clone()) for p in model.parameters()])
        return loss

    return closure


# ---------------------------------------------------------------------------------------------------------
# Algorithm 2-4 updates, reconstructed exactly from the sampled weights (any loss, any K)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("mean_step", "cov_step"), [(1.0, 1.0), (0.3, 1.0), (1.0, 0.25)])
def test_update_equals_paper_algorithm_for_recorded_samples(family, mean_step, cov_step):
    """Record theta_k and g_k in the closure, recover eps_k = A^-1 (theta_k - mu) and recompute the update
    from the paper's formulas (Lemmas 1-2 via `solve_fixed_point`): exact up to round-off, nonlinear loss.
    mean_step and cov_step scale E[g] and E[g eps^T] (1 and 1 in the paper)."""
    model = mlp(seed=3, dtype=F64)
    x, y = mlp_batch()
    x = x.double()
    k_samples = 3
    opt = FOOVB(model, family, k_samples, mean_step=mean_step, cov_step=cov_step, seed=11, **PAPER)
    randomize_factors(opt, make_generator(5))
    before = {id(b): {k: v.clone() for k, v in b.state.items()} for b in opt.blocks}
    records = []
    closure = recording_closure(model, x, y, records)

    opt.step(closure)
    assert len(records) == k_samples
    index = {id(p): i for i, p in enumerate(model.parameters())}
    for block in opt.blocks:
        old, new = before[id(block)], block.state
        ids = [index[id(p)] for p in block.params]
        thetas = [[rec[i][0] for i in ids] for rec in records]
        grads = [[rec[i][1] for i in ids] for rec in records]
        if family == "diagonal":
            mu, sigma = old["mean"], old["std"]
            eps = [(t[0] - mu) / sigma for t in thetas]
            e1 = sum(g[0] for g in grads) / k_samples
            e2 = cov_step * sum(g[0] * e for g, e in zip(grads, eps, strict=True)) / k_samples
            torch.testing.assert_close(new["mean"], mu - mean_step * sigma**2 * e1, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(new["std"], diag_formula(sigma, e2), rtol=1e-12, atol=1e-14)
        elif family == "full":
            mu, a = old["mean"], old["sqrt_cov"]
            flat = [torch.cat([t.flatten() for t in th]) for th in thetas]
            g = [torch.cat([t.flatten() for t in gr]) for gr in grads]
            eps = [torch.linalg.solve(a, f - mu) for f in flat]
            e1 = sum(g) / k_samples
            e2 = cov_step * sum(torch.outer(gk, ek) for gk, ek in zip(g, eps, strict=True)) / k_samples  # E[g eps^T]
            cov = a @ a.T
            x_new = solve_fixed_point(cov, e2)
            torch.testing.assert_close(new["mean"], mu - mean_step * cov @ e1, rtol=1e-11, atol=1e-13)
            torch.testing.assert_close(new["sqrt_cov"] @ new["sqrt_cov"].T, x_new @ x_new.T, rtol=1e-10,
                                       atol=1e-13)
        else:
            m, a, b = old["mean"], old["input_sqrt_cov"], old["output_sqrt_cov"]
            p, n = m.shape
            w = [torch.cat([th[0], th[1][:, None]], 1) for th in thetas]  # weight with the bias column
            psi = [torch.cat([gr[0], gr[1][:, None]], 1) for gr in grads]
            phi = [torch.linalg.solve(b, wk - m) @ torch.linalg.inv(a).T for wk in w]  # W = M + B Phi A^T
            e1 = sum(psi) / k_samples
            e2 = cov_step * sum(ps.T @ b @ ph for ps, ph in zip(psi, phi, strict=True)) / (p * k_samples)
            e3 = cov_step * sum(ps @ a @ ph.T for ps, ph in zip(psi, phi, strict=True)) / (n * k_samples)
            torch.testing.assert_close(new["mean"], m - mean_step * b @ b.T @ e1 @ a @ a.T, rtol=1e-11,
                                       atol=1e-13)
            x1, x2 = solve_fixed_point(a @ a.T, e2), solve_fixed_point(b @ b.T, e3)
            na, nb = new["input_sqrt_cov"], new["output_sqrt_cov"]
            torch.testing.assert_close(na @ na.T, x1 @ x1.T, rtol=1e-10, atol=1e-13)
            torch.testing.assert_close(nb @ nb.T, x2 @ x2.T, rtol=1e-10, atol=1e-13)
    # the model holds the new posterior mean
    for block in opt.blocks:
        for param, mean in zip(block.params, block.mean_values(), strict=True):
            assert torch.equal(param.detach(), mean)


def test_diagonal_output_factor_solves_lemma_2_with_the_diagonal_of_e3_in_the_output_layer():
    """diagonal_output_factor: the output layer's output factor B takes Lemma 2's root for the diagonal of E3
    (recorded samples, as above) and stays diagonal; its input factor A and mean take Algorithm 3's updates
    unchanged, and the hidden layers keep Algorithm 3 whole (their B not diagonal)."""
    model = mlp(seed=3, dtype=F64)
    x, y = mlp_batch()
    x = x.double()
    k_samples = 3
    opt = FOOVB(model, "kronecker", k_samples, seed=11, diagonal_output_factor=True, **PAPER)
    assert [block.diagonal_output_factor for block in opt.blocks] == [False] * (len(opt.blocks) - 1) + [True]
    gen = make_generator(5)
    randomize_factors(opt, gen)
    head = opt.blocks[-1]
    head.state["output_sqrt_cov"] = torch.diag(0.3 + torch.rand(head.out_features, generator=gen, dtype=F64))
    records = []
    closure = recording_closure(model, x, y, records)

    opt.step(closure)  # the step checked starts from an updated B
    old = {k: v.clone() for k, v in head.state.items()}
    records.clear()
    opt.step(closure)
    m, a, b = old["mean"], old["input_sqrt_cov"], old["output_sqrt_cov"]
    p, n = m.shape
    w = [torch.cat([rec[-2][0], rec[-1][0][:, None]], 1) for rec in records]  # the head's weight and bias
    psi = [torch.cat([rec[-2][1], rec[-1][1][:, None]], 1) for rec in records]
    phi = [torch.linalg.solve(b, wk - m) @ torch.linalg.inv(a).T for wk in w]
    e1 = sum(psi) / k_samples
    e2 = sum(ps.T @ b @ ph for ps, ph in zip(psi, phi, strict=True)) / (p * k_samples)
    e3 = sum(ps @ a @ ph.T for ps, ph in zip(psi, phi, strict=True)) / (n * k_samples)
    new_a, new_b = head.state["input_sqrt_cov"], head.state["output_sqrt_cov"]
    x1, x2 = solve_fixed_point(a @ a.T, e2), solve_fixed_point(b @ b.T, torch.diag(torch.diagonal(e3)))
    torch.testing.assert_close(new_a @ new_a.T, x1 @ x1.T, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(new_b @ new_b.T, x2 @ x2.T, rtol=1e-10, atol=1e-13)
    assert torch.equal(new_b, torch.diag(torch.diagonal(new_b)))
    torch.testing.assert_close(head.state["mean"], m - b @ b.T @ e1 @ a @ a.T, rtol=1e-11, atol=1e-13)
    hidden_b = opt.blocks[0].state["output_sqrt_cov"]
    assert not torch.equal(hidden_b, torch.diag(torch.diagonal(hidden_b)))


@pytest.mark.parametrize("implicit_mean", [False, True])
@pytest.mark.parametrize("tempering", [1.0, 3.0])
def test_the_diagonal_factor_update_is_the_general_solver_on_a_diagonal(implicit_mean, tempering):
    """The closed form of a diagonal output factor (h(|B_ii t_i|) per entry) is `sqrt_covariance_update` on the
    diagonal matrices, the tempered step factor included; entries of t of both signs."""
    model = nn.Linear(3, 6).double()
    opt = FOOVB(model, "kronecker", seed=0, diagonal_output_factor=True, implicit_mean=implicit_mean,
                secant_check=False, step_prior=1)
    block, gen = opt.blocks[0], make_generator(2)
    b = torch.diag(0.2 + torch.rand(6, generator=gen, dtype=F64))
    t = 3 * torch.randn(6, generator=gen, dtype=F64)
    closed = block.updated_and_step_factor(b, t, tempering)  # a vector t: the diagonal closed form
    general = block.updated_and_step_factor(b, LowRank(dense=torch.diag(t)), tempering)
    for mine, theirs in zip(closed, general, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------------------------------------------------
# Diagonal family on a quadratic: E[g] = H (mu - c), E[g eps] = H sigma
# ---------------------------------------------------------------------------------------------------------
def _diag_quadratic(d, k_samples, seed, antithetic=False):
    g = make_generator(seed)
    lin = nn.Linear(d, 1, bias=False).double()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(1, d, generator=g, dtype=F64))
    opt = FOOVB(lin, "diagonal", k_samples, init="keep", std_init=0.5, antithetic=antithetic, seed=seed, **PAPER)
    sigma = 0.2 + torch.rand(1, d, generator=g, dtype=F64)
    opt.blocks[0].state["std"].copy_(sigma)
    c = lin.weight.detach() + 0.5 * torch.randn(1, d, generator=g, dtype=F64)
    h = 0.3 + 2 * torch.rand(1, d, generator=g, dtype=F64)
    return lin, opt, sigma, c, h


def test_diagonal_update_matches_closed_form_expectations():
    k_samples = 4000
    lin, opt, sigma, c, h = _diag_quadratic(6, k_samples, seed=21)
    mu = lin.weight.detach().clone()
    opt.step(quadratic_closure(lin.weight, c, h))
    view = opt.posterior(lin.weight)
    e1, e2 = h * (mu - c), h * sigma  # exact expectations for a quadratic loss
    # Standard errors of the K-sample means: g eps = h (mu - c) eps + h sigma eps^2, Var(eps^2) = 2.
    se1 = h * sigma / math.sqrt(k_samples)
    se2 = h * torch.sqrt(((mu - c) ** 2 + 2 * sigma**2) / k_samples)
    assert bool((5 * se2 < 0.3 * e2).all())  # the tolerance is far tighter than the effect
    # The mean: mu - sigma^2 E1  <=>  the estimate of E1 implied by the update is within 5 SE.
    e1_hat = (mu - view.mean) / sigma**2
    assert bool(((e1_hat - e1).abs() < 5 * se1).all()), (e1_hat - e1) / se1
    # sigma_new = f(E2_hat) with f decreasing: it must lie between f(E2 + 5 SE) and f(E2 - 5 SE) ...
    assert bool((view.std >= diag_formula(sigma, e2 + 5 * se2)).all())
    assert bool((view.std <= diag_formula(sigma, e2 - 5 * se2)).all())
    # ... equivalently, the E2 implied by sigma_new^2 + sigma_new sigma^2 E2 - sigma^2 = 0 is within 5 SE.
    e2_hat = (sigma**2 - view.std**2) / (view.std * sigma**2)
    assert bool(((e2_hat - e2).abs() < 5 * se2).all()), (e2_hat - e2) / se2


@pytest.mark.parametrize("k_samples", [1, 3])
def test_diagonal_update_is_exact_for_reconstructed_noise(k_samples):
    lin, opt, sigma, c, h = _diag_quadratic(8, k_samples, seed=22)
    mu = lin.weight.detach().clone()
    thetas = []
    closure = quadratic_closure(lin.weight, c, h)

    def recording_closure():
        thetas.append(lin.weight.detach().clone())
        return closure()

    opt.step(recording_closure)
    eps = [(t - mu) / sigma for t in thetas]
    grads = [h * (t - c) for t in thetas]
    e1 = sum(grads) / k_samples
    e2 = sum(g * e for g, e in zip(grads, eps, strict=True)) / k_samples
    view = opt.posterior(lin.weight)
    torch.testing.assert_close(view.mean, mu - sigma**2 * e1, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(view.std, diag_formula(sigma, e2), rtol=1e-13, atol=1e-15)
    assert torch.equal(lin.weight.detach(), view.mean)


@pytest.mark.parametrize("k_samples", [2, 6])
def test_antithetic_diagonal_update_on_quadratic_is_exact_in_the_mean_and_never_grows_sigma(k_samples):
    """Quadratic loss, pairs (eps, -eps): the pair mean of g = h (mu - c + sigma eps) is h (mu - c) exactly, and
    of g eps it is h sigma eps^2 >= 0: the mean update is exact and sigma can only shrink, whatever K."""
    lin, opt, sigma, c, h = _diag_quadratic(50, k_samples, seed=23, antithetic=True)
    mu = lin.weight.detach().clone()
    opt.step(quadratic_closure(lin.weight, c, h))
    view = opt.posterior(lin.weight)
    torch.testing.assert_close(view.mean, mu - sigma**2 * h * (mu - c), rtol=1e-12, atol=1e-14)
    assert bool((view.std <= sigma).all())
    # Independent draws: the same K gives an inexact mean and, with K = 2, a larger sigma on some weights.
    lin, opt, sigma, c, h = _diag_quadratic(50, k_samples, seed=23)
    opt.step(quadratic_closure(lin.weight, c, h))
    view = opt.posterior(lin.weight)
    assert not torch.allclose(view.mean, mu - sigma**2 * h * (mu - c), rtol=1e-6, atol=0)
    assert bool((view.std > sigma).any()) == (k_samples == 2)


def test_cov_momentum_averages_e_g_eps_over_steps():
    """Three steps on a nonlinear loss, E[g eps] recomputed from the recorded samples of each step: the sigma
    update uses m_t = rho m_{t-1} + (1 - rho) E_t[g eps] (m_1 = E_1[g eps]), the mean update the current E[g]."""
    rho, cov_step, k_samples = 0.6, 0.5, 3
    model = mlp(seed=3, dtype=F64)
    opt = FOOVB(model, "diagonal", k_samples, cov_step=cov_step, cov_momentum=rho, seed=11, **PAPER)
    average = None
    for step in range(3):
        x, y = mlp_batch(seed=step)
        x = x.double()
        before = [(b.state["mean"].clone(), b.state["std"].clone()) for b in opt.blocks]
        records = []

        def closure(x=x, y=y, records=records):
            loss = F.cross_entropy(model(x), y, reduction="sum")
            loss.backward()
            records.append([(p.detach().clone(), p.grad.clone()) for p in model.parameters()])
            return loss

        opt.step(closure)
        e2 = [sum(grad * (theta - mu) / sigma for theta, grad in (rec[i] for rec in records)) / k_samples
              for i, (mu, sigma) in enumerate(before)]
        average = e2 if average is None else [rho * m + (1 - rho) * e for m, e in zip(average, e2, strict=True)]
        for i, (block, (mu, sigma), m) in enumerate(zip(opt.blocks, before, average, strict=True)):
            e1 = sum(rec[i][1] for rec in records) / k_samples
            torch.testing.assert_close(block.state["mean"], mu - sigma**2 * e1, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(block.state["std"], diag_formula(sigma, cov_step * m), rtol=1e-12,
                                       atol=1e-14)


def test_cov_momentum_removes_the_shrinkage_that_noise_alone_causes():
    """Quadratic loss with a dense Hessian H, one antithetic pair per step: the estimate of E[g eps]_i is
    sigma_i (H_ii eps_i^2 + sum_{j != i} H_ij eps_i eps_j), and the Lemma 2 root shrinks sigma by its absolute
    value, so the noise shrinks sigma below the noiseless trajectory sigma <- sigma h(sigma^2 H_ii). Averaging
    the estimate over steps (cov_momentum 0.5) removes most of that extra shrinkage (measured: sigma / noiseless
    0.977 without, 0.996 with, after 1000 steps)."""
    d = 40
    gen = make_generator(1)
    factor = torch.randn(d, d, generator=gen, dtype=F64)
    hessian = 0.05 * (0.5 * torch.eye(d, dtype=F64) + factor @ factor.T / d)
    centre = torch.randn(d, generator=gen, dtype=F64)
    noiseless = torch.full((d,), 0.3, dtype=F64)
    for _ in range(1000):
        noiseless = noiseless * root_scale(noiseless**2 * hessian.diagonal())
    ratios = {}
    for rho in (0.0, 0.5):
        lin = nn.Linear(d, 1, bias=False).double()
        opt = FOOVB(lin, "diagonal", 2, init="keep", std_init=0.3, antithetic=True, std_growth="none",
                    cov_momentum=rho, seed=3, **PAPER)

        def closure(lin=lin):
            offset = lin.weight[0] - centre
            loss = 0.5 * offset @ hessian @ offset
            loss.backward()
            return loss

        for _ in range(1000):
            opt.step(closure)
        ratios[rho] = (opt.posterior(lin.weight).std[0] / noiseless).mean().item()
    assert ratios[0.0] < 0.985  # the bias the test is about is there
    assert abs(1 - ratios[0.5]) < 0.3 * abs(1 - ratios[0.0]), ratios


# ---------------------------------------------------------------------------------------------------------
# Matrix-variate family (Algorithm 3)
# ---------------------------------------------------------------------------------------------------------
def _kron_layer(n_in, p, bias, seed, k_samples=3):
    g = make_generator(seed)
    torch.manual_seed(seed)
    lin = nn.Linear(n_in, p, bias=bias).double()
    opt = FOOVB(lin, "kronecker", k_samples, init="keep", seed=seed, **PAPER)
    block = opt.blocks[0]
    block.state["input_sqrt_cov"] = 0.7 * random_sqrt(n_in + int(bias), g)
    block.state["output_sqrt_cov"] = 0.7 * random_sqrt(p, g)
    return lin, opt, block, g


@pytest.mark.parametrize("path", ["step", "step_batched"])
def test_kronecker_mean_update_for_linear_loss_is_exact(path):
    """L = sum(G * W_aug): Psi = G for every sample, so E1 = G and M_new = M - B B^T G A A^T for any K."""
    n_in, p = 4, 3
    lin, opt, block, g = _kron_layer(n_in, p, bias=True, seed=31)
    m, a, b = (block.state[k].clone() for k in ("mean", "input_sqrt_cov", "output_sqrt_cov"))
    if path == "step":
        grad = torch.randn(p, n_in + 1, generator=g, dtype=F64)

        def closure():
            loss = (grad[:, :n_in] * lin.weight).sum() + (grad[:, n_in] * lin.bias).sum()
            loss.backward()
            return loss

        opt.step(closure)
    else:  # loss = sum(R * outputs): dL/dW_aug = R^T [X, 1], through the factored (never-formed-W) path
        x = torch.randn(5, n_in, generator=g, dtype=F64)
        r = torch.randn(5, p, generator=g, dtype=F64)
        grad = r.T @ torch.cat([x, torch.ones(5, 1, dtype=F64)], 1)
        opt.step_batched(x, r, lambda out, t: (out * t).sum(), chunk_size=2)
    torch.testing.assert_close(block.state["mean"], m - b @ b.T @ grad @ a @ a.T, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(lin.bias.detach(), block.state["mean"][:, n_in])


def test_kronecker_covariance_update_matches_exact_expectations_for_quadratic_loss():
    """L = 1/2 ||W - C||_F^2 with M = C: Psi = B Phi A^T, hence E[Psi^T B Phi] = tr(B^T B) A and
    E[Psi A Phi^T] = tr(A^T A) B, i.e. E2 = tr(B B^T)/p A and E3 = tr(A A^T)/n B (Phi iid N(0, 1))."""
    n_in, p, k_samples = 6, 5, 4000
    lin, opt, block, g = _kron_layer(n_in, p, bias=False, seed=32, k_samples=k_samples)
    a, b = block.state["input_sqrt_cov"].clone(), block.state["output_sqrt_cov"].clone()
    target = lin.weight.detach().clone()  # C = M: E1 = 0
    opt.step(quadratic_closure(lin.weight, target, torch.ones_like(target)))
    s_a, s_b = a.T @ a, b.T @ b
    e2, e3 = torch.trace(s_b) / p * a, torch.trace(s_a) / n_in * b
    for new, old, e, s_other, dim in (
        (block.state["input_sqrt_cov"], a, e2, s_b, n_in),
        (block.state["output_sqrt_cov"], b, e3, s_a, p),
    ):
        expected = sqrt_covariance_update(old, LowRank(dense=e))
        expected_cov, new_cov, old_cov = expected @ expected.T, new @ new.T, old @ old.T
        # MC error of Z = mean_k Phi_k^T S Phi_k (dim x dim, E Z = tr(S) I): Var(Z_ij) = (1 + [i = j])
        # tr(S^2) / K, so ||Z - E Z||_F / ||E Z||_F ~ sqrt((dim + 1) tr(S^2) / K) / tr(S) (conservative: the
        # per-entry relative error is sqrt(dim + 1) times smaller). h(s)^2 amplifies relative errors of s by
        # s / sqrt(1 + s^2/4) < 2; allow 5x the Frobenius estimate.
        rel_sd = math.sqrt((dim + 1) * torch.trace(s_other @ s_other) / k_samples) / torch.trace(s_other)
        gap = (torch.linalg.norm(new_cov - expected_cov) / torch.linalg.norm(expected_cov)).item()
        change = (torch.linalg.norm(old_cov - expected_cov) / torch.linalg.norm(expected_cov)).item()
        print(f"kronecker {dim}x{dim} factor: MC gap {gap:.4f}, predicted sd {rel_sd:.4f}, "
              f"change {change:.3f}")
        assert gap < 5 * rel_sd
        assert change > 4 * 5 * rel_sd  # the update itself is much larger than the tolerance


# ---------------------------------------------------------------------------------------------------------
# Diagonal sigma monotonicity (Theorem / Corollary)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["strongly-convex", "concave"])
def test_diagonal_sigma_monotone_in_curvature(sign):
    """Strongly convex L: E[g eps] >= m sigma > 0 so sigma strictly decreases; concave: it strictly increases.
    The mean starts at the optimum c, so the Monte Carlo term h (mu - c) mean(eps) of E2 stays negligible."""
    lin, opt, sigma, c, h = _diag_quadratic(5, 100, seed=51)
    c = lin.weight.detach().clone()
    previous = sigma.clone()
    closure = quadratic_closure(lin.weight, c, h, sign)
    for _ in range(6):
        opt.step(closure)
        std = opt.posterior(lin.weight).std.clone()
        assert bool((std < previous).all() if sign > 0 else (std > previous).all()), (previous, std)
        previous = std


def test_std_growth_none_takes_lemma2_root_and_capped_stops_at_the_prior():
    """std_growth="none": sigma <- sigma h(|sigma E[g eps]|). Flipping the sign of a quadratic loss flips E[g eps]
    exactly (same noise), so the std after one step is the same for L and -L, below the prior, and equal to the
    paper's formula on the convex side. "paper" grows sigma on the concave side; "capped" stops it at std_init."""
    results = {}
    for growth in ("paper", "capped", "none"):
        for sign in (1.0, -1.0):
            lin, opt, sigma, c, h = _diag_quadratic(5, 10, seed=52)
            opt.blocks[0].std_growth = growth
            opt.blocks[0].std_init = 0.7  # the cap; the prior stds lie in [0.2, 1.2]
            opt.step(quadratic_closure(lin.weight, c, h, sign))
            results[growth, sign] = opt.posterior(lin.weight).std.clone()
    torch.testing.assert_close(results["none", 1.0], results["none", -1.0], rtol=1e-12, atol=0)
    torch.testing.assert_close(results["none", 1.0], results["paper", 1.0], rtol=1e-12, atol=0)
    assert bool((results["none", -1.0] < sigma).all())
    assert bool((results["paper", -1.0] > sigma).all())
    torch.testing.assert_close(results["capped", -1.0], results["paper", -1.0].clamp(max=0.7), rtol=1e-12, atol=0)
    assert bool((results["capped", -1.0] < results["paper", -1.0]).any())  # the cap bound somewhere
    torch.testing.assert_close(results["capped", 1.0], results["paper", 1.0].clamp(max=0.7), rtol=1e-12, atol=0)


def test_std_growth_none_diagonal_equals_full_family_on_one_weight():
    """For a single weight the full family's Lemma 2 solution is the diagonal update with std_growth="none",
    on a loss with negative curvature too (the paper's diagonal closed form grows sigma there)."""
    stds = {}
    for family, growth in (("full", None), ("diagonal", "none"), ("diagonal", "paper")):
        lin = nn.Linear(1, 1, bias=False).double()
        with torch.no_grad():
            lin.weight.fill_(0.3)
        opt = FOOVB(lin, family, 6, init="keep", std_init=0.4, std_growth=growth, seed=3, **PAPER)
        closure = quadratic_closure(lin.weight, torch.full((1, 1), 0.1, dtype=F64),
                                    torch.full((1, 1), 2.0, dtype=F64), sign=-1.0)
        for _ in range(3):
            opt.step(closure)
        stds[family, growth] = opt.posterior(lin.weight).std
    torch.testing.assert_close(stds["diagonal", "none"], stds["full", None], rtol=1e-10, atol=0)
    assert stds["full", None].item() < 0.4 < stds["diagonal", "paper"].item()


# ---------------------------------------------------------------------------------------------------------
# Posterior views
# ---------------------------------------------------------------------------------------------------------
def _transform_covariance(block, index):
    """Cov of params[index] computed from TRANSFORM itself: the sample is affine in eps, theta = mu + J eps,
    so Cov = J J^T, with J read off by sampling unit noise vectors."""
    size = math.prod(block.noise_shape)
    basis = torch.eye(size, dtype=block.state["mean"].dtype).reshape(size, *block.noise_shape)
    zero = torch.zeros(1, *block.noise_shape, dtype=basis.dtype)
    jac = (block.sample(basis)[index] - block.sample(zero)[index]).flatten(1).T  # (numel, size)
    return jac @ jac.T


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["step", "batched"])
def test_posterior_views(family, mode):
    model = mlp(dtype=F64)
    opt = FOOVB(model, family, 4, seed=2, **PAPER)
    x, y = mlp_batch()
    x = x.double()
    for _ in range(2):
        if mode == "step":
            opt.step(ce_closure(model, x, y))
        else:
            opt.step_batched(x, y)
    for block in opt.blocks:  # the model holds the posterior mean
        for param, mean in zip(block.params, block.mean_values(), strict=True):
            assert torch.equal(param.detach(), mean)
    for param in model.parameters():
        view = opt.posterior(param)
        assert view.mean.shape == param.shape and view.std.shape == param.shape
        assert torch.equal(view.mean, param.detach())
        assert bool((view.std > 0).all())
        cov = view.covariance()
        assert cov.shape == (param.numel(), param.numel())
        torch.testing.assert_close(cov, cov.T, rtol=0, atol=1e-14)
        assert torch.linalg.eigvalsh(cov).min() >= -1e-12 * cov.diagonal().max()
        torch.testing.assert_close(cov.diagonal(), view.std.flatten() ** 2, rtol=1e-12, atol=1e-15)
        block = next(b for b in opt.blocks if any(p is param for p in b.params))
        index = next(i for i, p in enumerate(block.params) if p is param)
        torch.testing.assert_close(cov, _transform_covariance(block, index), rtol=1e-10, atol=1e-14)
        if family == "kronecker" and param.ndim == 2:
            a, b = block.state["input_sqrt_cov"], block.state["output_sqrt_cov"]
            n_in = param.shape[1]
            expected = torch.kron(b @ b.T, (a @ a.T)[:n_in, :n_in])
            torch.testing.assert_close(cov, expected, rtol=1e-12, atol=1e-15)
            assert (cov - torch.diag(cov.diagonal())).abs().max() > 1e-8  # correlated after training
        if family == "diagonal":
            assert torch.equal(cov, torch.diag(cov.diagonal()))
    with pytest.raises(KeyError):
        opt.posterior(torch.zeros(3))
    with pytest.raises(KeyError):
        opt.posterior(nn.Linear(4, 6).weight)


@pytest.mark.parametrize("family", FAMILIES)
def test_posterior_view_is_a_snapshot(family):
    model = mlp(seed=0)
    opt = FOOVB(model, family, 3, seed=0, **PAPER)
    view = opt.posterior(model[0].weight)
    mean, std = view.mean.clone(), view.std.clone()
    view.std.mul_(0)
    view.mean.add_(1)
    assert torch.equal(opt.posterior(model[0].weight).std, std)
    _steps(model, opt, 0, 1)
    after = opt.posterior(model[0].weight)
    assert not torch.equal(after.mean, mean) and torch.equal(view.mean, mean + 1)


# ---------------------------------------------------------------------------------------------------------
# Parameters of any shape
# ---------------------------------------------------------------------------------------------------------
class _Tempered(nn.Module):
    """A linear layer and a learnable 0-dim log-temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.log_temperature = nn.Parameter(torch.tensor(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) / self.log_temperature.exp()


@pytest.mark.parametrize("family", ["diagonal", "kronecker", "full"])
def test_a_zero_dim_parameter_is_trained_by_every_family(family):
    """The full family failed at construction (reshape of a 0-dim chunk) and in its statistics (flatten(1))."""
    torch.manual_seed(0)
    model, x, y = _Tempered(), torch.randn(16, 4), torch.randint(3, (16,))
    opt = FOOVB(model, family, 4, seed=0)
    before = model.log_temperature.detach().clone()

    def closure():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    for _ in range(2):
        opt.step(closure)
    view = opt.posterior(model.log_temperature)
    assert view.mean.shape == view.std.shape == () and bool(torch.isfinite(view.std)) and view.std > 0
    assert not torch.equal(view.mean, before) and torch.equal(view.mean, model.log_temperature.detach())
    assert predict(opt, x, 3).samples.shape == (3, 16, 3)


def test_diagonal_output_factor_is_validated_fixed_family_only_and_legacy_false():
    """A boolean of the matrix-variate family (and "auto"), on in its recommended preset, off in the paper's; fixed
    at construction; a state dict saved before it existed holds the full factor."""
    layer = nn.Linear(3, 2)
    assert FOOVB(layer).diagonal_output_factor and not FOOVB(layer, preset="paper").diagonal_output_factor
    with pytest.raises(ValueError, match="diagonal_output_factor must be True or False"):
        FOOVB(layer, diagonal_output_factor="yes")
    with pytest.raises(ValueError, match="diagonal_output_factor applies to the kronecker family"):
        FOOVB(layer, "diagonal", diagonal_output_factor=True)
    saved = FOOVB(layer, diagonal_output_factor=False).state_dict()
    del saved["param_groups"][0]["diagonal_output_factor"]  # a state dict saved before the setting existed
    FOOVB(layer, diagonal_output_factor=False).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"saved False, here True.*diagonal_output_factor=False"):
        FOOVB(layer).load_state_dict(saved)
    tampered = FOOVB(layer).state_dict()
    tampered["state"][0]["output_sqrt_cov"] = tampered["state"][0]["output_sqrt_cov"] + 0.01
    with pytest.raises(ValueError, match="'output_sqrt_cov' is not diagonal"):
        FOOVB(layer).load_state_dict(tampered)
