"""The robustness grid with the output factor statistic E3 kept to its diagonal in every matrix-variate layer
(MODE=all) or in the output layer only (MODE=last, what `diagonal_output_factor=True` does), issue 54, session 49
(docs/results/output_factor.md). The grid's `FOOVB(model)` learner is built with `diagonal_output_factor=False` and
the chosen blocks' E3 is cut to its diagonal before the update; everything else is `benchmarks/robustness_grid.py`,
whose arguments this takes (its spawn workers import this module as their main module, so the patch applies there):

    MODE=all python scripts/output_factor_probe.py --out runs/grid48 --half tuning --seeds 0 --examples 3072 \\
        --jobs 1 --learners foovb_kronecker --tag kron_diagE3_all
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import robustness_grid as grid  # noqa: E402

from foovb import FOOVB  # noqa: E402
from foovb.posteriors import KroneckerBlock  # noqa: E402

MODE = os.environ.get("MODE", "all")
library_update = KroneckerBlock.update


def update_with_diagonal_e3(self: KroneckerBlock, stats: dict, num_samples: int, mean_step: float,
                            cov_step: float) -> None:
    """The library's update, with sum_k Psi_k A Phi_k^T cut to its diagonal in the marked blocks."""
    if getattr(self, "probe_diagonal_e3", False):
        stats["psi_a_phi"] = torch.diag(torch.diagonal(stats["psi_a_phi"]))
    library_update(self, stats, num_samples, mean_step, cov_step)


def probe_learner(model, family: str, **settings) -> FOOVB:
    """The grid's learner with the full output factor in the library, the diagonal E3 marked by MODE."""
    optimizer = FOOVB(model, family, diagonal_output_factor=False, **settings)
    matrix_variate = [block for block in optimizer.blocks if isinstance(block, KroneckerBlock)]
    for block in matrix_variate[-1:] if MODE == "last" else matrix_variate:
        block.probe_diagonal_e3 = True
    return optimizer


KroneckerBlock.update = update_with_diagonal_e3
grid.FOOVB = probe_learner

if __name__ == "__main__":
    grid.main()
