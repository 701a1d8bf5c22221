"""The robustness grid with step_prior's width limit lifted, and a cheaper way to take the wide layers'
eigendecompositions (issue 54, session 46; docs/results/step_prior.md, "Session 46"). Set by environment variables,
which the grid's spawn workers inherit (they import this module as their main module, so the patch applies in them
too):

* PROBE_MAX_WIDTH: `foovb.calibration.STEP_PRIOR_MAX_FEATURES` (the most inputs or outputs widened; 100000 lifts
  the limit);
* PROBE_DELTA > 0: the eigendecompositions of matrix-variate factors wider than 512 are cached per block and refreshed
  only when the spectral norm of A - A_ref (A the factor's square root, A_ref the one at the last refresh; power
  iteration) exceeds PROBE_DELTA times A_ref's (the library's rule since session 47, `foovb.linalg.
  refreshed_factor_eigh`, with PROBE_DELTA as its REFRESH_TOLERANCE); PROBE_REFRESH = T > 0 instead refreshes every T
  steps of the block (PROBE_RAYLEIGH=1: with the stale basis's eigenvalues taken afresh every step, ||A^T u_i||^2).
  Neither: exact, every factor decomposed every step.

Every run's record gets `probe_wide_refresh_fraction`, the share of the wide factors' steps that recomputed their
eigendecomposition. Everything else is `benchmarks/robustness_grid.py`, whose arguments this takes:

    PROBE_MAX_WIDTH=100000 PROBE_DELTA=0.1 python scripts/step_prior_width_probe.py --out runs/grid_calib \\
        --half tuning --seeds 0 --examples 3072 --tag kron_sp16b_d01_secant --learners foovb_kronecker

`python scripts/step_prior_width_probe.py suite run CONFIG ...` runs the suite's command line with the patch instead,
and prints the refresh fraction at the end.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import robustness_grid as grid  # noqa: E402

import foovb.calibration  # noqa: E402
import foovb.linalg  # noqa: E402
import foovb.posteriors as posteriors  # noqa: E402
from foovb.linalg import EighCache, factor_eigh, refreshed_factor_eigh  # noqa: E402

WIDE = foovb.linalg.WIDE_FACTOR  # wider factors take the cached eigendecomposition
foovb.calibration.STEP_PRIOR_MAX_FEATURES = int(os.environ.get("PROBE_MAX_WIDTH",
                                                             foovb.calibration.STEP_PRIOR_MAX_FEATURES))
REFRESH = int(os.environ.get("PROBE_REFRESH", "0"))
DELTA = float(os.environ.get("PROBE_DELTA", "0"))
RAYLEIGH = os.environ.get("PROBE_RAYLEIGH") == "1"
COUNTS = {"calls": 0, "refreshes": 0}
STEPS: dict[int, int] = {}  # PROBE_REFRESH: the steps each cache has seen


def counted_eigh(sqrt_cov: Tensor) -> tuple[Tensor, Tensor]:
    """`foovb.linalg.factor_eigh`, counting the wide factors' decompositions."""
    COUNTS["refreshes"] += len(sqrt_cov) > WIDE
    return factor_eigh(sqrt_cov)


def every_t_steps(sqrt_cov: Tensor, state: dict, key: str, cache: EighCache) -> tuple[Tensor, Tensor]:
    """PROBE_REFRESH: a wide factor's decomposition refreshed every T steps of its block (optionally its eigenvalues
    taken afresh in the stale basis every step)."""
    if len(sqrt_cov) <= WIDE:
        return factor_eigh(sqrt_cov)
    count = STEPS[id(cache)] = STEPS.get(id(cache), -1) + 1
    if count % REFRESH == 0:
        cache.eigh = counted_eigh(sqrt_cov)
    values, vectors = cache.eigh
    if RAYLEIGH:
        values = (vectors.T @ sqrt_cov.double()).square().sum(1)
    return values, vectors


def counted_refreshed_eigh(sqrt_cov: Tensor, state: dict, key: str, cache: EighCache) -> tuple[Tensor, Tensor]:
    """The mean step's factor decompositions, by the probe's rule, counting the wide factors' calls."""
    COUNTS["calls"] += len(sqrt_cov) > WIDE
    if REFRESH > 0:
        return every_t_steps(sqrt_cov, state, key, cache)
    if DELTA > 0:
        return refreshed_factor_eigh(sqrt_cov, state, key, cache, DELTA)
    return counted_eigh(sqrt_cov)  # exact


original_run_one = grid.run_one


def counted_run_one(job: dict) -> dict:
    COUNTS.update(calls=0, refreshes=0)
    record = original_run_one(job)
    record["probe_wide_refresh_fraction"] = COUNTS["refreshes"] / max(COUNTS["calls"], 1)
    return record


foovb.linalg.factor_eigh = counted_eigh
posteriors.refreshed_factor_eigh = counted_refreshed_eigh
grid.run_one = counted_run_one

if __name__ == "__main__":
    print(f"STEP_PRIOR_MAX_FEATURES {foovb.calibration.STEP_PRIOR_MAX_FEATURES}, refresh every {REFRESH}, "
          f"delta {DELTA}, "
          f"rayleigh {RAYLEIGH}", flush=True)
    if sys.argv[1:2] == ["suite"]:
        from foovb_suite.cli import main

        code = main(sys.argv[2:])
        print(f"wide-factor refresh fraction {COUNTS['refreshes'] / max(COUNTS['calls'], 1):.4f} ({COUNTS})")
        sys.exit(code)
    grid.main()
