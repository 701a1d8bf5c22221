"""Step time of FOO-VB vs SGD on the paper's 784-100-100-10 MLP, batch 128 (issue: speed targets).

Prints, measured in this one run on this machine:
* SGD step time; FOO-VB diagonal step time and ratio to SGD for K = 1, 2, 10, 32, batched and sequential
  (the sequential path is "plain repetition": K forward/backward passes, like the reference code);
* the matrix-variate (Kronecker) step for K = 10, with the share of time spent in the posterior update;
* the full-covariance family on a small 64-32-10 MLP.

    python benchmarks/step_time.py [--repeats 30] [--threads N] [--device cuda] [--settings JSON]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

import foovb.optimizer
from foovb import FOOVB
from foovb_suite.data import MNIST_MEAN, MNIST_STD, load_mnist


def mlp(sizes=(784, 100, 100, 10)) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median wall time of `repeats` calls of fn. A call that returns False (a step that diverged, after which
    the optimizer was rebuilt) is not counted, and another call is made in its place. On a GPU each call is
    timed to the end of its kernels (synchronised before and after)."""
    def sync() -> None:  # every GPU (a timing on cuda:1 must wait for cuda:1's kernels)
        for index in range(torch.cuda.device_count() if torch.cuda.is_initialized() else 0):
            torch.cuda.synchronize(index)

    for _ in range(warmup):
        fn()
    times: list[float] = []
    for _ in range(10 * repeats):
        sync()
        tic = time.perf_counter()
        counted = fn() is not False
        sync()
        elapsed = time.perf_counter() - tic
        if counted:
            times.append(elapsed)
        if len(times) == repeats:
            return 1e3 * statistics.median(times)
    raise RuntimeError(f"only {len(times)} of {10 * repeats} calls completed a step")


def sgd_step_ms(x, y, repeats: int, sizes=(784, 100, 100, 10)) -> float:
    model = mlp(sizes).to(x.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y, reduction="sum").backward()
        opt.step()

    return median_ms(step, repeats)


def foovb_step_ms(x, y, posterior: str, k: int, batched: bool, repeats: int, sizes=(784, 100, 100, 10),
                  preset: str = "paper", **settings) -> float:
    model = mlp(sizes).to(x.device)
    opt = FOOVB(model, posterior, mc_samples=k, seed=0, preset=preset, **settings)
    loss_fn = lambda out, t: F.cross_entropy(out, t, reduction="sum")  # noqa: E731

    def closure() -> torch.Tensor:
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    def step() -> bool:
        nonlocal opt
        try:
            opt.step_batched(x, y, loss_fn) if batched else opt.step(closure)
        except FloatingPointError:  # K = 1 can diverge on one repeated batch (noisy E[g eps]); start over
            opt = FOOVB(model, posterior, mc_samples=k, seed=0, preset=preset, **settings)
            return False  # not a step: median_ms does not count it
        return True

    return median_ms(step, repeats)


def update_share(x, y, k: int, repeats: int, sizes=(784, 100, 100, 10)) -> tuple[float, float]:
    """Time of a Kronecker step and of its UPDATE alone (statistics -> new M, A, B for all layers)."""
    model = mlp(sizes).to(x.device)
    opt = FOOVB(model, "kronecker", mc_samples=k, seed=0, preset="paper")
    return step_and_update_ms(opt, lambda: opt.step_batched(x, y), repeats)


def step_and_update_ms(opt: FOOVB, step, repeats: int, warmup: int = 3) -> tuple[float, float]:
    """Median ms of `step()` (a step of `opt`) and of its UPDATE alone, replayed from the last step's statistics
    on the posterior that step produced (the same shapes and ranks, so the same work)."""
    captured = {}
    original = foovb.optimizer.apply_update

    def capture(*args):
        captured["args"] = args
        return original(*args)

    with mock.patch.object(foovb.optimizer, "apply_update", capture):
        step_ms = median_ms(step, repeats, warmup)
    args = captured["args"]
    saved = [{key: value.clone() for key, value in b.state.items()} for b in opt.blocks]

    def update_only() -> None:
        for block, state in zip(opt.blocks, saved, strict=True):
            block.state["mean"].copy_(state["mean"])  # the update changes the mean in place
            block.state.update({key: value for key, value in state.items() if key != "mean"})  # and replaces these
        original(*args)

    update_ms = median_ms(update_only, repeats, warmup)
    return step_ms, update_ms


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="torch device of the models and the batch, e.g. cuda")


def describe(device: torch.device) -> str:
    """The hardware a timing came from: the GPU's name, or the CPU threads."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return f"CPU, {torch.get_num_threads()} thread(s)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--sizes", default="784,100,100,10",
                        help="MLP layer sizes (the paper's timing table uses the continuous net 1024,200,200,10)")
    parser.add_argument("--ks", default="1,2,10,32", help="MC sample counts of the diagonal family")
    parser.add_argument("--settings", default=None, help="FOOVB keyword arguments (JSON): the recommended "
                        "matrix-variate step(closure) at K=10 is timed with them and without, after the table")
    add_device_argument(parser)
    args = parser.parse_args()
    sizes = tuple(int(v) for v in args.sizes.split(","))
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    mnist = load_mnist()  # a real batch: random inputs with random labels make the summed-loss updates diverge
    images = mnist.train_images[:128].float()
    if sizes[0] == 1024:  # the continuous scenario's 32 x 32 zero-padded inputs
        images = F.pad(images, (2, 2, 2, 2))
    x = ((images / 255 - MNIST_MEAN) / MNIST_STD).flatten(1).to(args.device)
    y = mnist.train_labels[:128].to(args.device)
    if x.shape[1] != sizes[0]:
        raise SystemExit(f"--sizes must start with 784 or 1024, got {sizes[0]}")
    print(f"torch {torch.__version__}, {describe(x.device)}; MLP {'-'.join(map(str, sizes))}, "
          f"batch 128; median of {args.repeats} steps")
    sgd = sgd_step_ms(x, y, args.repeats, sizes)
    print(f"\nSGD step: {sgd:.3f} ms\n")
    print("| posterior | K | batched ms | batched / SGD | sequential ms | sequential / SGD |")
    print("|---|---|---|---|---|---|")
    for k in (int(v) for v in args.ks.split(",")):
        batched = foovb_step_ms(x, y, "diagonal", k, True, args.repeats, sizes)
        sequential = foovb_step_ms(x, y, "diagonal", k, False, max(5, args.repeats // 3), sizes)
        print(f"| diagonal | {k} | {batched:.2f} | {batched / sgd:.1f} | {sequential:.2f} | {sequential / sgd:.1f} |")
    step, update = update_share(x, y, 10, args.repeats, sizes)
    sequential = foovb_step_ms(x, y, "kronecker", 10, False, max(5, args.repeats // 3), sizes)
    print(f"| kronecker | 10 | {step:.2f} | {step / sgd:.1f} | {sequential:.2f} | {sequential / sgd:.1f} |")
    print(f"\nKronecker K=10 batched step: {step:.1f} ms, of which the UPDATE of all three layers "
          f"(Lemma 2 for A and B, mean) {update:.1f} ms ({100 * update / step:.0f}%)")
    small = (64, 32, 10)
    xs = x[:, ::12][:, :64].contiguous()
    sgd_small = sgd_step_ms(xs, y, args.repeats, small)
    full = foovb_step_ms(xs, y, "full", 10, True, args.repeats, small)
    print(f"Full covariance, MLP 64-32-10 (blocks of 2080 and 330 parameters), K=10: {full:.1f} ms "
          f"= {full / sgd_small:.0f} x SGD ({sgd_small:.3f} ms)")
    if args.settings:
        repeats = max(5, args.repeats // 3)
        plain = foovb_step_ms(x, y, "kronecker", 10, False, repeats, sizes, preset="recommended")
        extra = foovb_step_ms(x, y, "kronecker", 10, False, repeats, sizes, preset="recommended",
                              **json.loads(args.settings))
        print(f"Matrix-variate step(closure), K=10, recommended preset: {plain:.1f} ms; with {args.settings}: "
              f"{extra:.1f} ms ({extra / plain:.2f}x)")


if __name__ == "__main__":
    main()
