"""Shared helpers for the FOO-VB core tests (linalg, optimizer, predict)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
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


def assert_algorithm_3_step(block, mean: torch.Tensor, a: torch.Tensor, b: torch.Tensor, psi: list[torch.Tensor],
                            phi: torch.Tensor, mean_rtol: float, cov_rtol: float) -> None:
    """A matrix-variate block's state after one step from (mean M, factors A, B) equals the paper's update from its
    samples' gradients Psi_k and noises Phi_k (prior's covariance in the mean step): M <- M - B B^T E1 A A^T,
    Sigma_1 <- Lemma 2 with E2 = mean Psi^T B Phi / p, Sigma_2 with E3 = mean Psi A Phi^T / n."""
    from foovb import solve_fixed_point

    (p, n), k_samples = mean.shape, len(psi)
    e1 = sum(psi) / k_samples
    e2 = sum(ps.T @ b @ f for ps, f in zip(psi, phi, strict=True)) / (p * k_samples)
    e3 = sum(ps @ a @ f.T for ps, f in zip(psi, phi, strict=True)) / (n * k_samples)
    torch.testing.assert_close(block.state["mean"], mean - b @ b.T @ e1 @ a @ a.T, rtol=mean_rtol, atol=1e-11)
    x1, x2 = solve_fixed_point(a @ a.T, e2), solve_fixed_point(b @ b.T, e3)
    new_a, new_b = block.state["input_sqrt_cov"], block.state["output_sqrt_cov"]
    torch.testing.assert_close(new_a @ new_a.T, x1 @ x1.T, rtol=cov_rtol, atol=1e-11)
    torch.testing.assert_close(new_b @ new_b.T, x2 @ x2.T, rtol=cov_rtol, atol=1e-11)


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


# ---------------------------------------------------------------------------------------------------------
# Shared by the library tests (tests/test_engine.py, test_model_changes.py, test_optimizer.py, test_persistence.py,
# test_posteriors.py, test_reduction.py, test_sampled.py)
# ---------------------------------------------------------------------------------------------------------
F64 = torch.float64

# How close two routes to one update must agree (step == step_batched, chunked or not)
TOLERANCE = {F64: {"atol": 1e-10, "rtol": 1e-9}, torch.float32: {"atol": 1e-5, "rtol": 1e-4}}

# The batch that the loss-reading tests' closures see by default (tests/test_reduction.py, test_model_changes.py)
_X8, _Y8 = mlp_batch(rows=8)


def ce_closure(model, x, y, reduction="sum"):
    def closure():
        loss = F.cross_entropy(model(x), y, reduction=reduction)
        loss.backward()
        return loss

    return closure


def take_steps(model, opt, start, count):
    """`count` steps with ce_closure on the batches mlp_batch(seed=200 + step), step = start, start + 1, ..."""
    for step in range(start, start + count):
        x, y = mlp_batch(seed=200 + step)
        opt.step(ce_closure(model, x, y))


def randomize_factors(opt, gen, scale=0.3):
    """Replace the (diagonal / isotropic) initial covariances by random non-symmetric square roots and random
    stds, so that the tests can tell A from A^T and rows from columns."""
    for block in opt.blocks:
        st = block.state
        if block.family == "diagonal":
            st["std"].copy_(scale * (0.5 + torch.rand(st["std"].shape, generator=gen, dtype=F64)))
        elif block.family == "full":
            st["sqrt_cov"] = scale * random_sqrt(st["sqrt_cov"].shape[0], gen).to(st["mean"].dtype)
        else:
            for key in ("input_sqrt_cov", "output_sqrt_cov"):
                st[key] = math.sqrt(scale) * random_sqrt(st[key].shape[0], gen).to(st["mean"].dtype)


def model_closure(model, loss_fn, detach=False):
    """A closure of loss_fn(model); `detach`: it returns a detached copy of the loss, as Lightning's closure does."""
    def closure():
        loss = loss_fn(model)
        loss.backward()
        return loss.detach().clone() if detach else loss  # Lightning's closure returns a detached copy

    return closure


def closure_of(model, loss_fn, x=_X8, y=_Y8):
    """A closure of loss_fn(model(x), y)."""
    def closure():
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    return closure


def summed_ce(out, y):
    return F.cross_entropy(out, y, reduction="sum")


def assert_same_posterior(got, want, rtol=1e-5, atol=1e-6):
    for a, b in zip(posterior_snapshot(got), posterior_snapshot(want), strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def one_step(loss_fn, family="diagonal", seed=0, **options):
    """The optimizer after one step of loss_fn on mlp(seed) (K = 4, seed 3) with closure_of's batch."""
    from foovb import FOOVB

    model = mlp(seed=seed)
    opt = FOOVB(model, family, 4, seed=3, **options)
    opt.step(closure_of(model, loss_fn))
    return opt
