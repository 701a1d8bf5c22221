"""The small models users bring, trained by FOO-VB with given settings (default: FOOVB(model)'s): a 1-64-64-1 tanh net
on y = sin(x) + 0.1 noise (512 points on [-2, 2], MSE mean, batch 32, 60 epochs; its MSE against sin(x)), a 20-8-20
ReLU autoencoder on 256 Gaussian vectors (MSE mean, batch 64, 100 steps; the last step's loss over the first's) and
a 1-64-2 Gaussian-NLL head on the same sine (batch 32, 30 epochs; its NLL and its mean's MSE). Adam (lr 1e-3) on the
sine for reference. One line per family and settings.

    python benchmarks/small_models.py [--settings '{}' '{"implicit_mean": false, "cov_step": 0.3}' ...]

Output: docs/results/default_implicit/small_models.md (docs/results.md, "A default that holds").
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

from foovb import FOOVB


def sine() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.rand(512, 1) * 4 - 2
    return x, torch.sin(x) + 0.1 * torch.randn(512, 1)


def train(model: nn.Module, opt: torch.optim.Optimizer, loss_fn, x: torch.Tensor, y: torch.Tensor, epochs: int,
          batch: int) -> list[float]:
    order, losses = torch.Generator().manual_seed(0), []
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=order)
        for start in range(0, len(x), batch):
            rows = perm[start:start + batch]

            def closure(rows: torch.Tensor = rows) -> torch.Tensor:
                opt.zero_grad()
                loss = loss_fn(model(x[rows]), y[rows])
                loss.backward()
                return loss

            loss = opt.step(closure)  # torch optimizers return the closure's tensor, FOOVB a float
            losses.append(float(loss.detach() if isinstance(loss, torch.Tensor) else loss))
    return losses


def cases(make) -> str:
    """The three cases' results for `make(model)`, an optimizer; an exception is reported as the case's result."""
    x, y = sine()
    out = []
    try:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
        train(net, make(net), F.mse_loss, x, y, 60, 32)
        with torch.no_grad():
            out.append(f"{F.mse_loss(net(x), torch.sin(x)).item():.3g}")
    except (FloatingPointError, RuntimeError) as error:
        out.append(type(error).__name__)
    try:
        torch.manual_seed(0)
        data = torch.randn(256, 20)
        torch.manual_seed(0)
        autoencoder = nn.Sequential(nn.Linear(20, 8), nn.ReLU(), nn.Linear(8, 20))
        losses = train(autoencoder, make(autoencoder), F.mse_loss, data, data, 25, 64)
        out.append(f"{losses[0]:.3g} -> {losses[-1]:.3g}")
    except (FloatingPointError, RuntimeError) as error:
        out.append(type(error).__name__)

    def nll(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.gaussian_nll_loss(output[:, :1], target, F.softplus(output[:, 1:]) + 1e-4)

    try:
        torch.manual_seed(0)
        head = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 2))
        train(head, make(head), nll, x, y, 30, 32)
        with torch.no_grad():
            output = head(x)
            out.append(f"{nll(output, y).item():.3g} (MSE {F.mse_loss(output[:, :1], torch.sin(x)).item():.2g})")
    except (FloatingPointError, RuntimeError) as error:
        out.append(type(error).__name__)
    return " | ".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=["{}"], help="JSON keyword arguments of FOOVB, each a row")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| optimizer | settings | sine MSE | autoencoder loss, first -> last step | Gaussian NLL (its mean's MSE) |")
    print("|---|---|---|---|---|")
    print(f"| Adam lr 1e-3 | | {cases(lambda model: torch.optim.Adam(model.parameters(), lr=1e-3))} |")
    for text in args.settings:
        settings = json.loads(text)
        for family in ("diagonal", "kronecker"):
            try:
                FOOVB(nn.Linear(1, 1), family, **settings)
            except ValueError:  # a setting of the other family
                continue
            row = cases(lambda model, family=family, settings=settings: FOOVB(model, family, seed=0, **settings))
            print(f"| FOOVB(model, {family!r}) | {text} | {row} |", flush=True)


if __name__ == "__main__":
    main()
