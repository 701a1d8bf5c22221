"""Probe (issue 38 item 2): MESU's update rule run inside FOO-VB's diagonal engine, one ingredient at a time.

python scripts/mesu_bridge_probe.py OUT [--init mesu|default] [--std-rule mesu|root] [--set key=value ...]
(from the repository root)

Runs configs/mesu_protocol_foovb_diagonal.yaml at 2 epochs per task (docs/results.md, "MESU on its own protocol"),
antithetic pairs off (MESU draws K independent samples), with every diagonal block's UPDATE replaced by MESU's
(`foovb_suite.mesu.mesu_update` with the settings of configs/mesu_protocol_mesu.yaml: eta_mu 0.46, eta_sigma 1.58,
prior N(0, 0.02^2), memory 5.8e6 batches, both gradient estimates clipped to 1/sigma). Same network, batch, K,
sampling and statistics (E[g] = sum_k g_k / K, E[g eps]) as FOO-VB: if this reproduces MESU's accuracy, the gap
between the two learners lies in the update rule and its settings, and the options below take one ingredient
back to FOO-VB's:
  --init mesu     (default) MESU's initialisation: means U(+-4/sqrt(fan_in)), sigma 2/sqrt(fan_in) per layer;
  --init default  FOOVB(model)'s: torch's initial weights, sigma sqrt(2/(fan_in+fan_out)) per layer;
  --std-rule mesu (default) MESU's sigma step, which can widen sigma;
  --std-rule root FOO-VB's (Lemma 2's root with beta = --set learner.params.cov_step, default 0.3), which only
                  contracts sigma; MESU's clipped mean step kept.
A probe, not a library option. Resume a stopped probe with its own command plus --resume (the command that
`foovb run` prints would resume without the patch).
"""

import argparse
import sys

from mesu_prior_probe import use_mesu_initialisation  # this directory, first on sys.path when run as a script

from foovb.linalg import root_scale
from foovb.posteriors import DiagonalBlock
from foovb_suite.cli import main
from foovb_suite.mesu import mesu_update

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--init", choices=["mesu", "default"], default="mesu")
parser.add_argument("--std-rule", choices=["mesu", "root"], default="mesu")
args, overrides = parser.parse_known_args()
MESU = {"mean_step": 0.46, "std_step": 1.58, "prior_mean": 0.0, "prior_std": 0.02, "memory": 5.8e6, "clip": 1.0}


def mesu_block_update(self, stats, num_samples, mean_step, cov_step):
    std = self.state["std"]
    grad_mean, grad_std = stats["grad_sum"] / num_samples, stats["grad_noise_sum"] / num_samples
    new_mean, new_std = mesu_update(self.state["mean"], std, grad_mean, grad_std, **MESU)
    self.state["mean"].copy_(new_mean)
    if args.std_rule == "mesu":
        std.copy_(new_std.abs())  # N(mu, sigma^2) depends on sigma^2 only (foovb_suite.mesu)
    else:
        std.mul_(root_scale((std * grad_std * cov_step).abs_()))


DiagonalBlock.update = mesu_block_update
if args.init == "mesu":
    use_mesu_initialisation(means=True)

sys.argv = ["foovb", "run", "configs/mesu_protocol_foovb_diagonal.yaml", "--out", args.out, "--no-progress",
            "--set", "threads=1", "--set", "scenario.epochs_per_task=2", "--set", "learner.params.antithetic=false",
            *overrides]
sys.exit(main())
