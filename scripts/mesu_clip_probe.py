"""Probe (issue 38 item 2): MESU's gradient clipping to [-c/sigma, c/sigma] applied to FOO-VB's diagonal update.

python scripts/mesu_clip_probe.py CLIP OUT [--set key=value ...]   (from the repository root)

Runs configs/mesu_protocol_foovb_diagonal.yaml at 2 epochs per task with both gradient estimates of the diagonal
update, E[g] and E[g eps], clipped to [-CLIP/sigma, CLIP/sigma] per weight (docs/results.md, "MESU on its own
protocol"); `--set learner.params.std_growth=paper` lets sigma widen where E[g eps] < 0, as MESU's sigma step does.
A probe, not a library option.
"""

import sys

import torch

from foovb.linalg import root_scale, signed_root_scale
from foovb.posteriors import DiagonalBlock
from foovb_suite.cli import main

clip = float(sys.argv[1])


def clipped_update(self, stats, num_samples, mean_step, cov_step):
    std = self.state["std"]
    bound = clip / std
    grad_mean = torch.maximum(torch.minimum(stats["grad_sum"] / num_samples, bound), -bound)
    grad_noise_mean = torch.maximum(torch.minimum(stats["grad_noise_sum"] / num_samples, bound), -bound)
    self.state["mean"].addcmul_(std.square(), grad_mean, value=-mean_step)
    assert not self.cov_momentum
    if self.std_growth == "none":  # Lemma 2's root: sigma only contracts
        std.mul_(root_scale((std * grad_noise_mean * cov_step).abs_()))
    else:  # --set learner.params.std_growth=paper (or capped): the positive root, which widens sigma where E[g eps] < 0
        std.mul_(signed_root_scale(std * grad_noise_mean * cov_step))
        if self.std_growth == "capped":
            std.clamp_(max=self.std_init)


DiagonalBlock.update = clipped_update
sys.argv = ["foovb", "run", "configs/mesu_protocol_foovb_diagonal.yaml", "--out", sys.argv[2], "--no-progress",
            "--set", "threads=1", "--set", "scenario.epochs_per_task=2", *sys.argv[3:]]
sys.exit(main())
