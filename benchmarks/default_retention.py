"""What `FOOVB(model)` remembers on a freshly built model: first-task and average accuracy after short drift streams.

Every learner of a seed starts from the same torch-initialised model (the way users build it) and trains with
step(closure) on the mean F.cross_entropy loss, batch 128, K = 10 (no task boundaries are given):

* permuted: MNIST then 3 pixel permutations of it, 300 steps each (1,200 steps);
* rotated: MNIST turned gradually from upright to 90 degrees over 1,200 steps, cut into 4 periods of 300
  (task t: the test set at the angle of the middle of period t).

Models: the paper's 784-100-100-10 MLP and a small CNN (two 5x5 convolutions of stride 2, 8 and 16 channels, one
Linear head), both with torch's default initialisation. Learners: `FOOVB(model)` (posterior "auto": the
matrix-variate family on both models) and `FOOVB(model, "diagonal")`, each also with init="paper" (the paper's
re-initialisation of the means; for the diagonal family also with one std_init 0.047 for every layer, its default
before the per-layer prior), SGD (lr 0.1) and Adam (lr 1e-3). Prints the accuracy of the posterior mean on each
task's test set after the stream, their average and each default's distance to the best FOO-VB row of its family.

    python benchmarks/default_retention.py [--seeds 0] [--models mlp,cnn] [--streams permuted,rotated]
        [--steps-per-task 300] [--threads 1] [--learners ...] [--json out.json]

About 12 minutes per stream for the MLP and 16 for the CNN, per seed, on 1 thread of this project's 2-core CPU
beside other runs. Output: docs/results/default_prior/default_retention.txt; docs/results.md, "The default prior".
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from foovb import FOOVB
from foovb_suite.scenarios import DiscretePermutedMNIST, PermutedMNIST, RotatedMNIST

NUM_TASKS = 4


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Unflatten(1, (1, 28, 28)), nn.Conv2d(1, 8, 5, stride=2), nn.ReLU(),
                         nn.Conv2d(8, 16, 5, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(256, 10))


MODELS = {"mlp": mlp, "cnn": cnn}
# name -> the optimizer built on the model, as a user would write it
LEARNERS: dict[str, Callable[[nn.Module, int], torch.optim.Optimizer]] = {
    "SGD lr 0.1": lambda model, seed: torch.optim.SGD(model.parameters(), lr=0.1),
    "Adam lr 1e-3": lambda model, seed: torch.optim.Adam(model.parameters(), lr=1e-3),
    "FOOVB(model)": lambda model, seed: FOOVB(model, seed=seed),  # "auto": matrix-variate on both models
    'FOOVB(model, "kronecker", init="paper")': lambda model, seed: FOOVB(model, "kronecker", init="paper", seed=seed),
    'FOOVB(model, "diagonal")': lambda model, seed: FOOVB(model, "diagonal", seed=seed),
    'FOOVB(model, "diagonal", init="paper")': lambda model, seed: FOOVB(model, "diagonal", init="paper", seed=seed),
    'FOOVB(model, "diagonal", init="paper", std_init=0.047)':
        lambda model, seed: FOOVB(model, "diagonal", init="paper", std_init=0.047, seed=seed),
}
FAMILY = {"FOOVB(model)": "kronecker", 'FOOVB(model, "kronecker", init="paper")': "kronecker",
          'FOOVB(model, "diagonal")': "diagonal", 'FOOVB(model, "diagonal", init="paper")': "diagonal",
          'FOOVB(model, "diagonal", init="paper", std_init=0.047)': "diagonal"}
DEFAULTS = ("FOOVB(model)", 'FOOVB(model, "diagonal")')  # what a user gets without arguments, and per family


def stream(name: str, steps_per_task: int, seed: int):
    """The scenario object of a stream (its `batches()` and `test_set(task)`)."""
    if name == "permuted":
        return DiscretePermutedMNIST(PermutedMNIST(NUM_TASKS, seed=seed), epochs_per_task=1, batch_size=128,
                                     seed=seed, train_subset=128 * steps_per_task)
    return RotatedMNIST(PermutedMNIST(1, seed=seed), num_tasks=NUM_TASKS, iterations_per_task=steps_per_task,
                        batch_size=128, max_angle=90.0, seed=seed)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy of the weights in the model (FOOVB leaves the posterior mean there)."""
    model.eval()
    return sum((model(x[i:i + 2000]).argmax(1) == y[i:i + 2000]).sum().item() for i in range(0, len(x), 2000)) / len(x)


def run(model_name: str, learner: str, scenario, seed: int) -> tuple[list[float], float]:
    """Train one learner on the stream; each task's test accuracy after it, and the seconds it took."""
    torch.manual_seed(seed)  # the same initial weights for every learner of this seed
    model = MODELS[model_name]()
    optimizer = LEARNERS[learner](model, seed)
    tic = time.perf_counter()
    model.train()
    for _, batch in scenario.batches():
        def closure(x: torch.Tensor = batch.x, y: torch.Tensor = batch.y) -> torch.Tensor:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        if isinstance(optimizer, FOOVB):
            optimizer.step(closure)
        else:
            optimizer.zero_grad()
            closure()
            optimizer.step()
    seconds = time.perf_counter() - tic
    return [accuracy(model, *scenario.test_set(task)) for task in range(scenario.num_tasks)], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0", help="comma-separated")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--streams", default="permuted,rotated")
    parser.add_argument("--steps-per-task", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--learners", default=";".join(LEARNERS), type=lambda text: text.split(";"),
                        help="';'-separated names among: " + "; ".join(LEARNERS))
    parser.add_argument("--json", help="also write every result to this JSON file")
    args = parser.parse_args()
    unknown = [name for name in args.learners if name not in LEARNERS]
    if unknown:
        parser.error(f"unknown learners {unknown}; choose among {list(LEARNERS)}")
    torch.set_num_threads(args.threads)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {NUM_TASKS} tasks x "
          f"{args.steps_per_task} steps, batch 128, K = 10, seeds {seeds}; accuracy (%) of the posterior mean after "
          "the stream, mean over the seeds", flush=True)
    results = []
    for stream_name in args.streams.split(","):
        for model_name in args.models.split(","):
            print(f"\n### {stream_name} stream, {model_name}\n\n| learner | first task | average | vs SGD (first task) "
                  "| seconds |\n|---|---|---|---|---|", flush=True)
            rows = {}
            for learner in args.learners:
                accs, secs = zip(*(run(model_name, learner, stream(stream_name, args.steps_per_task, seed), seed)
                                   for seed in seeds), strict=True)
                first = 100 * sum(a[0] for a in accs) / len(seeds)
                average = 100 * sum(sum(a) / len(a) for a in accs) / len(seeds)
                rows[learner] = (first, average)
                sgd = rows.get("SGD lr 0.1", (float("nan"),))[0]
                print(f"| {learner} | {first:.1f} | {average:.1f} | {first - sgd:+.1f} | "
                      f"{sum(secs) / len(secs):.0f} |", flush=True)
                results.append({"stream": stream_name, "model": model_name, "learner": learner, "seeds": seeds,
                                "task_accuracy": [list(a) for a in accs], "first_task": first, "average": average,
                                "seconds": list(secs)})
            for default in DEFAULTS:
                family = FAMILY[default]
                best = [name for name in rows if FAMILY.get(name) == family]
                if default in rows and len(best) > 1:
                    top = max(best, key=lambda name: rows[name][1])
                    print(f"{family} default: average {rows[default][1] - rows[top][1]:+.1f} points from the best "
                          f"{family} row ({top})", flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
