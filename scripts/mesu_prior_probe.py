"""Probe (issue 38 item 2): MESU's initialisation given to FOO-VB's diagonal family on MESU's protocol.

python scripts/mesu_prior_probe.py {std,both} OUT [--set key=value ...]   (from the repository root)

Runs configs/mesu_protocol_foovb_diagonal.yaml at 2 epochs per task (docs/results.md, "MESU on its own protocol")
with the default prior changed to MESU's (src/foovb_suite/mesu.py, init="mesu"):
  std:  each layer's prior std 2 / sqrt(fan_in) instead of sqrt(2 / (fan_in + fan_out)); torch's initial weights;
  both: that std, and the initial weights (prior means) drawn from U(-4 / sqrt(fan_in), 4 / sqrt(fan_in)).
A probe, not a library option.
"""

import math
import sys

import torch
from torch import nn

import foovb.priors
from foovb_suite.cli import main


def mesu_std(param: torch.Tensor, module: nn.Module | None = None) -> float:
    return 2 / math.sqrt(param[0].numel() if param.dim() > 1 else param.numel())


def mesu_weights(self: nn.Linear) -> None:
    bound = 4 / math.sqrt(self.in_features)
    nn.init.uniform_(self.weight, -bound, bound)
    if self.bias is not None:
        nn.init.uniform_(self.bias, -bound, bound)


def use_mesu_initialisation(*, means: bool) -> None:
    """Each layer's prior std 2 / sqrt(fan_in); with `means`, nn.Linear weights drawn from U(+-4 / sqrt(fan_in))."""
    foovb.priors.xavier_std = mesu_std  # what std_init="xavier" (the default) resolves each layer's std with
    if means:
        nn.Linear.reset_parameters = mesu_weights


if __name__ == "__main__":
    variant = sys.argv[1]
    if variant not in ("std", "both"):
        raise SystemExit("first argument: std or both")
    use_mesu_initialisation(means=variant == "both")
    sys.argv = ["foovb", "run", "configs/mesu_protocol_foovb_diagonal.yaml", "--out", sys.argv[2], "--no-progress",
                "--set", "threads=1", "--set", "scenario.epochs_per_task=2", *sys.argv[3:]]
    sys.exit(main())
