"""The robustness grid with step_prior's mean step taken per Kronecker factor: a cheaper form, tested and rejected
(issue 54, session 44; docs/results/default_probes.md).

`FOOVB(..., step_prior=K)` takes every matrix-variate mean step with f(Sigma) = (Sigma^-1 - 1/v0 + 1/(K v0))^-1,
Sigma = S_out (x) S_in, in the eigenbases of both factors: two symmetric eigendecompositions per layer and step (4.6
times the default step on a 1024-100-100-10 MLP at batch 128). This probe takes instead

    f_out(S_out) E f_in(S_in),   f_x(S) = S (I - c S)^-1,   c = 1 / sqrt(v0) - 1 / sqrt(K v0),

each factor's prior sqrt(v0) (the family splits the prior evenly) swapped for sqrt(K v0): K v0 where neither factor
has measured a direction (as the exact form), the algorithm's step where both have, but up to K^1/2 times the exact
form's where one factor has measured a direction and the other has not. Each f_x costs one Cholesky factorisation
of I - c S (its eigenvalues in [K^-1/2, 1]: Lemma 2 never lets a factor grow) and two triangular solves: about the
default step's time. Diagonal blocks keep the exact elementwise form. Everything else is
`benchmarks/robustness_grid.py`, whose arguments this takes (the candidate's JSON must hold step_prior):

    python scripts/factored_step_prior_probe.py --out runs/grid_calib --half tuning --seeds 0 --examples 3072 \\
        --tag kron_sp16f_secant --kronecker '{"step_prior": 16, "secant_check": true}' --learners foovb_kronecker

`python scripts/factored_step_prior_probe.py suite run two_tasks.yaml --set learner.params.step_prior=16` runs the
suite's command line with it instead (docs/suite.md's two-task example). The grid's workers import this module as
their main module, so the patch below applies in them too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import robustness_grid as grid  # noqa: E402

import foovb.posteriors  # noqa: E402


def factor_step(sqrt_cov: Tensor, prior: Tensor, new_prior: Tensor, matrix: Tensor) -> Tensor:
    """f(S) matrix for S = sqrt_cov sqrt_cov^T, f(S) = S (I - c S)^-1, c = 1 / prior - 1 / new_prior."""
    s = sqrt_cov @ sqrt_cov.T
    shifted = torch.eye(len(s), dtype=s.dtype, device=s.device) - (1 / prior - 1 / new_prior).to(s.dtype) * s
    return s @ torch.cholesky_solve(matrix, torch.linalg.cholesky(shifted))


def factored_product(matrix: Tensor, input_sqrt_cov: Tensor, output_sqrt_cov: Tensor, prior: Tensor,
                     new_prior: Tensor) -> Tensor:
    """f_out(S_out) matrix f_in(S_in): each factor's prior sqrt(v0) (the family splits it evenly at construction and
    Lemma 2 keeps each factor below it) swapped for sqrt(V)."""
    left = factor_step(output_sqrt_cov, prior.sqrt(), new_prior.sqrt(), matrix)
    return factor_step(input_sqrt_cov, prior.sqrt(), new_prior.sqrt(), left.T).T


foovb.posteriors.prior_swapped_kronecker_product = factored_product

if __name__ == "__main__":
    if sys.argv[1:2] == ["suite"]:  # `foovb ...` with the factored form, e.g. docs/suite.md's two-task example
        from foovb_suite.cli import main

        sys.exit(main(sys.argv[2:]))
    grid.main()
