"""The matrix-variate family on nn.Conv1d (session 52): `FOOVB(model)` put a diagonal posterior on every nn.Conv1d
before (matrix-variate: nn.Linear and nn.Conv2d only) and now a matrix-variate one. Both, on streams and a model
that the robustness grid does not hold, against SGD and Adam at their best of three learning rates per cell.

The model reads an MNIST digit as a sequence of 28 rows (28 channels, 28 steps): Conv1d(28, 32, 5, stride 2), ReLU,
Conv1d(32, 32, 3, stride 2), ReLU, Linear(160, outputs). The streams, batch sizes, examples per task, losses and
metrics are the robustness grid's (`benchmarks/robustness_grid.py`: permuted, rotated, Split MNIST, i.i.d.); every
learner of a cell and seed starts from the same weights and batches. Learners: `FOOVB(model)` (`conv1d_kronecker`),
the same with its nn.Conv1d layers diagonal as before (`conv1d_diagonal`: only the family of those two layers
differs), and the grid's baselines. Prints per cell the average accuracy (%) over tasks and the first task's, and the
FOO-VB rows minus the best baseline.

    python scripts/conv1d_streams.py [--seeds 0,1] [--cells permuted/16,...] [--examples 3072] [--out FILE.jsonl]
        [--table FILE.md]

Resumable (one line of --out per finished run); --table writes the printed rows as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import robustness_grid as grid  # noqa: E402

from foovb import priors  # noqa: E402

CELLS = [f"{stream}/{batch}" for stream in ("permuted", "rotated", "split", "iid") for batch in grid.BATCH_SIZES]
LEARNERS = ["conv1d_kronecker", "conv1d_diagonal"] + [name for name in grid.learner_names()
                                                      if not name.startswith("foovb_")]
TWO_D_AND_LINEAR = (nn.Linear, nn.Conv2d, nn.Conv3d)  # the families before: nn.Conv1d not matrix-variate


class RowConv(nn.Module):
    """A digit's 28 rows as a sequence of 28 steps with 28 channels (the row's pixels)."""

    def __init__(self, num_outputs: int):
        super().__init__()
        self.body = nn.Sequential(nn.Conv1d(28, 32, 5, stride=2), nn.ReLU(), nn.Conv1d(32, 32, 3, stride=2),
                                  nn.ReLU(), nn.Flatten())
        self.head = nn.Linear(160, num_outputs)

    def forward(self, x):
        return self.head(self.body(x.squeeze(1).transpose(1, 2)))  # (n, 1, 28, 28) -> (n, 28 pixels, 28 rows)


def run(cell: str, learner: str, seed: int, examples: int) -> dict:
    build, layers = grid.build_model, priors.MATRIX_VARIATE_LAYERS
    grid.build_model = lambda kind, outputs: RowConv(outputs)
    if learner == "conv1d_diagonal":
        priors.MATRIX_VARIATE_LAYERS = TWO_D_AND_LINEAR
    try:
        job = dict(cell=f"mlp/{cell}", learner="foovb_kronecker" if learner.startswith("conv1d_") else learner,
                   tag="conv1d", seed=seed, examples=examples, data_dir=None, candidate={})
        record = grid.run_one(job)  # the cell's stream is the MLP's (the same images); the model is RowConv
    finally:
        grid.build_model, priors.MATRIX_VARIATE_LAYERS = build, layers
    return {**record, "cell": cell, "learner": learner}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--cells", default=",".join(CELLS))
    parser.add_argument("--examples", type=int, default=3072)
    parser.add_argument("--out", type=Path, default=Path("runs/conv1d_streams.jsonl"))
    parser.add_argument("--table", type=Path, help="also write the rows as a markdown table here")
    args = parser.parse_args()
    seeds, cells = [int(s) for s in args.seeds.split(",")], args.cells.split(",")
    done = {}
    if args.out.is_file():  # resumable: one line per finished run
        for line in args.out.read_text().splitlines():
            record = json.loads(line)
            done[(record["cell"], record["learner"], record["seed"], record["examples"])] = record
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table = ["| cell | best baseline: average (first task) | `FOOVB(model)`, Conv1d matrix-variate: average (first "
             "task), vs the best baseline | the same, Conv1d diagonal (before): average (first task), vs the best "
             "baseline |", "|---|---|---|---|"]
    for cell in cells:
        for learner in LEARNERS:
            for seed in seeds:
                key = (cell, learner, seed, args.examples)
                if key not in done:
                    done[key] = run(cell, learner, seed, args.examples)
                    with args.out.open("a") as file:
                        file.write(json.dumps(done[key]) + "\n")
        rows = {}
        for learner in LEARNERS:
            records = [done[(cell, learner, seed, args.examples)] for seed in seeds]
            if any(r["diverged"] for r in records):
                rows[learner] = None
                continue
            rows[learner] = (statistics.fmean(statistics.fmean(r["tasks"]) for r in records),
                             statistics.fmean(r["tasks"][0] for r in records))
        # as the grid: each of SGD and Adam at its lr of the best average; the better average, the better first task
        tuned = [max((value for name, value in rows.items() if name.startswith(kind) and value), default=(0, 0))
                 for kind in ("sgd_", "adam_")]
        best = (max(value[0] for value in tuned), max(value[1] for value in tuned))
        line = [f"{cell:13s} best baseline {best[0]:5.1f} (first {best[1]:5.1f})"]
        cells_md = [cell, f"{best[0]:.1f} ({best[1]:.1f})"]
        for learner in ("conv1d_kronecker", "conv1d_diagonal"):
            value = rows[learner]
            line.append(f"{learner} diverged" if value is None else
                        f"{learner} {value[0]:5.1f} ({value[0] - best[0]:+5.1f}; first {value[1]:5.1f}, "
                        f"{value[1] - best[1]:+5.1f})")
            cells_md.append("diverged" if value is None else
                            f"{value[0]:.1f} ({value[1]:.1f}), {value[0] - best[0]:+.1f} ({value[1] - best[1]:+.1f})")
        print(" | ".join(line), flush=True)
        table.append("| " + " | ".join(cells_md) + " |")
    if args.table:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
