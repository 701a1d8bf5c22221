"""The matrix-variate family on more layers (session 52): `FOOVB(model)` put a diagonal posterior on every
nn.Conv1d before and now a matrix-variate one; recurrent layers get one matrix-variate block per weight matrix under
`FOOVB(model, "kronecker")` and, since session 55, under `FOOVB(model)` (diagonal before). Both families of those
layers, on streams and models that the robustness grid does not hold, against SGD and Adam at their best of three
learning rates.

Models (`--model`):
* `conv1d`: an MNIST digit read as a sequence of 28 rows (28 channels, 28 steps): Conv1d(28, 32, 5, stride 2), ReLU,
  Conv1d(32, 32, 3, stride 2), ReLU, Linear(160, outputs);
* `gru`, `lstm`: the grid's recurrent model (a 14 x 14 digit read row by row by a 64-unit GRU, then a Linear head),
  with an LSTM for `lstm`;
* `rescnn` (session 53, a lead from a user's trial): a residual CNN, a stride-2 stem and 3 blocks of two 3 x 3
  convolutions with BatchNorm and a skip connection (16, 32 stride 2, 32 channels), global average pooling and a
  Linear head; its Conv2d layers are matrix-variate under `FOOVB(model)`, `diagonal_before` makes them diagonal.
The streams, batch sizes, examples per task, losses and metrics are the robustness grid's
(`benchmarks/robustness_grid.py`: permuted, rotated, Split MNIST, i.i.d.); every learner of a cell and seed starts
from the same weights and batches. Learners: `matrix_variate` (conv1d: `FOOVB(model)`; gru, lstm: `FOOVB(model,
"kronecker")`, the same as `FOOVB(model)` since session 55), `diagonal_before` (the model's
Conv1d or recurrent layers diagonal: conv1d, `FOOVB(model)` before session 52; gru, lstm: before session 55; only the
family of those layers differs), `--matrices ih` (recurrent layers: only the input matrices weight_ih
matrix-variate, a candidate not kept), and the grid's baselines. Prints per cell the average accuracy (%) over tasks
and the first task's, and the FOO-VB rows minus the best baseline; the table also gives the first task as learned
(right after its own training, drift cells: what it can keep at most).

    python scripts/matrix_variate_layers.py [--model conv1d] [--seeds 0,1] [--cells permuted/16,...]
        [--examples 3072] [--matrices all|ih] [--out FILE.jsonl] [--table FILE.md]

Resumable (one line of --out per finished run); --table writes the printed rows as a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import robustness_grid as grid  # noqa: E402

from foovb import priors  # noqa: E402

CELLS = [f"{stream}/{batch}" for stream in ("permuted", "rotated", "split", "iid") for batch in grid.BATCH_SIZES]
BASELINES = [name for name in grid.learner_names() if not name.startswith("foovb_")]


class RowConv(nn.Module):
    """A digit's 28 rows as a sequence of 28 steps with 28 channels (the row's pixels)."""

    def __init__(self, num_outputs: int):
        super().__init__()
        self.body = nn.Sequential(nn.Conv1d(28, 32, 5, stride=2), nn.ReLU(), nn.Conv1d(32, 32, 3, stride=2),
                                  nn.ReLU(), nn.Flatten())
        self.head = nn.Linear(160, num_outputs)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x.squeeze(1).transpose(1, 2)))  # (n, 1, 28, 28) -> (n, 28 pixels, 28 rows)


class RowLSTM(grid.RowGRU):
    """The grid's RowGRU with an LSTM in the GRU's place (its attribute keeps the name)."""

    def __init__(self, num_outputs: int):
        super().__init__(num_outputs)
        self.gru = nn.LSTM(14, 64, batch_first=True)  # the forward reads [0], the outputs, of either


class ResidualBlock(nn.Module):
    """Two 3 x 3 convolutions with BatchNorm, added to the input (through a 1 x 1 convolution where the shape
    changes)."""

    def __init__(self, inputs: int, outputs: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False), nn.BatchNorm2d(outputs),
                                  nn.ReLU(), nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False), nn.BatchNorm2d(outputs))
        self.skip = nn.Identity() if inputs == outputs and stride == 1 else nn.Sequential(
            nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x: Tensor) -> Tensor:
        return (self.body(x) + self.skip(x)).relu()


class ResidualCNN(nn.Module):
    def __init__(self, num_outputs: int):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                  ResidualBlock(16, 16, 1), ResidualBlock(16, 32, 2), ResidualBlock(32, 32, 1))
        self.head = nn.Linear(32, num_outputs)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x).mean((2, 3)))


MODELS = {"conv1d": (RowConv, nn.Conv1d), "gru": (grid.RowGRU, nn.RNNBase), "lstm": (RowLSTM, nn.RNNBase),
          "rescnn": (ResidualCNN, nn.Conv2d)}


@contextlib.contextmanager
def family(layer: type[nn.Module], learner: str, matrices: str) -> Iterator[None]:
    """`priors.weight_matrices` as the learner needs it: `diagonal_before` none for `layer`, `--matrices ih` only
    the recurrent input matrices; the library's otherwise."""
    library = priors.weight_matrices

    def chosen(module: nn.Module, direct: list) -> list:
        pairs = library(module, direct)
        if not isinstance(module, layer):
            return pairs
        if learner == "diagonal_before":
            return []
        names = {id(param): name for name, param in module.named_parameters()}
        return [pair for pair in pairs if matrices == "all" or names[id(pair[0])].startswith("weight_ih")]

    priors.weight_matrices = chosen
    try:
        yield
    finally:
        priors.weight_matrices = library


def run(model: str, cell: str, learner: str, seed: int, examples: int, matrices: str) -> dict:
    build, (kind, layer) = grid.build_model, MODELS[model]
    grid.build_model = lambda name, outputs: kind(outputs)
    try:
        job = dict(cell=f"mlp/{cell}", learner=learner if learner in BASELINES else "foovb_kronecker",
                   tag=model, seed=seed, examples=examples, data_dir=None, candidate={})
        with family(layer, learner, matrices):
            record = grid.run_one(job)  # the cell's stream is the MLP's (the same images); the model is `kind`
    finally:
        grid.build_model = build
    return {**record, "cell": cell, "learner": learner, "model": model}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="conv1d")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--cells", default=",".join(CELLS))
    parser.add_argument("--examples", type=int, default=3072)
    parser.add_argument("--matrices", choices=("all", "ih"), default="all",
                        help="recurrent layers: every weight matrix matrix-variate (the library's), or weight_ih only")
    parser.add_argument("--out", type=Path, default=Path("runs/matrix_variate_layers.jsonl"))
    parser.add_argument("--table", type=Path, help="also write the rows as a markdown table here")
    args = parser.parse_args()
    seeds, cells = [int(s) for s in args.seeds.split(",")], args.cells.split(",")
    mine = "matrix_variate" if args.matrices == "all" else "matrix_variate_ih"
    learners = [mine, "diagonal_before", *BASELINES]
    done = {}
    if args.out.is_file():  # resumable: one line per finished run
        for line in args.out.read_text().splitlines():
            record = json.loads(line)
            done[(record["model"], record["cell"], record["learner"], record["seed"],
                  record["examples"])] = record
    args.out.parent.mkdir(parents=True, exist_ok=True)
    recurrent = MODELS[args.model][1] is nn.RNNBase
    mine_label = ("`FOOVB(model)`" + f", {args.model} matrix-variate"
                  + (" (weight_ih only)" if args.matrices == "ih" else ""))
    before_label = ("`FOOVB(model)` before session 55, recurrent layers diagonal" if recurrent else
                    "the same, Conv1d diagonal (before)" if args.model == "conv1d" else
                    f"the same, {MODELS[args.model][1].__name__} diagonal")
    table = [f"| cell | best baseline: average (first task) | {mine_label}: average (first task; as learned), vs "
             f"the best baseline | {before_label}: average (first task; as learned), vs the best baseline |",
             "|---|---|---|---|"]
    for cell in cells:
        for learner in learners:
            for seed in seeds:
                key = (args.model, cell, learner, seed, args.examples)
                if key not in done:
                    done[key] = run(args.model, cell, learner, seed, args.examples, args.matrices)
                    with args.out.open("a") as file:
                        file.write(json.dumps(done[key]) + "\n")
        rows = {}
        for learner in learners:
            records = [done[(args.model, cell, learner, seed, args.examples)] for seed in seeds]
            if any(r["diverged"] for r in records):
                rows[learner] = None
                continue
            learned = [r["first_learned"] for r in records if r.get("first_learned") is not None]
            rows[learner] = (statistics.fmean(statistics.fmean(r["tasks"]) for r in records),
                             statistics.fmean(r["tasks"][0] for r in records),
                             statistics.fmean(learned) if len(learned) == len(records) else None)
        # as the grid: each of SGD and Adam at its lr of the best average; the better average, the better first task
        tuned = [max((value for name, value in rows.items() if name.startswith(kind) and value), default=(0, 0),
                     key=lambda value: value[:2])
                 for kind in ("sgd_", "adam_")]
        best = (max(value[0] for value in tuned), max(value[1] for value in tuned))
        line = [f"{cell:13s} best baseline {best[0]:5.1f} (first {best[1]:5.1f})"]
        cells_md = [cell, f"{best[0]:.1f} ({best[1]:.1f})"]
        for learner in (mine, "diagonal_before"):
            value = rows[learner]
            line.append(f"{learner} diverged" if value is None else
                        f"{learner} {value[0]:5.1f} ({value[0] - best[0]:+5.1f}; first {value[1]:5.1f}, "
                        f"{value[1] - best[1]:+5.1f})")
            learned = "" if value is None or value[2] is None else f"; as learned {value[2]:.1f}"
            cells_md.append("diverged" if value is None else
                            f"{value[0]:.1f} ({value[1]:.1f}{learned}), {value[0] - best[0]:+.1f} "
                            f"({value[1] - best[1]:+.1f})")
        print(" | ".join(line), flush=True)
        table.append("| " + " | ".join(cells_md) + " |")
    if args.table:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
