"""Five recurrent continual-learning streams (a helper's check of FOOVB(model)'s matrix-variate recurrent layers, the
default since session 55), none of them in scripts/recurrent_streams.py or the repository:

  1 "LSTM(proj) next token": Embedding(16,16) -> nn.LSTM(16, 64, proj_size=32) -> Linear(32,16), next-token
    prediction at every step (many-to-many) of first-order Markov chains; each task its own 8-token vocabulary
    (0-7, 4-11, 8-15: half shared with the previous task) and its own transition matrix (3 successors per token,
    p = 0.75 / 0.15 / 0.10: the Bayes accuracy ~0.75 away from the sequence start). Metric: next-token accuracy.
  2 "biGRU regime tagging": nn.GRU(1, 48, bidirectional) -> Linear(96, 3) on every step; length-60 signals made of
    segments of 6-15 steps, each of one of 3 regimes, tag every step with its regime; task 1: levels -1/0/+1 (noise
    0.4); task 2: ramps up / ramps down / flat with noise 1.0; task 3: fast sine (period 4) / slow sine (period 12) /
    square wave (period 8). Labels 0-2 reused with new meanings. Metric: per-step accuracy.
  3 "GRU regressor, rule change": nn.GRU(1, 64) -> Linear(64, 1) on the last state; length-20 sequences
    x_t ~ N(mu_k, 1), mu = -1, 0, +1 (the task is readable from the inputs); target: task 1 the sum, task 2 the
    max, task 3 the last minus the first value, each standardized by its task's training mean / std.
    Metric: MSE (lower is better; predicting the task's mean scores 1).
  4 "LSTMCell glyphs, rotated": nn.LSTMCell(2, 64) unrolled by hand in a Python loop -> Linear(64, 5); pen
    trajectories of 5 glyphs (L, U, Z, 7, V) as 30 noisy (dx, dy) steps; task k rotates all glyphs by 0 / 60 / 120
    degrees (a domain shift, like rotated MNIST; the glyphs' turn angles identify them under any rotation).
    Metric: accuracy.
  5 "2-layer LSTM (dropout 0.2) motifs": nn.LSTM(10, 48, num_layers=2, dropout=0.2) -> Linear(48, 4) on the top
    layer's last state; length-15 one-hot sequences over 10 tokens with one 3-token motif planted at a random place;
    label: which of the task's 4 motifs (each task draws its own 4 motifs over the same tokens). Metric: accuracy.

Learners (the same initial weights and batches for all): NEW = FOOVB(model, seed=s) (today's default: posterior
"auto", recurrent layers matrix-variate); OLD = the same with priors.auto_matrix_variate patched during construction
so recurrent layers stay diagonal (the trick of scripts/recurrent_streams.py, learner B); Adam at 3e-4, 1e-3, 3e-3.

    python scripts/recurrent_streams_more.py STREAM SEEDS OUT.jsonl [--n-train N --n-test N --epochs E --learners ...]

Session 55's runs: streams 1, 3, 4 and 5 with `0,1,2 OUT --epochs 2`, stream 2 with `--n-train 2000` too, and stream 5
again with `--dropout 0 --learners NEW,OLD` on seeds 0,1 (docs/results/matrix_variate_layers/recurrent_streams_s55b/).
"""
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from foovb import FOOVB, priors
from foovb.posteriors import KroneckerBlock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recurrent_streams import NTASK, run_recorded, stream_parser, train_on_stream  # noqa: E402  (the training loop, shared)


# ------------------------------------------------------------------------------------------------------ data
def markov_chains(stream_seed):
    """Per task: (vocabulary, successor table (8, 3) of global token ids)."""
    g = torch.Generator().manual_seed(555 + stream_seed)
    chains = []
    for k in range(NTASK):
        vocab = torch.arange(4 * k, 4 * k + 8)
        succ = torch.stack([vocab[torch.randperm(8, generator=g)[:3]] for _ in range(8)])
        chains.append((vocab, succ))
    return chains


def lm_task(k, n, g, chains):
    L = 33
    vocab, succ = chains[k]
    p = torch.tensor([0.75, 0.15, 0.10])
    seq = torch.empty(n, L, dtype=torch.long)
    cur = torch.randint(0, 8, (n,), generator=g)  # local index
    seq[:, 0] = vocab[cur]
    for t in range(1, L):
        choice = torch.multinomial(p, n, replacement=True, generator=g)
        nxt_global = succ[cur, choice]
        seq[:, t] = nxt_global
        cur = nxt_global - 4 * k
    return seq[:, :-1], seq[:, 1:]


def tag_task(k, n, g):
    L = 60
    x = torch.zeros(n, L)
    y = torch.zeros(n, L, dtype=torch.long)
    for i in range(n):
        t = 0
        while t < L:
            ln = int(torch.randint(6, 16, (1,), generator=g))
            ln = min(ln, L - t)
            r = int(torch.randint(0, 3, (1,), generator=g))
            tt = torch.arange(ln).float()
            u = torch.rand(1, generator=g).item()
            if k == 0:
                seg = [-1.0, 0.0, 1.0][r] + 0.4 * torch.randn(ln, generator=g)
            elif k == 1:
                if r < 2:
                    a = 2 * u - 1
                    seg = a + (0.15 if r == 0 else -0.15) * tt + 0.2 * torch.randn(ln, generator=g)
                else:
                    seg = 1.0 * torch.randn(ln, generator=g)
            else:
                ph = 2 * math.pi * u
                if r == 0:
                    seg = torch.sin(2 * math.pi * tt / 4 + ph)
                elif r == 1:
                    seg = torch.sin(2 * math.pi * tt / 12 + ph)
                else:
                    seg = torch.sign(torch.sin(2 * math.pi * tt / 8 + ph) + 1e-6)
                seg = seg + 0.3 * torch.randn(ln, generator=g)
            x[i, t:t + ln] = seg
            y[i, t:t + ln] = r
            t += ln
    return x[:, :, None], y


def reg_raw(k, n, g):
    L = 20
    mu = [-1.0, 0.0, 1.0][k]
    x = mu + torch.randn(n, L, generator=g)
    if k == 0:
        y = x.sum(1)
    elif k == 1:
        y = x.max(1).values
    else:
        y = x[:, -1] - x[:, 0]
    return x[:, :, None], y


GLYPHS = {  # (heading in degrees, relative length) per stroke
    "L": [(-90, 1.0), (0, 0.6)],
    "U": [(-90, 1.0), (0, 0.8), (90, 1.0)],
    "Z": [(0, 1.0), (-135, 1.4), (0, 1.0)],
    "7": [(0, 1.0), (-115, 1.2)],
    "V": [(-65, 1.0), (65, 1.0)],
}


def glyph_task(k, n, g):
    T = 30
    names = list(GLYPHS)
    y = torch.randint(0, len(names), (n,), generator=g)
    x = torch.zeros(n, T, 2)
    for i in range(n):
        strokes = GLYPHS[names[int(y[i])]]
        rot = [0.0, 60.0, 120.0][k] + 10.0 * float(torch.randn(1, generator=g))
        heads = torch.tensor([h for h, _ in strokes]) + rot + 8.0 * torch.randn(len(strokes), generator=g)
        lens = torch.tensor([ln for _, ln in strokes]) * (0.7 + 0.6 * torch.rand(len(strokes), generator=g))
        # T steps spread along the strokes by arc length
        s = (torch.arange(T).float() + 0.5) / T * lens.sum()
        idx = torch.bucketize(s, torch.cumsum(lens, 0)).clamp_max(len(strokes) - 1)
        step = lens.sum() / T
        ang = torch.deg2rad(heads[idx])
        d = torch.stack([torch.cos(ang), torch.sin(ang)], 1) * step
        d = d + 0.35 * step * torch.randn(T, 2, generator=g)
        x[i] = d / step
    return x, y


def motif_task(k, n, g, motifs):
    """Length-15 sequences of 10 one-hot tokens, uniform background, one 3-token motif at a random place; the label
    is which of the task's 4 motifs (each task its own 4 motifs, all tokens shared)."""
    L = 15
    tok = torch.randint(0, 10, (n, L), generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    pos = torch.randint(0, L - 3, (n,), generator=g)
    for i in range(n):
        tok[i, pos[i]:pos[i] + 3] = motifs[k][y[i]]
    return F.one_hot(tok, 10).float(), y


def make_motifs(seed):
    g = torch.Generator().manual_seed(777 + seed)
    return [torch.randint(0, 10, (4, 3), generator=g) for _ in range(NTASK)]


# ---------------------------------------------------------------------------------------------------- models
class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 16)
        self.rnn = nn.LSTM(16, 64, proj_size=32, batch_first=True)
        self.head = nn.Linear(32, 16)

    def forward(self, x):
        return self.head(self.rnn(self.emb(x))[0])  # (B, T, 16)


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(1, 48, batch_first=True, bidirectional=True)
        self.head = nn.Linear(96, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0])  # (B, T, 3)


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(1, 64, batch_first=True)
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.rnn(x)[1][-1]).squeeze(1)


class CellClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(2, 64)
        self.head = nn.Linear(64, 5)

    def forward(self, x):
        h = x.new_zeros(x.shape[0], 64)
        c = x.new_zeros(x.shape[0], 64)
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
        return self.head(h)


DEEP_DROPOUT = 0.2  # --dropout (stream 5's ablation)


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(10, 48, num_layers=2, dropout=DEEP_DROPOUT, batch_first=True)
        self.head = nn.Linear(48, 4)

    def forward(self, x):
        return self.head(self.rnn(x)[1][0][-1])


STREAMS = {
    1: dict(name="LSTM(proj) next token", model=LM, kind="seqcls"),
    2: dict(name="biGRU regime tagging", model=Tagger, kind="seqcls"),
    3: dict(name="GRU regressor, rule change", model=Regressor, kind="reg"),
    4: dict(name="LSTMCell glyphs, rotated", model=CellClassifier, kind="cls"),
    5: dict(name="2-layer LSTM (dropout 0.2) motifs", model=Deep, kind="cls"),
}


def make_data(stream, seed, n_train, n_test):
    g = torch.Generator().manual_seed(9000 + 100 * stream + seed)
    data = []
    for k in range(NTASK):
        if stream == 1:
            chains = markov_chains(seed)
            tr, te = lm_task(k, n_train, g, chains), lm_task(k, n_test, g, chains)
        elif stream == 2:
            tr, te = tag_task(k, n_train, g), tag_task(k, n_test, g)
        elif stream == 3:
            tr, te = reg_raw(k, n_train, g), reg_raw(k, n_test, g)
            m, s = tr[1].mean(), tr[1].std()
            tr, te = (tr[0], (tr[1] - m) / s), (te[0], (te[1] - m) / s)
        elif stream == 4:
            tr, te = glyph_task(k, n_train, g), glyph_task(k, n_test, g)
        else:
            motifs = make_motifs(seed)
            tr, te = motif_task(k, n_train, g, motifs), motif_task(k, n_test, g, motifs)
        data.append((tr, te))
    return data


def loss_fn(kind, out, y):
    if kind == "seqcls":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    if kind == "cls":
        return F.cross_entropy(out, y)
    return F.mse_loss(out, y)


@torch.no_grad()
def evaluate(model, kind, x, y):
    model.eval()
    out = torch.cat([model(x[i:i + 500]) for i in range(0, len(x), 500)])
    model.train()
    if kind in ("seqcls", "cls"):
        return (out.argmax(-1) == y).float().mean().item()
    return F.mse_loss(out, y).item()


def make_opt(model, learner, seed):
    if learner == "NEW":
        return FOOVB(model, seed=seed)
    if learner == "OLD":  # FOOVB(model) before session 55: "auto" kept recurrent layers diagonal
        auto = priors.auto_matrix_variate
        priors.auto_matrix_variate = lambda module, matrices: (
            not isinstance(module, (nn.RNNBase, nn.RNNCellBase)) and auto(module, matrices))
        try:
            return FOOVB(model, seed=seed)
        finally:
            priors.auto_matrix_variate = auto
    return torch.optim.Adam(model.parameters(), lr=float(learner.split("@")[1]))


def run_learner(spec, learner, seed, data, orders, batch):
    kind = spec["kind"]
    torch.manual_seed(seed)
    model = spec["model"]()  # same initial weights for every learner of this stream and seed
    with torch.no_grad():
        init_hash = sum(float(p.double().sum()) for p in model.parameters())
    opt = make_opt(model, learner, seed)
    foovb = learner in ("NEW", "OLD")
    kron = ([type(b.module).__name__ for b in opt.blocks if isinstance(b, KroneckerBlock)]
            if foovb else None)
    torch.manual_seed(10_000 + seed)  # dropout-free models; FOOVB draws from its own seeded generator
    R, times, err = train_on_stream(model, opt, foovb, kind, data, orders, batch, loss_fn, evaluate)
    final = R[NTASK - 1]
    ok = err is None
    return dict(learner=learner, seed=seed, diverged=err, R=R, final=final,
                average=(sum(final) / NTASK if ok else None), first_final=final[0], first_learned=R[0][0],
                step_ms=1000 * sum(times) / max(len(times), 1), steps=len(times), kron_blocks=kron,
                init_hash=init_hash)


def main():
    torch.set_num_threads(1)
    ap = stream_parser(epochs=1, learners="NEW,OLD,adam@3e-4,adam@1e-3,adam@3e-3")
    ap.add_argument("--dropout", type=float, default=0.2, help="stream 5: dropout between the LSTM layers")
    a = ap.parse_args()
    global DEEP_DROPOUT
    DEEP_DROPOUT = a.dropout
    spec = STREAMS[a.stream]
    for seed in [int(s) for s in a.seeds.split(",")]:
        t0 = time.time()
        data = make_data(a.stream, seed, a.n_train, a.n_test)
        print(f"data {time.time() - t0:.1f}s", flush=True)
        go = torch.Generator().manual_seed(77 + 100 * a.stream + seed)
        orders = [[torch.randperm(a.n_train, generator=go) for _ in range(a.epochs)] for _ in range(NTASK)]
        for learner in a.learners.split(","):
            r, caught = run_recorded(run_learner, spec, learner, seed, data, orders, a.batch)
            r.update(stream=a.stream, name=spec["name"], warnings=sorted({text[:300] for text in caught}),
                     n_train=a.n_train, n_test=a.n_test, epochs=a.epochs, batch=a.batch,
                     dropout=(a.dropout if a.stream == 5 else None))
            print(json.dumps({k: v for k, v in r.items() if k not in ("R",)}), flush=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
