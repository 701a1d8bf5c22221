"""The robustness grid with step_prior's width limit lifted, and a cheaper way to take the wide layers'
eigendecompositions (issue 54, session 46; docs/results/step_prior.md, "Session 46"). Set by environment variables,
which the grid's spawn workers inherit (they import this module as their main module, so the patch applies in them
too):

* PROBE_MAX_WIDTH: `foovb.calibration.STEP_PRIOR_MAX_WIDTH` (the library's 512; 100000 lifts the limit);
* PROBE_DELTA > 0: the eigendecompositions of matrix-variate factors wider than 512 are cached per block and refreshed
  only when the spectral norm of A - A_ref (A the factor's square root, A_ref the one at the last refresh; power
  iteration) exceeds PROBE_DELTA times A_ref's; PROBE_REFRESH = T > 0 instead refreshes every T steps of the block
  (PROBE_RAYLEIGH=1: with the stale basis's eigenvalues taken afresh every step, ||A^T u_i||^2). Neither: exact.

Every run's record gets `probe_wide_refresh_fraction`, the share of the wide factors' steps that recomputed their
eigendecomposition. Everything else is `benchmarks/robustness_grid.py`, whose arguments this takes:

    PROBE_MAX_WIDTH=100000 PROBE_DELTA=0.1 python scripts/step_prior_width_probe.py --out runs/grid_calib \\
        --half tuning --seeds 0 --examples 3072 --tag kron_sp16b_d01_secant --learners foovb_kronecker

`python scripts/step_prior_width_probe.py suite run CONFIG ...` runs the suite's command line with the patch instead,
and prints the refresh fraction at the end.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import robustness_grid as grid  # noqa: E402

import foovb.calibration  # noqa: E402
import foovb.posteriors as posteriors  # noqa: E402
from foovb.linalg import factor_eigh, prior_swapped_in_eigenbases  # noqa: E402
from foovb.linalg import prior_swapped_kronecker_product as exact_product  # noqa: E402

WIDE = foovb.calibration.STEP_PRIOR_MAX_WIDTH  # the library's limit: wider factors take the cached eigendecomposition
foovb.calibration.STEP_PRIOR_MAX_WIDTH = int(os.environ.get("PROBE_MAX_WIDTH", foovb.calibration.STEP_PRIOR_MAX_WIDTH))
REFRESH = int(os.environ.get("PROBE_REFRESH", "0"))
DELTA = float(os.environ.get("PROBE_DELTA", "0"))
RAYLEIGH = os.environ.get("PROBE_RAYLEIGH") == "1"
COUNTS = {"calls": 0, "refreshes": 0}


def spectral_norm(matrix: Tensor, iterations: int = 8) -> float:
    """||matrix||_2 by power iteration on matrix^T matrix (a few matrix-vector products)."""
    v = torch.ones(matrix.shape[1], dtype=matrix.dtype) / matrix.shape[1] ** 0.5
    for _ in range(iterations):
        v = matrix.T @ (matrix @ v)
        v = v / v.norm().clamp_min(1e-30)
    return float((matrix @ v).norm())


def eigh(block: object, name: str, sqrt_cov: Tensor) -> tuple[Tensor, Tensor]:
    """The factor's eigendecomposition: exact for narrow factors, cached and refreshed by the rule for wide ones."""
    cache = block.__dict__.setdefault("_probe_cache", {})
    count = cache.get(name + "_count", 0)
    cache[name + "_count"] = count + 1
    wide = len(sqrt_cov) > WIDE
    COUNTS["calls"] += wide
    if DELTA > 0:
        reference = cache.get(name + "_reference")
        stale = reference is None or spectral_norm(sqrt_cov - reference) > DELTA * cache[name + "_norm"]
    else:
        stale = REFRESH <= 0 or count % REFRESH == 0
    if not wide or stale:
        values, vectors = factor_eigh(sqrt_cov)
        cache[name], cache[name + "_reference"] = (values, vectors), sqrt_cov.clone()
        cache[name + "_norm"] = float(values.max().clamp_min(0).sqrt())
        COUNTS["refreshes"] += wide
        return values, vectors
    values, vectors = cache[name]
    if RAYLEIGH:
        values = (vectors.T @ sqrt_cov.double()).square().sum(1)
    return values, vectors


def cached_product(block: object, matrix: Tensor, input_sqrt_cov: Tensor, output_sqrt_cov: Tensor, prior: Tensor,
                   new_prior: Tensor) -> Tensor:
    """`foovb.linalg.prior_swapped_kronecker_product` with the eigendecompositions of `eigh`."""
    return prior_swapped_in_eigenbases(matrix, eigh(block, "input", input_sqrt_cov),
                                       eigh(block, "output", output_sqrt_cov), prior, new_prior)


original_update = posteriors.KroneckerBlock.update


def update(self: posteriors.KroneckerBlock, stats: dict, num_samples: int, mean_step: float, cov_step: float) -> None:
    posteriors.prior_swapped_kronecker_product = functools.partial(cached_product, self)
    try:
        original_update(self, stats, num_samples, mean_step, cov_step)
    finally:
        posteriors.prior_swapped_kronecker_product = exact_product


original_run_one = grid.run_one


def counted_run_one(job: dict) -> dict:
    COUNTS.update(calls=0, refreshes=0)
    record = original_run_one(job)
    record["probe_wide_refresh_fraction"] = COUNTS["refreshes"] / max(COUNTS["calls"], 1)
    return record


if DELTA > 0 or REFRESH > 0:
    posteriors.KroneckerBlock.update = update
grid.run_one = counted_run_one

if __name__ == "__main__":
    print(f"STEP_PRIOR_MAX_WIDTH {foovb.calibration.STEP_PRIOR_MAX_WIDTH}, refresh every {REFRESH}, delta {DELTA}, "
          f"rayleigh {RAYLEIGH}", flush=True)
    if sys.argv[1:2] == ["suite"]:
        from foovb_suite.cli import main

        code = main(sys.argv[2:])
        print(f"wide-factor refresh fraction {COUNTS['refreshes'] / max(COUNTS['calls'], 1):.4f} ({COUNTS})")
        sys.exit(code)
    grid.main()
