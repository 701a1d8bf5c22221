"""FOO-VB step(closure) vs step_batched vs SGD on the paper's 784-100-100-10 MLP, batch 128 (issue 30).

Prints, measured in this one run on this machine, the SGD step time and, for the matrix-variate (Kronecker)
and diagonal families at K = 10, with the paper's preset and the default (recommended) one, the step(closure)
and step_batched times, their ratios to SGD and to each other. On the closure path the matrix-variate
statistics of nn.Linear layers are kept low-rank from the captured layer inputs and output gradients, and the
first layer's sampled weight is never formed, as in step_batched (issue 30).

Last row, the floor of the diagonal closure path: a bare loop of K forward/backward passes, the noise (one
torch.randn per antithetic pair and tensor, as the default preset draws), each sample written into the
parameters and its gradient summed in place (two in-place ops per tensor), then a trivial update: what any
implementation of the diagonal K-sample step on top of torch's CPU generator pays. And the floor of
step_batched: the same step with the K samples stacked (one batched forward and backward through `baddbmm`), the
floor that matters on a GPU, where one sample at a time is bound by kernel launches.

    python benchmarks/closure_path.py [--repeats 20] [--threads N] [--k 10] [--device cuda]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from step_time import add_device_argument, describe, foovb_step_ms, median_ms, mlp, sgd_step_ms

from foovb_suite.data import MNIST_MEAN, MNIST_STD, load_mnist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--k", type=int, default=10, help="Monte Carlo samples per step")
    add_device_argument(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    mnist = load_mnist()  # a real batch: random labels make the summed-loss updates diverge
    x = ((mnist.train_images[:128].float() / 255 - MNIST_MEAN) / MNIST_STD).flatten(1).to(args.device)
    y = mnist.train_labels[:128].to(args.device)
    print(f"torch {torch.__version__}, {describe(x.device)}; MLP 784-100-100-10, batch 128, "
          f"K={args.k}; median of {args.repeats} steps")
    sgd = sgd_step_ms(x, y, args.repeats)
    print(f"\nSGD step: {sgd:.3f} ms\n")
    print("| posterior | preset | step(closure) ms | / SGD | step_batched ms | / SGD | closure / batched |")
    print("|---|---|---|---|---|---|---|")
    for posterior in ("kronecker", "diagonal"):
        for preset in ("paper", "recommended"):
            closure = foovb_step_ms(x, y, posterior, args.k, False, args.repeats, preset=preset)
            batched = foovb_step_ms(x, y, posterior, args.k, True, args.repeats, preset=preset)
            print(f"| {posterior} | {preset} | {closure:.2f} | {closure / sgd:.1f} | {batched:.2f} | "
                  f"{batched / sgd:.1f} | {closure / batched:.2f} |")
    floor = bare_diagonal_loop_ms(x, y, args.k, args.repeats)
    stacked = bare_stacked_loop_ms(x, y, args.k, args.repeats)
    print(f"| diagonal floor: bare loop, antithetic | | {floor:.2f} | {floor / sgd:.1f} | {stacked:.2f} | "
          f"{stacked / sgd:.1f} | |")
    print("\n(floor row: the sequential bare loop under step(closure), the stacked one under step_batched)")


def bare_diagonal_loop_ms(x: torch.Tensor, y: torch.Tensor, k: int, repeats: int,
                          model: torch.nn.Module | None = None) -> float:
    """Median ms of `bare_diagonal_loop`."""
    return median_ms(bare_diagonal_loop(x, y, k, model), repeats)


def bare_diagonal_loop(x: torch.Tensor, y: torch.Tensor, k: int, model: torch.nn.Module | None = None,
                       loss_fn: Callable[..., torch.Tensor] | None = None) -> Callable[[], None]:
    """The diagonal K-sample step reduced to what it cannot avoid (module docstring), on `model` (default: the
    784-100-100-10 MLP) and `loss_fn(outputs, y)` (default: the summed cross-entropy): a function that runs one
    step."""
    loss_fn = loss_fn or (lambda outputs, targets: F.cross_entropy(outputs, targets, reduction="sum"))
    model = (mlp() if model is None else model).to(x.device)
    params = list(model.parameters())
    means = [p.detach().clone() for p in params]
    stds = [torch.full_like(p, 0.047) for p in params]
    sums = [torch.zeros_like(p) for p in params]
    weighted = [torch.zeros_like(p) for p in params]
    noises = [torch.empty_like(p) for p in params]
    generator = torch.Generator(device=x.device)

    def step() -> None:
        for total in sums + weighted:
            total.zero_()
        for sample in range(k):
            sign = -1.0 if sample % 2 else 1.0
            with torch.no_grad():
                for index, (param, noise) in enumerate(zip(params, noises, strict=True)):
                    if sign > 0:
                        generator.manual_seed(1000 * index + sample)
                        torch.randn(noise.shape, generator=generator, out=noise)
                    torch.addcmul(means[index], stds[index], noise, value=sign, out=param.data)
                    param.grad = None
            loss_fn(model(x), y).backward()
            with torch.no_grad():
                for index, param in enumerate(params):
                    sums[index].add_(param.grad)
                    weighted[index].addcmul_(param.grad, noises[index], value=sign)
        with torch.no_grad():
            for mean, std, total, param in zip(means, stds, sums, params, strict=True):
                mean.addcmul_(std, total, value=-1e-9)
                param.data.copy_(mean)

    return step


def bare_stacked_loop_ms(x: torch.Tensor, y: torch.Tensor, k: int, repeats: int,
                         sizes: tuple[int, ...] = (784, 100, 100, 10)) -> float:
    """The diagonal K-sample step of an MLP with the samples stacked, reduced to what it cannot avoid: antithetic
    noise for each tensor (one draw per pair), the K sampled weights, one batched forward and backward of the K
    networks (`baddbmm`), then E[g] and E[g eps] summed over the samples and a trivial update."""
    means = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True):
        means += [0.05 * torch.randn(fan_out, fan_in, device=x.device), torch.zeros(fan_out, device=x.device)]
    stds = [torch.full_like(mean, 0.047) for mean in means]
    generator = torch.Generator(device=x.device)
    targets = y.repeat(k)

    def step() -> None:
        noises = []
        for index, mean in enumerate(means):
            generator.manual_seed(index)
            half = torch.randn(((k + 1) // 2, *mean.shape), generator=generator, device=x.device)
            noises.append(torch.cat([half, -half])[:k])
        params = [torch.addcmul(mean, std, noise).requires_grad_() for mean, std, noise in
                  zip(means, stds, noises, strict=True)]
        hidden = x.expand(k, *x.shape)
        for layer in range(len(sizes) - 1):
            weight, bias = params[2 * layer], params[2 * layer + 1]
            hidden = torch.baddbmm(bias[:, None, :], hidden, weight.transpose(1, 2))
            if layer < len(sizes) - 2:
                hidden = hidden.relu()
        loss = F.cross_entropy(hidden.reshape(-1, sizes[-1]), targets, reduction="sum")
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for mean, std, grad, noise in zip(means, stds, grads, noises, strict=True):
                mean.addcmul_(std, grad.sum(0), value=-1e-9)
                std.addcmul_(std, (grad * noise).sum(0), value=-1e-12)

    return median_ms(step, repeats)


if __name__ == "__main__":
    main()
