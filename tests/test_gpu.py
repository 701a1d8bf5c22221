"""FOOVB(model) on a CUDA GPU: the same checks on the CPU (always run) and on a GPU (skipped without one; run by
scripts/device_check.sh). The default's posterior lives on the model's device, trains the models users bring
(a classifier, an autoencoder with a mean loss over its outputs, a CNN), keeps the output layer's output factor
diagonal there, repeats itself for one seed, reaches the CPU run's loss (other noise: a GPU draws its own), and
its state_dict moves between the CPU and the GPU."""

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from foovb import FOOVB
from foovb.posteriors import KroneckerBlock, output_layer_blocks

_spec = importlib.util.spec_from_file_location(
    "step_ops", Path(__file__).resolve().parents[1] / "benchmarks" / "step_ops.py")
step_ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_ops)
OperatorCount = step_ops.OperatorCount

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_gpu)]
pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: threads only contend


def problem(kind: str, device: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, object]:
    """A model built on the CPU from a fixed seed, moved to `device`, and its full batch (inputs, targets, loss)."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if kind == "autoencoder":
        model = nn.Sequential(nn.Linear(20, 8), nn.ReLU(), nn.Linear(8, 20))
        codes = torch.randn(256, 3, generator=generator)
        inputs = torch.tanh(codes @ torch.randn(3, 20, generator=generator))
        targets, loss_fn = inputs, F.mse_loss
    else:
        shape = (1, 8, 8) if kind == "cnn" else (20,)
        inputs = torch.randn(256, *shape, generator=generator)
        targets = (inputs.flatten(1) @ torch.randn(inputs[0].numel(), 10, generator=generator)).argmax(1)
        loss_fn = F.cross_entropy
        if kind == "cnn":
            model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
        else:
            model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 10))
    return model.to(device), inputs.to(device), targets.to(device), loss_fn


def train(kind: str, device: str, steps: int, seed: int = 0, posterior: str = "auto") -> tuple[FOOVB, list[float]]:
    model, inputs, targets, loss_fn = problem(kind, device)
    optimizer = FOOVB(model, posterior, mc_samples=4, seed=seed)
    losses = [float(optimizer.step_batched(inputs, targets, loss_fn)) for _ in range(steps)]
    return optimizer, losses


def state_tensors(optimizer: FOOVB) -> list[torch.Tensor]:
    return [value for entry in optimizer.state_dict()["state"].values() for value in entry.values()
            if isinstance(value, torch.Tensor) and value.dim() > 0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mlp", "autoencoder", "cnn"])
def test_the_default_trains_on_the_device_with_a_diagonal_output_factor(kind: str, device: str) -> None:
    optimizer, losses = train(kind, device, steps=60)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.8 * losses[0]
    tensors = state_tensors(optimizer)
    assert tensors and {tensor.device.type for tensor in tensors} == {device}
    head = output_layer_blocks(optimizer.blocks)
    assert head and all(isinstance(block, KroneckerBlock) and block.diagonal_output_factor for block in head)
    for block in head:
        output_factor = block.state["output_sqrt_cov"]
        assert torch.equal(output_factor, torch.diag(torch.diagonal(output_factor)))
    hidden = [block for block in optimizer.blocks if block not in head]
    assert not any(getattr(block, "diagonal_output_factor", False) for block in hidden)


@pytest.mark.parametrize("damping", [True, False])
def test_the_gpu_sums_of_a_diagonal_block_are_the_per_sample_sums(damping: bool) -> None:
    model = nn.Linear(6, 5)
    (block,) = [b for b in FOOVB(model, "diagonal", curvature_damping=damping, implicit_mean=True).blocks
                if b.params[0] is model.weight]
    generator = torch.Generator().manual_seed(1)
    noise, grad = (torch.randn(8, 5, 6, generator=generator) for _ in range(2))
    per_sample, reduced = block.new_statistics(), block.new_statistics()
    block.accumulate(per_sample, noise, [grad])  # the CPU's path
    block.accumulate_reduced(reduced, noise, grad)  # a GPU's
    assert per_sample.keys() == reduced.keys() and len(reduced) == (4 if damping else 2)
    for key, value in per_sample.items():
        torch.testing.assert_close(reduced[key], value)
    torch.testing.assert_close(reduced["grad_noise_sum"], (grad * noise).sum(0))
    # what the reduction is for: a GPU step is bound by kernel launches (docs/performance.md, "On a GPU")
    per_sample, reduced = block.new_statistics(), block.new_statistics()
    with OperatorCount() as per_sample_count:
        block.accumulate(per_sample, noise, [grad])
    with OperatorCount() as reduced_count:
        block.accumulate_reduced(reduced, noise, grad)
    assert reduced_count.count <= 10 < 2 * len(noise) <= per_sample_count.count


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_the_diagonal_family_trains_on_the_device(kind: str, device: str) -> None:
    optimizer, losses = train(kind, device, steps=60, posterior="diagonal")
    assert all(torch.isfinite(torch.tensor(losses))) and sum(losses[-5:]) / 5 < 0.8 * losses[0]
    assert {tensor.device.type for tensor in state_tensors(optimizer)} == {device}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("posterior", ["auto", "diagonal"])
def test_one_seed_gives_one_run_on_the_device(posterior: str, device: str) -> None:
    first, _ = train("mlp", device, steps=8, posterior=posterior)
    second, _ = train("mlp", device, steps=8, posterior=posterior)
    for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_gpu
@pytest.mark.parametrize(("kind", "posterior"), [("mlp", "auto"), ("autoencoder", "auto"), ("mlp", "diagonal")])
def test_a_gpu_run_reaches_the_cpu_runs_loss(kind: str, posterior: str) -> None:
    _, on_cpu = train(kind, "cpu", steps=150, posterior=posterior)
    _, on_gpu = train(kind, "cuda", steps=150, posterior=posterior)
    cpu_end, gpu_end = sum(on_cpu[-10:]) / 10, sum(on_gpu[-10:]) / 10
    assert max(cpu_end, gpu_end) < 0.5 * on_cpu[0] and abs(cpu_end - gpu_end) < 0.2 * on_cpu[0]


@needs_gpu
@pytest.mark.parametrize(("source", "target"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_the_state_dict_moves_between_the_cpu_and_the_gpu(source: str, target: str) -> None:
    trained, _ = train("mlp", source, steps=5)
    model, inputs, targets, loss_fn = problem("mlp", target)
    model.load_state_dict(copy.deepcopy(trained.model.state_dict()))
    moved = FOOVB(model, mc_samples=4, seed=0)
    moved.load_state_dict(trained.state_dict())
    for here, there in zip(state_tensors(moved), state_tensors(trained), strict=True):
        assert here.device.type == target
        torch.testing.assert_close(here.cpu(), there.cpu())
    assert torch.isfinite(moved.step_batched(inputs, targets, loss_fn))
