"""How fast `FOOVB(model)` learns a deeper network than the paper's MLP, against Adam and SGD (issue 54, session 41).

One stream of `benchmarks/robustness_grid.py` (`fashion`: MNIST, then Fashion-MNIST into the same 10-way head; batch
64, 3,072 training examples per task, seed 0) and one model per row: the grid's LeNet, or a 784-100-...-100-10
ReLU MLP of `--depths` Linear layers, as torch initialises it (`torch`), with Kaiming-normal weights and zero biases
(`kaiming`, what SGD needs at depth) or with a LayerNorm after every hidden Linear (`layernorm`). Prints the
posterior mean's (or the network's) test accuracy on both tasks after each half task, so that a row shows how far
the first task was learned before the second began, and how much of it was kept.

    python scripts/depth_probe.py [--rows lenet,mlp3,mlp4,mlp6,mlp6-kaiming,mlp6-layernorm]
        [--learners foovb_kronecker,adam_0.001,sgd_0.1] [--settings '{"alpha": 0.8}'] [--data-dir ../shared/data]

`--settings`: keyword arguments of FOOVB for the FOO-VB learners (for the matrix-variate family, `alpha` sets the
prior variance of a kept model, 2 (1 - alpha) / (n_in + 2): alpha 0.8 is 0.4 times the default's).

`--noise`: instead of training, how much the prior's sampled networks differ from the mean network on the stream's
first batch of 128: the sum over rows of ||f(theta_k, x) - f(mu, x)||^2 over that of ||f(mu, x) - its batch mean||^2
(the outputs' noise against their signal, averaged over 10 samples), and the cross-entropy of the mean and of the
samples, for `FOOVB(model, settings)` on each row (the grid's model kinds may be rows too: `narrow`, `cnn`, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import robustness_grid as grid  # noqa: E402

from foovb import FOOVB  # noqa: E402
from foovb.calibration import noise_ratio  # noqa: E402

EXAMPLES, BATCH = 3072, 64


def build(row: str, num_outputs: int) -> nn.Module:
    """One of the grid's classifiers (`lenet`, `mlp`, `narrow`, `ln_mlp`, `cnn`, `bn_cnn`, `gru`), or
    `mlp<depth>[-kaiming|-layernorm]`."""
    if row in ("lenet", "mlp", "narrow", "ln_mlp", "cnn", "bn_cnn", "gru"):
        return grid.build_model(row, num_outputs)
    name, _, variant = row.partition("-")
    if not name.startswith("mlp") or not name[3:].isdigit() or int(name[3:]) < 2:
        raise ValueError(f"unknown row {row!r}: lenet or mlp<depth >= 2>[-kaiming|-layernorm]")
    if variant not in ("", "kaiming", "layernorm"):
        raise ValueError(f"unknown variant {variant!r} of {row!r}: kaiming or layernorm")
    widths = [784] + [100] * (int(name[3:]) - 1)
    layers: list[nn.Module] = [nn.Flatten()]
    for fan_in, fan_out in zip(widths[:-1], widths[1:], strict=True):
        layers.append(nn.Linear(fan_in, fan_out))
        if variant == "layernorm":
            layers.append(nn.LayerNorm(fan_out))
        layers.append(nn.ReLU())
    model = nn.Sequential(*layers, nn.Linear(widths[-1], num_outputs))
    if variant == "kaiming":
        for module in model:
            if isinstance(module, nn.Linear):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                nn.init.zeros_(module.bias)
    return model


def probe(row: str, learner: str, settings: dict, data_dir: str | None) -> list[tuple[int, list[float]]]:
    """(step, accuracy per task) after every half task."""
    stream = grid.make_stream("mlp", "fashion", BATCH, EXAMPLES, 0, data_dir)
    torch.manual_seed(0)
    model = build(row, stream.num_outputs)
    family = learner.removeprefix("foovb_")
    optimizer = grid.make_optimizer(learner, model, 0, {family: settings} if learner.startswith("foovb_") else {})
    every, curve = EXAMPLES // BATCH // 2, []
    for step, (x, y) in enumerate(stream.batches(), 1):
        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        optimizer.step(closure)
        if step % every == 0:
            curve.append((step, grid.evaluate(model, stream.tests, False)))
    return curve


@torch.no_grad()
def sampled_outputs(optimizer: FOOVB, model: nn.Module, x: torch.Tensor,
                    samples: int = 10) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """f(mu, x) and f(theta_k, x) for `samples` draws of the posterior (seeds 0, 1, ...)."""
    mean_out, outs = model(x), []
    for seed in range(samples):
        with optimizer.sampled_params(seed=seed):
            outs.append(model(x))
    return mean_out, outs


@torch.no_grad()
def output_noise(row: str, settings: dict, data_dir: str | None) -> tuple[float, float, float]:
    """(output noise / signal, the mean network's loss, the samples' mean loss) on the stream's first batch."""
    stream = grid.make_stream("mlp", "fashion", 128, EXAMPLES, 0, data_dir)
    x, y = next(iter(stream.batches()))
    torch.manual_seed(0)
    model = build(row, stream.num_outputs).eval()
    mean_out, outs = sampled_outputs(FOOVB(model, seed=0, **settings), model, x)
    sample_loss = sum(float(F.cross_entropy(out, y)) for out in outs) / len(outs)
    return noise_ratio(mean_out, outs), float(F.cross_entropy(mean_out, y)), sample_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="lenet,mlp3,mlp4,mlp6,mlp6-kaiming,mlp6-layernorm")
    parser.add_argument("--learners", default="foovb_kronecker,adam_0.001,sgd_0.1")
    parser.add_argument("--settings", default="{}", help="FOOVB keyword arguments (JSON) for the FOO-VB learners")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--noise", action="store_true", help="the prior's output noise instead of training")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = json.loads(args.settings)
    data_dir = args.data_dir or next((d for d in grid.FASHION_DIRS if Path(d).is_dir()), None)
    if args.noise:
        print(f"torch {torch.__version__}; FOOVB(model, **{settings}); the first batch of 128 of mlp/fashion\n")
        print("| row | output noise / signal | mean network's loss | samples' loss |")
        print("|---|---|---|---|")
        for row in args.rows.split(","):
            ratio, mean_loss, sample_loss = output_noise(row, settings, data_dir)
            print(f"| {row} | {ratio:.1f} | {mean_loss:.3f} | {sample_loss:.3f} |", flush=True)
        return
    print(f"torch {torch.__version__}; stream mlp/fashion/{BATCH} of the robustness grid, {EXAMPLES} examples per "
          f"task, seed 0; FOOVB settings {settings or 'the defaults'}; accuracy (%) on MNIST / Fashion-MNIST\n")
    steps = [EXAMPLES // BATCH // 2 * k for k in range(1, 5)]  # each half task
    print("| row | learner | " + " | ".join(f"step {step}" for step in steps) + " |")
    print("|---|---|" + "---|" * len(steps))
    for row in args.rows.split(","):
        for learner in args.learners.split(","):
            curve = probe(row, learner, settings, data_dir)
            cells = " | ".join(f"{mnist:.1f} / {fashion:.1f}" for _, (mnist, fashion) in curve)
            print(f"| {row} | {learner} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
