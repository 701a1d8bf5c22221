"""One FOO-VB step in pieces (Algorithm 1): the Monte Carlo noise eps_k, the evaluation of the K sampled networks
theta_k = mu + A eps_k (one at a time through a closure or an own loop, or stacked in one batched pass), the sums
that estimate E[g] and E[g eps^T], and the checked UPDATE of every block. `FOOVB` holds the posterior and the
settings and calls these in that order."""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .capture import LinearCapture, UnseenUse
from .linalg import LowRank
from .posteriors import KroneckerBlock, PosteriorBlock
from .precision import full_precision
from .reduction import LossSpy, loss_reduction_of, loss_scale, reads_a_mean
from .sampled import SampledNetwork, augmented_input, check_batched_support

__all__ = ["RunningStatistics", "Sample", "SkippedBatch", "StatisticsReducer", "Step", "WIDE_LAYER", "apply_update",
           "check_batched_step", "check_gradients", "closure_of", "deferred_closure_sample", "draw_noise", "mix",
           "scale_statistics", "stacking_is_slower"]

# On the CPU, a sampled weight of this many elements (or more) in one layer makes step_batched's stacked samples
# slower than one network at a time (docs/performance.md: diagonal K=10, 784-1000-1000-10 1.37x), and so does any
# convolution (one grouped convolution: a step 1.2-1.5x slower on the LeNet and a small CNN, the predictions 1.3-2x;
# measured with nn.Conv2d, assumed for nn.Conv1d / Conv3d).
# On a GPU stacking wins at every width measured (a step there is bound by kernel launches).
WIDE_LAYER = 2**17

_MASK64 = (1 << 64) - 1


def mix(*values: int) -> int:
    """splitmix64 of a tuple: the seed of one (step, block, sample) noise stream."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 31
    return h & ((1 << 63) - 1)


def draw_noise(blocks: list[PosteriorBlock], seed: int, samples: range, *, antithetic: bool = False,
               only: list[PosteriorBlock] | None = None,
               into: dict[PosteriorBlock, Tensor] | None = None) -> dict[PosteriorBlock, Tensor]:
    """eps for the given sample indices, (len(samples), *noise_shape) per block (of `only`; None: all), drawn
    into the tensors of `into` where it has one of that shape on the drawing device (else into new ones).

    The noise of sample k of block b is a pure function of (seed, b, k): the sequential and batched paths, any
    chunking and any split of the samples across processes see the same draws. It is drawn on the device of the
    block's mean where that device has a generator (a GPU; its draws differ from the CPU's, and between GPU models
    for large blocks, so a run resumed on another kind of device continues with other, equally valid, noise);
    others get the CPU's draws, copied. With `antithetic`, sample 2j + 1 is the negative of sample 2j. (A thread
    pool for the blocks made the training loop slower: its OpenMP workers spin against the main thread's.)
    """
    noises = {}
    generators: dict[torch.device, torch.Generator] = {}
    for index, block in enumerate(blocks):
        if only is not None and block not in only:
            continue
        ref = block.state["mean"]
        if ref.device not in generators:
            try:
                generators[ref.device] = torch.Generator(device=ref.device)
            except RuntimeError:  # no generator on this device (e.g. meta): draw on the CPU and copy
                generators[ref.device] = torch.Generator()
        generator = generators[ref.device]
        out = (into or {}).get(block)
        if out is None or out.shape != (len(samples), *block.noise_shape) or out.device != generator.device:
            out = torch.empty(len(samples), *block.noise_shape, dtype=ref.dtype, device=generator.device)
        whole_pairs = antithetic and len(samples) % 2 == 0 and samples.start % 2 == 0 and samples.step == 1
        for row, k in enumerate(samples):
            if whole_pairs and k % 2:  # negated below, every pair at once (one kernel, not one per pair)
                continue
            if antithetic and k % 2 and row and samples[row - 1] == k - 1:  # the pair's first half is drawn
                torch.neg(out[row - 1], out=out[row])
                continue
            generator.manual_seed(mix(seed, index, k // 2 if antithetic else k))
            torch.randn(block.noise_shape, generator=generator, dtype=ref.dtype, out=out[row])
            if antithetic and k % 2:
                out[row].neg_()
        if whole_pairs and len(samples):
            torch.neg(out[0::2], out=out[1::2])
        noises[block] = out.to(ref.device)
    return noises


def check_gradients(blocks: list[PosteriorBlock], layouts: bool = True) -> None:
    """After a closure: some parameter received a gradient (else the step would silently do nothing); `layouts`:
    and none is sparse (a step's first sample checks, the others run the same closure on the same parameters)."""
    grads = [p.grad for block in blocks for p in block.params if p.grad is not None]
    if not grads:
        raise RuntimeError("no parameter received a gradient: the closure must call loss.backward() "
                           "(and the loss must depend on the parameters)")
    if layouts and any(g.is_sparse for g in grads):
        raise ValueError("sparse gradients are not supported (e.g. nn.Embedding(sparse=True)); use dense ones")


class StatisticsReducer(Protocol):
    """Combines the Monte Carlo statistics of the processes that train one posterior together
    (`foovb.distributed.distribute` sets one on the optimizer)."""

    samples: range  # the sample indices this process evaluates

    def reduce(self, blocks: list[PosteriorBlock], stats: dict[PosteriorBlock, dict], num_samples: int,
               losses: list[float], loss_rows: float,
               step_seed: int) -> tuple[dict[PosteriorBlock, dict], int, list[float]]:
        """The statistics and sample count summed over all processes, and each sample's loss over the whole
        batch (`loss_rows`: the rows this process's losses are means over, 0 for summed losses; `step_seed`:
        the seed of the step's noise, the same on every process in step)."""
        ...

    def whole_batch(self, value: float) -> float:
        """`value`, a sum over the rows of the batch this process evaluated, for the whole batch: the sum over the
        processes' shards (data mode), or their mean (MC mode, where each evaluated the whole batch)."""
        ...


class SkippedBatch(Exception):  # noqa: N818 - a signal, not an error
    """The closure's first sample returned None without calling backward(): the caller skips this batch (Lightning's
    automatic optimization when training_step returns None), as a torch optimizer with no gradients does."""


@dataclass
class Sample:
    """What a `sampled_params` block sees: its sample index, and where `step(closure)` puts the loss."""

    index: int
    loss: float | None = None


class RunningStatistics:
    """Batch-norm running statistics updated once per step: each sampled network's forward starts from the step's
    statistics (K updates would forget K times faster), and the step leaves those of one forward of the new mean
    (`Step.run_at_mean`), the network that predicts; where the step has no closure to run there
    (sampled_params(train=True) blocks), the samples' average."""

    def __init__(self, model: nn.Module):
        self.modules = [m for m in model.modules()
                        if getattr(m, "running_mean", None) is not None and getattr(m, "running_var", None) is not None
                        and getattr(m, "num_batches_tracked", None) is not None]  # batch / instance norm
        self.before = [(m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
                       for m in self.modules]
        self.sums = [(torch.zeros_like(mean), torch.zeros_like(var)) for mean, var, _ in self.before]
        self.count = 0

    def restore(self) -> None:
        if not self.modules:  # (twice per sample: without batch norm, no no_grad contexts, 0.1 ms of a 10 ms step)
            return
        with torch.no_grad():
            for module, (mean, var, tracked) in zip(self.modules, self.before, strict=True):
                module.running_mean.copy_(mean)
                module.running_var.copy_(var)
                module.num_batches_tracked.copy_(tracked)

    def record(self) -> None:
        if not self.modules:
            return
        with torch.no_grad():
            for module, (mean_sum, var_sum) in zip(self.modules, self.sums, strict=True):
                mean_sum.add_(module.running_mean)
                var_sum.add_(module.running_var)
        self.count += 1

    def updated_in_training(self) -> bool:
        """Whether a forward updates any of the statistics (a module in training mode; eval mode reads them)."""
        return any(module.training for module in self.modules)

    @torch.no_grad()
    def average(self) -> None:
        """Leave the average of the recorded statistics, num_batches_tracked as one sample left it (also after a
        forward at the mean that failed part way)."""
        if not self.count:
            return
        for module, (mean_sum, var_sum), (_, _, tracked) in zip(self.modules, self.sums, self.before, strict=True):
            module.running_mean.copy_(mean_sum / self.count)
            module.running_var.copy_(var_sum / self.count)
            module.num_batches_tracked.copy_(tracked + 1 if module.training else tracked)


@dataclass
class Step:
    """A step being evaluated: its noise seed, statistics and losses; its methods are Algorithm 1's loop body: `noise`
    (eps_k), `gradients` (g_k of the loaded network, added to the sums), `evaluate_stacked` (both, stacked)."""

    seed: int
    blocks: list[PosteriorBlock]  # those trained by this step (not frozen since construction)
    all_blocks: list[PosteriorBlock]  # every block of the optimizer (the noise streams are numbered by them)
    model: nn.Module
    antithetic: bool
    loss_reduction: str
    stats: dict
    running: RunningStatistics
    batch_size: int | None
    grad_scale: float | None = None  # sequential samples: their loss's scale, applied to the sums at the update
    losses: list[float] = field(default_factory=list)
    loss_rows: float = 0.0  # the rows each of `losses` is a mean over (0: summed losses, L_n itself)
    count: int = 0
    noises: dict = field(default_factory=dict)  # the last sample's noise (an antithetic pair's first half)
    noise_of: int = -1  # its sample index
    factored_inputs: dict = field(default_factory=dict)  # block -> the caches of its captured input X (LinearCapture)
    recheck: Callable[[], Tensor] | None = None  # the step's closure, for `run_at_mean` (None: sampled_params blocks)
    watch_layers: bool = False  # follow which block's module the model calls last: `last_layer`
    last_layer: nn.Module | None = None

    @functools.cached_property
    def all_params(self) -> list[Tensor]:
        """The parameters of every block (their gradients are cleared around each sample)."""
        return [p for block in self.all_blocks for p in block.params]

    @functools.cached_property
    def linear_kronecker(self) -> list[PosteriorBlock]:
        """The trained matrix-variate nn.Linear blocks, whose statistics the closure path keeps low-rank."""
        return [block for block in self.blocks if isinstance(block, KroneckerBlock) and isinstance(block.module,
                                                                                                   nn.Linear)]

    def run_at_mean(self) -> list[Tensor]:
        """The step's closure once more on the model as it holds it (the new mean, loaded by the caller): the
        gradients of the trained blocks' parameters (zeros where none), in the closure's scale, their .grad cleared
        after. Batch-norm running statistics start from the step's and are left as this forward updated them: the
        mean network's."""
        params = [p for block in self.blocks for p in block.params]
        for p in self.all_params:
            p.grad = None
        self.running.restore()
        try:
            with torch.enable_grad():
                self.recheck()
            return [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        finally:
            for p in self.all_params:
                p.grad = None

    def watched_layers(self) -> dict[int, nn.Module]:
        """The blocks' modules, where `watch_layers` asks which one the model calls last (else none: every sample
        of every later step asks)."""
        if not self.watch_layers:
            return {}
        return {id(block.module): block.module for block in self.all_blocks if block.module is not None}

    def noise(self, k: int) -> dict[PosteriorBlock, Tensor]:
        """eps_k of every trained block, (1, *noise_shape); an antithetic pair's second half is -eps of its first
        (not redrawn). Blocks whose statistics keep no noise (`noise_reusable`) get it in the previous sample's
        tensors (a sequential step's allocations: docs/performance.md)."""
        if self.antithetic and k % 2 and self.noise_of == k - 1:
            noises = {block: noise.neg_() if block.noise_reusable else noise.neg()
                      for block, noise in self.noises.items()}
        else:
            reused = {block: noise for block, noise in self.noises.items() if block.noise_reusable}
            noises = draw_noise(self.all_blocks, self.seed, range(k, k + 1), antithetic=self.antithetic,
                                only=self.blocks, into=reused)
        self.noises, self.noise_of = noises, k
        return noises

    @contextlib.contextmanager
    def gradients(self, k: int, noises: dict[PosteriorBlock, Tensor], reports_loss: bool,
                  deferred: dict[PosteriorBlock, Tensor] | None = None) -> Iterator[Sample]:
        """g_k: the block runs forward and backward on the sampled network theta_k that the caller loaded, then its
        gradients are added to the sums for E[g] and E[g eps^T]. `reports_loss`: the block sets `sample.loss`; else
        it is read from the loss that backward() is called on. `deferred`: matrix-variate nn.Linear samples the
        caller did not load, formed where the block uses them (`LinearCapture`); a use it cannot see raises
        `UnseenUse` (the caller redoes the sample with them loaded). Batch-norm statistics start from the step's."""
        params = self.all_params
        for p in params:
            p.grad = None
        self.running.restore()
        sample = Sample(k)
        watched = self.watched_layers()
        spy = (LossSpy(self.model, watched) if self.grad_scale is None or not reports_loss else
               contextlib.nullcontext())
        linear_kronecker = self.linear_kronecker
        capture = LinearCapture(linear_kronecker, deferred or {}, self.factored_inputs) if linear_kronecker else None
        try:
            with torch.enable_grad(), spy, capture if capture is not None else contextlib.nullcontext():
                yield sample
            check_gradients(self.all_blocks, layouts=not self.count)  # first: sparse gradients refused before use
            if deferred:
                capture.check_seen(sample.loss, params)
            if isinstance(spy, LossSpy) and spy.last_watched is not None:
                self.last_layer = spy.last_watched
            if self.grad_scale is None:  # the batch is the same for every sample: read its scale once
                self.grad_scale = spy.scale(self.loss_reduction, self.batch_size)
                self.loss_rows = self.grad_scale if spy.reads_a_mean(self.loss_reduction, self.batch_size) else 0.0
            self.running.record()
            self.losses.append(sample.loss if reports_loss else spy.loss)
            if capture is not None and capture.compiled:  # shown once per process (Python's default filter)
                warnings.warn(
                    "FOOVB: the closure ran the matrix-variate nn.Linear layers in torch.compile'd code, where their "
                    "output errors cannot be captured: their statistics fall back to the dense gradients and the "
                    "dense fixed-point solve, 3-4x slower steps on the paper's MLP (docs/performance.md). Run the "
                    "model eagerly (the update is the same)", stacklevel=5)
            with full_precision():
                for block in self.blocks:
                    if capture is not None and self._accumulate_captured(capture, block, self, noises[block]):
                        continue
                    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in block.params]
                    block.accumulate_one(self.stats[block], noises[block][0], grads)
            self.count += 1
        except BaseException:
            self.running.restore()
            raise
        finally:
            if capture is not None:
                capture.close()
            for p in params:
                p.grad = None

    def closure_sample(self, k: int, noises: dict[PosteriorBlock, Tensor], closure: Callable[[], Tensor],
                       deferred: dict[PosteriorBlock, Tensor] | None = None) -> float:
        """`gradients` with the closure as the block (it must return the loss tensor); returns the loss."""
        with self.gradients(k, noises, reports_loss=True, deferred=deferred) as sample:
            loss = closure()
            if not isinstance(loss, Tensor):
                called_backward = loss is None and any(p.grad is not None for p in self.all_params)
                if loss is None and not self.count and not called_backward:
                    raise SkippedBatch  # no loss and no gradients on the first sample: a skipped batch
                raise TypeError(f"the closure must return the loss tensor, got {type(loss).__name__}"
                                + (" (it called backward(): return the loss)" if called_backward else ""))
            if loss.numel() != 1:
                raise ValueError(f"the closure must return the scalar loss it called backward() on, not a tensor of "
                                 f"shape {tuple(loss.shape)} (per-example losses: return their sum or mean)")
            sample.loss = float(loss.detach())
        return sample.loss

    @staticmethod
    def _accumulate_captured(capture: LinearCapture, block: PosteriorBlock, pending: Step,
                             noise: Tensor) -> bool:
        """Accumulate a matrix-variate nn.Linear block's statistics in low-rank form from its captured input X and
        errors Delta (as `step_batched` does, `KroneckerBlock.accumulate_factored`), where the gradient is
        exactly Delta^T X_aug and X has fewer rows than X_aug has columns (else the dense gradient is as cheap).
        An input equal to the previous sample's (the batch itself, for the first layer) reuses its X_aug and
        X_aug A, so sum_k Psi_k^T B Phi_k = X_aug^T (sum_k Delta_k B Phi_k) keeps rank r. False: use .grad."""
        if not capture.exact(block):
            return False
        x, delta = capture.inputs(block)
        if x.shape[0] >= block.in_features + int(block.has_bias):
            return False
        inputs, products = pending.factored_inputs.setdefault(block, ({}, {}))
        x_aug = augmented_input(block, x, inputs, keep_one=True)
        if products.get("x_aug") is not x_aug:
            products.clear()
            products.update(x_aug=x_aug, x_a=block.input_times_a(x))
        noise_pre = capture.noise_pre(block)  # X_aug A Phi^T, from a factored forward (the same X_aug) or here
        if noise_pre is None:
            noise_pre = products["x_a"] @ noise[0].T
        psi = block.join([p.grad[None] for p in block.params])[0]  # Delta^T X_aug, already computed by backward
        block.accumulate_factored(pending.stats[block], noise, delta[None], x_aug, noise_pre[None], psi)
        return True

    def evaluate_stacked(self, shard: range, inputs: Tensor, targets: Tensor,
                         loss_fn: Callable[[Tensor, Tensor], Tensor], chunk: int) -> None:
        """Evaluate the samples of `shard` `chunk` at a time in one forward/backward each (`SampledNetwork`) and
        accumulate their statistics."""
        modules: dict[nn.Module, list[PosteriorBlock]] = {}
        for block in self.blocks:
            modules.setdefault(block.module, []).append(block)
        rows, shared_inputs = inputs.shape[0], {}
        for start in range(0, len(shard), chunk):
            samples = shard[start : start + chunk]
            c = len(samples)
            noises = draw_noise(self.all_blocks, self.seed, samples, antithetic=self.antithetic, only=self.blocks)
            watched = self.watched_layers() if start == 0 else {}
            with SampledNetwork(modules, noises, c, rows, track_grad=True) as network:
                with torch.enable_grad():
                    with LossSpy(self.model, watched) if watched else contextlib.nullcontext() as spy:
                        outputs = self.model(inputs)
                    if watched:
                        self.last_layer = spy.last_watched
                    loss = loss_fn(outputs, targets.repeat(c, *([1] * (targets.ndim - 1))))
                    # sum: d(sum_k L_k)/d theta_k = g_k; a mean over the c stacked batches: back to the sum
                    reduction = loss_reduction_of(loss)
                    try:
                        grad_scale = loss_scale(reduction, self.loss_reduction, None, frozenset({c * rows}))
                    except ValueError as stacked:  # its advice is for step(closure): step_batched has no batch_size
                        # the advice for step(closure) on the batch itself: its rows and 1/c of the stacked terms
                        on_one = reduction._replace(terms=reduction.terms / c, mean_inside=reduction.mean_inside / c)
                        try:
                            loss_scale(on_one, self.loss_reduction, None, frozenset({rows}))
                            read = str(stacked)
                        except ValueError as on_the_batch:
                            read = str(on_the_batch)
                        raise ValueError(
                            f"step_batched: loss_fn must return a mean over the {c} x {rows} stacked rows or their "
                            "sum (e.g. F.cross_entropy's default, or reduction='sum'); for any other loss (a "
                            "regulariser, a constant) use step(closure), whose error names the fix. "
                            f"What was read: {read}") from None
                    loss.backward()
                with full_precision():
                    network.accumulate(self.stats, grad_scale, shared_inputs)
            value = float(loss.detach())  # a mean over the c stacked batches, or the sum of their losses
            is_mean = reads_a_mean(reduction, self.loss_reduction, None, frozenset({c * rows}))
            self.losses.extend([value if is_mean else value / c] * c)
            self.loss_rows = grad_scale / c if is_mean else 0.0
            self.count += c


def deferred_closure_sample(pending: Step, k: int, noises: dict[PosteriorBlock, Tensor], closure: Callable[[], Tensor],
                            load: Callable[[dict[PosteriorBlock, Tensor], int], None]) -> bool:
    """One closure sample on step(closure)'s fast path (`capture.LinearCapture`): the same numbers as loading
    theta_k whole (`load`), but the matrix-variate nn.Linear samples are formed only where the closure uses them (the
    first layer's never: a factored forward). A use the capture cannot see (`UnseenUse`) redoes the sample with every
    weight loaded. Returns whether to go on deferring: not once a redone sample was finite (a non-finite loss either
    way, e.g. from the data, is no sign)."""
    deferred = {block: noises[block] for block in pending.linear_kronecker}
    load({block: noise for block, noise in noises.items() if block not in deferred}, 0)
    try:
        pending.closure_sample(k, noises, closure, deferred)
        return True
    except UnseenUse:
        pass
    load(noises, 0)
    return not math.isfinite(pending.closure_sample(k, noises, closure))


def scale_statistics(stats: dict[PosteriorBlock, dict], factor: float) -> None:
    """Rescale every block's Monte Carlo sums for gradients multiplied by `factor` (in place where they are
    tensors): by factor ** the sum's power in the gradients (`PosteriorBlock.statistic_powers`, 1 by default)."""
    for block, block_stats in stats.items():
        for key, value in block_stats.items():
            scale = factor ** block.statistic_powers.get(key, 1)
            block_stats[key] = value.scaled(scale) if isinstance(value, LowRank) else value.mul_(scale)


def _norms(tensors: list[Tensor]) -> list[Tensor]:
    """The norm of each tensor (NaN / Inf propagate: one synchronisation checks them all), in one foreach call
    (what clip_grad_norm_ calls; tests/test_torch_internals.py)."""
    return list(torch._foreach_norm(tensors))


@torch.no_grad()
def apply_update(stats: dict[PosteriorBlock, dict], losses: list[float], loss_rows: float, num_samples: int,
                 mean_step: float, cov_step: float, reducer: StatisticsReducer | None, step_number: int,
                 std_growth: str, step_seed: int) -> tuple[float, dict[PosteriorBlock, dict], int]:
    """UPDATE (Algorithm 1): all-reduce the statistics under torch.distributed (`reducer`), check them, then
    one fixed-point iteration of every block of `stats` (those the step trains). Non-finite statistics or an
    update that overflows raise FloatingPointError and leave every block as it was.

    Returns the mean loss over all samples (of all processes; `loss_rows`: see `StatisticsReducer.reduce`), and the
    statistics applied (summed over the processes; their sums of gradients as they were) with their sample count."""
    blocks = list(stats)
    if reducer is not None:
        stats, num_samples, losses = reducer.reduce(blocks, stats, num_samples, losses, loss_rows, step_seed)

    def pieces(block: PosteriorBlock) -> list[Tensor]:
        return [t for v in stats[block].values() for t in (v.tensors() if isinstance(v, LowRank) else [v])]

    # NaN/Inf propagate through norms: one synchronisation for all blocks, then find the culprits
    norms = _norms([t for block in blocks for t in pieces(block)])
    bad = [] if torch.stack(norms).sum().isfinite() else [
        b for b in blocks if not all(torch.isfinite(t).all() for t in pieces(b))]
    if bad or not all(math.isfinite(v) for v in losses):
        where = "the loss" if not bad else f"the gradients of {len(bad)} parameter block(s)"
        raise FloatingPointError(
            f"non-finite values in {where} at step {step_number}; the posterior was left unchanged")
    before = {block: {key: value.clone() for key, value in block.state.items()} for block in blocks}

    def undo() -> None:
        for block in blocks:
            block.state.clear()  # entries that the failed update created (cov_momentum's average) go too
            block.state.update(before[block])

    try:
        with full_precision():
            for block in blocks:
                block.update(stats[block], num_samples, mean_step, cov_step)
        # finite statistics can still overflow (a sigma grown by the paper's closed form, squared): undo the step
        overflowed = not torch.stack(_norms([v for block in blocks for v in block.state.values()])).sum().isfinite()
    except BaseException:  # out of memory in a decomposition's workspace, a LinAlgError, Ctrl-C: the earlier
        undo()  # blocks (and this one's mean) were updated already
        raise
    if overflowed:
        undo()
        grown = std_growth != "none" and any(block.family == "diagonal" for block in blocks)  # sigma may grow
        raise FloatingPointError(
            f"the update at step {step_number} overflowed to non-finite posterior values"
            f"{f' (with std_growth={std_growth!r}, a sigma that grew too large?)' if grown else ''}; the posterior "
            "was left unchanged")
    return sum(losses) / len(losses), stats, num_samples


def check_batched_step(blocks: list[PosteriorBlock], model: nn.Module, loss_reduction: str, shard: range,
                       inputs: Tensor, targets: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor] | None,
                       chunk_size: int | None) -> tuple[Callable[[Tensor, Tensor], Tensor], int]:
    """step_batched's arguments checked; its loss function (default: cross-entropy reduced as the optimizer's
    loss_reduction asks) and the samples per pass."""
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size!r}")
    check_batched_support(blocks, model)
    if loss_fn is None:
        reduction = "mean" if loss_reduction == "mean" else "sum"
        loss_fn = lambda out, y: F.cross_entropy(out, y, reduction=reduction)  # noqa: E731
    for name, value in (("inputs", inputs), ("targets", targets)):
        if not isinstance(value, Tensor):
            raise ValueError(f"step_batched takes one tensor of {name} (its rows the batch's), got a "
                             f"{type(value).__name__}: for a model of several inputs, or targets that are not one "
                             "tensor, use step(closure)")
    rows = inputs.shape[0]
    if targets.shape[0] != rows:
        raise ValueError(f"inputs have {rows} rows but targets {targets.shape[0]}")
    if rows == 0:
        raise ValueError("empty batch: step_batched needs at least one row")
    return loss_fn, len(shard) if chunk_size is None else min(chunk_size, len(shard))


def stacking_is_slower(blocks: list[PosteriorBlock]) -> bool:
    """On the CPU: a convolution (nn.Conv1d-3d), or a layer whose samples are built whole (not a matrix-variate
    nn.Linear) with WIDE_LAYER elements or more. Never on another device (a GPU: docs/performance.md, "On a GPU")."""
    def slower(block: PosteriorBlock) -> bool:
        if isinstance(block.module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            return True
        if isinstance(block, KroneckerBlock) and isinstance(block.module, nn.Linear):
            return False
        return sum(p.numel() for p in block.params) >= WIDE_LAYER

    return any(block.state["mean"].device.type == "cpu" and slower(block) for block in blocks)


def closure_of(model: nn.Module, inputs: Tensor, targets: Tensor,
               loss_fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[[], Tensor]:
    """The closure of one batch: forward, loss, backward; returns the loss."""
    def closure() -> Tensor:
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        return loss

    return closure
