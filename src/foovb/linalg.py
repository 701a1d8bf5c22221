"""Linear algebra of FOO-VB: the matrix fixed-point equation of Lemmas 1-2.

The covariance update of the multivariate (Algorithm 2) and matrix-variate (Algorithm 3) families needs a
solution X of the quadratic matrix equation (paper, Eq. "Matrix equation" of Lemma 1)

    X X^T + M T X^T - M = 0,        M = M^T > 0.

Lemma 1 gives the solutions X = D Q - 1/2 M T with D = (M + 1/4 M T T^T M)^(1/2), and Lemma 2 picks
Q = S W^T from the SVD of D^-1 M T.
Computing D^-1 is unstable when B = M + 1/4 M T T^T M is ill-conditioned (the reason for the paper's Lemma 3).
We use an equivalent route that never inverts an ill-conditioned matrix:

* Lemma 2's solution does not depend on which square root of B is used as D: if D' = D O (O orthogonal), the SVD of
  D'^-1 M T has left singular vectors O^T S, so D' Q' = D Q and X is unchanged.
* With any square root A of M (M = A A^T) and N = A^T T, the square root D' = A (I + 1/4 N N^T)^(1/2)
  gives, with the SVD N = U s W^T,

      X = A U h(s) W^T,     h(s) = sqrt(1 + s^2 / 4) - s / 2      (in (0, 1], so X is nonsingular).

  Substituting: X X^T + M T X^T - M = A U (h^2 + s h - 1) U^T A^T = 0, since h solves h^2 + s h - 1 = 0.

The optimizer stores square roots of covariances, and only the covariance X X^T matters for the posterior
(replacing A by A O leaves the distribution of theta = mu + A eps unchanged). It therefore uses
X Q^T = A U h(s) U^T = A (I + U (h(s) - 1) U^T), a function of N N^T only, which needs just the left singular
vectors of N. When T has rank r < n (T = L^T C, L, C: r x n), N = (L A)^T C and U, s follow from a thin QR
and the left singular pairs of an r x n matrix: O(n^2 r) instead of dense O(n^3) decompositions (see
`sqrt_covariance_update`).

A property worth knowing (tested): h(s) <= 1, so Lemma 2's solution never increases the covariance
(Sigma_new <= Sigma_old in the Loewner order). The diagonal family's closed form (Eq. "diagonal implicit
solution") takes the positive root instead and does increase sigma where E[g eps] < 0; the two agree
whenever T is symmetric positive semi-definite in the frame of A.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["LowRank", "left_singular_pairs", "root_scale", "signed_root_scale", "solve_fixed_point",
           "sqrt_covariance_update", "prior_swapped", "prior_swapped_product", "prior_swapped_kronecker_product",
           "factor_eigh", "prior_swapped_in_eigenbases", "spectral_norm", "EighCache", "refreshed_factor_eigh"]


def root_scale(singular_values: Tensor) -> Tensor:
    """h(s) = sqrt(1 + s^2/4) - s/2, the positive root of h^2 + s h - 1 = 0, written without cancellation as
    2 / (s + sqrt(4 + s^2)) (4 + s^2 in one pass: the diagonal update runs this on every weight)."""
    four = singular_values.new_tensor(4.0)
    return torch.addcmul(four, singular_values, singular_values).sqrt_().add_(singular_values).reciprocal_().mul_(2.0)


def signed_root_scale(x: Tensor) -> Tensor:
    """sqrt(1 + x^2/4) - x/2 for x of any sign, without cancellation and without branches (boolean masks cost
    more than the arithmetic here): with h = x/2, q = sqrt(1 + h^2), p = max(h, 0), n = min(h, 0), the value
    is (q - n) / (1 + p (q + p)): q - h for h < 0, and q / (1 + h q + h^2) = 1 / (q + h) for h >= 0."""
    half = 0.5 * x
    q = half.square().add_(1.0).sqrt_()
    positive = half.clamp_min(0.0)
    return (q - half.clamp_max_(0.0)).div_(torch.add(q, positive).mul_(positive).add_(1.0))


def _check_finite(name: str, value: Tensor) -> None:
    if not torch.isfinite(value).all():
        raise ValueError(f"{name} contains NaN or Inf")


def solve_fixed_point(M: Tensor, T: Tensor, *, symmetry_tol: float | None = None) -> Tensor:
    """Solve X X^T + M T X^T - M = 0 for X (Lemma 2's solution), stably.

    Args:
        M: symmetric positive definite (N, N) matrix (the prior covariance V in the paper).
        T: (N, N) matrix (the Monte Carlo estimate E[grad L(theta) eps^T]).
        symmetry_tol: allowed relative asymmetry of M; default max(1e-8, 4 sqrt(N) eps) for M's floating
            dtype (the rounding of a product of N terms), so that a float32 M symmetric up to its rounding is
            accepted.

    Returns:
        X (N, N), nonsingular, in the dtype of M. Computed in float64 as X = A U h(s) W^T, where M = A A^T
        (symmetric eigendecomposition) and N = A^T T = U s W^T; this equals Lemma 2's D Q - 1/2 M T
        (module docstring), without inverting the possibly ill-conditioned D (the role of Lemma 3).

    Raises:
        ValueError: non-square or mismatched shapes, NaN/Inf input, M not symmetric or not positive
            definite (then no solution exists: X X^T = M + ... requires M > 0).
    """
    if M.ndim != 2 or M.shape[0] != M.shape[1]:
        raise ValueError(f"M must be a square matrix, got shape {tuple(M.shape)}")
    if T.shape != M.shape:
        raise ValueError(f"T must have the shape of M {tuple(M.shape)}, got {tuple(T.shape)}")
    _check_finite("M", M)
    _check_finite("T", T)
    m64, t64 = M.to(torch.float64), T.to(torch.float64)
    if symmetry_tol is None:
        eps = torch.finfo(M.dtype if M.is_floating_point() else torch.float64).eps
        symmetry_tol = max(1e-8, 4 * math.sqrt(M.shape[0]) * eps)
    scale = m64.abs().max()
    if (m64 - m64.T).abs().max() > symmetry_tol * scale:
        raise ValueError("M must be symmetric")
    eigenvalues, eigenvectors = torch.linalg.eigh(m64)
    # eigenvalues within rounding of zero (n eps |lambda|_max) make M numerically singular
    if eigenvalues.min() <= M.shape[0] * torch.finfo(torch.float64).eps * eigenvalues.abs().max():
        raise ValueError(
            f"M must be positive definite (smallest eigenvalue {eigenvalues.min().item():.3e}); "
            "X X^T + M T X^T - M = 0 has no solution otherwise"
        )
    sqrt_m = eigenvectors * eigenvalues.sqrt()  # M = sqrt_m sqrt_m^T
    u, s, wh = torch.linalg.svd(sqrt_m.T @ t64)
    x = (sqrt_m @ u) * root_scale(s) @ wh
    return x.to(M.dtype)


# `sqrt_covariance_update` takes the dense route for a low-rank statistic of rank r > DENSE_FRACTION n.
# Measured (float32 factors, 1 thread): the low-rank update over the dense one is 0.5-0.65 at r = 0.6 n and
# 1.4-1.6 at r = 0.75 n for n = 76, 200 (a few ms either way); 0.8 at 0.75 n for n = 501 and 1251, then 1.5 at
# 0.9 n for n = 501 and 0.95 for n = 1251, 1.3-1.7 at r = 0.99 n.
DENSE_FRACTION = 0.85


@dataclass
class LowRank:
    """A matrix stored as T = left^T right (left, right: r x n), accumulated without forming the n x n product.

    FOO-VB's estimates of E[g eps^T] are sums of few outer products: rank K for the full family (K Monte Carlo
    samples) and rank r (batch rows) for the input factor of the first Linear layer of a matrix-variate model.
    Once the rank would reach n, the sum is collapsed to a dense matrix (kept in `dense`).
    """

    left: Tensor | None = None
    right: Tensor | None = None
    dense: Tensor | None = None

    @property
    def rank(self) -> int:
        return 0 if self.left is None else self.left.shape[0]

    def add(self, left: Tensor, right: Tensor) -> None:
        """T += left^T right (a left factor identical to the stored one adds to the right factor)."""
        if self.left is left:
            self.right = self.right + right
            return
        n = left.shape[1]
        if self.dense is None and self.rank + left.shape[0] < n:
            if self.left is None:
                self.left, self.right = left, right
            else:
                self.left = torch.cat([self.left, left])
                self.right = torch.cat([self.right, right])
            return
        product = left.T @ right
        self.dense = product if self.dense is None else self.dense + product
        if self.left is not None:
            self.dense += self.left.T @ self.right
            self.left = self.right = None

    def tensors(self) -> list[Tensor]:
        """The stored pieces (factors and/or dense part)."""
        return [t for t in (self.left, self.right, self.dense) if t is not None]

    def add_dense(self, matrix: Tensor) -> None:
        self.dense = matrix.clone() if self.dense is None else self.dense + matrix

    def to_dense(self) -> Tensor:
        out = self.dense
        if self.left is not None:
            low = self.left.T @ self.right
            out = low if out is None else out + low
        if out is None:
            raise ValueError("empty LowRank accumulator")
        return out

    def scaled(self, factor: float) -> LowRank:
        if self.dense is not None:
            return LowRank(dense=self.to_dense() * factor)
        return LowRank(self.left, self.right * factor)


def left_singular_pairs(matrix: Tensor, *, gram: bool) -> tuple[Tensor, Tensor]:
    """Left singular vectors U (m, m) and singular values s (m,) of an (m, p) matrix M with m <= p.

    `gram=False`: an SVD, accurate to about eps * s_max. `gram=True`: an eigendecomposition of the Gram matrix
    M M^T = U s^2 U^T, 2-3x faster at the sizes of the optimizer's layers but accurate only to about
    sqrt(eps) * s_max (1.5e-8 s_max in float64; tested): M M^T rounds the small s_i^2 by eps * s_max^2. The s_i
    are recomputed as ||M^T u_i||, which is never NaN (an eigenvalue can round below 0).
    """
    if not gram:
        u, s, _ = torch.linalg.svd(matrix, full_matrices=False)
        return u, s
    _, u = torch.linalg.eigh(matrix @ matrix.T)
    return u, torch.linalg.vector_norm(matrix.T @ u, dim=0)


def sqrt_covariance_update(sqrt_cov: Tensor, t: LowRank, *, dtype: torch.dtype = torch.float64,
                           gram: bool | None = None,
                           also_scaled: float | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """New square root of the covariance after one fixed-point step (Algorithms 2 and 3).

    Given the prior's square root A (V = A A^T) and T = E[g eps^T] (or the matrix-variate E2 / E3), returns
    A_new = A (I + U (h(s) - 1) U^T) where U, s are the left singular vectors / values of N = A^T T.
    A_new A_new^T = X X^T for Lemma 2's solution X of X X^T + V T X^T - V = 0 (see module docstring), so the
    posterior is the paper's. Uses a thin QR and the left singular pairs of an r x n matrix in O(n^2 r) when T
    is low rank (r <= DENSE_FRACTION n), those of N otherwise (`left_singular_pairs`). The decompositions run in
    `dtype` (float64); the O(n^2 r) and O(n r^2) products in A's own dtype, whose precision is that of the stored
    factor anyway. For a float32 A they use the Gram route: its error in A_new, about 1e-8 s_max relative (h is
    1-Lipschitz), stays below float32 rounding (6e-8) while s_max < 4 (the layers of the benchmarks stay below 2);
    a float64 A gets SVDs. `gram` overrides that choice. Measured at width 1000 (benchmarks/update_routes.py):
    decomposing in float32 makes the UPDATE 10% (SVD) to 36% (Gram) faster there but its error 2.5 to 33 times
    larger, beyond the tests' float32 bound (docs/performance.md), so it is not used. `also_scaled=r`: also returns
    the solution for r T, from the same decomposition (the singular values of A^T r T are r s).
    """
    if gram is None:
        gram = sqrt_cov.dtype != torch.float64  # Gram route for float32 / float16 factors
    a = sqrt_cov
    if t.dense is not None or t.rank > DENSE_FRACTION * a.shape[0]:  # the dense route, cheaper there
        u, s = left_singular_pairs((a.T @ t.to_dense().to(a.dtype)).to(dtype), gram=gram)
    else:
        # N = A^T L^T C = Z C with Z = (L A)^T (n x r); Z = Q_Z R_Z, so N = Q_Z (R_Z C), and the small r x n
        # matrix R_Z C gives N's nonzero singular values and left singular vectors Q_Z U_small.
        z = (t.left.to(a.dtype) @ a).T.to(dtype)
        q_z, r_z = torch.linalg.qr(z)
        core = (r_z.to(a.dtype) @ t.right.to(a.dtype)).to(dtype)  # O(n r^2) products in A's dtype, as z
        u_small, s = left_singular_pairs(core, gram=gram)
        u = q_z.to(a.dtype) @ u_small.to(a.dtype)
    u = u.to(a.dtype)
    a_u = a @ u
    new = a + (a_u * (root_scale(s) - 1.0).to(a.dtype)) @ u.T
    if also_scaled is None:
        return new
    return new, a + (a_u * (root_scale(s * also_scaled) - 1.0).to(a.dtype)) @ u.T


def diagonal_sqrt_covariance_update(sqrt_cov: Tensor, t: Tensor, *,
                                    also_scaled: float | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """`sqrt_covariance_update` for a diagonal square root A and the diagonal t of T (a vector): A^T diag(t) has
    singular values |A_ii t_i| along the axes, so the root is A_ii h(|A_ii t_i|) in closed form, no decomposition."""
    scale = sqrt_cov.diagonal()
    singular_values = (scale * t).abs()
    new = torch.diag(scale * root_scale(singular_values))
    if also_scaled is None:
        return new
    return new, torch.diag(scale * root_scale(singular_values * also_scaled))


def prior_swapped(variances: Tensor, prior: Tensor, new_prior: Tensor) -> Tensor:
    """1 / (1 / variances - 1 / prior + 1 / new_prior), elementwise, for `new_prior` >= `prior`: the eigenvalues of a
    posterior covariance whose isotropic prior variance `prior` is replaced by `new_prior` (calibrate_prior's and
    step_prior's mean step, `foovb.calibration`). A variance equal to `prior` becomes `new_prior`, one far below both
    stays as it is; one above `prior` (the diagonal family's sigma may grow) is taken as `prior`, never made
    smaller."""
    work = variances.float() if variances.dtype in (torch.float16, torch.bfloat16) else variances  # 1/v - 1/v0
    prior, new_prior = prior.to(work.dtype), new_prior.to(work.dtype)  # cancels: half precision loses it
    # in place on one temporary, scalars inverted once (3x faster than the expression on a layer's weights)
    swapped = torch.minimum(work, prior).reciprocal_().sub_(prior.reciprocal()).add_(new_prior.reciprocal())
    return torch.maximum(swapped.reciprocal_(), work, out=swapped).to(variances.dtype)


def factor_eigh(sqrt_cov: Tensor) -> tuple[Tensor, Tensor]:
    """The symmetric eigendecomposition (eigenvalues, eigenvectors) of A A^T in float64."""
    return torch.linalg.eigh((sqrt_cov @ sqrt_cov.T).double())


WIDE_FACTOR = 512  # wider matrix-variate factors take `refreshed_factor_eigh`'s cached eigendecomposition
REFRESH_TOLERANCE = 0.1  # ... refreshed when the factor moves by more than this, relative (spectral norm)


def spectral_norm(matrix: Tensor, iterations: int = 8) -> float:
    """||matrix||_2 by power iteration on matrix^T matrix from the all-ones vector (a few matrix-vector products:
    an estimate from below, close after 8 on the factors `refreshed_factor_eigh` compares)."""
    v = torch.ones(matrix.shape[1], dtype=matrix.dtype, device=matrix.device) / matrix.shape[1] ** 0.5
    for _ in range(iterations):
        v = matrix.T @ (matrix @ v)
        v = v / v.norm().clamp_min(1e-30)
    return float((matrix @ v).norm())


@dataclass
class EighCache:
    """`refreshed_factor_eigh`'s eigendecomposition of one factor, the tensor it was taken from and that tensor's
    in-place version then: a reference replaced (a load, an undone update) or changed in place is decomposed anew."""

    reference: Tensor | None = None
    version: int = -1
    eigh: tuple[Tensor, Tensor] | None = None

    def of(self, reference: Tensor) -> tuple[Tensor, Tensor]:
        """`factor_eigh`(reference), taken once per reference."""
        if self.reference is not reference or self.version != reference._version or self.eigh is None:
            self.reference, self.version, self.eigh = reference, reference._version, factor_eigh(reference)
        return self.eigh


def refreshed_factor_eigh(sqrt_cov: Tensor, state: dict, key: str, cache: EighCache,
                          tolerance: float = REFRESH_TOLERANCE) -> tuple[Tensor, Tensor]:
    """`factor_eigh`(sqrt_cov) for a factor of at most WIDE_FACTOR rows. A wider one's is refreshed only when the
    factor has moved: the eigendecomposition of state[key], the factor at the last refresh A_ref, as long as
    ||sqrt_cov - A_ref||_2 <= tolerance ||A_ref||_2 (`spectral_norm`); else sqrt_cov
    becomes state[key] and is decomposed. The reference lives in the block's state (a resumed run takes the same
    decompositions), the decomposition in `cache`. Taken exactly every step, the decompositions made step_prior's
    mean step on a 1024-100-100-10 MLP 3.7 times the algorithm's; on permuted MNIST the rule refreshed under 1% of
    the steps, on the exact form's accuracy (docs/results/step_prior.md, "Session 46")."""
    if len(sqrt_cov) <= WIDE_FACTOR:
        return factor_eigh(sqrt_cov)
    reference = state.get(key)
    if reference is not None:
        values, _ = cache.of(reference)
        if spectral_norm(sqrt_cov - reference) <= tolerance * float(values.max().clamp_min(0).sqrt()):
            return cache.eigh
    state[key] = sqrt_cov.clone()
    return cache.of(state[key])


def prior_swapped_product(vector: Tensor, sqrt_cov: Tensor, prior: Tensor, new_prior: Tensor) -> Tensor:
    """`prior_swapped`(Sigma) times `vector`, for Sigma = A A^T, in Sigma's eigenbasis (float64)."""
    variances, u = factor_eigh(sqrt_cov)
    product = u @ (prior_swapped(variances.clamp_min(0), prior, new_prior) * (u.T @ vector.double()))
    return product.to(vector.dtype)


def prior_swapped_kronecker_product(matrix: Tensor, input_sqrt_cov: Tensor, output_sqrt_cov: Tensor, prior: Tensor,
                                    new_prior: Tensor) -> Tensor:
    """`prior_swapped`(Sigma) times `matrix` (p x n) for Sigma = A A^T (x) B B^T, whose eigenvalues are the products of
    the factors' (float64): W ((W^T matrix U) * prior_swapped(mu lambda^T)) U^T."""
    return prior_swapped_in_eigenbases(matrix, factor_eigh(input_sqrt_cov), factor_eigh(output_sqrt_cov), prior,
                                       new_prior)


def prior_swapped_in_eigenbases(matrix: Tensor, input_eigh: tuple[Tensor, Tensor], output_eigh: tuple[Tensor, Tensor],
                                prior: Tensor, new_prior: Tensor) -> Tensor:
    """`prior_swapped_kronecker_product` from the factors' eigendecompositions (`factor_eigh`)."""
    (input_variances, u), (output_variances, w) = input_eigh, output_eigh
    products = (output_variances[:, None] * input_variances[None, :]).clamp_min(0)
    rotated = w.T @ matrix.double() @ u
    return (w @ (rotated * prior_swapped(products, prior, new_prior)) @ u.T).to(matrix.dtype)
