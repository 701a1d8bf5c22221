"""step_batched against step(closure) as the layers widen (issue 30: the batched path must never be slower).

Diagonal FOO-VB, K=10, batch 128, MLP 784-w-w-10, a random batch; prints, measured in this one run, the median
step time of each path and their ratio, for every width and chunk size. Layers of WIDE_LAYER weights or more are
evaluated one sample at a time by step_batched too (foovb.engine.WIDE_LAYER).

    python benchmarks/wide_layers.py [--widths 100,400,1000] [--repeats 8] [--threads 1]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from step_time import median_ms

from foovb import FOOVB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", default="100,400,1000")
    parser.add_argument("--chunks", default="0,5,2,1", help="chunk sizes of step_batched (0: all K at once)")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x, y = torch.randn(128, 784), torch.randint(10, (128,))
    print(f"torch {torch.__version__}, {args.threads} thread(s); diagonal FOO-VB, K=10, batch 128\n")
    print("| width | step(closure) ms | step_batched chunk | step_batched ms | batched / closure |")
    print("|---|---|---|---|---|")
    for width in map(int, args.widths.split(",")):
        model = torch.nn.Sequential(torch.nn.Linear(784, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                    torch.nn.ReLU(), torch.nn.Linear(width, 10))
        opt = FOOVB(model, "diagonal", 10, seed=0)

        def closure(model=model) -> torch.Tensor:
            loss = F.cross_entropy(model(x), y, reduction="sum")
            loss.backward()
            return loss

        sequential = median_ms(lambda opt=opt, closure=closure: opt.step(closure), args.repeats)
        for chunk in map(int, args.chunks.split(",")):
            batched = median_ms(lambda opt=opt, chunk=chunk: opt.step_batched(x, y, chunk_size=chunk or None),
                                args.repeats)
            print(f"| {width} | {sequential:.1f} | {chunk or 'all'} | {batched:.1f} | {batched / sequential:.2f} |")


if __name__ == "__main__":
    main()
