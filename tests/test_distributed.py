"""Multi-process FOO-VB (foovb.distributed): 2 processes over gloo on loopback equal one process.

The worker processes are started with torch.multiprocessing (spawn); they write their results with torch.save
into tmp_path and the parent compares them with a single-process run of the same seed and data.
"""

from __future__ import annotations

import math
import os
import socket
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import PAPER, all_equal, make_generator, params_snapshot, posterior_snapshot
from torch import nn

import foovb.distributed as fd
import foovb.engine
import foovb.optimizer
from foovb import FOOVB
from foovb.distributed import MODES, distribute, init_from_env, sample_range, setup_run, shard_batch
from foovb_suite.cli import main
from foovb_suite.config import config_from_dict
from foovb_suite.loading import load_run
from foovb_suite.runner import run

WORLD = 2
STEPS = 3
K = 3  # not divisible by WORLD: shares of 1 and 2 samples
ROWS = 8
PATHS = ("batched", "closure")
# (family, path, inputs): with 11 and 20 inputs (n = 12, 21 with the bias) the first Kronecker layer's
# low-rank statistic (rank 6 or 8 per process) is all-reduced dense (11 inputs: total rank >= 12, except the
# batched MC case, whose left factor is shared) or as factors (20 inputs).
MC_CASES = [(family, path, 4) for family in ("diagonal", "kronecker", "full") for path in PATHS] + [
    ("kronecker", path, inputs) for inputs in (11, 20) for path in PATHS]
DATA_CASES = [(family, path, 4) for family in ("diagonal", "kronecker") for path in PATHS] + [
    ("kronecker", path, 20) for path in PATHS]
MEAN_CASES = [("diagonal", path) for path in PATHS] + [("kronecker", "closure")]
BY_HAND = ("mean-by-hand", "sum-by-hand")  # sum / rows and mean * rows: a mean and a sum written by hand
# steps wide enough for the secant check to cut them
SECANT = {"diagonal": {"secant_check": True, "step_prior": 16.0, "mean_step": 60.0},
          "kronecker": {"secant_check": True, "step_prior": 16.0, "mean_step": 2.0}}
SECANT_CASES = [(family, path) for family in ("diagonal", "kronecker") for path in PATHS]


def mlp(inputs: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(inputs, 6), nn.ReLU(), nn.Linear(6, 3))


def batch(step: int, inputs: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = make_generator(100 + step)
    return torch.randn(ROWS, inputs, generator=g), torch.randint(3, (ROWS,), generator=g)


def run_steps(optimizer: FOOVB, model: nn.Module, path: str, inputs: int, mode: str | None, reduction: str,
              rows: int, loss_fn: Any) -> list:
    """The STEPS steps of `train` on its batches; their losses."""
    losses = []
    for step in range(STEPS):
        x, y = batch(step, inputs)
        if reduction != "sum":
            x, y = x[:rows], y[:rows]
        if mode == "data":
            x, y = shard_batch(x, y)
        if path == "batched":
            losses.append(optimizer.step_batched(x, y, loss_fn))
        else:
            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                loss = loss_fn(model(x), y)
                loss.backward()
                return loss

            losses.append(optimizer.step(closure))
    return losses


# -- the training both the workers and the parent run --------------------------------------------------------
def train(family: str, path: str, inputs: int, mode: str | None,
          record_noise: bool = False, reduction: str = "sum", rows: int = 7,
          options: dict[str, Any] | None = None) -> dict[str, Any]:
    """3 FOO-VB steps on a tiny MLP (with FOOVB `options` added); mode None: single process, else
    distribute(optimizer, mode) first.
    reduction "mean" (or one of BY_HAND): the batch's mean (sum) loss over `rows` rows (data mode, 7: shards of 4
    and 3 rows), else the sum over all ROWS."""
    model = mlp(inputs)
    preset = PAPER if reduction == "sum" else {"preset": "paper"}
    optimizer = FOOVB(model, family, K, seed=7, **preset, **(options or {}))
    if mode is not None:
        distribute(optimizer, mode)
    noises: dict[tuple[int, int], list[torch.Tensor]] = {}
    draw = foovb.engine.draw_noise

    def recording_draw(blocks: list, seed: int, samples: range, **kwargs: Any) -> dict:
        out = draw(blocks, seed, samples, **kwargs)
        for row, k in enumerate(samples):
            noises[(optimizer.steps_taken, k)] = [out[block][row].clone() for block in optimizer.blocks]
        return out

    recording = mock.patch.object(foovb.engine, "draw_noise", recording_draw) if record_noise else nullcontext()
    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if reduction == "mean-by-hand":
            return F.cross_entropy(out, target, reduction="sum") / len(target)
        if reduction == "sum-by-hand":
            return F.cross_entropy(out, target) * len(target)
        return F.cross_entropy(out, target, reduction=reduction)

    with recording:
        losses = run_steps(optimizer, model, path, inputs, mode, reduction, rows, loss_fn)
    views = [optimizer.posterior(p) for p in model.parameters()]
    return {"means": [v.mean.clone() for v in views], "stds": [v.std.clone() for v in views],
            "state": posterior_snapshot(optimizer), "losses": losses, "noises": noises,
            "bytes": optimizer.statistics_reducer.bytes if optimizer.statistics_reducer else None}


def job_equivalence(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for family, path, inputs in MC_CASES:
        out[("mc", family, path, inputs)] = train(family, path, inputs, "mc",
                                                  record_noise=family == "diagonal")
    for family, path, inputs in DATA_CASES:
        out[("data", family, path, inputs)] = train(family, path, inputs, "data")
    for family, path in MEAN_CASES:
        out[("data-mean", family, path, 4)] = train(family, path, 4, "data", reduction="mean")
        out[("mc-mean", family, path, 4)] = train(family, path, 4, "mc", reduction="mean")
    for family, path in SECANT_CASES:
        for mode in MODES:
            out[(mode + "-secant", family, path, 4)] = train(family, path, 4, mode, options=SECANT[family])
    for path in PATHS:  # shards of 2 rows and 1 row: a mean over one row is a mean too
        out[("data-mean-3", "diagonal", path, 4)] = train("diagonal", path, 4, "data", reduction="mean", rows=3)
        for reduction in BY_HAND:
            out[("data-" + reduction, "diagonal", path, 4)] = train("diagonal", path, 4, "data", reduction=reduction)
    try:  # K = 1 < 2 processes: every process raises the same ValueError after a consistent check
        distribute(FOOVB(mlp(), "diagonal", 1, seed=7, **PAPER), "mc")
    except ValueError as error:
        out["too_few_samples"] = str(error)
    try:  # the processes built different optimizers
        distribute(FOOVB(mlp(), "diagonal", 4, seed=7, mean_step=1.0 + rank, antithetic=rank == 0, **PAPER),
                   "mc")
    except ValueError as error:
        out["different_settings"] = str(error)
    for path in PATHS:  # data mode, shard_batch forgotten: the same batch on both processes
        out[f"unsharded {path}"] = unsharded_data_step(path)
    for path in (*PATHS, "own loop"):  # MC mode, every process its own batch (a DistributedSampler)
        out[f"own batches {path}"] = mc_step_on_own_batches(rank, path)
    out["own batches unchecked"] = mc_step_on_own_batches(rank, "closure", check_same_batch=False)
    out["augmented in closure"] = mc_step_augmenting_in_the_closure(rank)
    out["out of step"] = out_of_step_process(rank)
    return out


def out_of_step_process(rank: int) -> dict[str, Any]:
    """MC mode, rank 0 alone loads a state dict saved one step earlier: the next step's error and whether the
    posterior stayed as it was."""
    model = mlp()
    optimizer = FOOVB(model, "diagonal", K, seed=7, **PAPER)
    distribute(optimizer, "mc")
    x, y = batch(0, 4)
    optimizer.step(summed_loss_closure(model, x, y))
    saved = optimizer.state_dict()
    optimizer.step(summed_loss_closure(model, x, y))
    if rank == 0:
        optimizer.load_state_dict(saved)
    before = posterior_snapshot(optimizer)
    result: dict[str, Any] = {}
    try:
        optimizer.step(summed_loss_closure(model, x, y))
    except ValueError as error:
        result["error"] = str(error)
    result["unchanged"] = all_equal(posterior_snapshot(optimizer), before)
    return result


def unsharded_data_step(path: str) -> dict[str, Any]:
    """A data-parallel step on the whole batch on every process: its error, whether the posterior and the model
    stayed as they were, and the loss of a step on the shards after it."""
    model = mlp()
    optimizer = FOOVB(model, "diagonal", K, seed=7, **PAPER)
    distribute(optimizer, "data")
    x, y = batch(0, 4)
    before, params = posterior_snapshot(optimizer), params_snapshot(model)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        if path == "batched":
            return optimizer.step_batched(x, y, lambda out, target: F.cross_entropy(out, target, reduction="sum"))
        return optimizer.step(summed_loss_closure(model, x, y))

    result: dict[str, Any] = {}
    try:
        step(x, y)
    except ValueError as error:
        result["error"] = str(error)
    result["unchanged"] = all_equal(posterior_snapshot(optimizer), before) and all_equal(params_snapshot(model),
                                                                                        params)
    result["sharded_loss"] = step(*shard_batch(x, y))
    return result


def mc_step_on_own_batches(rank: int, path: str, check_same_batch: bool = True) -> dict[str, Any]:
    """An MC-parallel step where each process got its own batch: its error, whether the posterior and the model
    stayed as they were, and the loss of a step on the same batch after it."""
    model = mlp()
    optimizer = FOOVB(model, "diagonal", K, seed=7, **PAPER)
    distribute(optimizer, "mc", check_same_batch=check_same_batch)
    before, params = posterior_snapshot(optimizer), params_snapshot(model)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        if path == "batched":
            return optimizer.step_batched(x, y, lambda out, target: F.cross_entropy(out, target, reduction="sum"))
        if path == "closure":
            return optimizer.step(summed_loss_closure(model, x, y))
        for _ in optimizer.sample_shard:
            with optimizer.sampled_params(train=True):
                F.cross_entropy(model(x), y, reduction="sum").backward()
        return optimizer.step()

    result: dict[str, Any] = {"error": None}
    try:
        result["loss"] = step(*batch(rank, 4))
    except ValueError as error:
        result["error"] = str(error)
    result["unchanged"] = all_equal(posterior_snapshot(optimizer), before) and all_equal(params_snapshot(model),
                                                                                        params)
    result["same_batch_loss"] = step(*batch(5, 4))
    return result


def mc_step_augmenting_in_the_closure(rank: int) -> dict[str, Any]:
    """MC mode, the same batch on both processes, but the closure adds fresh noise to it at every call (rank 1
    evaluates 2 samples, so its samples saw different inputs): no error, finite losses."""
    model = mlp()
    optimizer = FOOVB(model, "diagonal", K, seed=7, **PAPER)
    distribute(optimizer, "mc")
    x, y = batch(0, 4)
    noise = make_generator(rank)

    def closure() -> torch.Tensor:
        loss = F.cross_entropy(model(x + 0.1 * torch.randn(x.shape, generator=noise)), y, reduction="sum")
        loss.backward()
        return loss

    return {"losses": [optimizer.step(closure) for _ in range(2)]}


def job_failure(rank: int, failure: str) -> None:
    """At step 2 rank 1's closure raises or hangs, while rank 0 waits in the all-reduce."""
    model = mlp()
    optimizer = FOOVB(model, "diagonal", K, seed=7, **PAPER)
    distribute(optimizer, "mc")
    x, y = batch(0, 4)
    for step in range(STEPS):
        def closure(step: int = step) -> torch.Tensor:
            if rank == 1 and step == 2:
                if failure == "hangs":
                    time.sleep(600)
                raise RuntimeError("injected failure on rank 1")
            loss = F.cross_entropy(model(x), y, reduction="sum")
            loss.backward()
            return loss

        optimizer.step(closure)


# -- distribute(): every process starts from the first one's state ------------------------------------------
def summed_loss_closure(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    def closure():
        loss = F.cross_entropy(model(x), y, reduction="sum")
        loss.backward()
        return loss
    return closure


def state_snapshot(optimizer: FOOVB, model: nn.Module) -> dict:
    return {"generator": optimizer.generator.get_state().clone(), "steps": optimizer.steps_taken,
            "state": posterior_snapshot(optimizer), "params": params_snapshot(model)}


def job_distribute_state(rank: int) -> dict:
    out: dict = {}
    # 1. every process built its own model (init seed), noise seed and step count
    model = mlp(seed=rank)
    optimizer = FOOVB(model, "diagonal", K, seed=7 + 10 * rank, **PAPER)
    optimizer.steps_taken = 4 * rank
    if rank == 0:  # one step by itself first: non-trivial stds
        x, y = batch(0, 4)
        optimizer.step(summed_loss_closure(model, x, y))
        optimizer.steps_taken = 0
    out["before"] = state_snapshot(optimizer, model)
    distribute(optimizer, "mc")
    out["after"] = state_snapshot(optimizer, model)
    # 2. a hyperparameter differing between the processes, one at a time
    out["differing"] = {}
    for name, value in (("cov_step", 1.0 + 0.5 * rank), ("alpha", 0.5 - 0.25 * rank),
                        ("std_growth", ("paper", "none")[rank]), ("cov_momentum", 0.1 * rank)):
        try:
            init = {"init": "alpha"} if name == "alpha" else {}  # alpha applies to the diagonal family through init
            distribute(FOOVB(mlp(), "diagonal", 4, seed=7, **{name: value}, **init, **PAPER), "mc")
            out["differing"][name] = None
        except ValueError as error:
            out["differing"][name] = str(error)
    # 2b. layers of other shapes with the same number of blocks and posterior size: 5-4-6-3 against 5-2-10-3
    widths = ((4, 6), (2, 10))[rank]
    layered = nn.Sequential(nn.Linear(5, widths[0]), nn.ReLU(), nn.Linear(*widths), nn.ReLU(), nn.Linear(widths[1], 3))
    try:
        distribute(FOOVB(layered, "diagonal", 4, seed=7, **PAPER), "mc")
        out["differing"]["shapes"] = None
    except ValueError as error:
        out["differing"]["shapes"] = str(error)
    # 2c. weights loaded into the model after FOOVB was built, before distribute: they are the shared mean
    model = mlp(seed=0)
    optimizer = FOOVB(model, "diagonal", K, seed=7, **PAPER)
    model.load_state_dict(mlp(seed=5).state_dict())
    distribute(optimizer, "mc")
    out["loaded_then_distributed"] = params_snapshot(model)
    # 3. the per-sample losses all_reduce_statistics returns (MC mode: sample k's loss at index k)
    reduced = []
    original = fd.all_reduce_statistics

    def recording(*args, **kwargs):
        result = original(*args, **kwargs)
        reduced.append(list(result[2]))
        return result

    fd.all_reduce_statistics = recording
    try:
        model = mlp()
        optimizer = FOOVB(model, "diagonal", K, seed=7, **PAPER)
        distribute(optimizer, "mc")
        x, y = batch(0, 4)
        optimizer.step(summed_loss_closure(model, x, y))
    finally:
        fd.all_reduce_statistics = original
    out["reduced_losses"] = reduced
    return out


def single_process_losses() -> list[float]:
    """The per-sample losses one process hands to the update (the same seed, model and batch)."""
    model = mlp()
    optimizer = FOOVB(model, "diagonal", K, seed=7, **PAPER)
    seen = []
    apply = foovb.optimizer.apply_update

    def recording(stats, losses, *rest):
        seen.append(list(losses))
        return apply(stats, losses, *rest)

    x, y = batch(0, 4)
    with mock.patch.object(foovb.optimizer, "apply_update", recording):
        optimizer.step(summed_loss_closure(model, x, y))
    return seen[0]


JOBS = {"equivalence": job_equivalence,
        "distribute_state": job_distribute_state,
        "raises": lambda rank: job_failure(rank, "raises"),
        "hangs": lambda rank: job_failure(rank, "hangs")}


def worker(rank: int, world: int, port: int, job: str, out_dir: str, timeout_s: float) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        torch.save(JOBS[job](rank), Path(out_dir) / f"rank{rank}.pt")
    except Exception as error:
        (Path(out_dir) / f"error{rank}.txt").write_text(f"{type(error).__name__}: {error}")
        raise
    finally:
        dist.destroy_process_group()


RUNNER_CONFIG = {
    "name": "dist",
    "scenario": {"kind": "discrete_permuted_mnist", "num_tasks": 2, "epochs_per_task": 1, "train_subset": 256,
                 "batch_size": 64},
    "model": {"kind": "mlp", "hidden": [16]},
    "learner": {"kind": "foovb", "params": {"posterior": "kronecker", "mc_samples": 4, "eval_samples": 2}},
    "evaluation": {"test_subset": 200},
    "checkpoint_every": 3,
    "threads": 1,
    "device": "cpu",  # gloo on the CPU, compared exactly with a single-process CPU run
}


def runner_worker(rank: int, world: int, port: int, run_dir: str, stop_after: int) -> None:
    """`foovb_suite.runner.run` as torchrun would start it: the environment variables, nothing initialised."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        run(config_from_dict(RUNNER_CONFIG), run_dir, progress=False, stop_after=stop_after)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, job: str) -> list[dict]:
    """Run `job` on WORLD spawned gloo processes; return each rank's result. A process that saved its result and
    then died in gloo's teardown ("terminate called without an active exception", SIGABRT, seen about once in ten
    launches here) finished its job: only a missing result is a failure."""
    try:
        mp.start_processes(worker, args=(WORLD, free_port(), job, str(out), 30.0), nprocs=WORLD,
                           start_method="spawn")
    except mp.ProcessExitedException:
        if not all((out / f"rank{r}.pt").is_file() for r in range(WORLD)):
            raise
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


# -- tests --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Both ranks' results of `job_equivalence` (one 2-process launch shared by the equivalence tests)."""
    return launch(tmp_path_factory.mktemp("distributed"), "equivalence")


def assert_close_posteriors(got: dict, want: dict) -> None:
    for name in ("means", "stds"):
        for a, b in zip(got[name], want[name], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize(("family", "path", "inputs"), MC_CASES)
def test_mc_parallel_equals_single_process(results: list[dict], family: str, path: str, inputs: int) -> None:
    single = train(family, path, inputs, None)
    for rank in range(WORLD):
        assert_close_posteriors(results[rank][("mc", family, path, inputs)], single)


@pytest.mark.parametrize(("family", "path", "inputs"), DATA_CASES)
def test_data_parallel_equals_single_process_on_full_batch(results: list[dict], family: str, path: str,
                                                          inputs: int) -> None:
    single = train(family, path, inputs, None)
    for rank in range(WORLD):
        assert_close_posteriors(results[rank][("data", family, path, inputs)], single)


@pytest.mark.parametrize(("family", "path"), SECANT_CASES)
@pytest.mark.parametrize("mode", MODES)
def test_the_secant_check_cuts_alike_in_both_modes(results: list[dict], family: str, path: str, mode: str) -> None:
    """The cut of every process is the single process's: E[g] of the whole batch, g(mu + d) . d summed over the
    shards (data mode) or shared (MC mode). The check acts here: without it the steps differ."""
    single = train(family, path, 4, None, options=SECANT[family])
    unchecked = train(family, path, 4, None, options={**SECANT[family], "secant_check": False})
    assert max(float((a - b).abs().max()) for a, b in zip(single["means"], unchecked["means"], strict=True)) > 1e-2
    for rank in range(WORLD):
        got = results[rank][(mode + "-secant", family, path, 4)]
        for name in ("means", "stds"):  # wide steps: the sums' order across processes shows at 1e-6 relative
            for a, b in zip(got[name], single[name], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("family", "path"), MEAN_CASES)
def test_data_parallel_with_a_mean_loss_equals_single_process_on_full_batch(results: list[dict], family: str,
                                                                           path: str) -> None:
    """Shards of 4 and 3 rows, each process's loss their mean: the posterior and the reported loss are the whole
    batch's (the reported loss was the sum of the shards' means, about 2x)."""
    single = train(family, path, 4, None, reduction="mean")
    for rank in range(WORLD):
        assert_close_posteriors(results[rank][("data-mean", family, path, 4)], single)


@pytest.mark.parametrize(("family", "path"), MEAN_CASES)
def test_mc_parallel_with_a_mean_loss_reports_the_single_process_loss(results: list[dict], family: str,
                                                                     path: str) -> None:
    """Each sample's loss comes from one process: it was multiplied by the batch's rows (in one version)."""
    single = train(family, path, 4, None, reduction="mean")
    for rank in range(WORLD):
        assert_close_posteriors(results[rank][("mc-mean", family, path, 4)], single)


@pytest.mark.parametrize("path", PATHS)
def test_data_parallel_with_a_one_row_shard_reports_the_whole_batchs_mean(results: list[dict], path: str) -> None:
    """Shards of 2 rows and 1 row: the one-row mean was taken for a sum, (2 m_a + l_b) / 2 was reported."""
    single = train("diagonal", path, 4, None, reduction="mean", rows=3)
    for rank in range(WORLD):
        assert_close_posteriors(results[rank][("data-mean-3", "diagonal", path, 4)], single)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("reduction", BY_HAND)
def test_losses_written_by_hand_report_the_whole_batchs_loss(results: list[dict], path: str,
                                                             reduction: str) -> None:
    """sum / len(y) is a mean and mean * len(y) a sum: data-parallel training reported the sum of the shards'
    means and the average of their sums, and step_batched reported a hand-written mean divided by K."""
    single = train("diagonal", path, 4, None, reduction=reduction)
    mean = train("diagonal", path, 4, None, reduction="mean")["losses"]
    rows = 7
    want = mean if reduction == "mean-by-hand" else [rows * loss for loss in mean]
    torch.testing.assert_close(torch.tensor(single["losses"]), torch.tensor(want), rtol=1e-5, atol=1e-5)
    for rank in range(WORLD):
        assert_close_posteriors(results[rank][("data-" + reduction, "diagonal", path, 4)], single)


def test_ranks_stay_identical(results: list[dict]) -> None:
    for key, first in results[0].items():
        if isinstance(key, tuple):
            other = results[1][key]
            assert all(torch.equal(a, b) for a, b in zip(first["state"], other["state"], strict=True)), key
            assert first["losses"] == other["losses"], key


def test_union_of_ranks_noise_equals_single_process_draws(results: list[dict]) -> None:
    single = train("diagonal", "batched", 4, None, record_noise=True)["noises"]
    shares = [results[r][("mc", "diagonal", "batched", 4)]["noises"] for r in range(WORLD)]
    assert set(shares[0]).isdisjoint(shares[1])
    union = {**shares[0], **shares[1]}
    assert union.keys() == single.keys()
    for key, value in single.items():
        assert all(torch.equal(a, b) for a, b in zip(union[key], value, strict=True)), key
    assert {k for _, k in shares[0]} == set(sample_range(K, 0, WORLD)) == {0}
    assert {k for _, k in shares[1]} == set(sample_range(K, 1, WORLD)) == {1, 2}


def test_all_reduced_bytes(results: list[dict]) -> None:
    """What travels per step: float32 statistics and losses, and 16 bytes per low-rank statistic and process
    (its rank and fingerprint)."""
    params = sum(p.numel() for p in mlp().parameters())  # diagonal: grad_sum and grad_noise_sum per weight
    # check_in_step, float64 maxima of values and of their negations: the step seed's two halves; in data mode the
    # losses' hash's two halves; in MC mode the batch signature (a flag and the inputs' 4 moments)
    check = {"mc": 2 * 8 * (2 + 5), "data": 2 * 8 * (2 + 2)}
    assert results[0][("mc", "diagonal", "batched", 4)]["bytes"] == 4 * (2 * params + K) + check["mc"]
    # kronecker, 20 inputs, batched: layer 1 (p = 6, n = 21): psi_sum p x n, psi_a_phi p x p, and psi_b_phi =
    # X^T R, whose left factor X (8 x n) is the batch: the same on both processes under MC-parallel training,
    # so only R (8 x n) is summed; data-parallel: the shards' X differ, X and R travel stacked (8 x n each).
    # Layer 2 (p = 3, n = 7): all dense.
    layer2 = 3 * 7 + 7 * 7 + 3 * 3
    mc = (6 * 21 + 8 * 21 + 6 * 6) + layer2 + K
    data = (6 * 21 + 2 * 8 * 21 + 6 * 6) + layer2 + K + 1  # data mode: the losses' rows too
    assert results[0][("mc", "kronecker", "batched", 20)]["bytes"] == 4 * mc + 16 * 2 * WORLD + check["mc"]
    assert results[0][("data", "kronecker", "batched", 20)]["bytes"] == 4 * data + 16 * 2 * WORLD + check["data"]
    # full: per Linear, grad_sum (d) and grad_noise as stacked factors of rank K (K x d each)
    d1, d2 = 4 * 6 + 6, 6 * 3 + 3
    floats = (d1 + 2 * K * d1) + (d2 + 2 * K * d2) + K
    assert results[0][("mc", "full", "batched", 4)]["bytes"] == 4 * floats + 16 * 2 * WORLD + check["mc"]


@pytest.mark.parametrize("path", PATHS)
def test_data_mode_refuses_the_same_batch_on_every_process(results: list[dict], path: str) -> None:
    """shard_batch forgotten: every process's statistics of the whole batch were summed, the batch's likelihood
    counted twice, silently. Now a ValueError on every process, nothing changed, and the sharded step runs."""
    for rank in range(WORLD):
        got = results[rank][f"unsharded {path}"]
        assert "every process evaluated the same batch" in got["error"] and "shard_batch" in got["error"]
        assert got["unchanged"]
        assert math.isfinite(got["sharded_loss"])


@pytest.mark.parametrize("path", [*PATHS, "own loop"])
def test_mc_mode_refuses_a_different_batch_on_every_process(results: list[dict], path: str) -> None:
    """MC mode with each process's own batch (a DistributedSampler's habit): every sample's gradient would be of
    another batch, silently. Now a ValueError on every process, nothing changed, and a step on one batch runs."""
    for rank in range(WORLD):
        got = results[rank][f"own batches {path}"]
        assert "evaluated different batches" in got["error"] and "mode='data'" in got["error"], got["error"]
        assert got["unchanged"]
        assert math.isfinite(got["same_batch_loss"])


def test_mc_mode_batch_check_can_be_turned_off(results: list[dict]) -> None:
    for rank in range(WORLD):
        got = results[rank]["own batches unchecked"]
        assert got["error"] is None and not got["unchanged"] and math.isfinite(got["loss"])


def test_mc_mode_accepts_inputs_changed_inside_the_closure(results: list[dict]) -> None:
    """A process whose own samples saw different inputs (augmentation in the closure) skips the comparison."""
    assert results[0]["augmented in closure"] == results[1]["augmented in closure"]
    assert all(math.isfinite(loss) for loss in results[0]["augmented in closure"]["losses"])


def test_processes_out_of_step_raise_on_every_rank(results: list[dict]) -> None:
    """A state dict loaded on one process after distribute (or a step skipped on one): the processes summed the
    statistics of different steps' noise around different means, silently."""
    for rank in range(WORLD):
        got = results[rank]["out of step"]
        assert "different steps of the posterior" in got["error"] and got["unchanged"]


def test_too_few_samples_for_mc_mode_raises_on_every_rank(results: list[dict]) -> None:
    for rank in range(WORLD):
        assert "at least one Monte Carlo sample" in results[rank]["too_few_samples"]


def test_different_optimizer_settings_raise_on_every_rank(results: list[dict]) -> None:
    for rank in range(WORLD):
        assert "disagree on lr, antithetic" in results[rank]["different_settings"]


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["raises", "hangs"])
def test_failing_rank_stops_the_whole_job(tmp_path: Path, failure: str) -> None:
    """No launcher stops the survivor here: rank 0 must fail by itself, at once when rank 1 raises (the peer's
    connection closes) and after the collective timeout when rank 1 hangs."""
    timeout_s = 5.0
    tic = time.monotonic()
    context = mp.start_processes(worker, args=(WORLD, free_port(), failure, str(tmp_path), timeout_s),
                                 nprocs=WORLD, join=False, start_method="spawn")
    survivor, failing = context.processes
    try:
        survivor.join(timeout=60)
        elapsed = time.monotonic() - tic
        if failure == "raises":
            failing.join(timeout=10)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    assert survivor.exitcode not in (None, 0), "rank 0 hung or succeeded"
    assert (tmp_path / "error0.txt").exists()  # rank 0's all-reduce raised
    if failure == "raises":
        assert failing.exitcode not in (None, 0)
        assert "injected failure on rank 1" in (tmp_path / "error1.txt").read_text()
    assert not list(tmp_path.glob("rank*.pt"))
    assert elapsed < 45, elapsed


def test_distribute_needs_an_initialised_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    optimizer = FOOVB(mlp(), "diagonal", K, seed=7, **PAPER)
    with pytest.raises(RuntimeError, match="process group"):
        distribute(optimizer)
    with pytest.raises(RuntimeError, match="process group"):
        shard_batch(torch.zeros(4, 2))
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        init_from_env()
    assert optimizer.statistics_reducer is None


def test_invalid_modes_raise(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        with pytest.raises(ValueError, match="loss_reduction 'auto' or 'sum'"):
            distribute(FOOVB(mlp(), "diagonal", K, seed=7, loss_reduction="mean", preset="paper"), "data")
        with pytest.raises(ValueError, match="mode must be one of"):
            distribute(FOOVB(mlp(), "diagonal", K, seed=7, **PAPER), "pipeline")
        damped = FOOVB(mlp(), "diagonal", 4, seed=7)  # the diagonal default damps
        with pytest.raises(ValueError, match="cannot sum the squared per-sample gradients.*curvature_damping=False"):
            distribute(damped, "data")
        assert damped.statistics_reducer is None
        with pytest.raises(ValueError, match="different numbers of rows"):
            shard_batch(torch.zeros(4, 2), torch.zeros(3))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_runner_under_torchrun_resumes_single_process_with_the_same_metrics(tmp_path: Path) -> None:
    """2 processes train 5 iterations (evaluating once) and checkpoint; 1 process resumes: the metrics equal
    those of an uninterrupted single-process run."""
    config = config_from_dict(RUNNER_CONFIG)
    run(config, tmp_path / "single", progress=False)
    mp.start_processes(runner_worker, args=(WORLD, free_port(), str(tmp_path / "multi"), 5), nprocs=WORLD,
                       start_method="spawn")
    assert torch.load(tmp_path / "multi" / "checkpoint.pt", weights_only=False)["iteration"] == 5
    run(config, tmp_path / "multi", resume=True, progress=False)
    want, got = (load_run(tmp_path / name)["records"] for name in ("single", "multi"))
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want] == [4, 8]
    for mine, theirs in zip(got, want, strict=True):
        for metric, tolerance in (("accuracy", 0.006), ("nll", 1e-4)):  # 0.006: one test example of 200
            for mode, values in theirs[metric].items():
                assert mine[metric][mode] == pytest.approx(values, abs=tolerance), (metric, mode)


def test_runner_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert setup_run("sgd") is False  # not launched by torchrun: single process, nothing initialised
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="single-process only"):
        setup_run("sgd")
    assert not dist.is_initialized()


def test_a_baseline_under_torchrun_is_one_error_line(monkeypatch: pytest.MonkeyPatch, config_file: Path,
                                                    tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`torchrun ... foovb run` of a baseline: a ValueError traceback on every rank before."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["run", str(config_file), "--set", "learner.kind=sgd", "--set", "learner.params={lr: 0.1}",
                 "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error == ["foovb: error: learner.kind: learner 'sgd' runs single-process only; multi-process training "
                     "(torchrun) is implemented for the foovb learner"]
    assert not dist.is_initialized() and not (tmp_path / "r").exists()


def test_too_few_samples_under_torchrun_is_one_error_line(monkeypatch: pytest.MonkeyPatch, config_file: Path,
                                                          tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """distribute's ValueError on every rank (K below the processes, settings that differ) is a user's error."""
    import foovb_suite.runner as runner

    def refuse(optimizer: FOOVB, mode: str) -> None:
        sample_range(1, 0, 2)

    monkeypatch.setattr(runner.distributed, "setup_run", lambda kind, device: True)
    monkeypatch.setattr(runner.distributed, "distribute", refuse)
    monkeypatch.setattr(runner.torch.distributed, "get_rank", lambda: 0)
    assert main(["run", str(config_file), "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    (error,) = capsys.readouterr().err.strip().splitlines()
    assert error.startswith("foovb: error: torchrun: mc_samples=1 is smaller than the 2 processes")


@pytest.fixture(scope="module")
def state_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Both ranks' results of `job_distribute_state`: processes built differently on purpose."""
    return launch(tmp_path_factory.mktemp("distribute_state"), "distribute_state")


def test_distribute_gives_every_process_the_first_process_state(state_results):
    first = state_results[0]["before"]
    assert first["steps"] == 0 and state_results[1]["before"]["steps"] == 4  # they did differ
    assert not torch.equal(first["generator"], state_results[1]["before"]["generator"])
    assert not all(torch.equal(a, b) for a, b in zip(first["state"], state_results[1]["before"]["state"], strict=True))
    for rank in range(WORLD):
        after = state_results[rank]["after"]
        assert torch.equal(after["generator"], first["generator"]), f"rank {rank}: noise generator"
        assert after["steps"] == first["steps"], f"rank {rank}: step counter"
        assert all(torch.equal(a, b) for a, b in zip(after["state"], first["state"], strict=True)), \
            f"rank {rank}: posterior"
        # the model holds the posterior mean (rank 0's)
        assert all(torch.equal(a, b) for a, b in zip(after["params"], first["params"], strict=True)), \
            f"rank {rank}: model parameters"


def test_weights_loaded_before_distribute_are_the_mean_every_process_starts_from(state_results):
    """distribute broadcast the mean the optimizer was built with and wrote it over the loaded weights."""
    for rank in range(WORLD):
        assert all_equal(state_results[rank]["loaded_then_distributed"], params_snapshot(mlp(seed=5))), rank


@pytest.mark.parametrize("name", ["cov_step", "alpha", "std_growth", "cov_momentum", "shapes"])
def test_any_differing_hyperparameter_raises_on_every_rank(state_results, name):
    for rank in range(WORLD):
        message = state_results[rank]["differing"][name]
        want = "posterior shapes" if name == "shapes" else name
        assert message is not None and f"disagree on {want}" in message, (rank, message)


def test_all_reduced_losses_are_each_samples_loss_at_its_index(state_results):
    want = single_process_losses()
    for rank in range(WORLD):
        (got,) = state_results[rank]["reduced_losses"]
        assert got == pytest.approx(want, rel=1e-5), rank


def test_input_moments_tell_batches_apart() -> None:
    """The MC-mode batch check's moments: equal for equal inputs, different for the same rows in another order
    (the position-weighted sum), another row count, or one changed element; finite for NaN / Inf inputs."""
    x = torch.randn(8, 5, generator=make_generator(0))
    y = torch.arange(8)
    moments = fd.input_moments([x, y])
    assert torch.equal(moments, fd.input_moments([x.clone(), y.clone()]))
    assert moments[0] == 8 * 5 + 8 and torch.isclose(moments[1], x.double().sum() + 28)
    changed = x.clone()
    changed[3, 2] += 1e-3
    for other in ([x.flip(0), y], [x, y.flip(0)], [x[:7], y[:7]], [changed, y]):
        assert not torch.equal(moments, fd.input_moments(other))
    assert torch.isfinite(fd.input_moments([torch.tensor([float("nan"), float("inf"), 1.0])])).all()
