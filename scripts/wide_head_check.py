"""The output layer's output factor (issue 54, session 49): `FOOVB(model)` with `diagonal_output_factor` off and on
(the output layer's covariance between its outputs kept diagonal) against Adam (two learning rates), on models with
wide heads that the robustness grid does not hold:

    wide_class_head   MNIST, 784-100-1000 classifier (10 of its 1,000 classes used), 2 permuted tasks, one pass
    many_classes      600 Gaussian classes in 32 dimensions, a 32-128-600 classifier, 3 passes
    token_lm          next-token prediction over a 600-token Markov chain: Embedding-GRU-Linear(64, 600), 2 passes
    multi_regression  a 20-64-600 tanh regression on a random teacher, 2 passes
    autoencoder       a 784-32-784 ReLU autoencoder, MNIST (standardised), one pass

Prints one line per case and learner (accuracy: higher is better; loss / MSE: lower) and writes them as JSON:

    python scripts/wide_head_check.py --out docs/results/wide_head/output_factor_seed0.json --seed 0
    python scripts/wide_head_check.py --table docs/results/wide_head/output_factor.md \\
        docs/results/wide_head/output_factor_seed0.json docs/results/wide_head/output_factor_seed1.json

(The first candidate of session 49, posterior="auto" giving an output layer of more than 512 outputs diagonal blocks,
was measured by this script's first version, git 362cd5c: docs/results/wide_head/head_diagonal_posterior_seed*.json.)
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from foovb import FOOVB
from foovb_suite.data.datasets import load_dataset

Batches = list[tuple[Tensor, Tensor]]


def mnist(examples: int, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    data = load_dataset("mnist", None)
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(data.train_labels), generator=gen)[:examples]

    def scale(x: Tensor) -> Tensor:
        return ((x.float() / 255 - 0.1307) / 0.3081).flatten(1)

    test_images, test_labels = data.test_images[:2000], data.test_labels[:2000]
    return scale(data.train_images[pick]), data.train_labels[pick], scale(test_images), test_labels


def batches_of(x: Tensor, y: Tensor, batch: int, passes: int, gen: torch.Generator) -> Batches:
    out = []
    for _ in range(passes):
        order = torch.randperm(len(x), generator=gen)
        out += [(x[i], y[i]) for i in order.split(batch)]
    return out


class TokenLM(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, 32)
        self.gru = nn.GRU(32, 64, batch_first=True)
        self.head = nn.Linear(64, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.gru(self.embed(tokens))[0])


def case(name: str, seed: int) -> tuple[Callable[[], nn.Module], Batches, list[tuple[Tensor, Tensor]], Callable]:
    """(model factory, training batches, test sets, loss(outputs, targets)); the metric is accuracy where the loss
    is cross-entropy on classes, else the loss itself."""
    gen = torch.Generator().manual_seed(seed)
    if name == "wide_class_head":
        x, y, tx, ty = mnist(4096, seed)
        perm = torch.randperm(784, generator=gen)
        tasks = [(x[:2048], y[:2048]), (x[2048:, perm], y[2048:])]
        train = [b for tx_, ty_ in tasks for b in batches_of(tx_, ty_, 32, 1, gen)]
        return (lambda: nn.Sequential(nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 1000)), train,
                [(tx, ty), (tx[:, perm], ty)], F.cross_entropy)
    if name == "many_classes":
        protos = torch.randn(600, 32, generator=gen)
        labels = torch.arange(600).repeat(12)
        points = protos[labels] + 0.6 * torch.randn(len(labels), 32, generator=gen)
        train_x, train_y, test_x, test_y = points[:6000], labels[:6000], points[6000:], labels[6000:]
        return (lambda: nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 600)),
                batches_of(train_x, train_y, 64, 3, gen), [(test_x, test_y)], F.cross_entropy)
    if name == "token_lm":
        successors = torch.randint(0, 600, (600, 4), generator=gen)
        weights = torch.rand(600, 4, generator=gen)

        def sequences(count: int) -> Tensor:
            seq = torch.empty(count, 17, dtype=torch.long)
            seq[:, 0] = torch.randint(0, 600, (count,), generator=gen)
            for t in range(16):
                choice = torch.multinomial(weights[seq[:, t]], 1, generator=gen).squeeze(1)
                seq[:, t + 1] = successors[seq[:, t], choice]
            return seq

        train_seq, test_seq = sequences(1500), sequences(500)

        def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

        return (lambda: TokenLM(600), batches_of(train_seq[:, :-1], train_seq[:, 1:], 32, 2, gen),
                [(test_seq[:, :-1], test_seq[:, 1:])], lm_loss)
    if name == "multi_regression":
        teacher = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 600))
        with torch.no_grad():
            x = torch.randn(3000, 20, generator=gen)
            y = teacher(x) + 0.1 * torch.randn(3000, 600, generator=gen)
        return (lambda: nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 600)),
                batches_of(x[:2000], y[:2000], 32, 2, gen), [(x[2000:], y[2000:])], F.mse_loss)
    if name == "autoencoder":
        x, _, tx, _ = mnist(3072, seed)
        return (lambda: nn.Sequential(nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 784)),
                batches_of(x, x, 16, 1, gen), [(tx, tx)], F.mse_loss)
    raise ValueError(name)


@torch.no_grad()
def evaluate(model: nn.Module, tests: list[tuple[Tensor, Tensor]], loss_fn: Callable, accuracy: bool) -> list[float]:
    out = []
    for x, y in tests:
        pred = model(x)
        out.append(float((pred.argmax(-1) == y).float().mean() * 100) if accuracy else float(loss_fn(pred, y)))
    return out


def train(name: str, learner: str, seed: int) -> list[float]:
    build, batches, tests, loss_fn = case(name, seed)
    torch.manual_seed(seed)
    model = build()
    if learner.startswith("adam"):
        optimizer = torch.optim.Adam(model.parameters(), lr=float(learner.split("_")[1]))
    else:
        optimizer = FOOVB(model, seed=seed, diagonal_output_factor=learner == "foovb_diagonal_output_factor")
    model.train()
    for x, y in batches:
        def closure(x=x, y=y) -> Tensor:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss

        optimizer.step(closure)
    model.eval()
    return evaluate(model, tests, loss_fn, accuracy=name in ("wide_class_head", "many_classes"))


METRICS = {"wide_class_head": "accuracy %, 2 tasks", "many_classes": "accuracy %", "token_lm": "cross-entropy",
           "multi_regression": "MSE", "autoencoder": "MSE"}


# the learners of the first version (git 362cd5c): "auto" with an output layer of more than 512 outputs diagonal
# ("foovb_default" then) and without that rule (the full output factor, as foovb_full_output_factor here)
FIRST_VERSION_NAMES = {"foovb_default": "foovb_output_layer_diagonal", "foovb_rule_off": "foovb_full_output_factor"}


def table(paths: list[Path]) -> str:
    """A markdown table of result files (one per seed): a row per case, a column per learner; each cell the mean over
    the files of the average over tasks, then each file's value in parentheses."""
    runs = [{"/".join(FIRST_VERSION_NAMES.get(part, part) for part in key.split("/")): value
             for key, value in json.loads(path.read_text()).items()} for path in paths]
    learners = list(dict.fromkeys(key.split("/")[1] for run in runs for key in run))
    cases = list(dict.fromkeys(key.split("/")[0] for run in runs for key in run))
    lines = ["| case (metric) | " + " | ".join(learners) + " |", "|---" * (len(learners) + 1) + "|"]
    for case in cases:
        cells = []
        for learner in learners:
            values = [run.get(f"{case}/{learner}") for run in runs]
            if any(v is None or None in v for v in values):
                cells.append("diverged" if any(v is not None for v in values) else "")
                continue
            per_run = [sum(v) / len(v) for v in values]
            cells.append(f"{sum(per_run) / len(per_run):.4g} ({' / '.join(f'{v:.4g}' for v in per_run)})")
        lines.append(f"| {case} ({METRICS[case]}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="the JSON file of this seed's results (resumed where it exists)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", default="wide_class_head,many_classes,token_lm,multi_regression,autoencoder")
    parser.add_argument("--table", type=Path, nargs="+", metavar=("TABLE_MD", "JSON"),
                        help="instead of running: write TABLE_MD, a markdown table of the JSON result files")
    args = parser.parse_args()
    if args.table:
        if len(args.table) < 2:
            parser.error("--table needs the markdown file to write and at least one JSON result file")
        args.table[0].write_text(table(args.table[1:]))
        return
    if args.out is None:
        parser.error("--out is required (or --table)")
    torch.set_num_threads(1)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    for name in args.cases.split(","):
        for learner in ("foovb_full_output_factor", "foovb_diagonal_output_factor", "adam_0.001", "adam_0.003"):
            key = f"{name}/{learner}"
            if key not in results:
                values = train(name, learner, args.seed)
                results[key] = [v if math.isfinite(v) else None for v in values]
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(results, indent=1))
            print(key, " ".join(f"{v:.4g}" if v is not None else "nan" for v in results[key]), flush=True)


if __name__ == "__main__":
    main()
