"""The robustness grid with cheaper forms of step_prior's matrix-variate mean step (issue 54, session 44;
docs/results/step_prior.md), chosen by the tag:

`FOOVB(..., step_prior=K)` takes every matrix-variate mean step with f(Sigma) = (Sigma^-1 - 1/v0 + 1/(K v0))^-1,
Sigma = S_out (x) S_in, in the eigenbases of both factors: two symmetric eigendecompositions per layer and step (3.9
times the default step on a 1024-100-100-10 MLP at batch 128).

* a tag with `sp16f` (factored; rejected): f_out(S_out) E f_in(S_in), f_x(S) = S (I - c S)^-1, c = 1 / sqrt(v0) -
  1 / sqrt(K v0), each factor's prior sqrt(v0) (the family splits the prior evenly) swapped for sqrt(K v0): K v0
  where neither factor has measured a direction (as the exact form), the algorithm's step where both have, but up to
  K^1/2 times the exact form's where one has and the other not. One Cholesky factorisation of I - c S per factor
  (eigenvalues in [K^-1/2, 1]: Lemma 2 never lets a factor grow) and two triangular solves.
* a tag with `sp16n512` (narrow): the exact form on layers whose two factors are at most 512 wide, the algorithm's
  step on wider ones (the eigendecompositions of the wide input factors are the cost); `sp16n512b` (narrow, body):
  the same, and no step prior on the model's last block (its output layer); `sp16n512h2`: the output layer's step
  prior 2 (any number after the h) instead.

Diagonal blocks keep the exact elementwise form. Everything else is `benchmarks/robustness_grid.py`, whose arguments
this takes (the candidate's JSON must hold step_prior):

    python scripts/step_prior_forms_probe.py --out runs/grid_calib --half tuning --seeds 0 --examples 3072 \\
        --tag kron_sp16n512_secant --kronecker '{"step_prior": 16, "secant_check": true}' --learners foovb_kronecker

`python scripts/step_prior_forms_probe.py suite-factored run two_tasks.yaml --set learner.params.step_prior=16` runs
the suite's command line with the factored form instead (docs/suite.md's two-task example). The grid's workers get
the parent's arguments and import this module as their main module, so the patch below applies in them too.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import robustness_grid as grid  # noqa: E402

import foovb.optimizer  # noqa: E402
import foovb.posteriors  # noqa: E402
from foovb.calibration import widen_step_prior  # noqa: E402
from foovb.linalg import prior_swapped_kronecker_product  # noqa: E402


def factor_step(sqrt_cov: Tensor, prior: Tensor, new_prior: Tensor, matrix: Tensor) -> Tensor:
    """f(S) matrix for S = sqrt_cov sqrt_cov^T, f(S) = S (I - c S)^-1, c = 1 / prior - 1 / new_prior."""
    s = sqrt_cov @ sqrt_cov.T
    shifted = torch.eye(len(s), dtype=s.dtype, device=s.device) - (1 / prior - 1 / new_prior).to(s.dtype) * s
    return s @ torch.cholesky_solve(matrix, torch.linalg.cholesky(shifted))


def factored_product(matrix: Tensor, input_sqrt_cov: Tensor, output_sqrt_cov: Tensor, prior: Tensor,
                     new_prior: Tensor) -> Tensor:
    left = factor_step(output_sqrt_cov, prior.sqrt(), new_prior.sqrt(), matrix)
    return factor_step(input_sqrt_cov, prior.sqrt(), new_prior.sqrt(), left.T).T


def narrow_product(matrix: Tensor, input_sqrt_cov: Tensor, output_sqrt_cov: Tensor, prior: Tensor,
                   new_prior: Tensor) -> Tensor:
    if max(len(input_sqrt_cov), len(output_sqrt_cov)) > 512:  # the algorithm's step, B B^T E A A^T
        return output_sqrt_cov @ (output_sqrt_cov.T @ matrix @ input_sqrt_cov) @ input_sqrt_cov.T
    return prior_swapped_kronecker_product(matrix, input_sqrt_cov, output_sqrt_cov, prior, new_prior)


def body_only(blocks: list) -> list:
    """step_prior on every block but the last (the output layer, in the model's parameter order)."""
    return list(blocks[:-1])


def other_head(blocks: list, factor: float, head_factor: float) -> None:
    """step_prior `factor` on every block but the last, `head_factor` on the last (the output layer)."""
    widen_step_prior(blocks[:-1], factor)
    if head_factor > 1:
        widen_step_prior(blocks[-1:], head_factor)


def use_product(product: object) -> None:
    """KroneckerBlock's step_prior mean step taken by product(matrix, A, B, v0, V), A and B the step's factors (the
    library's eigendecompositions bypassed)."""
    foovb.posteriors.refreshed_factor_eigh = lambda sqrt_cov, *_: sqrt_cov
    foovb.posteriors.prior_swapped_in_eigenbases = product


# the probes' forms choose their own blocks: every one (the library since session 45: `step_prior_blocks`)
foovb.optimizer.step_prior_blocks = list
if sys.argv[1:2] == ["suite-factored"] or re.search(r"--tag\S*\s+\S*sp16f", " ".join(sys.argv)):
    use_product(factored_product)
elif re.search(r"--tag\S*\s+\S*sp16n512", " ".join(sys.argv)):
    use_product(narrow_product)
    if re.search(r"--tag\S*\s+\S*sp16n512b", " ".join(sys.argv)):
        foovb.optimizer.step_prior_blocks = body_only
    elif head := re.search(r"--tag\S*\s+\S*sp16n512h(\d+(?:\.\d+)?)", " ".join(sys.argv)):
        foovb.optimizer.widen_step_prior = functools.partial(other_head, head_factor=float(head.group(1)))
elif __name__ == "__main__":
    sys.exit("step_prior_forms_probe.py: error: --tag must name the form (sp16f or sp16n512)")

if __name__ == "__main__":
    if sys.argv[1:2] == ["suite-factored"]:
        from foovb_suite.cli import main

        sys.exit(main(sys.argv[2:]))
    grid.main()
