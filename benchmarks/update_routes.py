"""The matrix-variate UPDATE at width 1000 by three decomposition routes (issue 30): time and accuracy.

The update of a float32 factor decomposes N = A^T T (or its r x n low-rank core) by one of:
  * float64 Gram (the library's route): eigh of N N^T in float64;
  * float32 SVD;
  * float32 Gram: eigh of N N^T in float32.
Prints, measured in this one run: the step and UPDATE times of step_batched for a 784-w-w-10 MLP (K=10, batch
128, random batch) by each route, then each route's error on one dense w x w factor against float64 SVDs of the
same float32-rounded inputs, in units of float32 eps times the largest entry (the bound of
tests/test_linalg.py::test_float32_update_by_gram_route_matches_float64_svd_to_float32_precision is 4), for
s_max = ||N|| in 0.3, 1, 2 (the benchmarks' layers stay below 2). (The low-rank route cannot help at this width:
the dense factors' statistics have rank K r = 1280 >= w.)

    python benchmarks/update_routes.py [--width 1000] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import functools

import torch
from step_time import update_share

import foovb.posteriors
from foovb.linalg import LowRank, sqrt_covariance_update

ROUTES = {"float64 Gram (library)": (torch.float64, True), "float32 SVD": (torch.float32, False),
          "float32 Gram": (torch.float32, True)}


def route_error(width: int, s_max: float, dtype: torch.dtype, gram: bool) -> float:
    g = torch.Generator().manual_seed(0)
    eye = torch.eye(width, dtype=torch.float64)
    a = (0.05 * (eye + 0.01 * torch.randn(width, width, generator=g, dtype=torch.float64))).float()
    t = torch.randn(width, 1280, generator=g, dtype=torch.float64) @ torch.randn(1280, width, generator=g,
                                                                                dtype=torch.float64)
    t = (t * (s_max / torch.linalg.matrix_norm(a.double().T @ t, 2))).float()
    exact = sqrt_covariance_update(a.double(), LowRank(dense=t.double()), gram=False)
    got = sqrt_covariance_update(a, LowRank(dense=t), dtype=dtype, gram=gram)
    return ((got.double() - exact).abs().max() / (torch.finfo(torch.float32).eps * exact.abs().max())).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x, y = torch.randn(128, 784), torch.randint(10, (128,))
    w = args.width
    print(f"torch {torch.__version__}, {args.threads} thread(s); matrix-variate FOO-VB, MLP 784-{w}-{w}-10, K=10, "
          f"batch 128; step_batched, median of {args.repeats}\n")
    print("| route | step ms | UPDATE ms | UPDATE share | error / (eps32 max), s_max 0.3 / 1 / 2 |")
    print("|---|---|---|---|---|")
    library = foovb.posteriors.sqrt_covariance_update
    try:
        for name, (dtype, gram) in ROUTES.items():
            foovb.posteriors.sqrt_covariance_update = functools.partial(library, dtype=dtype, gram=gram)
            step, update = update_share(x, y, 10, args.repeats, sizes=(784, w, w, 10))
            errors = " / ".join(f"{route_error(w, s_max, dtype, gram):.2f}" for s_max in (0.3, 1.0, 2.0))
            print(f"| {name} | {step:.0f} | {update:.0f} | {update / step:.0%} | {errors} |", flush=True)
    finally:
        foovb.posteriors.sqrt_covariance_update = library


if __name__ == "__main__":
    main()
