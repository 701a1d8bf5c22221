"""Time per training iteration inside the experiment loop: a config's own stream and learner, as `foovb run`
trains them (next batch, then `learner.observe`), for each thread count asked for.

`step_time.py` times isolated steps on one batch; this script catches what only the loop shows (it is how a
thread pool that drew the noise was found to double the matrix-variate iteration at 2 threads).

    python benchmarks/loop_time.py configs/continuous_pmnist_foovb_kronecker.yaml \\
        --set learner.params.antithetic=true --steps 150 --threads 1,2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from foovb_suite.config import load_config
from foovb_suite.factories import build_learner, build_scenario, resolve_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=150, help="timed iterations (after 20 warm-up ones)")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    args = parser.parse_args()
    config = load_config(args.config, args.overrides)
    scenario = build_scenario(config)
    device = resolve_device(config.device)
    print(f"{config.name}: {config.learner.kind} {config.learner.params}, torch {torch.__version__}, "
          f"{args.steps} iterations after 20 warm-up ones\n")
    print("| threads | ms per iteration (mean) | median | iterations / s |")
    print("|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        learner = build_learner(config, scenario, device)
        stream = scenario.batches(0)
        times = []
        for step in range(20 + args.steps):
            tic = time.perf_counter()
            _, batch = next(stream)
            task = int(batch.task[0]) if scenario.task_aware else None
            learner.observe(batch.x.to(device), batch.y.to(device), task)
            if step >= 20:
                times.append(time.perf_counter() - tic)
        mean_ms = 1e3 * statistics.fmean(times)
        print(f"| {threads} | {mean_ms:.1f} | {1e3 * statistics.median(times):.1f} | {1e3 / mean_ms:.1f} |")


if __name__ == "__main__":
    main()
