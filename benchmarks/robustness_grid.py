"""Does `FOOVB(model)` hold where nobody tuned it? A grid of models, streams and batch sizes, each cell against SGD
and Adam at their best of three learning rates for that cell.

Cells: a model kind on a stream that fits it, at batch 16, 64 and 256 (63 cells):

* models: the paper's 784-100-100-10 MLP (`mlp`), a narrow 784-20-20-10 MLP (`narrow`), an MLP with LayerNorm
  (`ln_mlp`), a small CNN (`cnn`), the same with BatchNorm (`bn_cnn`), the paper's vision-mix LeNet (`lenet`), a GRU
  reading a 14 x 14 digit row by row (`gru`), a 1-64-64-1 tanh regression net (`regression`) and a 784-32-784
  ReLU autoencoder (`autoencoder`); every one as torch initialises it;
* streams: `permuted` (MNIST then 2 pixel permutations), `rotated` (turned gradually from 0 to 90 degrees, 3
  periods), `fashion` (MNIST then Fashion-MNIST into one shared 10-way head), `split` (Split MNIST
  domain-incremental: 5 digit pairs, 2 classes), `iid` (MNIST, no drift: plasticity alone), for the regression net
  `drift` (y = sin(2x), its inputs sliding from [-3, -1] to [1, 3]: 3 regions) and `iid` (y = sin(x) + noise 0.1
  on [-2, 2], the issue's case); the autoencoder reconstructs permuted or i.i.d. MNIST.

Every task sees the same number of training examples at every batch size (`--examples`, 6,144: 384 steps of 16,
96 of 64, 24 of 256); the test sets hold 1,000 examples per task. Losses are the means users write
(F.cross_entropy, F.mse_loss); every learner of a cell and seed starts from the same weights and batches. Learners:
`FOOVB(model, "diagonal")` and `FOOVB(model)` (learner `foovb_kronecker`: posterior "auto", the matrix-variate
family on every layer of the grid's models but the autoencoder's 784-output layer, which "auto" makes diagonal; K = 10;
a candidate's settings with `--diagonal` / `--kronecker` and a `--tag`), SGD at lr 0.01, 0.03, 0.1 and Adam at
3e-4, 1e-3, 3e-3 (the best lr of each per cell, by the average over tasks).

Held-out half: a cell is in the tuning half when the first byte of the SHA-256 of its name is even, else in the
held-out half. Candidates are compared on `--half tuning`; the held-out half is run once, for the chosen default.

Metrics per cell (the posterior mean's): accuracy (%) or mean squared error per task after the stream, their
average, the first task's (retention) and the last task's, divergence (an exception, or a non-finite metric).
Against the best baseline: delta average and delta first task in points (accuracy), or the error ratio.

    python benchmarks/robustness_grid.py --out runs/grid [--quick] [--half tuning|heldout|all] [--seeds 0,1]
        [--jobs 2] [--tag default --diagonal '{}' --kronecker '{}'] [--summary-only] [--data-dir ../shared/data]

Resumable: every finished run is one line of OUT/results.jsonl, and a new call skips what is there (the key: cell,
learner, tag, seed, scale). Outputs: OUT/summary_TAG.csv (a row per cell), OUT/heatmap_TAG.png (FOO-VB minus the
best baseline) and the targets of the issue per half, printed. `--quick`: 12 cells, seed 0, 2,048 examples per task
(minutes). The whole grid at 2 seeds: about 3 hours on 2 jobs of this project's 2-core CPU.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from foovb import FOOVB

BATCH_SIZES = (16, 64, 256)
SGD_LRS = (0.01, 0.03, 0.1)
ADAM_LRS = (3e-4, 1e-3, 3e-3)
NUM_TASKS = 3
TEST_SIZE = 1000
FASHION_DIRS = ("../shared/data", "data")  # where --data-dir is looked for when not given

# model kind -> the streams it is run on
MODEL_STREAMS = {
    "mlp": ("permuted", "rotated", "fashion", "split", "iid"),
    "narrow": ("permuted", "split"),
    "ln_mlp": ("permuted", "rotated"),
    "cnn": ("rotated", "fashion"),
    "bn_cnn": ("permuted", "iid"),
    "lenet": ("fashion", "split"),
    "gru": ("permuted", "iid"),
    "regression": ("drift", "iid"),
    "autoencoder": ("permuted", "iid"),
}
QUICK_CELLS = ("mlp/permuted/64", "mlp/split/16", "narrow/split/256", "ln_mlp/rotated/16", "cnn/fashion/64",
               "bn_cnn/permuted/16", "lenet/split/64", "gru/permuted/64", "regression/drift/16",
               "regression/iid/64", "autoencoder/permuted/64", "mlp/iid/256")


def cell_names() -> list[str]:
    return [f"{model}/{stream}/{batch}" for model, streams in MODEL_STREAMS.items() for stream in streams
            for batch in BATCH_SIZES]


def half_of(cell: str) -> str:
    """The fixed rule that splits the grid: the parity of the first byte of the SHA-256 of the cell's name."""
    return "tuning" if hashlib.sha256(cell.encode()).digest()[0] % 2 == 0 else "heldout"


# -- models ------------------------------------------------------------------------------------------------------
class RowGRU(nn.Module):
    """A GRU reading a 14 x 14 image (average-pooled MNIST) one row per time step; a Linear head on the last state."""

    def __init__(self, num_outputs: int):
        super().__init__()
        self.gru = nn.GRU(14, 64, batch_first=True)
        self.head = nn.Linear(64, num_outputs)

    def forward(self, x: Tensor) -> Tensor:
        rows = F.avg_pool2d(x, 2).squeeze(1)  # (n, 14, 14): 14 steps of 14 features
        return self.head(self.gru(rows)[0][:, -1])


def build_model(kind: str, num_outputs: int) -> nn.Module:
    flat = nn.Flatten()
    if kind == "mlp":
        return nn.Sequential(flat, nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(),
                             nn.Linear(100, num_outputs))
    if kind == "narrow":
        return nn.Sequential(flat, nn.Linear(784, 20), nn.ReLU(), nn.Linear(20, 20), nn.ReLU(),
                             nn.Linear(20, num_outputs))
    if kind == "ln_mlp":
        return nn.Sequential(flat, nn.Linear(784, 100), nn.LayerNorm(100), nn.ReLU(), nn.Linear(100, 100),
                             nn.LayerNorm(100), nn.ReLU(), nn.Linear(100, num_outputs))
    if kind == "cnn":
        return nn.Sequential(nn.Conv2d(1, 8, 5, stride=2), nn.ReLU(), nn.Conv2d(8, 16, 5, stride=2), nn.ReLU(),
                             flat, nn.Linear(256, num_outputs))
    if kind == "bn_cnn":
        return nn.Sequential(nn.Conv2d(1, 8, 5, stride=2), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 16, 5, stride=2),
                             nn.BatchNorm2d(16), nn.ReLU(), flat, nn.Linear(256, num_outputs))
    if kind == "lenet":
        return nn.Sequential(nn.Conv2d(1, 20, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(20, 50, 5), nn.ReLU(),
                             nn.MaxPool2d(2), flat, nn.Linear(800, 500), nn.ReLU(), nn.Linear(500, num_outputs))
    if kind == "gru":
        return RowGRU(num_outputs)
    if kind == "regression":
        return nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    if kind == "autoencoder":
        return nn.Sequential(flat, nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 784))
    raise ValueError(f"unknown model {kind!r}")


# -- streams -----------------------------------------------------------------------------------------------------
@dataclass
class Stream:
    """Training batches in order and one test set per task; `error`: the metric is a mean squared error;
    `first_steps`: the training steps of the first task (drift streams; None for i.i.d. ones), after which the first
    task is also evaluated: what it kept at the end can be no more than what it reached then."""

    batches: Callable[[], Iterator[tuple[Tensor, Tensor]]]
    tests: list[tuple[Tensor, Tensor]]
    error: bool
    num_outputs: int
    first_steps: int | None = None


_IMAGES: dict[str, tuple[Tensor, Tensor, Tensor, Tensor]] = {}


def images(name: str, data_dir: str | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(train x, train y, test x, test y), x float (n, 1, 28, 28) standardised with MNIST's statistics."""
    if name not in _IMAGES:
        from foovb_suite.data.datasets import load_dataset

        data = load_dataset(name, data_dir)

        def scale(x: Tensor) -> Tensor:
            return (x.float() / 255 - 0.1307) / 0.3081

        _IMAGES[name] = (scale(data.train_images), data.train_labels, scale(data.test_images), data.test_labels)
    return _IMAGES[name]


def rotate(x: Tensor, degrees: float) -> Tensor:
    radians = math.radians(degrees)
    cos, sin = math.cos(radians), math.sin(radians)
    theta = torch.tensor([[cos, -sin, 0.0], [sin, cos, 0.0]]).expand(len(x), 2, 3)
    background = (0 - 0.1307) / 0.3081
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x - background, grid, align_corners=False) + background


def make_stream(model: str, stream: str, batch: int, examples: int, seed: int, data_dir: str | None) -> Stream:
    """The stream of a cell; its randomness (permutations, batch order, test subsets) from `seed` alone."""
    gen = torch.Generator().manual_seed(1000 + seed)
    steps = max(1, examples // batch)
    if model == "regression":
        return regression_stream(stream, batch, steps, gen)
    train_x, train_y, test_x, test_y = images("mnist", data_dir)
    test_rows = torch.randperm(len(test_x), generator=gen)[:TEST_SIZE]
    if stream in ("permuted", "iid"):
        num_tasks = NUM_TASKS if stream == "permuted" else 1
        perms = [torch.arange(784)] + [torch.randperm(784, generator=gen) for _ in range(num_tasks - 1)]

        def permute(x: Tensor, task: int) -> Tensor:
            return x.flatten(1)[:, perms[task]].reshape(x.shape)

        task_steps = steps * (NUM_TASKS if stream == "iid" else 1)  # iid: the same total examples, no drift
        order = [torch.randint(len(train_x), (task_steps, batch), generator=gen) for _ in range(num_tasks)]
        tests = [(permute(test_x[test_rows], t), test_y[test_rows]) for t in range(num_tasks)]

        def batches() -> Iterator[tuple[Tensor, Tensor]]:
            for task in range(num_tasks):
                for rows in order[task]:
                    x = permute(train_x[rows], task)
                    yield x, (x.flatten(1) if model == "autoencoder" else train_y[rows])

        if model == "autoencoder":
            tests = [(x, x.flatten(1)) for x, _ in tests]
        return Stream(batches, tests, model == "autoencoder", 10, steps if stream == "permuted" else None)
    if stream == "rotated":
        total = steps * NUM_TASKS
        order = torch.randint(len(train_x), (total, batch), generator=gen)
        angles = [90.0 * (t + 0.5) / NUM_TASKS for t in range(NUM_TASKS)]
        tests = [(rotate(test_x[test_rows], angle), test_y[test_rows]) for angle in angles]

        def batches() -> Iterator[tuple[Tensor, Tensor]]:
            for i, rows in enumerate(order):
                yield rotate(train_x[rows], 90.0 * i / total), train_y[rows]

        return Stream(batches, tests, False, 10, steps)  # the first period: the first test angle's
    if stream == "fashion":
        fashion = images("fashion_mnist", data_dir)
        sets = [(train_x, train_y, test_x[test_rows], test_y[test_rows]),
                (fashion[0], fashion[1], fashion[2][test_rows], fashion[3][test_rows])]
        order = [torch.randint(len(s[0]), (steps, batch), generator=gen) for s in sets]

        def batches() -> Iterator[tuple[Tensor, Tensor]]:
            for (x_all, y_all, _, _), rows_all in zip(sets, order, strict=True):
                for rows in rows_all:
                    yield x_all[rows], y_all[rows]

        return Stream(batches, [(s[2], s[3]) for s in sets], False, 10, steps)
    if stream == "split":
        pairs = [(2 * t, 2 * t + 1) for t in range(5)]
        train_sets, tests = [], []
        for pair in pairs:
            rows = torch.nonzero((train_y == pair[0]) | (train_y == pair[1])).flatten()
            train_sets.append(rows)
            test = torch.nonzero((test_y == pair[0]) | (test_y == pair[1])).flatten()
            test = test[torch.randperm(len(test), generator=gen)[:TEST_SIZE]]
            tests.append((test_x[test], test_y[test] % 2))
        order = [rows[torch.randint(len(rows), (steps, batch), generator=gen)] for rows in train_sets]

        def batches() -> Iterator[tuple[Tensor, Tensor]]:
            for rows_all in order:
                for rows in rows_all:
                    yield train_x[rows], train_y[rows] % 2

        return Stream(batches, tests, False, 2, steps)
    raise ValueError(f"unknown stream {stream!r}")


def regression_stream(stream: str, batch: int, steps: int, gen: torch.Generator) -> Stream:
    if stream == "iid":  # the case: sin(x) + noise on [-2, 2]; error against sin(x) on the training inputs
        x_all = torch.rand(512, 1, generator=gen) * 4 - 2
        y_all = torch.sin(x_all) + 0.1 * torch.randn(512, 1, generator=gen)
        order = torch.randint(512, (steps * NUM_TASKS, batch), generator=gen)

        def batches() -> Iterator[tuple[Tensor, Tensor]]:
            for rows in order:
                yield x_all[rows], y_all[rows]

        return Stream(batches, [(x_all, torch.sin(x_all))], True, 1)
    if stream == "drift":  # the inputs' window slides from [-3, -1] to [1, 3]; y = sin(2x) + noise 0.05
        total = steps * NUM_TASKS
        low = torch.linspace(-3, 1, total)
        tests = []
        for t in range(NUM_TASKS):
            x = torch.linspace(-3 + 2 * t, -1 + 2 * t, 200)[:, None]
            tests.append((x, torch.sin(2 * x)))
        noise = torch.randn(total, batch, 1, generator=gen)
        uniform = torch.rand(total, batch, 1, generator=gen)

        def batches() -> Iterator[tuple[Tensor, Tensor]]:
            for i in range(total):
                x = low[i] + 2 * uniform[i]
                yield x, torch.sin(2 * x) + 0.05 * noise[i]

        return Stream(batches, tests, True, 1, steps)
    raise ValueError(f"unknown regression stream {stream!r}")


# -- one run -----------------------------------------------------------------------------------------------------
def learner_names() -> list[str]:
    return (["foovb_diagonal", "foovb_kronecker"] + [f"sgd_{lr:g}" for lr in SGD_LRS]
            + [f"adam_{lr:g}" for lr in ADAM_LRS])


def make_optimizer(learner: str, model: nn.Module, seed: int, candidate: dict) -> torch.optim.Optimizer:
    if learner.startswith("foovb_"):
        family = learner.removeprefix("foovb_")  # "kronecker": FOOVB(model)'s "auto", the matrix-variate default
        return FOOVB(model, "auto" if family == "kronecker" else family, seed=seed, **candidate.get(family, {}))
    kind, lr = learner.split("_")
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=float(lr))
    return torch.optim.Adam(model.parameters(), lr=float(lr))


@torch.no_grad()
def evaluate(model: nn.Module, tests: list[tuple[Tensor, Tensor]], error: bool) -> list[float]:
    model.eval()
    out = []
    for x, y in tests:
        pred = torch.cat([model(x[i:i + 500]) for i in range(0, len(x), 500)])
        out.append(F.mse_loss(pred, y).item() if error else 100 * (pred.argmax(1) == y).float().mean().item())
    model.train()
    return out


def run_one(job: dict) -> dict:
    """Train one learner on one cell and seed; the record of the run (never raises: a failure is a divergence)."""
    torch.set_num_threads(1)
    model_kind, stream_name, batch = job["cell"].split("/")
    stream = make_stream(model_kind, stream_name, int(batch), job["examples"], job["seed"], job["data_dir"])
    torch.manual_seed(job["seed"])  # the same initial weights for every learner of this seed
    model = build_model(model_kind, stream.num_outputs)
    loss_fn = F.mse_loss if stream.error else F.cross_entropy
    record = {key: job[key] for key in ("cell", "learner", "tag", "seed", "examples")}
    record.update(half=half_of(job["cell"]), error_metric=stream.error, diverged=False, reason="")
    tic = time.perf_counter()
    try:
        optimizer = make_optimizer(job["learner"], model, job["seed"], job["candidate"])
        losses = []
        for step, (x, y) in enumerate(stream.batches(), 1):
            def closure(x: Tensor = x, y: Tensor = y) -> Tensor:
                optimizer.zero_grad()
                loss = loss_fn(model(x), y)
                loss.backward()
                return loss

            loss = optimizer.step(closure)  # torch optimizers return the closure's tensor, FOOVB a float
            loss = float(loss.detach() if isinstance(loss, Tensor) else loss)
            if not math.isfinite(loss):
                raise FloatingPointError(f"non-finite loss {loss}")
            losses.append(loss)
            if step == stream.first_steps:  # the first task as learned, before the drift
                record["first_learned"] = evaluate(model, stream.tests[:1], stream.error)[0]
        window = max(1, min(10, len(losses) // 4))
        first, last = statistics.fmean(losses[:window]), statistics.fmean(losses[-window:])
        record.update(loss_first=first, loss_last=last)
        if last > 100 * max(first, 1e-3):  # the training loss grew a hundredfold: diverged without an error
            raise FloatingPointError(f"training loss grew from {first:.3g} to {last:.3g}")
        metrics = evaluate(model, stream.tests, stream.error)
        if not all(math.isfinite(m) for m in metrics):
            raise FloatingPointError("non-finite test metric")
    except Exception as error:  # noqa: BLE001 - any failure of a learner is its divergence, recorded
        metrics = [math.nan] * len(stream.tests)
        record.update(diverged=True, reason=f"{type(error).__name__}: {str(error)[:200]}")
    record.update(tasks=metrics, seconds=round(time.perf_counter() - tic, 2))
    return record


# -- summaries ---------------------------------------------------------------------------------------------------
def key_of(record: dict) -> tuple:
    return record["cell"], record["learner"], record["tag"], record["seed"], record["examples"]


def load_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill: that run is redone
            continue
    return records


def cell_summary(records: list[dict], cell: str, tag: str, tried: dict | None = None) -> dict | None:
    """Seed-averaged metrics of the cell's FOO-VB learners (of `tag`) against the best SGD and Adam, and against the
    best FOO-VB setting tried in the cell: `tried` maps a cell to (family, setting, average) of other runs."""
    tried = tried or {}
    mine = [r for r in records if r["cell"] == cell]
    if not mine:
        return None
    error = mine[0]["error_metric"]

    def avg(values: list[float]) -> float:
        return statistics.fmean(values) if values else math.nan

    def stats(learner: str, learner_tag: str) -> dict | None:
        runs = [r for r in mine if r["learner"] == learner and r["tag"] == learner_tag]
        if not runs:
            return None
        diverged = any(r["diverged"] for r in runs)
        bad = math.inf if error else 0.0
        tasks = [[bad if not math.isfinite(m) else m for m in r["tasks"]] for r in runs]
        learned = [r["first_learned"] for r in runs if math.isfinite(r.get("first_learned", math.nan))]
        return {"average": avg([avg(t) for t in tasks]), "first": avg([t[0] for t in tasks]),
                "last": avg([t[-1] for t in tasks]), "diverged": diverged, "seeds": len(runs),
                "first_learned": avg(learned) if len(learned) == len(runs) else math.nan}

    better = min if error else max
    baselines = {}
    for kind, lrs in (("sgd", SGD_LRS), ("adam", ADAM_LRS)):
        candidates = [(lr, stats(f"{kind}_{lr:g}", "baseline")) for lr in lrs]
        candidates = [(lr, s) for lr, s in candidates if s is not None]
        if candidates:
            lr, best = better(candidates, key=lambda item: item[1]["average"])
            baselines[kind] = {**best, "lr": lr}
    if len(baselines) < 2:
        return None
    # the first task right after it was learned, the best of any learner (every lr, both families of `tag`): what a
    # learner that forgot nothing would keep; seed-averaged; only where every learner's runs recorded it (runs of
    # an earlier version of this script did not)
    runs = [s for learner in learner_names() for learner_tag in ("baseline", tag)
            if (s := stats(learner, learner_tag)) is not None]
    learned = [s["first_learned"] for s in runs] if all(math.isfinite(s["first_learned"]) for s in runs) else []
    best_average = better(b["average"] for b in baselines.values())
    best_first = better(b["first"] for b in baselines.values())
    row = {"cell": cell, "half": half_of(cell), "metric": "mse" if error else "accuracy",
           "drift": cell.split("/")[1] != "iid", "best_baseline_average": best_average,
           "best_baseline_first": best_first,
           "sgd_lr": baselines["sgd"]["lr"], "adam_lr": baselines["adam"]["lr"]}
    if learned and not error:
        row["best_first_learned"] = better(learned)
    for family in ("diagonal", "kronecker"):
        s = stats(f"foovb_{family}", tag)
        if s is None:
            continue
        row[f"{family}_average"], row[f"{family}_first"] = s["average"], s["first"]
        row[f"{family}_diverged"] = s["diverged"]
        if error:
            row[f"{family}_average_vs_best"] = s["average"] / best_average  # error ratio
            row[f"{family}_first_vs_best"] = s["first"] / best_first
        else:
            row[f"{family}_average_vs_best"] = s["average"] - best_average  # points
            row[f"{family}_first_vs_best"] = s["first"] - best_first
    # the best FOO-VB setting tried in this cell: any tag in the records run on as many seeds as `tag`'s runs (and
    # the `tried` rows of earlier summaries), of either family (`best_foovb_*`) and of the family itself
    seeds = max((s["seeds"] for family in ("diagonal", "kronecker")
                 if (s := stats(f"foovb_{family}", tag)) is not None), default=0)
    settings = [(learner.removeprefix("foovb_"), f"{learner}:{learner_tag}", s["average"])
                for learner, learner_tag in sorted({(r["learner"], r["tag"]) for r in mine
                                                    if r["learner"].startswith("foovb_")})
                if (s := stats(learner, learner_tag)) is not None and s["seeds"] == seeds and not s["diverged"]]
    settings = list({setting: (family, setting, average)
                     for family, setting, average in settings + tried.get(cell, [])}.values())  # each setting once
    if settings and not error:
        _, row["best_foovb_setting"], row["best_foovb_average"] = max(settings, key=lambda item: item[2])
        for family in ("diagonal", "kronecker"):
            own = [average for setting_family, _, average in settings if setting_family == family]
            if f"{family}_average" in row and own:
                row[f"{family}_average_vs_best_foovb"] = row[f"{family}_average"] - row["best_foovb_average"]
                row[f"{family}_average_vs_own_best"] = row[f"{family}_average"] - max(own)
                row[f"{family}_settings_tried"] = len(own)
    return row


def target_counts(rows: list[dict], family: str) -> dict | None:
    """The issue's targets for one family over summary `rows` (`cell_summary`'s): the cells that diverged, the drift
    cells, those whose first task was kept 10 points above the best baseline, those measured and reachable, the
    accuracy cells and those more than 2 points below the best baseline, the error cells and those above 1.5x its
    error, the median accuracy cell vs the best baseline; None if no row has the family."""
    rows = [r for r in rows if f"{family}_average" in r]
    if not rows:
        return None
    drift = [r for r in rows if r["drift"] and r["metric"] == "accuracy"]
    # reachable: the target is at most what the first task reached right after it was learned (any learner)
    measured = [r for r in drift if math.isfinite(r.get("best_first_learned", math.nan))]
    accuracy_rows = [r for r in rows if r["metric"] == "accuracy"]
    error_rows = [r for r in rows if r["metric"] == "mse"]
    return {"rows": rows, "diverged": [r["cell"] for r in rows if r[f"{family}_diverged"]], "drift": drift,
            "kept": [r for r in drift if r[f"{family}_first_vs_best"] >= 10], "measured": measured,
            "reachable": [r for r in measured if r["best_baseline_first"] + 10 <= r["best_first_learned"]],
            "accuracy": accuracy_rows,
            "low": [r["cell"] for r in accuracy_rows if not r[f"{family}_average_vs_best"] >= -2],
            "errors": error_rows, "high": [r["cell"] for r in error_rows if not r[f"{family}_average_vs_best"] <= 1.5],
            "median": statistics.median([r[f"{family}_average_vs_best"] for r in accuracy_rows]) if accuracy_rows
            else math.nan}


def targets(rows: list[dict], family: str) -> list[str]:
    """The issue's targets for one family over `rows`: divergence, drift retention, average vs the best baseline."""
    counts = target_counts(rows, family)
    if counts is None:
        return []
    rows, diverged, drift, kept = counts["rows"], counts["diverged"], counts["drift"], counts["kept"]
    measured, reachable, accuracy_rows, low = counts["measured"], counts["reachable"], counts["accuracy"], counts["low"]
    error_rows, high, median = counts["errors"], counts["high"], counts["median"]
    versus_tried = [r for r in accuracy_rows if f"{family}_average_vs_best_foovb" in r]

    def median_of(column: str) -> float:
        return statistics.median([r[column] for r in versus_tried])

    settings = sorted({r[f"{family}_settings_tried"] for r in versus_tried})
    return [
        f"{family}: {len(rows)} cells; diverged in {len(diverged)} {diverged if diverged else ''}",
        f"  first task >= 10 points above the best baseline in {len(kept)}/{len(drift)} drift cells "
        f"({100 * len(kept) / max(len(drift), 1):.0f}%, target 75%)",
        *([f"  reachable at all (the best baseline's first task + 10 <= the best first task right after it was "
           f"learned, any learner) in {len(reachable)}/{len(measured)} measured drift cells; kept in "
           f"{len([r for r in reachable if r in kept])} of them; out of reach: "
           f"{[r['cell'] for r in measured if r not in reachable]}"] if measured else []),
        f"  average more than 2 points below the best baseline: {len(low)}/{len(accuracy_rows)} {low if low else ''}",
        f"  error above 1.5x the best baseline's: {len(high)}/{len(error_rows)} {high if high else ''}",
        f"  median average vs best baseline (accuracy cells): {median:+.2f} points",
        *([f"  median average vs the best FOO-VB setting tried in the cell (accuracy cells; target >= -2 points): "
           f"{median_of(f'{family}_average_vs_best_foovb'):+.2f} points against either family's settings tried "
           f"(OUT/results.jsonl, --tried), {median_of(f'{family}_average_vs_own_best'):+.2f} against this family's "
           f"({settings[0]}-{settings[-1]} settings)"] if versus_tried else []),
    ]


def tried_in_summaries(paths: list[Path], records: list[dict], tag: str) -> dict:
    """(family, setting, average) per accuracy cell from the summary CSVs of earlier candidates (`--tried`): only
    their cells whose best baseline average equals this run's, the sign of the same cells, seeds and examples."""
    baseline = {cell: row["best_baseline_average"] for cell in {r["cell"] for r in records}
                if (row := cell_summary(records, cell, tag)) is not None and row["metric"] == "accuracy"}
    tried: dict[str, list] = {}
    for path in paths:
        for row in csv.DictReader(path.open()):
            cell = row["cell"]
            if cell not in baseline or not math.isclose(float(row["best_baseline_average"]), baseline[cell],
                                                        rel_tol=1e-3):
                continue
            for family in ("diagonal", "kronecker"):
                if row.get(f"{family}_average") and row.get(f"{family}_diverged") == "False":
                    setting = f"foovb_{family}:{path.stem.removeprefix('summary_')}"
                    tried.setdefault(cell, []).append((family, setting, float(row[f"{family}_average"])))
    return tried


def write_summary(out: Path, records: list[dict], cells: list[str], tag: str, tried: dict) -> list[dict]:
    rows = [row for cell in cells if (row := cell_summary(records, cell, tag, tried)) is not None]
    if not rows:
        return rows
    fields = sorted({key for row in rows for key in row}, key=lambda k: (k != "cell", k))
    tmp = out / f".summary_{tag}.csv.tmp"
    with tmp.open("w", newline="") as file:
        writer = csv.DictWriter(file, fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()})
    tmp.replace(out / f"summary_{tag}.csv")
    heatmap(out / f"heatmap_{tag}.png", rows, tag)
    return rows


def heatmap(path: Path, rows: list[dict], tag: str) -> None:
    """FOO-VB minus the best baseline per cell: points for accuracy cells; for error cells -10 log2(error ratio)
    (10 points a halving of the error), each square annotated with its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [(f, kind) for f in ("diagonal", "kronecker") for kind in ("average", "first")]
    values, labels = [], []
    for row in rows:
        line, text = [], []
        for family, kind in columns:
            value = row.get(f"{family}_{kind}_vs_best", math.nan)
            if row["metric"] == "mse":
                line.append(-10 * math.log2(value) if value and math.isfinite(value) and value > 0 else -40)
                text.append(f"x{value:.2g}")
            else:
                line.append(value if math.isfinite(value) else -40)
                text.append(f"{value:+.0f}")
            if row.get(f"{family}_diverged"):
                text[-1] = "div"
        values.append(line)
        labels.append(text)
    fig, ax = plt.subplots(figsize=(6, 0.22 * len(rows) + 1.5))
    image = ax.imshow(values, cmap="RdBu", vmin=-30, vmax=30, aspect="auto")
    for i, text in enumerate(labels):
        for j, value in enumerate(text):
            ax.text(j, i, value, ha="center", va="center", fontsize=6)
    ax.set_xticks(range(len(columns)), [f"{f}\n{k}" for f, k in columns], fontsize=7)
    ax.set_yticks(range(len(rows)), [f"{r['cell']} ({r['half'][0]})" for r in rows], fontsize=6)
    ax.set_title(f"FOO-VB minus the best of SGD/Adam ({tag})", fontsize=8)
    fig.colorbar(image, ax=ax, label="points (error cells: -10 log2 ratio)")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


# -- command -----------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/robustness_grid")
    parser.add_argument("--quick", action="store_true", help="12 cells, seed 0, 2,048 examples per task")
    parser.add_argument("--half", choices=("tuning", "heldout", "all"), default="all")
    parser.add_argument("--cells", help="comma-separated cell names (model/stream/batch), instead of the grid")
    parser.add_argument("--seeds", default=None, help="comma-separated (default 0,1; --quick: 0)")
    parser.add_argument("--examples", type=int, default=None, help="training examples per task (default 6144)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--tag", default="default", help="the name of the FOO-VB settings under test")
    parser.add_argument("--diagonal", default="{}", help='JSON keyword arguments of FOOVB(model, "diagonal")')
    parser.add_argument("--kronecker", default="{}",
                        help="JSON keyword arguments of FOOVB(model) (learner foovb_kronecker)")
    parser.add_argument("--learners", default=None, help="comma-separated subset of: " + ", ".join(learner_names()))
    parser.add_argument("--summary-only", action="store_true")
    parser.add_argument("--tried", nargs="*", default=[], type=Path,
                        help="summary CSVs of earlier candidates (same cells, seeds, examples): FOO-VB settings tried "
                             "besides those in OUT/results.jsonl, for the target against the best setting tried")
    parser.add_argument("--data-dir", default=None, help="the folder holding fashion_mnist/ (or fashion-mnist/)")
    args = parser.parse_args()
    try:
        candidate = {"diagonal": json.loads(args.diagonal), "kronecker": json.loads(args.kronecker)}
    except json.JSONDecodeError as error:
        parser.error(f"--diagonal / --kronecker must be JSON objects: {error}")
    if args.tag == "baseline":
        parser.error("--tag baseline is the baselines' own")
    cells = (args.cells.split(",") if args.cells else list(QUICK_CELLS) if args.quick else cell_names())
    unknown = [c for c in cells if c not in cell_names()]
    if unknown:
        parser.error(f"unknown cells {unknown}")
    if args.half != "all":
        cells = [c for c in cells if half_of(c) == args.half]
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1")).split(",")]
    examples = args.examples or (2048 if args.quick else 6144)
    learners = args.learners.split(",") if args.learners else learner_names()
    data_dir = args.data_dir or next((d for d in FASHION_DIRS if Path(d).is_dir()), None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    records = load_results(results_path)
    done = {key_of(r) for r in records}
    jobs = []
    for cell in cells:
        for learner in learners:
            tag = args.tag if learner.startswith("foovb_") else "baseline"
            for seed in seeds:
                job = {"cell": cell, "learner": learner, "tag": tag, "seed": seed, "examples": examples,
                       "candidate": candidate, "data_dir": data_dir}
                if key_of(job) not in done:
                    jobs.append(job)
    settings_path = out / f"candidate_{args.tag}.json"
    if jobs and not args.summary_only and any(j["tag"] == args.tag for j in jobs):
        if settings_path.exists() and json.loads(settings_path.read_text()) != candidate:
            parser.error(f"tag {args.tag!r} was run with other settings ({settings_path}); choose another --tag")
        settings_path.write_text(json.dumps(candidate))
    print(f"torch {torch.__version__}; {len(cells)} cells, seeds {seeds}, {examples} examples per task; "
          f"{len(jobs)} runs to do ({len(done)} done in {results_path})", flush=True)
    if jobs and not args.summary_only:
        from tqdm import tqdm

        jobs.sort(key=lambda j: (j["cell"].split("/")[0] == "lenet", j["learner"].startswith("foovb")))
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool, results_path.open("a") as file:
            for record in tqdm(pool.imap_unordered(run_one, jobs), total=len(jobs), file=sys.stderr):
                file.write(json.dumps(record) + "\n")
                file.flush()
                os.fsync(file.fileno())
                records.append(record)
    subset = [r for r in records if r["examples"] == examples and r["seed"] in seeds]
    rows = write_summary(out, subset, cells, args.tag, tried_in_summaries(args.tried, subset, args.tag))
    for half in ("tuning", "heldout"):
        half_rows = [r for r in rows if r["half"] == half]
        if half_rows:
            print(f"\n## {half} half ({args.tag})")
            for family in ("diagonal", "kronecker"):
                print("\n".join(targets(half_rows, family)))
    print(f"\nwrote {out / f'summary_{args.tag}.csv'} and {out / f'heatmap_{args.tag}.png'}")


if __name__ == "__main__":
    main()
