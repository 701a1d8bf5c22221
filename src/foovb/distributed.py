"""Multi-process FOO-VB training with torch.distributed (launch: docs/distributed.md).

One FOO-VB step needs, from every Monte Carlo sample k, the gradient g_k of the summed mini-batch loss L_n at
theta_k = mu + A eps_k, and only through *sums over k* of a few products of g_k and eps_k (each posterior
block's statistics, see `PosteriorBlock.accumulate`). Sums can be split over processes and added back with a
all-reduce, in two ways:

* ``mode="mc"`` (MC-parallel): every process sees the same batch and evaluates a contiguous share of the K
  sample indices (`AllReduce.samples`); the statistics of the shares are summed.
* ``mode="data"`` (data-parallel): every process evaluates all K samples, with the same noise, on its own
  contiguous shard of the batch (`shard_batch`). L_n is a *sum* over rows, so the full batch's statistics are
  the sum of the shards' statistics (this needs ``loss_reduction`` "auto" or "sum").

In both modes `distribute` gives the optimizer an `AllReduce` as its `statistics_reducer`; its `reduce`
(called by `engine.apply_update`) checks in a tiny all-reduce that the processes are in step (and, in data mode,
on different shards; in MC mode, on the same batch: `check_in_step`), then (`all_reduce_statistics`) sums the
statistics and the per-sample losses with one all-reduce per dtype (one in practice; low-rank statistics add a
tiny one that chooses how they travel), so every process applies the identical update, raises identically on
NaN/Inf and returns the same mean loss.

Reproducibility: the noise of sample k of block b at a step is a pure function of (step seed, b, k)
(`FOOVB.draw_noise`), and the step seeds come from `FOOVB.generator`, whose state `distribute` broadcasts from
rank 0 together with the posterior. The samples evaluated by all processes together are therefore exactly
those one process draws for the same seed, whatever the number of processes.
"""

from __future__ import annotations

import functools
import hashlib
import os
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from .linalg import LowRank
from .optimizer import FOOVB
from .posteriors import PosteriorBlock

__all__ = ["MODES", "init_from_env", "setup_run", "distribute", "shard_batch", "sample_range", "all_reduce_statistics"]

MODES = ("mc", "data")
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _require_initialized(what: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs an initialised torch.distributed process group: launch the script with torchrun "
            "and call foovb.distributed.init_from_env() (or torch.distributed.init_process_group) first"
        )


def _group_or_world(group: Any | None) -> Any:
    return dist.group.WORLD if group is None else group


def _comm_device(group: Any) -> torch.device:
    """Where the tensors of a collective must live: the current GPU for NCCL, the CPU otherwise (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> None:
    """Initialise the default process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    Args:
        backend: "gloo" or "nccl"; default nccl when CUDA is available (then the process also selects the
            GPU LOCAL_RANK), gloo otherwise.
        timeout_s: how long a collective waits for the other processes before failing. A process that dies
            breaks its peers' connections at once (and torchrun stops the job when a process exits non-zero);
            the timeout bounds the wait when a process hangs instead.
    Does nothing if the process group is already initialised.
    """
    if dist.is_initialized():
        return
    missing = [name for name in _TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise RuntimeError(f"environment variables {', '.join(missing)} are not set: launch with torchrun "
                           "(see docs/distributed.md)")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def setup_run(learner_kind: str, device: torch.device | None = None) -> bool:
    """For the experiment runner: is this run distributed? Initialises the process group under torchrun.

    A run is distributed when launched with WORLD_SIZE > 1 (torchrun: NCCL with one GPU per process,
    LOCAL_RANK, when the run's `device` is CUDA; gloo otherwise) or when the caller already initialised a
    process group of more than one process. Only FOO-VB learners support it (MC-parallel); the baselines
    raise ValueError.
    """
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not launched and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    if learner_kind != "foovb":
        raise ValueError(f"learner {learner_kind!r} runs single-process only; multi-process training "
                         "(torchrun) is implemented for the foovb learner")
    init_from_env(backend="nccl" if device is not None and device.type == "cuda" else "gloo")
    return True


def sample_range(num_samples: int, rank: int, world_size: int) -> range:
    """The contiguous share of the sample indices 0..num_samples-1 that process `rank` evaluates (MC mode)."""
    if num_samples < world_size:
        raise ValueError(f"mc_samples={num_samples} is smaller than the {world_size} processes: in "
                         "MC-parallel mode every process needs at least one Monte Carlo sample (use fewer "
                         "processes or more samples; in your own script, distribute(..., mode='data') also works)")
    return range(rank * num_samples // world_size, (rank + 1) * num_samples // world_size)


def _check_same_everywhere(values: list[int], names: list[str], group: Any) -> None:
    """Raise ValueError on every process if some process has different `values` (one all-reduce)."""
    local = torch.tensor(values, dtype=torch.int64)
    both = torch.cat([local, -local]).to(_comm_device(group))
    dist.all_reduce(both, dist.ReduceOp.MAX, group=group)
    both = both.cpu()
    high, low = both[: len(values)], -both[len(values):]
    differ = [name for name, hi, lo in zip(names, high.tolist(), low.tolist(), strict=True) if hi != lo]
    if differ:
        raise ValueError(f"the processes disagree on {', '.join(differ)}: every process must build the same "
                         "model and optimizer settings")


def _broadcast_(tensor: Tensor, group: Any) -> None:
    """Overwrite `tensor` in place with its value on the group's first process."""
    staged = tensor.detach().to(_comm_device(group)).contiguous()
    dist.broadcast(staged, src=dist.get_global_rank(group, 0), group=group)
    if staged is not tensor:
        tensor.copy_(staged)


def distribute(optimizer: FOOVB, mode: str = "mc", group: Any | None = None, *,
               check_same_batch: bool = True) -> None:
    """Make `optimizer` train jointly with the other processes of `group` (default: all processes).

    Call it on every process, after building the identical model and optimizer (and after loading a
    checkpoint, if any). It broadcasts the noise generator's state, the step counter and the posterior of the
    group's first process, so all processes start identical, and then sets `optimizer.statistics_reducer` to
    an `AllReduce` over the group (its samples: this process's share of the K samples in MC mode).

    Args:
        mode: "mc" (every process gets the same batch and evaluates its share of the K samples; needs
            K >= number of processes) or "data" (every process gets its shard of the batch, see
            `shard_batch`, and evaluates all K samples; needs loss_reduction "auto" or "sum").
        check_same_batch: MC mode: at every step, compare across the processes a few moments of the inputs the
            model was called with during the step's samples (a forward pre-hook on the model), and raise
            ValueError on every process when they differ (each process got its own batch, e.g. from a
            DistributedSampler: that is data mode). A process whose samples saw different inputs (random
            augmentation inside the closure) skips the comparison, except with one sample per process, where
            the two cannot be told apart: pass False there.
    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: unknown mode, data mode with loss_reduction="mean" or calibrate_prior, too few
            samples for MC mode, or the processes' optimizers differ in a hyperparameter (family, K, step sizes,
            options) or in the shapes of their posteriors (the models' layers).
    """
    _require_initialized("foovb.distributed.distribute")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "data" and optimizer.curvature_damping:
        raise ValueError("mode='data' cannot sum the squared per-sample gradients that curvature_damping (on in "
                         "the diagonal family's recommended preset) reads (each process has a shard of the batch): "
                         "build the optimizer with curvature_damping=False, or use mode='mc'")
    if mode == "data" and optimizer.calibrate_prior is not None:
        raise ValueError("mode='data' gives each process its own shard of the batch, on which calibrate_prior would "
                         "scale each process's prior by another factor: build the optimizer with "
                         "calibrate_prior=None, or use mode='mc'")
    if mode == "data" and optimizer.loss_reduction == "mean":
        raise ValueError("mode='data' needs loss_reduction 'auto' or 'sum': with 'mean' each process's loss would be "
                         "the mean over its own shard, and the shards' statistics could not be summed")
    group = _group_or_world(group)
    optimizer._adopt_model_weights()  # weights loaded into the model since construction are the mean to share
    state = [block.state[key] for block in optimizer.blocks for key in sorted(block.state)]
    hyperparameters = {key: value for key, value in optimizer.param_groups[0].items() if key != "params"}
    shapes = repr([tuple(t.shape) for t in state])
    _check_same_everywhere(  # hyperparameters and shapes by a stable hash of their repr: any difference is caught
        [MODES.index(mode), len(optimizer.blocks), sum(t.numel() for t in state), zlib.crc32(shapes.encode()),
         *(zlib.crc32(repr(value).encode()) for value in hyperparameters.values())],
        ["mode", "number of posterior blocks", "posterior size", "posterior shapes", *hyperparameters], group)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    num_samples = optimizer.mc_samples
    shard = sample_range(num_samples, rank, world_size) if mode == "mc" else range(num_samples)
    generator_state = optimizer.generator.get_state()
    _broadcast_(generator_state, group)
    optimizer.generator.set_state(generator_state)
    steps = torch.tensor([optimizer.steps_taken], dtype=torch.int64)
    _broadcast_(steps, group)
    optimizer.steps_taken = int(steps.item())
    for tensor in state:
        _broadcast_(tensor, group)
    optimizer.load_mean_into_model()
    previous = optimizer.statistics_reducer
    if isinstance(previous, AllReduce) and previous.input_hook is not None:
        previous.input_hook.remove()
    reducer = AllReduce(group, mode, shard)
    if mode == "mc" and check_same_batch:
        reducer.input_hook = _watch_inputs(optimizer, reducer)
    optimizer.statistics_reducer = reducer


def _watch_inputs(optimizer: FOOVB, reducer: AllReduce) -> RemovableHandle:
    """A forward pre-hook on the model that records, during a step's samples, the moments of its inputs."""
    def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        pending = optimizer._pending
        if pending is not None and optimizer.statistics_reducer is reducer:  # (not after it was replaced)
            reducer.record_inputs(pending.seed, [*args, *kwargs.values()])

    return optimizer.model.register_forward_pre_hook(record, with_kwargs=True)


def input_moments(tensors: list[Tensor]) -> Tensor:
    """Four float64 numbers that tell batches apart, on the tensors' device: their number of elements, sum, sum of
    squares, and sum weighted by position (the tensors flattened and concatenated, positions scaled to [0, 1))."""
    flat = [torch.nan_to_num((torch.view_as_real(t) if t.is_complex() else t).detach().reshape(-1).double())
            for t in tensors]
    total, offset = sum(v.numel() for v in flat), 0
    moments = torch.zeros(4, dtype=torch.float64, device=flat[0].device)
    moments[0] = float(total)
    for v in flat:
        position = (torch.arange(v.numel(), dtype=torch.float64, device=v.device) + offset) / max(total, 1)
        moments[1:] += torch.stack([v.sum(), v.square().sum(), (v * position).sum()]).to(moments.device)
        offset += v.numel()
    return torch.nan_to_num(moments)


@dataclass
class AllReduce:
    """The optimizer's `StatisticsReducer` under torch.distributed: `all_reduce_statistics` over `group`."""

    group: Any
    mode: str
    samples: range  # the sample indices this process evaluates
    bytes: int = 0  # bytes all-reduced by the last step (statistics, losses and layouts)
    input_hook: RemovableHandle | None = None  # MC mode, check_same_batch: `_watch_inputs`
    inputs: list[tuple[int, Tensor | None]] = field(default_factory=list)  # (step seed, `input_moments`) per call
    _last_inputs: tuple | None = field(default=None, repr=False)  # (tensors, their versions, their moments)

    def record_inputs(self, step_seed: int, values: list[Any]) -> None:
        """Record the moments of the tensors a model call received (None: no tensor). The same tensors, unchanged,
        as in the previous call (a closure that passes its batch to every sample) reuse their moments."""
        tensors = [v for v in values if isinstance(v, Tensor)]
        if not tensors:
            self.inputs.append((step_seed, None))
            return
        versions = [None if t.is_inference() else t._version for t in tensors]
        last = self._last_inputs
        if (last is None or None in versions or len(last[0]) != len(tensors)
                or any(a is not b for a, b in zip(last[0], tensors, strict=True)) or last[1] != versions):
            last = self._last_inputs = (tensors, versions, input_moments(tensors))
        self.inputs.append((step_seed, last[2]))

    def batch_signature(self, step_seed: int) -> list[float]:
        """[1, the moments] when every model call of this step's samples on this process received the same
        inputs, else [0, 0, 0, 0, 0]; forgets the calls recorded so far."""
        records = [moments for seed, moments in self.inputs if seed == step_seed]
        self.inputs, self._last_inputs = [], None
        if not records or any(m is None for m in records):
            return [0.0] * 5
        first = records[0].cpu()
        if any(not torch.equal(m.cpu(), first) for m in records[1:] if m is not records[0]):
            return [0.0] * 5
        return [1.0, *first.tolist()]

    def reduce(self, blocks: list[PosteriorBlock], stats: dict[PosteriorBlock, dict], num_samples: int,
               losses: list[float], loss_rows: float,
               step_seed: int) -> tuple[dict[PosteriorBlock, dict], int, list[float]]:
        checked = check_in_step(self, losses, step_seed)
        reduced = all_reduce_statistics(self, blocks, stats, num_samples, losses, loss_rows)
        self.bytes += checked
        return reduced

    def whole_batch(self, value: float) -> float:
        """secant_check's slope at the new mean for the whole batch: the shards' sum (data mode), or the processes'
        mean of one number (MC mode: each evaluated the whole batch), so that every process cuts its step alike."""
        total = torch.tensor([value], dtype=torch.float64, device=_comm_device(self.group))
        dist.all_reduce(total, group=self.group)
        return float(total) / (dist.get_world_size(self.group) if self.mode == "mc" else 1)


def shard_batch(*tensors: Tensor, group: Any | None = None) -> tuple[Tensor, ...]:
    """This process's contiguous share of the rows of each tensor (data mode); shares differ by <= 1 row."""
    _require_initialized("foovb.distributed.shard_batch")
    group = _group_or_world(group)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    rows = {t.shape[0] for t in tensors}
    if len(rows) != 1:
        raise ValueError(f"the tensors have different numbers of rows: {sorted(rows)}")
    (num_rows,) = rows
    if num_rows < world_size:
        raise ValueError(f"a batch of {num_rows} rows cannot be split over {world_size} processes")
    return tuple(torch.tensor_split(t, world_size)[rank] for t in tensors)


class _Layout(NamedTuple):
    """How one low-rank statistic L^T R travels: "dense"; "shared" (L is bitwise the same on every process,
    e.g. the batch input under MC-parallel training: only R is summed); or "stacked" (every process writes L
    and R into its rows offsets[r]:offsets[r + 1] of zero-filled stacked factors, so the sum concatenates)."""

    kind: str
    offsets: list[int]


def _fingerprint(tensor: Tensor) -> int:
    """A 56-bit hash of the tensor's bytes (to detect a low-rank left factor shared by all processes)."""
    data = tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


def _low_rank_layouts(values: list[LowRank], group: Any) -> list[_Layout]:
    """Choose each low-rank statistic's `_Layout`, identically on every process (one small all-reduce).

    A sum over processes of L_r^T R_r stays low rank, and keeps the update's cheap O(n^2 r) route (e.g. for
    the input factor of a matrix-variate first layer, rank = batch rows), when every process holds it as
    factors and either all L_r are the same (sum of the R_r, rank unchanged, as `LowRank.add` does for an
    identical left factor) or the total rank stays below the matrix's n rows (`LowRank.add`'s own rule).
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    meta = torch.zeros(len(values), 2, world_size, dtype=torch.int64)  # [rank or -1 if dense, fingerprint]
    for row, value in enumerate(values):
        if value.dense is not None:
            meta[row, 0, rank] = -1
        elif value.left is not None:
            meta[row, :, rank] = torch.tensor([value.rank, _fingerprint(value.left)])
    meta = meta.to(_comm_device(group))
    dist.all_reduce(meta, dist.ReduceOp.SUM, group=group)
    layouts = []
    for value, (ranks, fingerprints) in zip(values, meta.cpu().tolist(), strict=True):
        if 0 in ranks:
            raise RuntimeError(f"process {ranks.index(0)} has no Monte Carlo statistics to all-reduce")
        size = value.dense.shape[0] if value.dense is not None else value.left.shape[1]
        offsets = [0]
        for r in ranks:
            offsets.append(offsets[-1] + r)
        if min(ranks) < 0:
            layouts.append(_Layout("dense", []))
        elif len(set(fingerprints)) == 1 and len(set(ranks)) == 1:
            layouts.append(_Layout("shared", []))
        else:
            layouts.append(_Layout("stacked" if offsets[-1] < size else "dense", offsets))
    return layouts


def _halves(value: int) -> list[float]:
    """A non-negative integer below 2^64 as two 32-bit halves, exact in float64."""
    return [float(value >> 32), float(value & 0xFFFFFFFF)]


def check_in_step(reducer: AllReduce, losses: list[float], step_seed: int) -> int:
    """Before a step's statistics are summed, one tiny all-reduce (the max of each value and of its negation, as
    float64: 32 bytes, 64 in data mode, 112 in MC mode with check_same_batch) checks that the processes are in step
    and on the batches their mode expects; a ValueError on every process otherwise (the posterior unchanged),
    where the sum would mix them silently:
    * the step seeds differ: a process skipped a step (an exception caught on it alone) or loaded a state dict the
      others did not;
    * data mode: every process evaluates the same K sampled networks, so equal losses on all processes mean one
      batch on all of them (shard_batch forgotten): its likelihood would count once per process;
    * MC mode: the moments of the model's inputs differ between processes whose own samples all saw one input
      (`AllReduce.batch_signature`): each process got its own batch (a DistributedSampler; that is data mode),
      and every sample's gradient would be of another batch. Equal within a relative 1e-9 (the same batch gives
      the same moments up to summation order on different hardware).
    Returns the bytes it all-reduced."""
    group = reducer.group
    values = _halves(step_seed)
    if reducer.mode == "data":
        values += _halves(_fingerprint(torch.tensor(losses, dtype=torch.float64)))
    signature = len(values)  # where the MC-mode batch signature starts: [flag, 4 moments]
    if reducer.input_hook is not None:
        values += reducer.batch_signature(step_seed)
    extremes = torch.tensor([v for value in values for v in (value, -value)], dtype=torch.float64)
    sent = extremes.numel() * extremes.element_size()
    extremes = extremes.to(_comm_device(group))
    dist.all_reduce(extremes, dist.ReduceOp.MAX, group=group)
    high, low = (extremes.view(-1, 2).cpu() * torch.tensor([1.0, -1.0], dtype=torch.float64)).unbind(1)
    if not torch.equal(high[:2], low[:2]):
        raise ValueError(
            "the processes are at different steps of the posterior (their step seeds differ): a process skipped a "
            "step (an exception caught on it alone?) or loaded a state dict the others did not (load it on every "
            "process, or before distribute)")
    if reducer.mode == "data" and dist.get_world_size(group) > 1 and torch.equal(high[2:4], low[2:4]):
        raise ValueError(
            "distribute(..., mode='data'): every process evaluated the same batch (their losses of the step's "
            f"{len(losses)} sampled networks are equal), which counts its likelihood once per process. Give each "
            "process its own rows (foovb.distributed.shard_batch(x, y), or a DistributedSampler); for the same "
            "batch on every process, use mode='mc'")
    if reducer.input_hook is not None and float(low[signature]) == 1.0:  # every process saw one input in its samples
        moments_high, moments_low = high[signature + 1:], low[signature + 1:]
        if bool(((moments_high - moments_low) > 1e-9 * torch.maximum(moments_high.abs(), moments_low.abs())).any()):
            raise ValueError(
                "distribute(..., mode='mc'): the processes evaluated different batches (the model's inputs differ "
                "between them), and every Monte Carlo sample's gradient would be of another batch. MC mode splits "
                "the K samples of one batch: give every process the same batch, or, for a batch split over the "
                "processes (shard_batch, a DistributedSampler), use mode='data'. If your closure itself draws new "
                "inputs at every call (random augmentation) with one sample per process, the two cannot be told "
                "apart: distribute(..., check_same_batch=False)")
    return sent


def all_reduce_statistics(reducer: AllReduce, blocks: list[PosteriorBlock], stats: dict[PosteriorBlock, dict],
                          num_samples: int, losses: list[float],
                          loss_rows: float = 0.0) -> tuple[dict[PosteriorBlock, dict], int, list[float]]:
    """Sum the Monte Carlo statistics and the per-sample losses over the processes.

    All statistics, with the losses, travel in one flat buffer per dtype and one all-reduce (one dtype in
    practice). A low-rank statistic (`LowRank`: L^T R) travels as factors when that keeps it low rank (only R
    when L is the same on every process; else every process's L and R in its own rows of zero-filled stacked
    factors, so the sum is the concatenation), otherwise dense (see `_low_rank_layouts`). Models with
    low-rank statistics (kronecker, full) add one tiny all-reduce that chooses.

    `losses` holds this process's losses of the samples `reducer.samples`. They are placed at their
    sample indices in a length-K vector before the sum, so the result is, per sample, the sample's loss (MC
    mode: one process evaluated it) or the full batch's loss (data mode): the sum of the shards' summed losses,
    or, for losses that are means over `loss_rows` rows of each shard, the shards' means weighted by their
    rows (data mode adds the rows to the vector: one more element). The reduced losses (all K samples, the
    full batch) are returned, so that `step` / `step_batched` report the same mean loss on every process and
    as one process would on the whole batch. They travel in the statistics' widest floating dtype (at least
    float32).

    Returns (reduced statistics, num_samples, losses), identical on every process. `num_samples` is
    unchanged: both modes sum over exactly K samples. Records the bytes it all-reduced (statistics, losses
    and ranks) in `reducer.bytes`.
    """
    group = reducer.group
    rank = dist.get_rank(group)
    shard = reducer.samples
    if len(losses) != len(shard):
        raise RuntimeError(f"{len(losses)} losses for the {len(shard)} samples of this process")
    entries = [(block, key, value) for block in blocks for key, value in stats[block].items()]
    low_rank = [value for _, _, value in entries if isinstance(value, LowRank)]
    layouts = _low_rank_layouts(low_rank, group) if low_rank else []
    reducer.bytes = 16 * len(low_rank) * dist.get_world_size(group)
    pieces: list[Tensor] = []  # this process's contribution, entry by entry (stacked LowRank: left, right)
    layout_of = iter(layouts)
    for _, _, value in entries:
        layout = next(layout_of) if isinstance(value, LowRank) else None
        if layout is None:
            pieces.append(value)
        elif layout.kind == "dense":
            pieces.append(value.to_dense())
        elif layout.kind == "shared":
            pieces.append(value.right)
        else:
            begin, end = layout.offsets[rank], layout.offsets[rank + 1]
            for factor in (value.left, value.right):
                stacked = factor.new_zeros(layout.offsets[-1], factor.shape[1])
                stacked[begin:end] = factor
                pieces.append(stacked)
    loss_dtype = functools.reduce(torch.promote_types, [t.dtype for t in pieces], torch.float32)
    data_mode = reducer.mode == "data"
    loss_vector = torch.zeros(num_samples + data_mode, dtype=loss_dtype)
    loss_vector[shard.start : shard.stop] = torch.tensor(losses, dtype=loss_dtype) * (
        (loss_rows or 1.0) if data_mode else 1.0)  # MC mode: each sample's loss is one process's
    if data_mode:
        loss_vector[-1] = loss_rows
    pieces.append(loss_vector)
    device = _comm_device(group)
    positions: dict[torch.dtype, list[int]] = {}
    for index, t in enumerate(pieces):
        positions.setdefault(t.dtype, []).append(index)
    reduced = list(pieces)
    for indices in positions.values():
        buffer = torch.cat([pieces[i].reshape(-1).to(device) for i in indices])
        dist.all_reduce(buffer, dist.ReduceOp.SUM, group=group)
        reducer.bytes += buffer.numel() * buffer.element_size()
        for i, part in zip(indices, buffer.split([pieces[i].numel() for i in indices]), strict=True):
            reduced[i] = part.view(pieces[i].shape).to(pieces[i].device)
    new_stats: dict[PosteriorBlock, dict] = {block: {} for block in blocks}
    values, layout_of = iter(reduced), iter(layouts)
    for block, key, value in entries:
        layout = next(layout_of) if isinstance(value, LowRank) else None
        if layout is None:
            new_stats[block][key] = next(values)
        elif layout.kind == "dense":
            new_stats[block][key] = LowRank(dense=next(values))
        elif layout.kind == "shared":
            new_stats[block][key] = LowRank(value.left, next(values))
        else:
            new_stats[block][key] = LowRank(next(values), next(values))
    reduced_losses = next(values)
    if data_mode:  # each shard's mean times its rows, summed: over all rows; summed losses: their sum
        reduced_losses, rows = reduced_losses[:-1], float(reduced_losses[-1])
        reduced_losses = reduced_losses / rows if rows > 0 else reduced_losses
    return new_stats, num_samples, reduced_losses.tolist()
