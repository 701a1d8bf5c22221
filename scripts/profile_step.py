"""Where a FOO-VB step spends its time: torch.profiler tables (host time, and kernel time on a GPU) of a few
step_batched calls, K = 10, with the default preset, on the continuous scenario's 1024-200-200-10 MLP (a real MNIST
batch of 128, padded to 32x32) and on the vision mix's LeNet (random 3x32x32 inputs, batch 64).

    python scripts/profile_step.py [--device cuda] [--steps 5]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from foovb import FOOVB
from foovb_suite.data import MNIST_MEAN, MNIST_STD, load_mnist
from foovb_suite.models import lenet


def profile_steps(name: str, step, steps: int, device: torch.device) -> None:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for _ in range(3):  # warm-up
        step()
    sync()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    averages = prof.key_averages()
    print(f"==== {name}: {steps} steps")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=50))
    if device.type == "cuda":
        print(averages.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=50))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    mnist = load_mnist()
    images = F.pad((mnist.train_images[:128].float() / 255 - MNIST_MEAN) / MNIST_STD, (2, 2, 2, 2))
    x, y = images.flatten(1).to(device), mnist.train_labels[:128].to(device)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(64, 3, 32, 32, generator=generator).to(device)
    labels = torch.randint(10, (64,), generator=generator).to(device)
    for posterior in ("diagonal", "kronecker"):
        model = nn.Sequential(nn.Linear(1024, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU(),
                              nn.Linear(200, 10)).to(device)
        opt = FOOVB(model, posterior, 10, seed=0)
        profile_steps(f"MLP 1024-200-200-10 {posterior} step_batched K=10",
                      lambda opt=opt: opt.step_batched(x, y, lambda out, t: F.cross_entropy(out, t, reduction="sum")),
                      args.steps, device)
    for posterior in ("diagonal", "kronecker"):
        opt = FOOVB(lenet().to(device), posterior, 10, seed=0)
        profile_steps(f"LeNet {posterior} step_batched K=10",
                      lambda opt=opt: opt.step_batched(images, labels, lambda out, t: F.cross_entropy(out[:, :10], t)),
                      max(1, args.steps // 2), device)


if __name__ == "__main__":
    main()
