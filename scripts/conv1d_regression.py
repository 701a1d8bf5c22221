"""The matrix-variate Conv1d of FOOVB(model) (session 52) on a regression net and an autoencoder: a Conv1d net reads
a noisy sine window of 32 values and predicts the next clean value (regression) or the clean window (autoencoder);
3 tasks move the frequency band (1-3, 3-5, 5-7 cycles per window), 2,000 windows each, 2 passes, batch 32, MSE mean.
Learners: FOOVB(model) now, the same with its Conv1d layers diagonal as before session 52, Adam at 3 learning rates;
the test MSE over the 3 tasks after the last and the first task's, mean of seeds 0-1.

    python scripts/conv1d_regression.py
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from foovb import FOOVB, priors

LENGTH = 32
BANDS = [(1, 3), (3, 5), (5, 7)]


def signals(n: int, gen: torch.Generator, low: float, high: float) -> tuple[Tensor, Tensor]:
    """(noisy, clean) sines of LENGTH + 1 values, frequency in [low, high) cycles per window, random phase."""
    freq = low + (high - low) * torch.rand(n, 1, generator=gen)
    phase = 2 * math.pi * torch.rand(n, 1, generator=gen)
    clean = torch.sin(2 * math.pi * freq * torch.arange(LENGTH + 1).float()[None] / LENGTH + phase)
    return clean + 0.1 * torch.randn(clean.shape, generator=gen), clean


def tasks(kind: str, gen: torch.Generator) -> list[tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]]:
    """Per band: (train x, y), (test x, y); x the noisy window, y the next clean value or the clean window."""
    out = []
    for low, high in BANDS:
        pairs = []
        for rows in (2000, 500):
            noisy, clean = signals(rows, gen, low, high)
            target = clean[:, LENGTH:] if kind == "regression" else clean[:, :LENGTH]
            pairs.append((noisy[:, None, :LENGTH], target))
        out.append((pairs[0], pairs[1]))
    return out


def model(kind: str) -> nn.Module:
    return nn.Sequential(nn.Conv1d(1, 16, 5, padding=2), nn.Tanh(), nn.Conv1d(16, 16, 5, padding=2, stride=2),
                         nn.Tanh(), nn.Flatten(), nn.Linear(16 * 16, 1 if kind == "regression" else LENGTH))


def optimizer_of(learner: str, net: nn.Module, seed: int) -> torch.optim.Optimizer:
    if learner.startswith("adam"):
        return torch.optim.Adam(net.parameters(), lr=float(learner[4:]))
    layers = priors.MATRIX_VARIATE_LAYERS
    if learner == "before":  # nn.Conv1d diagonal, as FOOVB(model) made it before session 52
        priors.MATRIX_VARIATE_LAYERS = (nn.Linear, nn.Conv2d, nn.Conv3d)
    try:
        return FOOVB(net, seed=seed)
    finally:
        priors.MATRIX_VARIATE_LAYERS = layers


def run(kind: str, learner: str, seed: int) -> list[float]:
    data = tasks(kind, torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    net = model(kind)
    opt = optimizer_of(learner, net, seed)
    order = torch.Generator().manual_seed(100 + seed)
    for (x, y), _ in data:
        for _ in range(2):
            for rows in torch.randperm(len(x), generator=order).split(32):
                def closure(xb: Tensor = x[rows], yb: Tensor = y[rows]) -> Tensor:
                    if not isinstance(opt, FOOVB):
                        opt.zero_grad()
                    loss = F.mse_loss(net(xb), yb)
                    loss.backward()
                    return loss

                loss = opt.step(closure)
                if not math.isfinite(float(loss.detach() if isinstance(loss, Tensor) else loss)):
                    return [math.inf] * len(data)
    with torch.no_grad():
        return [F.mse_loss(net(x), y).item() for _, (x, y) in data]


def main() -> None:
    torch.set_num_threads(1)
    for kind in ("regression", "autoencoder"):
        for learner in ("now", "before", "adam3e-4", "adam1e-3", "adam3e-3"):
            results = [run(kind, learner, seed) for seed in (0, 1)]
            print(f"{kind:11s} {learner:9s} mean MSE over tasks "
                  f"{statistics.fmean(statistics.fmean(r) for r in results):.4f}  first task "
                  f"{statistics.fmean(r[0] for r in results):.4f}", flush=True)


if __name__ == "__main__":
    main()
