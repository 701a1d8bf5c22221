"""The benchmark scripts' helpers run against the library as it is (they reach into it to time its parts): a
renamed internal fails here, not on a lent GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from step_time import mlp, step_and_update_ms  # noqa: E402

from foovb import FOOVB  # noqa: E402


def test_step_and_update_ms_times_a_step_and_replays_its_update():
    torch.manual_seed(0)
    model = mlp((6, 5, 3))
    opt = FOOVB(model, "kronecker", 2, seed=0)
    x, y = torch.randn(8, 6), torch.randint(3, (8,))
    steps = []

    def step():
        steps.append(opt.step_batched(x, y, lambda out, t: F.cross_entropy(out, t, reduction="sum")))

    step_ms, update_ms = step_and_update_ms(opt, step, repeats=2, warmup=1)
    assert step_ms > 0 and update_ms > 0 and len(steps) == 3
