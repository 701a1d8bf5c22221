"""FOO-VB step time on the paper's LeNet of the vision-datasets mix (issue 39): conv 5x5 with 20 and 50 channels,
max-pool, fully connected 1250 -> 500, a 10-way head per task (5 heads in one Linear); 3x32x32 inputs, batch 64.

Prints, measured in this one run on this machine, with random inputs and labels and the default preset
(`FOOVB(model, posterior, mc_samples=K)`): the SGD step; the floor (a bare loop of K forward/backward passes of
the same network with the noise drawn and the gradients summed: `closure_path.bare_diagonal_loop_ms`); and for
the diagonal and matrix-variate families, step(closure) and step_batched, over SGD, over the floor, and the
matrix-variate step over the diagonal one on the same path. Then the matrix-variate UPDATE alone (its statistics
-> new means and Kronecker factors, replayed) of the step(closure) path: the samples of a matrix-variate step cost at
least the diagonal step's (the same K forward/backward passes), so (diagonal step + UPDATE) / diagonal step bounds
the matrix-variate / diagonal ratio from below at the current UPDATE.

    python benchmarks/lenet_step.py [--repeats 5] [--threads 1] [--k 10] [--device cuda] [--settings JSON]

`--settings`: FOOVB keyword arguments (JSON); each family's step(closure) with them is timed after the defaults'
rows, against the same SGD step and floor (e.g. '{"calibrate_prior": 150}': the calibrated prior's mean step,
after a first step that is not timed).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from closure_path import bare_diagonal_loop_ms
from step_time import add_device_argument, describe, median_ms, step_and_update_ms

from foovb import FOOVB
from foovb_suite.models import lenet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--k", type=int, default=10, help="Monte Carlo samples per step")
    parser.add_argument("--settings", default=None, help="FOOVB keyword arguments (JSON) of extra rows")
    add_device_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 3, 32, 32, generator=generator), torch.randint(10, (64,), generator=generator)
    x, y = x.to(args.device), y.to(args.device)
    loss_fn = lambda out, t: F.cross_entropy(out[:, :10], t)  # noqa: E731  (the first task's head)
    print(f"torch {torch.__version__}, {describe(x.device)}; LeNet 3x32x32, batch 64, K={args.k}; "
          f"median of {args.repeats} steps\n")

    torch.manual_seed(0)
    model = lenet().to(x.device)
    sgd_opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def sgd_step() -> None:
        sgd_opt.zero_grad()
        loss_fn(model(x), y).backward()
        sgd_opt.step()

    sgd = median_ms(sgd_step, args.repeats)
    torch.manual_seed(0)
    floor = bare_diagonal_loop_ms(x, y, args.k, args.repeats, model=lenet_head())
    print("| step | ms | / SGD | / floor | matrix-variate / diagonal |")
    print("|---|---|---|---|---|")
    print(f"| SGD | {sgd:.0f} | 1.0 | | |")
    print(f"| floor: bare K-sample loop | {floor:.0f} | {floor / sgd:.1f} | 1.00 | |")
    times = {}
    for posterior in ("diagonal", "kronecker"):
        for batched in (False, True):
            torch.manual_seed(0)
            model = lenet().to(x.device)
            opt = FOOVB(model, posterior, mc_samples=args.k, seed=0)

            def closure(model=model) -> torch.Tensor:
                loss = loss_fn(model(x), y)
                loss.backward()
                return loss

            def step(opt=opt, batched=batched, closure=closure) -> None:
                opt.step_batched(x, y, loss_fn) if batched else opt.step(closure)

            if (posterior, batched) == ("kronecker", False):
                ms, update = step_and_update_ms(opt, step, args.repeats, warmup=1)
            else:
                ms = median_ms(step, args.repeats, warmup=1)
            times[posterior, batched] = ms
            ratio = f"{ms / times['diagonal', batched]:.2f}" if posterior == "kronecker" else ""
            name = f"{posterior} {'step_batched' if batched else 'step(closure)'}"
            print(f"| {name} | {ms:.0f} | {ms / sgd:.1f} | {ms / floor:.2f} | {ratio} |")
    diagonal = times["diagonal", False]
    if args.settings:
        for posterior in ("diagonal", "kronecker"):
            torch.manual_seed(0)
            model = lenet().to(x.device)
            opt = FOOVB(model, posterior, mc_samples=args.k, seed=0, **json.loads(args.settings))
            ms = median_ms(lambda opt=opt, model=model: opt.step(lambda: loss_backward(model, x, y, loss_fn)),
                           args.repeats, warmup=1)
            print(f"| {posterior} step(closure), {args.settings} | {ms:.0f} | {ms / sgd:.1f} | {ms / floor:.2f} | "
                  f"{ms / times[posterior, False]:.2f} of the default's |")
    print(f"\nmatrix-variate UPDATE alone (step(closure) path): {update:.0f} ms, {update / diagonal:.2f} of the "
          f"diagonal step; matrix-variate / diagonal >= {(diagonal + update) / diagonal:.2f} at this UPDATE")


def loss_backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn) -> torch.Tensor:
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss


def lenet_head() -> torch.nn.Module:
    """The LeNet with the first task's head only, for the bare loop (which applies a plain cross-entropy)."""
    return torch.nn.Sequential(*lenet()[:-1], torch.nn.Linear(500, 10))


if __name__ == "__main__":
    main()
