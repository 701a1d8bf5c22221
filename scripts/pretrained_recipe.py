"""Continuing from a pretrained model (docs/api.md, "Starting from a pretrained model"): FOOVB(model) keeps the
weights as the prior mean, but its prior variance knows nothing of the data they were trained on, so new data move
them as freely as a fresh network's. A pass over the old data with the mean step at 0 (param_groups[0]["lr"] = 0)
fits the covariance to the old data and leaves the weights as they are; the new data then move the weights the old
data need less.

Two synthetic tasks (a 20-64-64-2 MLP; task B: other inputs, the same rule, permuted features; 3,000 training
examples each), pretrained on A with Adam, then trained on B by Adam (lr 1e-3), by FOOVB(model), and by FOOVB(model)
after that pass (`--pass-steps`: its lengths in steps of 64, 47 being one epoch of A); task A's and B's test accuracy
after B, per seed and their mean, and task A's after B's first and second steps. `--data mnist` (session 55, a user's
trial): a 784-200-200-10 MLP, A MNIST, B MNIST upside down (2,000 test images each); `--data mnist-same`:
B is MNIST again (more of the data the model was pretrained on). `--settings`: FOOVB's keyword arguments (JSON).

    python scripts/pretrained_recipe.py [--seeds 0,1,2] [--steps 400] [--pass-steps 47,400] [--data synthetic]
        [--settings '{"step_prior": 1}']
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from foovb import FOOVB

FEATURES = 20


def tasks(seed: int) -> dict[str, tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Task name -> (train x, train y, test x, test y): y = [x . w > 0] on shifted Gaussian inputs."""
    gen = torch.Generator().manual_seed(seed)
    w, perm = torch.randn(FEATURES, generator=gen), torch.randperm(FEATURES, generator=gen)
    shift = {"A": torch.cat([torch.full((10,), 1.5), torch.zeros(10)]),
             "B": torch.cat([torch.zeros(10), torch.full((10,), 1.5)])}

    def draw(name: str, rows: int) -> tuple[Tensor, Tensor]:
        x = torch.randn(rows, FEATURES, generator=gen)
        y = (x @ w > 0).long()
        return (x[:, perm] if name == "B" else x) + shift[name], y

    return {name: (*draw(name, 3000), *draw(name, 1000)) for name in ("A", "B")}


def mnist_tasks(same: bool) -> dict[str, tuple[Tensor, Tensor, Tensor, Tensor]]:
    """A: MNIST (flattened, standardised), B: the same digits upside down (rows reversed), or MNIST again (`same`)."""
    from foovb_suite.data.datasets import load_dataset

    data = load_dataset("mnist", None)
    x, x_test = ((images.float() / 255 - 0.1307) / 0.3081 for images in (data.train_images, data.test_images[:2000]))
    y, y_test = data.train_labels, data.test_labels[:2000]
    flipped = (x, x_test) if same else (x.flip(-2), x_test.flip(-2))
    return {"A": (x.flatten(1), y, x_test.flatten(1), y_test),
            "B": (flipped[0].flatten(1), y, flipped[1].flatten(1), y_test)}


def make_model(data: str) -> nn.Module:
    inputs, hidden, outputs = (FEATURES, 64, 2) if data == "synthetic" else (784, 200, 10)
    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, outputs))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor, steps: int, seed: int,
          watch: tuple[Tensor, Tensor] | None = None) -> list[float]:
    """`steps` steps of 64 random rows; the accuracy on `watch` after the first and the second step."""
    gen = torch.Generator().manual_seed(seed)
    first_steps = []
    for step in range(steps):
        rows = torch.randint(len(x), (64,), generator=gen)

        def closure(rows: Tensor = rows) -> Tensor:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[rows]), y[rows])
            loss.backward()
            return loss

        optimizer.step(closure)
        if watch is not None and step < 2:
            first_steps.append(accuracy(model, *watch))
    return first_steps


@torch.no_grad()
def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    return (model(x).argmax(1) == y).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=400, help="steps per task (batch 64)")
    parser.add_argument("--pass-steps", default="47,400", help="lengths of the lr=0 pass over A, in steps of 64")
    parser.add_argument("--data", choices=("synthetic", "mnist", "mnist-same"), default="synthetic")
    parser.add_argument("--settings", default="{}", help="FOOVB's keyword arguments, JSON")
    args = parser.parse_args()
    settings = json.loads(args.settings)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (task A is reported after B's first two steps)")
    torch.set_num_threads(1)
    results: dict[str, list[tuple[float, float, float, float]]] = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        data = tasks(seed) if args.data == "synthetic" else mnist_tasks(args.data == "mnist-same")
        torch.manual_seed(seed)
        pretrained = make_model(args.data)
        train(pretrained, torch.optim.Adam(pretrained.parameters(), lr=1e-3), *data["A"][:2], args.steps, seed)
        passes = [int(steps) for steps in args.pass_steps.split(",")]  # (label, steps of the lr=0 pass or 0)
        learners = [("adam", 0), ("foovb", 0), *((f"foovb, lr=0 for {steps} steps on A", steps) for steps in passes)]
        for learner, pass_steps in learners:
            model = copy.deepcopy(pretrained)
            if learner == "adam":
                optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
            else:
                optimizer = FOOVB(model, seed=seed, **settings)
                if pass_steps:
                    lr = optimizer.param_groups[0]["lr"]
                    optimizer.param_groups[0]["lr"] = 0.0  # covariance only: the weights stay as pretrained
                    train(model, optimizer, *data["A"][:2], pass_steps, seed + 100)
                    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                                 pretrained.state_dict().values(), strict=True))
                    optimizer.param_groups[0]["lr"] = lr
            first_steps = train(model, optimizer, *data["B"][:2], args.steps, seed + 200, watch=data["A"][2:])
            result = (accuracy(model, *data["A"][2:]), accuracy(model, *data["B"][2:]), *first_steps)
            results.setdefault(learner, []).append(result)
            print(f"seed {seed}  {learner:34s} after B: task A {result[0]:.3f}, task B {result[1]:.3f}; task A after "
                  f"B's first steps {result[2]:.3f}, {result[3]:.3f}", flush=True)
    print(f"\nmean over seeds ({args.data}, FOOVB settings {settings or 'the defaults'}):")
    for learner, values in results.items():
        a, b, first, second = (statistics.fmean(v[i] for v in values) for i in range(4))
        print(f"  {learner:34s} task A {a:.3f}, task B {b:.3f}; task A after B's first steps {first:.3f}, {second:.3f}")


if __name__ == "__main__":
    main()
