"""The robustness grid with `FOOVB(model)`'s "auto" family giving diagonal blocks to layers of more than 512 outputs
(issue 54, session 48: the lead on the autoencoder cells; docs/results/robustness_grid.md, "A lead: the autoencoder's
output layer"). The grid's matrix-variate learner runs as posterior="auto" (the same blocks on every model of the grid
but the autoencoder, whose 32 -> 784 output layer becomes diagonal); everything else is
`benchmarks/robustness_grid.py`, whose arguments this takes (its spawn workers import this module as their main
module, so the patch applies in them too):

    python scripts/wide_output_probe.py --out runs/grid48ae --cells autoencoder/permuted/16,autoencoder/permuted/64,\\
        autoencoder/permuted/256 --seeds 0 --examples 3072 --jobs 1 --learners foovb_kronecker --tag auto_wideout_diag
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import robustness_grid as grid  # noqa: E402

import foovb.priors as priors  # noqa: E402
from foovb import FOOVB  # noqa: E402

MAX_OUTPUTS = 512
library_rule = priors.affordable_matrix_variate


def affordable_and_narrow(module) -> bool:
    """The library's rule, and at most MAX_OUTPUTS outputs."""
    return library_rule(module) and module.weight.shape[0] <= MAX_OUTPUTS


def auto_learner(model, family: str, **settings) -> FOOVB:
    """The grid's kronecker learner as posterior="auto"."""
    return FOOVB(model, "auto" if family == "kronecker" else family, **settings)


priors.affordable_matrix_variate = affordable_and_narrow
grid.FOOVB = auto_learner

if __name__ == "__main__":
    grid.main()
