"""The FOOVB presets on models that are not MLPs: a small CNN and an LSTM on MNIST (issue 28).

Trains, from the same initial weights per seed, with step(closure) on the mean F.cross_entropy loss (the "auto"
reduction), batch 128, K = 10:
* FOOVB diagonal and kronecker, preset "recommended" (init="keep": torch's default init is the prior mean) and
  preset "paper" (the paper's init); for the CNN also "recommended" with init="paper";
* Adam lr 1e-3 as a reference.
The LSTM's kronecker family is matrix-variate for its Linear head only: nn.LSTM's parameters fall back to diagonal.
Reports the posterior mean's test accuracy and the wall time. With --stream-steps N > 0, a task-agnostic stream: MNIST,
then a fixed pixel permutation of it, N steps each; accuracy on both tasks after both (forgetting).

    python benchmarks/presets_beyond_mlp.py [--steps 250] [--stream-steps 0] [--seeds 0] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from foovb import FOOVB
from foovb_suite.data import MNIST_MEAN, MNIST_STD, load_mnist


class LSTMNet(nn.Module):
    """Reads the 28 rows of an image as a sequence; the last hidden state -> Linear(64, 10)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(28, 64, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x.view(-1, 28, 28))[0][:, -1])


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(512, 10))


MODELS = {"cnn": cnn, "lstm": LSTMNet}
# name -> (family, preset, extra FOOVB arguments); None: Adam
OPTIMIZERS = {
    "diagonal recommended": ("diagonal", "recommended", {}),
    "diagonal recommended init=paper": ("diagonal", "recommended", {"init": "paper"}),
    "diagonal paper": ("diagonal", "paper", {}),
    "kronecker recommended": ("kronecker", "recommended", {}),
    "kronecker recommended init=paper": ("kronecker", "recommended", {"init": "paper"}),
    "kronecker paper": ("kronecker", "paper", {}),
    "adam 1e-3": None,
}
RUNS = {"cnn": list(OPTIMIZERS), "lstm": ["diagonal recommended", "diagonal paper", "kronecker recommended",
                                         "kronecker paper", "adam 1e-3"]}
STREAM_RUNS = ["diagonal recommended", "diagonal paper", "kronecker recommended", "adam 1e-3"]


def make(model_name: str, opt_name: str, seed: int, mc_samples: int) -> tuple[nn.Module, object]:
    torch.manual_seed(seed)  # the same initial weights for every optimizer of this seed
    model = MODELS[model_name]()
    if OPTIMIZERS[opt_name] is None:
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)
    family, preset, extra = OPTIMIZERS[opt_name]
    return model, FOOVB(model, family, mc_samples, preset=preset, seed=seed, **extra)


def train(model: nn.Module, opt, x: torch.Tensor, y: torch.Tensor, steps: int, batch: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(x), (batch,), generator=gen)
        xb, yb = x[idx], y[idx]

        def closure(xb: torch.Tensor = xb, yb: torch.Tensor = yb) -> torch.Tensor:
            loss = F.cross_entropy(model(xb), yb)  # mean: FOOVB's "auto" reduction rescales it
            loss.backward()
            return loss

        if isinstance(opt, FOOVB):
            opt.step(closure)
        else:
            opt.zero_grad()
            closure()
            opt.step()


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy of the weights in the model (FOOVB leaves the posterior mean there)."""
    model.eval()
    return sum((model(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum().item() for i in range(0, len(x), 1000)) / len(x)


def run(model_name: str, opt_name: str, tasks: list, test_sets: list, args, seed: int) -> tuple[list[float], float]:
    """Train on the tasks in sequence; the accuracy on every test set after the last one, and the seconds."""
    tic = time.perf_counter()
    try:
        model, opt = make(model_name, opt_name, seed, args.mc_samples)
        for task, (x, y) in enumerate(tasks):
            train(model, opt, x, y, args.stream_steps if len(tasks) > 1 else args.steps, args.batch, seed + task)
        accs = [accuracy(model, x, y) for x, y in test_sets]
    except (FloatingPointError, RuntimeError, ValueError) as error:  # report a library failure, carry on
        print(f"  {model_name} / {opt_name}: {type(error).__name__}: {error}", flush=True)
        accs = [float("nan")] * len(test_sets)
    return accs, time.perf_counter() - tic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=250, help="training steps of the single-task table")
    parser.add_argument("--stream-steps", type=int, default=0,
                        help="steps per task of the stream (0: skip; 150 took > 10 min on a busy 2-core CPU)")
    parser.add_argument("--train-subset", type=int, default=60000)
    parser.add_argument("--test-subset", type=int, default=10000)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--models", default="cnn,lstm")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--mc-samples", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    models = args.models.split(",")
    mnist = load_mnist()
    norm = lambda images: ((images.float() / 255 - MNIST_MEAN) / MNIST_STD).unsqueeze(1)  # noqa: E731
    train_set = (norm(mnist.train_images[:args.train_subset]), mnist.train_labels[:args.train_subset])
    test_set = (norm(mnist.test_images[:args.test_subset]), mnist.test_labels[:args.test_subset])
    perm = torch.randperm(784, generator=torch.Generator().manual_seed(1234))
    permute = lambda data: (data[0].flatten(1)[:, perm].view_as(data[0]), data[1])  # noqa: E731
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch {args.batch}, K={args.mc_samples}, "
          f"{args.steps} steps on {len(train_set[1])} training images, seeds {seeds}, {len(test_set[1])} test "
          "images", flush=True)

    print("\n| model | optimizer / preset | test acc (posterior mean) | seconds |\n|---|---|---|---|", flush=True)
    for model_name in models:
        for opt_name in RUNS[model_name]:
            results = [run(model_name, opt_name, [train_set], [test_set], args, seed) for seed in seeds]
            accs = [100 * r[0][0] for r in results]
            acc = " / ".join(f"{a:.2f}" for a in accs) + (f" (mean {sum(accs) / len(accs):.2f})" if len(seeds) > 1
                                                         else "")
            print(f"| {model_name} | {opt_name} | {acc} | {sum(r[1] for r in results) / len(results):.0f} |",
                  flush=True)

    if args.stream_steps > 0:
        print(f"\nStream: MNIST then permuted MNIST, {args.stream_steps} steps each, no task boundary given to the "
              "optimizer; accuracy after both tasks")
        print("\n| model | optimizer / preset | task 1 acc | task 2 acc | seconds |\n|---|---|---|---|---|", flush=True)
        for model_name in models:
            for opt_name in STREAM_RUNS:
                for seed in seeds:
                    (acc1, acc2), secs = run(model_name, opt_name, [train_set, permute(train_set)],
                                             [test_set, permute(test_set)], args, seed)
                    print(f"| {model_name} | {opt_name} (seed {seed}) | {100 * acc1:.2f} | {100 * acc2:.2f} | "
                          f"{secs:.0f} |", flush=True)


if __name__ == "__main__":
    main()
