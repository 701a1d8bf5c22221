"""foovb.linalg: the fixed-point equation X X^T + M T X^T - M = 0 of Lemma 1 and its square-root form."""

import math

import pytest
import torch
from conftest import make_generator, random_spd, random_sqrt
from torch import Tensor

import foovb.linalg as linalg_module
from foovb.linalg import (
    LowRank,
    left_singular_pairs,
    prior_swapped,
    prior_swapped_kronecker_product,
    prior_swapped_product,
    root_scale,
    signed_root_scale,
    solve_fixed_point,
    sqrt_covariance_update,
)

pytestmark = pytest.mark.usefixtures("single_thread")

F64 = torch.float64


def sym_sqrt(b: torch.Tensor) -> torch.Tensor:
    """The symmetric square root B^(1/2) of an SPD matrix (Lemma 1's D), via eigh."""
    w, v = torch.linalg.eigh(b)
    return (v * w.sqrt()) @ v.T


def residual(x, m, t):
    return torch.linalg.norm(x @ x.T + m @ t @ x.T - m) / torch.linalg.norm(m)


def lemma12_literal(m, t):
    """X = D Q - 1/2 M T with D = B^(1/2), Q = S W^T from the SVD of D^-1 M T (the paper's Lemmas 1-2)."""
    d = sym_sqrt(m + 0.25 * m @ t @ t.T @ m)
    s, _, wh = torch.linalg.svd(torch.linalg.solve(d, m @ t))
    return d @ s @ wh - 0.5 * m @ t


# ---------------------------------------------------------------------------------------------------------
# solve_fixed_point
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_solution_well_conditioned(seed):
    g = make_generator(seed)
    n = 6
    m = random_spd(n, g)
    t = torch.randn(n, n, generator=g, dtype=F64) * (seed + 1)  # includes a strongly informative T
    x = solve_fixed_point(m, t)
    assert x.dtype == F64 and x.shape == (n, n)
    assert residual(x, m, t) < 1e-8
    sv = torch.linalg.svdvals(x)
    assert sv.min() > 1e-6 * sv.max()
    # Lemma 1: X = D Q - M T / 2 with D = B^(1/2) symmetric, Q orthogonal and D Q T^T M symmetric.
    d = sym_sqrt(m + 0.25 * m @ t @ t.T @ m)
    q = torch.linalg.solve(d, x + 0.5 * m @ t)
    torch.testing.assert_close(q.T @ q, torch.eye(n, dtype=F64), atol=1e-9, rtol=0)
    sym = d @ q @ t.T @ m
    assert torch.linalg.norm(sym - sym.T) < 1e-9 * torch.linalg.norm(sym)


@pytest.mark.parametrize("cond", [1e2, 1e4, 1e6, 1e8])
def test_solution_ill_conditioned(cond):
    g = make_generator(int(math.log10(cond)))
    n = 8
    m = random_spd(n, g, cond=cond)
    assert torch.linalg.cond(m) == pytest.approx(cond, rel=1e-3)
    t = torch.randn(n, n, generator=g, dtype=F64)
    x = solve_fixed_point(m, t)
    assert residual(x, m, t) < 1e-8
    sv = torch.linalg.svdvals(x)
    assert sv.min() > 0 and math.isfinite(torch.linalg.cond(x).item())
    # D Q T^T M symmetric <=> X T^T M symmetric (X T^T M = D Q T^T M - M T T^T M / 2): M T X^T = X T^T M
    mtx = m @ t @ x.T
    scale = torch.linalg.norm(m) * torch.linalg.norm(t) * torch.linalg.norm(x)
    assert torch.linalg.norm(mtx - mtx.T) < 1e-10 * scale


@pytest.mark.parametrize("seed", range(3))
def test_matches_literal_lemma12_construction(seed):
    g = make_generator(100 + seed)
    n = 5
    m = random_spd(n, g)
    t = torch.randn(n, n, generator=g, dtype=F64)
    expected = lemma12_literal(m, t)
    assert residual(expected, m, t) < 1e-10  # the reference itself solves the equation
    torch.testing.assert_close(solve_fixed_point(m, t), expected, atol=1e-10, rtol=1e-10)


def test_float32_input_returns_float32_solution(gen):
    m = random_spd(4, gen)
    t = torch.randn(4, 4, generator=gen, dtype=F64)
    x32 = solve_fixed_point(m.float(), t.float())
    assert x32.dtype == torch.float32
    torch.testing.assert_close(x32.double(), solve_fixed_point(m, t), atol=1e-5, rtol=1e-5)


def _bad_inputs():
    eye = torch.eye(3, dtype=F64)
    nan, inf = eye.clone(), eye.clone()
    nan[0, 1] = nan[1, 0] = float("nan")
    inf[2, 2] = float("inf")
    asym = eye.clone()
    asym[0, 1] = 0.5
    return [
        pytest.param(torch.ones(3, 4, dtype=F64), torch.ones(3, 4, dtype=F64), "square", id="non-square"),
        pytest.param(torch.ones(3, dtype=F64), torch.ones(3, dtype=F64), "square", id="1-d"),
        pytest.param(eye, torch.eye(4, dtype=F64), "shape", id="mismatched"),
        pytest.param(nan, eye, "NaN", id="nan-M"),
        pytest.param(inf, eye, "Inf", id="inf-M"),
        pytest.param(eye, nan, "NaN", id="nan-T"),
        pytest.param(eye, inf, "Inf", id="inf-T"),
        pytest.param(asym, eye, "symmetric", id="non-symmetric"),
        pytest.param(torch.diag(torch.tensor([1.0, -1.0, 2.0], dtype=F64)), eye, "positive definite",
                     id="indefinite"),
        pytest.param(torch.diag(torch.tensor([1.0, 0.0, 2.0], dtype=F64)), eye, "positive definite",
                     id="singular"),
        pytest.param(torch.zeros(3, 3, dtype=F64), eye, "positive definite", id="zero"),
    ]


@pytest.mark.parametrize("m, t, message", _bad_inputs())
def test_invalid_inputs_raise(m, t, message):
    with pytest.raises(ValueError, match=message):
        solve_fixed_point(m, t)


def test_float32_m_symmetric_up_to_its_rounding_is_accepted():
    g = make_generator(11)
    a = torch.randn(50, 50, generator=g)
    m = a @ torch.diag(torch.rand(50, generator=g) + 0.5) @ a.T  # float32: asymmetric in the last bits
    assert (m - m.T).abs().max() > 1e-8 * m.abs().max()
    t = 0.01 * torch.randn(50, 50, generator=g)
    x = solve_fixed_point(m, t)
    assert x.dtype == torch.float32
    residual = x.double() @ x.double().T + m.double() @ t.double() @ x.double().T - m.double()
    assert residual.abs().max() < 1e-4 * m.abs().max()
    lopsided = m.clone()
    lopsided[0, 1] += 1e-3 * m.abs().max()  # far above float32 rounding: still refused
    with pytest.raises(ValueError, match="symmetric"):
        solve_fixed_point(lopsided, t)
    skewed = torch.eye(300, dtype=torch.bfloat16)
    skewed[0, 1] = 0.9  # not a rounding error even at bfloat16's precision, for a large matrix
    with pytest.raises(ValueError, match="symmetric"):
        solve_fixed_point(skewed, torch.zeros_like(skewed))


def test_numerically_singular_m_is_rejected():
    g = make_generator(7)
    accepted = 0
    for _ in range(50):
        v = torch.randn(4, 2, generator=g, dtype=F64)  # M = v v^T has rank 2
        try:
            solve_fixed_point(v @ v.T, torch.randn(4, 4, generator=g, dtype=F64))
            accepted += 1
        except ValueError as err:
            assert "positive definite" in str(err)
    assert accepted == 0, f"{accepted}/50 rank-2 4x4 matrices were accepted as positive definite"


@pytest.mark.parametrize("v, e", [(0.7, 0.0), (0.7, 0.3), (1.3, 2.0), (0.05, 40.0), (3.0, 1e3)])
def test_scalar_case_is_the_diagonal_formula(v, e):
    x = solve_fixed_point(torch.tensor([[v * v]], dtype=F64), torch.tensor([[e]], dtype=F64)).item()
    assert x == pytest.approx(v * math.sqrt(1 + (v * e / 2) ** 2) - v * v * e / 2, rel=1e-12)


@pytest.mark.parametrize("v, e", [(0.7, -0.3), (1.3, -2.0), (0.05, -40.0)])
def test_scalar_case_negative_t_gives_the_other_root(v, e):
    """For T < 0, Lemma 2's solution (h(s) <= 1) returns the negative root; |X| = v sqrt(1 + (v e/2)^2) + v^2 e/2 < v,
    whereas the diagonal family's formula v sqrt(...) - v^2 e / 2 would grow sigma (module docstring)."""
    x = solve_fixed_point(torch.tensor([[v * v]], dtype=F64), torch.tensor([[e]], dtype=F64)).item()
    assert x < 0
    assert abs(x) == pytest.approx(v * math.sqrt(1 + (v * e / 2) ** 2) + v * v * e / 2, rel=1e-12)
    assert x * x + v * v * e * x - v * v == pytest.approx(0.0, abs=1e-12)  # still a root of the equation


def test_root_scale_solves_its_quadratic_without_cancellation():
    s = torch.tensor([0.0, 1e-8, 0.5, 1.0, 10.0, 1e4, 1e8, 1e12], dtype=F64)
    h = root_scale(s)
    assert h[0] == 1.0 and bool(((h > 0) & (h <= 1)).all())
    torch.testing.assert_close(h * h + s * h, torch.ones_like(s), atol=1e-14, rtol=0)
    big = s[-3:]  # h(s) = 1/s - 1/s^3 + O(s^-5): the naive sqrt(1 + s^2/4) - s/2 would return 0 here
    torch.testing.assert_close(h[-3:], 1 / big - 1 / big**3, rtol=1e-12, atol=0)



@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_signed_root_scale_solves_its_quadratic_for_both_signs(dtype: torch.dtype):
    """The paper's diagonal sigma factor v(x) = sqrt(1 + x^2/4) - x/2 is the positive root of v^2 + x v - 1 = 0
    for either sign of x: relative accuracy near the dtype's rounding from 1e-6 to 1e15 (no cancellation for
    large positive x, where v ~ 1/x), v(0) = 1 and v(-x) = 1 / v(x)."""
    magnitudes = torch.logspace(-6, 15, 43, dtype=F64)
    x = torch.cat([-magnitudes.flip(0), torch.zeros(1, dtype=F64), magnitudes])
    exact = torch.where(x > 0, 1 / (torch.sqrt(1 + x * x / 4) + x / 2), torch.sqrt(1 + x * x / 4) - x / 2)
    assert bool((exact * exact + x * exact - 1).abs().le(1e-9 * (1 + x.abs() * exact)).all())  # the reference
    value = signed_root_scale(x.to(dtype)).to(F64)
    tolerance = 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(value, exact, rtol=tolerance, atol=0)
    assert value[43] == 1.0
    torch.testing.assert_close(value[:43].flip(0) * value[44:], torch.ones(43, dtype=F64), rtol=tolerance, atol=0)

# ---------------------------------------------------------------------------------------------------------
# sqrt_covariance_update and LowRank
# ---------------------------------------------------------------------------------------------------------
def _matrix_with_singular_values(shape: tuple[int, int], singular_values: Tensor, gen: torch.Generator) -> Tensor:
    m, p = shape
    left = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=F64))[0]
    right = torch.linalg.qr(torch.randn(p, m, generator=gen, dtype=F64))[0]
    return (left * singular_values) @ right.T


@pytest.mark.parametrize("gram", [False, True])
@pytest.mark.parametrize("shape", [(6, 6), (4, 9)])
def test_left_singular_pairs_error_bounds(shape, gram):
    """Singular values from 1e2 down to 1e-12: within ~eps * s_max of the exact ones by SVD, ~sqrt(eps) * s_max
    by the Gram route (its documented accuracy); both give orthonormal U diagonalising M M^T."""
    g = make_generator(sum(shape))
    exact = torch.logspace(2, -12, shape[0], dtype=F64)
    matrix = _matrix_with_singular_values(shape, exact, g)
    u, s = left_singular_pairs(matrix, gram=gram)
    order = torch.argsort(s, descending=True)
    bound = (1.5e-8 if gram else 1e-15) * exact.max()
    assert (s[order] - exact).abs().max() <= bound
    torch.testing.assert_close(u.T @ u, torch.eye(shape[0], dtype=F64), atol=1e-12, rtol=0)
    torch.testing.assert_close((u * s**2) @ u.T, matrix @ matrix.T, atol=1e-10, rtol=0)


def test_float32_update_by_gram_route_matches_float64_svd_to_float32_precision():
    """A float32 factor takes the Gram route: on a spectrum from s_max = 2 down to 1e-10 (a real layer's range),
    its update matches the float64 SVD update to float32 rounding."""
    g = make_generator(3)
    n = 40
    a = random_sqrt(n, g)
    n_mat = _matrix_with_singular_values((n, n), torch.logspace(0.3, -10, n, dtype=F64), g)
    t = LowRank(dense=torch.linalg.solve(a.T, n_mat))  # A^T T = N
    expected = sqrt_covariance_update(a, t)
    got = sqrt_covariance_update(a.float(), LowRank(dense=t.to_dense().float()))
    baseline = sqrt_covariance_update(a.float().double(), LowRank(dense=t.to_dense().float().double()))
    scale = expected.abs().max()
    # the float32 result is as close to the exact one as rounding the inputs to float32 alone makes it
    assert (got.double() - baseline).abs().max() <= 4 * torch.finfo(torch.float32).eps * scale
    assert (got.double() - expected).abs().max() <= 1e-5 * scale
    forced_svd = sqrt_covariance_update(a.float(), LowRank(dense=t.to_dense().float()), gram=False)
    assert not torch.equal(forced_svd, got)  # `gram` overrides the route: another computation, as accurate here
    assert (forced_svd.double() - baseline).abs().max() <= 4 * torch.finfo(torch.float32).eps * scale


@pytest.mark.parametrize("seed", [0, 3])
def test_float32_low_rank_update_matches_float64_to_float32_precision(seed):
    """The low-rank route of a float32 factor (its products in float32, the QR and the decomposition in float64):
    with N = A^T L^T C = Z C of rank 20 over n = 40, Z's singular values from 1 to 1e-4 and C's from 2 to 1e-10
    (so ||R_Z|| ||C|| >> ||R_Z C||, where a float32 product R_Z C could lose digits), the update matches the
    float64 one of the same float32-rounded inputs to float32 rounding."""
    g = make_generator(seed)
    n, rank = 40, 20
    a = random_sqrt(n, g)
    z = torch.linalg.qr(torch.randn(n, rank, generator=g, dtype=F64))[0] * torch.logspace(0, -4, rank, dtype=F64)
    left = torch.linalg.solve(a.T, z).T
    right = _matrix_with_singular_values((rank, n), torch.logspace(0.3, -10, rank, dtype=F64), g)
    low = LowRank(left.float(), right.float())
    assert low.rank == rank and low.dense is None
    got = sqrt_covariance_update(a.float(), low)
    baseline = sqrt_covariance_update(a.float().double(), LowRank(left.float().double(), right.float().double()))
    expected = sqrt_covariance_update(a, LowRank(left, right))
    scale = expected.abs().max()
    assert got.dtype == torch.float32
    assert (got.double() - baseline).abs().max() <= 4 * torch.finfo(torch.float32).eps * scale
    assert (got.double() - expected).abs().max() <= 1e-6 * scale


def test_float64_update_by_svd_route_matches_lemma2_on_a_wide_spectrum():
    """A float64 factor takes the SVD route: with N = A^T T's singular values from 1e2 down to 1e-10 the new
    covariance is Lemma 2's solution X X^T (solve_fixed_point) to 1e-12 relative. The Gram route, accurate to
    ~sqrt(eps) s_max only (`left_singular_pairs`), is ~1e-7 off here."""
    g = make_generator(4)
    n = 12
    a = random_sqrt(n, g)
    n_mat = _matrix_with_singular_values((n, n), torch.logspace(2, -10, n, dtype=F64), g)
    t = torch.linalg.solve(a.T, n_mat)  # A^T T = N
    x = solve_fixed_point(a @ a.T, t)
    expected = x @ x.T
    new = sqrt_covariance_update(a, LowRank(dense=t))
    assert new.dtype == F64
    assert torch.linalg.norm(new @ new.T - expected) < 1e-12 * torch.linalg.norm(expected)


@pytest.mark.parametrize("rank", [1, 3, 5])
def test_sqrt_update_dense_and_low_rank_give_lemma2_covariance(rank):
    g = make_generator(rank)
    n = 7
    a = random_sqrt(n, g)
    left = torch.randn(rank, n, generator=g, dtype=F64)
    right = torch.randn(rank, n, generator=g, dtype=F64)
    t = left.T @ right
    x = solve_fixed_point(a @ a.T, t)
    expected = x @ x.T
    dense = sqrt_covariance_update(a, LowRank(dense=t))
    low = LowRank(left, right)
    assert low.rank == rank and low.dense is None
    low_rank = sqrt_covariance_update(a, low)
    for new in (dense, low_rank):
        cov = new @ new.T
        assert torch.linalg.norm(cov - expected) < 1e-9 * torch.linalg.norm(expected)
    # Both routes return the same square root A (I + U (h(s) - 1) U^T), not only the same covariance.
    torch.testing.assert_close(dense, low_rank, atol=1e-10, rtol=1e-10)


def test_sqrt_update_zero_t_keeps_covariance(gen):
    a = random_sqrt(5, gen)
    torch.testing.assert_close(sqrt_covariance_update(a, LowRank(dense=torch.zeros(5, 5, dtype=F64))), a)


def test_sqrt_update_keeps_input_dtype(gen):
    a = random_sqrt(4, gen)
    t = torch.randn(4, 4, generator=gen, dtype=F64)
    new32 = sqrt_covariance_update(a.float(), LowRank(dense=t.float()))
    assert new32.dtype == torch.float32
    expected = sqrt_covariance_update(a, LowRank(dense=t))
    torch.testing.assert_close(new32.double(), expected, atol=1e-5, rtol=1e-5)


def test_low_rank_accumulates_then_collapses_to_dense(gen):
    n = 6
    acc = LowRank()
    assert acc.rank == 0
    with pytest.raises(ValueError, match="empty"):
        acc.to_dense()
    pairs = [(torch.randn(2, n, generator=gen, dtype=F64), torch.randn(2, n, generator=gen, dtype=F64))
             for _ in range(4)]
    total = torch.zeros(n, n, dtype=F64)
    for i, (left, right) in enumerate(pairs):
        acc.add(left, right)
        total += left.T @ right
        if i < 2:  # ranks 2, 4 < n stay factored
            assert acc.dense is None and acc.rank == 2 * (i + 1)
        else:  # rank would reach n: collapsed
            assert acc.dense is not None and acc.left is None and acc.rank == 0
        torch.testing.assert_close(acc.to_dense(), total, atol=1e-12, rtol=1e-12)
    acc.add_dense(torch.eye(n, dtype=F64))
    torch.testing.assert_close(acc.to_dense(), total + torch.eye(n, dtype=F64), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(acc.scaled(0.5).to_dense(), 0.5 * (total + torch.eye(n, dtype=F64)))


@pytest.mark.parametrize("rank, route_rows", [(8, 8), (9, 10)])
def test_sqrt_update_takes_the_dense_route_past_dense_fraction(rank, route_rows, monkeypatch):
    """A low-rank statistic of rank r > DENSE_FRACTION n (0.85) is updated by the dense route (cheaper there):
    over n = 10, rank 8 decomposes the 8 x 10 core, rank 9 the 10 x 10 N; both give the same update."""
    g = make_generator(rank)
    n = 10
    a = random_sqrt(n, g)
    left, right = torch.randn(rank, n, generator=g, dtype=F64), torch.randn(rank, n, generator=g, dtype=F64)
    shapes = []
    original = linalg_module.left_singular_pairs
    monkeypatch.setattr(linalg_module, "left_singular_pairs",
                        lambda m, gram: shapes.append(tuple(m.shape)) or original(m, gram=gram))
    new = sqrt_covariance_update(a, LowRank(left, right))
    assert shapes == [(route_rows, n)]
    torch.testing.assert_close(new, sqrt_covariance_update(a, LowRank(dense=left.T @ right)), atol=1e-10, rtol=1e-10)


def test_low_rank_identical_left_sums_right_factors(gen):
    n = 6
    left = torch.randn(2, n, generator=gen, dtype=F64)
    r1, r2 = torch.randn(2, n, generator=gen, dtype=F64), torch.randn(2, n, generator=gen, dtype=F64)
    acc = LowRank()
    acc.add(left, r1)
    acc.add(left, r2)  # the same tensor object: no growth in rank
    assert acc.rank == 2 and acc.dense is None
    torch.testing.assert_close(acc.right, r1 + r2)
    torch.testing.assert_close(acc.to_dense(), left.T @ r1 + left.T @ r2)
    acc.add(left.clone(), r1)  # an equal but distinct tensor is appended
    assert acc.rank == 4
    torch.testing.assert_close(acc.to_dense(), left.T @ (2 * r1 + r2))
    scaled = acc.scaled(2.0)
    assert scaled.dense is None
    torch.testing.assert_close(scaled.to_dense(), 2 * acc.to_dense())


@pytest.mark.parametrize("seed", range(4))
def test_update_never_increases_covariance(seed):
    g = make_generator(200 + seed)
    n = 6
    a = random_sqrt(n, g)
    t = torch.randn(n, n, generator=g, dtype=F64) * 3
    new = sqrt_covariance_update(a, LowRank(dense=t))
    old_cov, new_cov = a @ a.T, new @ new.T
    eig = torch.linalg.eigvalsh(old_cov - new_cov)
    assert eig.min() >= -1e-10 * torch.linalg.eigvalsh(old_cov).max()
    assert eig.max() > 1e-3  # and a nonzero T does shrink it


@pytest.mark.parametrize("seed", range(3))
def test_symmetric_psd_t_in_frame_of_a_gives_matrix_diagonal_formula(seed):
    """T = H A (H symmetric PSD, A symmetric): N = A H A and A_new A_new^T = A (sqrt(I + N^2/4) - N/2)^2 A."""
    g = make_generator(300 + seed)
    n = 5
    a = random_spd(n, g)
    root = torch.randn(n, 3, generator=g, dtype=F64)
    h = root @ root.T  # PSD, rank 3
    new = sqrt_covariance_update(a, LowRank(dense=h @ a))
    w, v = torch.linalg.eigh(a @ h @ a)
    w = w.clamp_min(0)
    scale = (v * (torch.sqrt(1 + w**2 / 4) - w / 2)) @ v.T
    expected = a @ scale @ scale @ a.T
    torch.testing.assert_close(new @ new.T, expected, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("rank", [2, 40])
def test_also_scaled_is_the_solution_for_the_scaled_statistic(rank):
    """One decomposition gives the solutions for T and for r T (the implicit mean step's tempered covariance)."""
    gen = make_generator(3)
    a = random_sqrt(30, gen).to(torch.float64)
    t = LowRank()
    t.add(torch.randn(rank, 30, generator=gen, dtype=torch.float64), torch.randn(rank, 30, generator=gen,
                                                                                  dtype=torch.float64))
    new, scaled = sqrt_covariance_update(a, t, also_scaled=2.5)
    torch.testing.assert_close(new, sqrt_covariance_update(a, t))
    want = sqrt_covariance_update(a, t.scaled(2.5))
    torch.testing.assert_close(scaled @ scaled.T, want @ want.T)


def test_prior_swapped_closed_forms():
    """1 / (1/s - 1/v0 + 1/V): the prior itself becomes the new prior, a variance far below both stays, 0 stays 0,
    and a variance above the prior (the diagonal family's sigma may grow) is taken as the prior, never made smaller."""
    prior, new_prior = torch.tensor(0.1), torch.tensor(0.4)
    variances = torch.tensor([0.1, 1e-6, 0.0, 0.3, 0.05, 0.5], dtype=torch.float64)
    swapped = prior_swapped(variances, prior, new_prior)
    assert swapped[0] == pytest.approx(0.4)
    assert swapped[1] == pytest.approx(1e-6, rel=1e-5)
    assert swapped[2] == 0
    assert swapped[3] == pytest.approx(0.4)
    assert swapped[4] == pytest.approx(1 / (20 - 10 + 2.5))
    assert swapped[5] == 0.5  # above the new prior as well: the variance itself
    assert swapped.dtype == torch.float64


def test_prior_swapped_products_match_the_dense_covariance(gen):
    """The eigenbasis routes against (Sigma^-1 - 1/v0 + 1/V)^-1 formed densely, for Sigma = A A^T and for the
    Kronecker product of two factors (the mean's p x n layout, row-major: B B^T (x) A A^T)."""
    prior, new_prior = torch.tensor(1.0, dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64)

    def shrunk(n: int) -> torch.Tensor:  # a square root with A A^T <= I, as Lemma 2 leaves a prior of variance 1
        q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
        return q * torch.rand(n, generator=gen, dtype=torch.float64).mul(0.9).add(0.05)

    def dense(sigma: torch.Tensor) -> torch.Tensor:
        eye = torch.eye(len(sigma), dtype=torch.float64)
        return torch.linalg.inv(torch.linalg.inv(sigma) - eye / prior + eye / new_prior)

    a, b = shrunk(5), shrunk(3)
    vector = torch.randn(5, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(prior_swapped_product(vector, a, prior, new_prior), dense(a @ a.T) @ vector)
    matrix = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    expected = (dense(torch.kron(b @ b.T, a @ a.T)) @ matrix.flatten()).reshape(3, 5)
    torch.testing.assert_close(prior_swapped_kronecker_product(matrix, a, b, prior, new_prior), expected)
