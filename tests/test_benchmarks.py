"""The benchmark scripts' helpers run against the library as it is (they reach into it to time its parts): a
renamed internal fails here, not on a lent GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from closure_path import bare_diagonal_loop  # noqa: E402
from step_prior_cost import Learner  # noqa: E402
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


def test_the_bare_loop_evaluates_k_sampled_networks_and_restores_the_mean():
    """closure_floor.py's floor: K forward/backward passes at mean + std eps, then the (trivially updated) mean in
    the parameters again."""
    torch.manual_seed(0)
    model = mlp((6, 5, 3))
    x, y = torch.randn(8, 6), torch.randint(3, (8,))
    before = [p.detach().clone() for p in model.parameters()]
    calls = []
    model.register_forward_hook(lambda module, args, out: calls.append(
        max(float((p.detach() - b).abs().max()) for p, b in zip(module.parameters(), before, strict=True))))
    bare_diagonal_loop(x, y, 4, model)()
    assert len(calls) == 4 and min(calls) > 0.01  # each pass saw a sampled network (std 0.047)
    assert all(torch.allclose(p, b, atol=1e-6) for p, b in zip(model.parameters(), before, strict=True))


def test_step_prior_costs_settings_patch_what_they_name():
    """step_prior_cost.py: `exact` decomposes the 1,025-wide input factor at every step, the default at its first
    (then as it moves), `narrow` and `no_step_prior` never; the library's constants are restored after each turn."""
    import foovb.calibration
    import foovb.linalg

    limits = (foovb.linalg.WIDE_FACTOR, foovb.calibration.STEP_PRIOR_MAX_FEATURES)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 1024, generator=generator), torch.randint(10, (8,), generator=generator))
               for _ in range(2)]
    counts = {}
    for name in ("default", "exact", "narrow", "no_step_prior"):
        learner = Learner(name)
        learner.train(batches)
        counts[name] = learner.decompositions
        assert learner.steps == 2 and learner.seconds > 0
    assert counts == {"default": 1, "exact": 2, "narrow": 0, "no_step_prior": 0}
    assert (foovb.linalg.WIDE_FACTOR, foovb.calibration.STEP_PRIOR_MAX_FEATURES) == limits
