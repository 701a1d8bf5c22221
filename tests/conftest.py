"""Shared helpers for the FOO-VB core tests (linalg, optimizer, predict)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

FAMILIES = ("diagonal", "kronecker", "full")


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_spd(n: int, gen: torch.Generator, cond: float | None = None) -> torch.Tensor:
    """Random SPD float64 matrix; with `cond`, eigenvalues logspaced over [1/cond, 1]."""
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    if cond is None:
        eig = torch.rand(n, generator=gen, dtype=torch.float64) * 2 + 0.2
    else:
        eig = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), n, dtype=torch.float64)
    return (q * eig) @ q.T


def random_sqrt(n: int, gen: torch.Generator) -> torch.Tensor:
    """A random, well-conditioned, non-symmetric square root A (covariance A A^T)."""
    return torch.eye(n, dtype=torch.float64) + 0.3 * torch.randn(n, n, generator=gen, dtype=torch.float64)


def mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).to(dtype)


def cnn(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    # the second convolution sees per-sample activations (the grouped-convolution branch of the batched path)
    convs = [nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 3, 3, stride=2), nn.ReLU()]
    return nn.Sequential(*convs, nn.Flatten(), nn.Linear(3 * 2 * 2, 3)).to(dtype)


def mlp_batch(seed: int = 1, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = make_generator(seed)
    return torch.randn(rows, 4, generator=g), torch.randint(3, (rows,), generator=g)


def cnn_batch(seed: int = 1, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = make_generator(seed)
    return torch.randn(rows, 2, 5, 5, generator=g), torch.randint(3, (rows,), generator=g)


def posterior_snapshot(opt) -> list[torch.Tensor]:
    """Clones of every tensor of every block's state (means, stds, square roots / factors)."""
    return [v.detach().clone() for block in opt.blocks for v in block.state.values()]


def params_snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def all_equal(xs, ys) -> bool:
    return len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys, strict=True))


@pytest.fixture
def gen() -> torch.Generator:
    return make_generator(1234)


@pytest.fixture
def always_stacked(monkeypatch):
    """step_batched and sample_probabilities stack the samples of every layer, as on a GPU (on the CPU they
    evaluate models with a Conv2d or a wide layer one sample at a time: `engine.stacking_is_slower`), so that
    the stacked path of such models is what a test exercises."""
    import foovb.optimizer
    import foovb.predict

    for module in (foovb.optimizer, foovb.predict):
        monkeypatch.setattr(module, "stacking_is_slower", lambda blocks: False)


@pytest.fixture(scope="module")
def single_thread():
    """The core tests use tiny matrices: intra-op threads only add overhead (severe on a busy box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The paper's hyperparameters with the summed loss that the math tests' closures return
PAPER = {"preset": "paper", "loss_reduction": "sum"}


# The runner tests' tiny run (tests/test_run_recovery.py, tests/test_run_robustness.py).
# 10 iterations per task, 2 tasks: evaluations after 10 and 20 iterations, periodic checkpoints after 7 and 14
TINY = {
    "name": "tiny",
    "scenario": {"kind": "discrete_permuted_mnist", "num_tasks": 2, "epochs_per_task": 1, "train_subset": 640,
                 "batch_size": 64},
    "model": {"kind": "mlp", "hidden": [16, 16]},
    "learner": {"kind": "foovb", "params": {"mc_samples": 4, "eval_samples": 4}},
    "evaluation": {"test_subset": 300},
    "checkpoint_every": 7,
    "device": "cpu",
}


@pytest.fixture
def config_file(tmp_path):
    """TINY as a YAML config file."""
    import yaml

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


def page_files(page: Path) -> dict[str, str]:
    """The files a docs page shows whole, each announced by `<!-- file: NAME -->` on the line before its fence
    (docs/suite.md's custom-stream example): name -> content. tests/test_readme.py checks the page's commands on
    them, tests/test_runner.py runs them."""
    return dict(re.findall(r"<!--\s*file:\s*(\S+)\s*-->\n```\w*\n(.*?)```", page.read_text(), re.S))
