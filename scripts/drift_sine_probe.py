"""A drifting sine regression that is in neither the robustness grid nor the suite (session 45's user trial; issue
54): a 1-32-32-1 tanh net, y = sin(a x) on x ~ U(-3, 3), a = 1, 1.5, 0.7, 2 for 150 steps each at batch 256, mean
squared error; prints each phase's test MSE of the posterior mean at its end and their mean, per seed and setting.

    python scripts/drift_sine_probe.py SEED VARIANTS     # e.g. 0 new,old,sp_only,secant_only,sp4

Variants: `new` FOOVB(model) as it is; `old` the default before session 45 (step_prior=1, secant_check=False);
`sp_only` without the secant check; `secant_only` without the step prior; `sp4` step_prior=4
(docs/results/step_prior.md; output: docs/results/robustness_grid/drift_sine_probe.txt).
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

from foovb import FOOVB

VARIANTS = {"new": {}, "old": {"step_prior": 1, "secant_check": False}, "sp_only": {"secant_check": False},
            "secant_only": {"step_prior": 1}, "sp4": {"step_prior": 4}}
PHASES = (1.0, 1.5, 0.7, 2.0)
STEPS, BATCH = 150, 256


def main() -> None:
    torch.set_num_threads(1)
    seed, names = int(sys.argv[1]), sys.argv[2].split(",")
    test_x = torch.linspace(-3, 3, 400).unsqueeze(1)
    for name in names:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
        opt = FOOVB(model, seed=seed, **VARIANTS[name])
        generator = torch.Generator().manual_seed(seed)
        ends = []
        for a in PHASES:
            for _ in range(STEPS):
                x = torch.rand(BATCH, 1, generator=generator) * 6 - 3
                y = torch.sin(a * x)

                def closure(x: torch.Tensor = x, y: torch.Tensor = y, model: nn.Module = model) -> torch.Tensor:
                    loss = F.mse_loss(model(x), y)
                    loss.backward()
                    return loss

                opt.step(closure)
            with torch.no_grad():
                ends.append(round(F.mse_loss(model(test_x), torch.sin(a * test_x)).item(), 4))
        print(seed, name, ends, f"mean {sum(ends) / len(ends):.4f}", flush=True)


if __name__ == "__main__":
    main()
