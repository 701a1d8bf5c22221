"""Digests of training traces, to show that a restructuring changed no number (issue 37).

For each posterior family and each way to step (step(closure) with a mean loss, step_batched, the own loop of
sampled_params(train=True) blocks), 200 steps on 2,048 MNIST images (a 784-32-10 MLP; the full family on a
49-8-10 one, every 16th pixel), then: the SHA-256 of every posterior tensor after every 50 steps, of the losses,
and of sampled predictions. Run it before and after a change and compare the printed lines::

    python scripts/trace_digest.py > before.txt   # (on the old commit)
    python scripts/trace_digest.py > after.txt && diff before.txt after.txt
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from foovb import FOOVB
from foovb.predict import predict
from foovb_suite.data import MNIST_MEAN, MNIST_STD, load_mnist

STEPS, BATCH, K = 200, 64, 4


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def trace(family: str, engine: str, x: torch.Tensor, y: torch.Tensor) -> list[str]:
    torch.manual_seed(0)
    if family == "full":  # small layers only: a full covariance is d x d
        x = x[:, ::16]
    width = 8 if family == "full" else 32
    model = nn.Sequential(nn.Linear(x.shape[1], width), nn.ReLU(), nn.Linear(width, 10))
    opt = FOOVB(model, family, K, seed=1)
    lines, losses = [], []
    for step in range(STEPS):
        xb, yb = x[(step * BATCH) % len(x):][:BATCH], y[(step * BATCH) % len(x):][:BATCH]
        if engine == "closure":
            def closure(xb=xb, yb=yb):
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                return loss

            losses.append(opt.step(closure))
        elif engine == "batched":
            losses.append(opt.step_batched(xb, yb))
        else:
            for _ in range(K):
                with opt.sampled_params(train=True):
                    F.cross_entropy(model(xb), yb).backward()
            losses.append(opt.step())
        if (step + 1) % 50 == 0:
            state = [v for block in opt.blocks for v in block.state.values()]
            lines.append(f"{family:9s} {engine:8s} step {step + 1:3d} posterior {digest(state)}")
    lines.append(f"{family:9s} {engine:8s} losses {digest([torch.tensor(losses, dtype=torch.float64)])}")
    predictions = predict(opt, x[:256], 5, seed=3)
    lines.append(f"{family:9s} {engine:8s} predictions {digest([predictions.mean, predictions.samples])}")
    return lines


def main() -> None:
    torch.set_num_threads(1)
    mnist = load_mnist()
    x = ((mnist.train_images[:2048].float() / 255 - MNIST_MEAN) / MNIST_STD).flatten(1)
    y = mnist.train_labels[:2048]
    for family in ("diagonal", "kronecker", "full"):
        for engine in ("closure", "batched", "own loop"):
            for line in trace(family, engine, x, y):
                print(line, flush=True)


if __name__ == "__main__":
    main()
