"""FOO-VB step(closure) vs step_batched vs SGD on the paper's 784-100-100-10 MLP, batch 128 (issue 30).

Prints, measured in this one run on this machine, the SGD step time and, for the matrix-variate (Kronecker)
and diagonal families at K = 10, the step(closure) and step_batched times, their ratios to SGD and to each
other. On the closure path the matrix-variate statistics of nn.Linear layers are kept low-rank from the
captured layer inputs and output gradients, as step_batched builds them (issue 30).

    python benchmarks/closure_path.py [--repeats 20] [--threads N] [--k 10]
"""

from __future__ import annotations

import argparse

import torch
from step_time import foovb_step_ms, sgd_step_ms

from foovb_suite.data import MNIST_MEAN, MNIST_STD, load_mnist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--k", type=int, default=10, help="Monte Carlo samples per step")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    mnist = load_mnist()  # a real batch: random labels make the summed-loss updates diverge
    x = ((mnist.train_images[:128].float() / 255 - MNIST_MEAN) / MNIST_STD).flatten(1)
    y = mnist.train_labels[:128]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; MLP 784-100-100-10, batch 128, "
          f"K={args.k}; median of {args.repeats} steps")
    sgd = sgd_step_ms(x, y, args.repeats)
    print(f"\nSGD step: {sgd:.3f} ms\n")
    print("| posterior | step(closure) ms | / SGD | step_batched ms | / SGD | closure / batched |")
    print("|---|---|---|---|---|---|")
    for posterior in ("kronecker", "diagonal"):
        closure = foovb_step_ms(x, y, posterior, args.k, False, args.repeats)
        batched = foovb_step_ms(x, y, posterior, args.k, True, args.repeats)
        print(f"| {posterior} | {closure:.2f} | {closure / sgd:.1f} | {batched:.2f} | {batched / sgd:.1f} | "
              f"{closure / batched:.2f} |")


if __name__ == "__main__":
    main()
