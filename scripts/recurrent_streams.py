"""Four synthetic recurrent continual-learning streams, not in the robustness grid (a helper's, session 55; the
evidence for FOOVB(model)'s matrix-variate recurrent layers, docs/results/matrix_variate_layers.md): a GRU classifying
sine bands, a GRU predicting drifting AR(2) series, an LSTM counting tokens, a 2-layer bidirectional LSTM on token
order; 3 tasks of 3,000 sequences, 2 passes each, batch 32. Learners: A = FOOVB(model, "kronecker") (matrix-variate
recurrent layers: FOOVB(model) since session 55 on these models), B = FOOVB(model) before session 55 (recurrent
layers diagonal), Adam at 3 learning rates; the same weights and batches for all.

    python scripts/recurrent_streams.py STREAM SEEDS OUT.jsonl [--n-train N --n-test N --epochs E]
    python scripts/recurrent_streams.py --table OUT.jsonl > TABLE.md    (the summary table, one row per stream)

One JSON line per stream, seed and learner (the task matrix R[after task k][task j]); tables: the session's
docs/results/matrix_variate_layers/recurrent_streams_s55/tables.md."""
import argparse
import json
import math
import sys
import time
import traceback
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from foovb import FOOVB, priors

NTASK = 3


# ----------------------------------------------------------------------------------------------------- data
def sine_task(k, n, g):
    """Stream 1: noisy sines, length 50, 4 frequency bands (cycles/step). Frequency sets of the 3 tasks are disjoint
    (jointly solvable), but task 2 interleaves task 1's bands with the label order reversed and task 3 moves to higher
    frequencies with a permuted label order, so learning a later task moves the band boundaries of earlier ones."""
    L = 50
    centers = [[0.04, 0.08, 0.12, 0.16], [0.06, 0.10, 0.14, 0.18], [0.22, 0.26, 0.30, 0.34]][k]
    labels = [[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]][k]
    amp_lo, amp_hi, noise = [(0.8, 1.2, 0.3), (0.4, 2.0, 0.5), (0.8, 1.2, 0.3)][k]
    band = torch.randint(0, 4, (n,), generator=g)
    f = torch.tensor(centers)[band] + (torch.rand(n, generator=g) * 2 - 1) * 0.008
    amp = amp_lo + (amp_hi - amp_lo) * torch.rand(n, generator=g)
    phase = 2 * math.pi * torch.rand(n, generator=g)
    t = torch.arange(L).float()
    x = amp[:, None] * torch.sin(2 * math.pi * f[:, None] * t[None] + phase[:, None])
    x = x + noise * torch.randn(n, L, generator=g)
    y = torch.tensor(labels)[band]
    return x[:, :, None], y


AR = [(1.6, -0.8), (-0.9, -0.5), (0.2, 0.7)]


def ar_task(k, n, g):
    """Stream 2: AR(2) x_t = a1 x_{t-1} + a2 x_{t-2} + e_t, coefficients per task, scaled to unit stationary variance;
    input a window of 30 values (after a burn-in of 100), target the next value."""
    a1, a2 = AR[k]
    var = (1 - a2) / ((1 + a2) * ((1 - a2) ** 2 - a1 ** 2))
    burn, W = 100, 30
    e = torch.randn(n, burn + W + 1, generator=g)
    x = torch.zeros(n, burn + W + 1)
    for t in range(burn + W + 1):
        x[:, t] = e[:, t] + (a1 * x[:, t - 1] if t >= 1 else 0) + (a2 * x[:, t - 2] if t >= 2 else 0)
    x = x[:, burn:] / math.sqrt(var)
    return x[:, :W, None], x[:, W]


SUBSETS = [[0, 1, 2, 3, 4, 5], [2, 3, 4, 5, 6, 7], [4, 5, 6, 7, 8, 9]]  # tokens a task's sequences use


def count_task(k, n, g):
    """Stream 3: length-80 sequences over task k's 6 tokens, token probabilities ~ Dirichlet(1) per sequence; the label
    is the count of token SUBSETS[k][0] (0, 2, 4: each present in the previous task's sequences too) in 4 bins
    (quartiles: <=5, 6-11, 12-20, >=21 of the Beta(1,5)-binomial). The task is identifiable from the tokens used."""
    L = 80
    gam = -torch.log(torch.rand(n, 6, generator=g).clamp_min(1e-12))  # Gamma(1) -> Dirichlet(1)
    p = gam / gam.sum(1, keepdim=True)
    idx = torch.multinomial(p, L, replacement=True, generator=g)  # (n, L) indices into the subset
    tokens = torch.tensor(SUBSETS[k])[idx]
    count = (idx == 0).sum(1)
    y = torch.bucketize(count, torch.tensor([5, 11, 20]), right=False)  # <=5 ->0, 6-11 ->1, 12-20 ->2, >=21 ->3
    return F.one_hot(tokens, 10).float(), y


def order_task(k, n, g):
    """Stream 4: length-40 sequences, tokens uniform over task k's 6 tokens; label: whether the first occurrence of
    token t_k comes before that of u_k ((0,1), (2,3), (4,5); 2,3 and 4,5 occur in the earlier tasks too). A token
    absent counts as occurring at position 40."""
    L = 40
    t_k, u_k = SUBSETS[k][0], SUBSETS[k][1]
    idx = torch.randint(0, 6, (n, L), generator=g)
    tokens = torch.tensor(SUBSETS[k])[idx]
    pos = torch.arange(L)

    def first(tok):
        return torch.where(tokens == tok, pos, torch.full_like(tokens, L)).min(1).values

    y = (first(t_k) < first(u_k)).long()
    return F.one_hot(tokens, 10).float(), y


# ---------------------------------------------------------------------------------------------------- models
class RNNHead(nn.Module):
    def __init__(self, cell, inp, hidden, out, layers=1, bidirectional=False):
        super().__init__()
        self.rnn = cell(inp, hidden, num_layers=layers, batch_first=True, bidirectional=bidirectional)
        self.bidirectional = bidirectional
        self.head = nn.Linear(hidden * (2 if bidirectional else 1), out)

    def forward(self, x):
        out = self.rnn(x)[1]
        h = out[0] if isinstance(out, tuple) else out  # LSTM: (h_n, c_n)
        h = torch.cat([h[-2], h[-1]], 1) if self.bidirectional else h[-1]  # last layer (both directions)
        return self.head(h)


STREAMS = {
    1: dict(name="GRU sine bands", make=sine_task, model=lambda: RNNHead(nn.GRU, 1, 32, 4), task="cls"),
    2: dict(name="GRU AR(2) next value", make=ar_task, model=lambda: RNNHead(nn.GRU, 1, 32, 1), task="reg"),
    3: dict(name="LSTM token counting", make=count_task, model=lambda: RNNHead(nn.LSTM, 10, 48, 4), task="cls"),
    4: dict(name="2-layer biLSTM order", make=order_task,
            model=lambda: RNNHead(nn.LSTM, 10, 32, 2, layers=2, bidirectional=True), task="cls"),
}


def loss_fn(kind, out, y):
    return F.cross_entropy(out, y) if kind == "cls" else F.mse_loss(out.squeeze(1), y)


@torch.no_grad()
def evaluate(model, kind, x, y):
    model.eval()
    out = torch.cat([model(x[i:i + 500]) for i in range(0, len(x), 500)])
    model.train()
    if kind == "cls":
        return (out.argmax(1) == y).float().mean().item()
    return F.mse_loss(out.squeeze(1), y).item()


def train_on_stream(model, opt, foovb, kind, data, orders, batch, loss_of=None, metric_of=None):
    """Train `model` with `opt` (FOOVB's closure step where `foovb`) on the tasks of `data` in the batch orders
    `orders`; after each task every task's test metric: (R[after task k][task j], step times, the error that stopped
    it or None). `loss_of(kind, out, y)` and `metric_of(model, kind, x, y)`: this script's loss_fn and evaluate by
    default (scripts/recurrent_streams_more.py passes its own)."""
    loss_of, metric_of = loss_of or loss_fn, metric_of or evaluate
    R = [[None] * NTASK for _ in range(NTASK)]
    times, err = [], None
    try:
        for k in range(NTASK):
            (xtr, ytr), _ = data[k]
            for perm in orders[k]:
                for i in range(0, len(perm), batch):
                    b = perm[i:i + batch]
                    xb, yb = xtr[b], ytr[b]
                    t0 = time.perf_counter()
                    if foovb:
                        def closure(xb=xb, yb=yb):
                            loss = loss_of(kind, model(xb), yb)
                            loss.backward()
                            return loss
                        loss = opt.step(closure)
                    else:
                        opt.zero_grad()
                        loss = loss_of(kind, model(xb), yb)
                        loss.backward()
                        opt.step()
                    times.append(time.perf_counter() - t0)
                    if not torch.isfinite(torch.as_tensor(loss)).all():
                        raise FloatingPointError(f"non-finite loss {float(loss)} at task {k} step {len(times)}")
            for j in range(NTASK):
                R[k][j] = metric_of(model, kind, *data[j][1])
            if any(not math.isfinite(v) for v in R[k]):
                raise FloatingPointError(f"non-finite test metric after task {k}: {R[k]}")
    except Exception as e:  # diverged: record and continue
        err = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    return R, times, err


def run_learner(spec, learner, seed, data, orders, batch):
    kind = spec["task"]
    torch.manual_seed(seed)
    model = spec["model"]()  # same initial weights for every learner of this stream and seed
    if learner == "A":
        opt = FOOVB(model, "kronecker", seed=seed)
    elif learner == "B":  # FOOVB(model) before session 55: its "auto" kept recurrent layers diagonal
        auto = priors.auto_matrix_variate
        priors.auto_matrix_variate = lambda module, matrices: (
            not isinstance(module, (nn.RNNBase, nn.RNNCellBase)) and auto(module, matrices))
        try:
            opt = FOOVB(model, seed=seed)
        finally:
            priors.auto_matrix_variate = auto
    else:
        opt = torch.optim.Adam(model.parameters(), lr=float(learner.split("@")[1]))
    foovb = learner in ("A", "B")
    R, times, err = train_on_stream(model, opt, foovb, kind, data, orders, batch)
    final = R[NTASK - 1]
    return dict(learner=learner, seed=seed, diverged=err, R=R,
                final=final, average=(sum(final) / NTASK if err is None else None),
                first_final=final[0], first_learned=R[0][0],
                step_ms=1000 * sum(times) / max(len(times), 1), steps=len(times))


def summary_table(lines: list[str]) -> str:
    """One markdown row per stream: the mean over seeds of A's, B's and the best Adam's average (Adam's lr chosen per
    seed by its average), A's and B's first task after the stream, and A's step time over B's."""
    runs = [json.loads(line) for line in lines if line.strip()]
    rows = ["| stream | metric | A: matrix-variate recurrent layers | B: diagonal recurrent layers | Adam, best of 3 "
            "lr | first task after the stream, A / B | step time A / B |", "|---|---|---|---|---|---|---|"]
    for stream in sorted({r["stream"] for r in runs}):
        mine = [r for r in runs if r["stream"] == stream]
        error = STREAMS[stream]["task"] != "cls"
        seeds = sorted({r["seed"] for r in mine})

        def of(learner: str, key: str, mine: list = mine) -> float:
            values = [r[key] for r in mine if r["learner"] == learner]
            return math.nan if any(v is None for v in values) else sum(values) / len(values)

        def adam(seed: int, mine: list = mine, error: bool = error) -> float:
            values = [r["average"] for r in mine if r["seed"] == seed and r["learner"].startswith("adam")
                      and r["average"] is not None]
            return min(values) if error else max(values)

        best_adam = sum(adam(seed) for seed in seeds) / len(seeds)
        rows.append(f"| {mine[0]['name']} | {'MSE (lower is better)' if error else 'accuracy'} | "
                    f"{of('A', 'average'):.3f} | {of('B', 'average'):.3f} | {best_adam:.3f} | "
                    f"{of('A', 'first_final'):.3f} / {of('B', 'first_final'):.3f} | "
                    f"{of('A', 'step_ms') / of('B', 'step_ms'):.2f}x |")
    return "\n".join(rows) + "\n"


def run_recorded(run, spec, learner, seed, data, orders, batch):
    """`run(spec, learner, seed, data, orders, batch)`'s record with its wall time ("wall_s"), and the texts of the
    warnings it raised."""
    t0 = time.time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = run(spec, learner, seed, data, orders, batch)
    record["wall_s"] = time.time() - t0
    return record, [f"{w.category.__name__}: {w.message}" for w in caught]


def stream_parser(epochs: int, learners: str) -> argparse.ArgumentParser:
    """The arguments of this script and of scripts/recurrent_streams_more.py."""
    ap = argparse.ArgumentParser()
    ap.add_argument("stream", type=int)
    ap.add_argument("seeds")
    ap.add_argument("out")
    ap.add_argument("--n-train", type=int, default=3000)
    ap.add_argument("--n-test", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=epochs)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--learners", default=learners)
    return ap


def main():
    torch.set_num_threads(1)
    if sys.argv[1:2] == ["--table"]:  # python scripts/recurrent_streams.py --table OUT.jsonl > TABLE.md
        with open(sys.argv[2]) as file:
            print(summary_table(file.readlines()), end="")
        return
    a = stream_parser(epochs=2, learners="A,B,adam@3e-4,adam@1e-3,adam@3e-3").parse_args()
    spec = STREAMS[a.stream]
    for seed in [int(s) for s in a.seeds.split(",")]:
        g = torch.Generator().manual_seed(1000 * a.stream + seed)
        data = [(spec["make"](k, a.n_train, g), spec["make"](k, a.n_test, g)) for k in range(NTASK)]
        go = torch.Generator().manual_seed(7 + 1000 * a.stream + seed)
        orders = [[torch.randperm(a.n_train, generator=go) for _ in range(a.epochs)] for _ in range(NTASK)]
        if spec["task"] == "cls":
            print("label balance", [torch.bincount(d[0][1], minlength=4).tolist() for d in data], flush=True)
        for learner in a.learners.split(","):
            r, caught = run_recorded(run_learner, spec, learner, seed, data, orders, a.batch)
            r.update(stream=a.stream, name=spec["name"], warnings=sorted({text[:200] for text in caught}),
                     n_train=a.n_train, n_test=a.n_test, epochs=a.epochs)
            print(json.dumps({k: v for k, v in r.items() if k != "warnings"}), flush=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
