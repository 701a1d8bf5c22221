"""Operators dispatched per FOO-VB step: a CPU proxy for a GPU step's kernel launches, which bound a small model's step
there (docs/performance.md, "On a GPU"). Counts the aten operators of step_batched on the paper's 784-100-100-10 MLP
(batch 128, K = 10) for each preset, and for the recommended diagonal preset with each of its options turned off; with
--gpu-sums the diagonal blocks sum their samples as they do on a GPU (`DiagonalBlock.accumulate_reduced`).

    python benchmarks/step_ops.py [--gpu-sums] [--steps 5]
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from foovb import FOOVB
from foovb.posteriors import DiagonalBlock


class OperatorCount(TorchDispatchMode):
    """Counts the aten operators dispatched inside it (tests/test_gpu.py uses it too)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def operators_per_step(posterior: str, preset: str, steps: int, **settings) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10))
    inputs, targets = torch.randn(128, 784), torch.randint(0, 10, (128,))
    optimizer = FOOVB(model, posterior, 10, preset=preset, seed=0, **settings)
    for _ in range(3):  # past the first step's one-off work (calibration, caches)
        optimizer.step_batched(inputs, targets)
    with OperatorCount() as counter:
        for _ in range(steps):
            optimizer.step_batched(inputs, targets)
    return counter.count / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-sums", action="store_true", help="the diagonal blocks' sums as on a GPU")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [("diagonal", "paper", {}), ("diagonal", "recommended", {})]
    rows += [("diagonal", "recommended", {option: False})
             for option in ("secant_check", "curvature_damping", "antithetic")]
    rows += [("diagonal", "recommended", {"step_prior": 1.0}), ("kronecker", "paper", {}),
             ("kronecker", "recommended", {})]
    patch = mock.patch.object(DiagonalBlock, "accumulate", lambda block, stats, noise, grads:
                              block.accumulate_reduced(stats, noise, grads[0])) if args.gpu_sums else mock.MagicMock()
    print(f"aten operators per step_batched, MLP 784-100-100-10, batch 128, K=10, torch {torch.__version__}; diagonal "
          f"sums {'as on a GPU (reductions)' if args.gpu_sums else 'as on the CPU (per sample)'}\n")
    print("| posterior | preset | changed | operators per step |\n|---|---|---|---|")
    with patch:
        for posterior, preset, settings in rows:
            changed = ", ".join(f"{key}={value}" for key, value in settings.items()) or "-"
            count = operators_per_step(posterior, preset, args.steps, **settings)
            print(f"| {posterior} | {preset} | {changed} | {count:.0f} |")


if __name__ == "__main__":
    main()
