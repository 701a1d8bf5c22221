"""foovb.capture: the closure path's low-rank matrix-variate statistics (issue 30). step(closure) captures each
Kronecker nn.Linear layer's input X and output errors Delta and accumulates sum_k Psi_k^T B Phi_k = X_aug^T sum_k
Delta_k B Phi_k as step_batched does, instead of from the dense gradient. These tests compare every statistic, and the
updated posterior, with the dense computation (`Step._accumulate_captured` switched off), on MLPs (the first layer's
input is shared by the samples, the later layers' are per sample), and check the fallback to the dense gradient
wherever the gradient is not exactly Delta^T X_aug (a layer called twice, a weight used outside F.linear,
clipped gradients, autograd.grad, an unused layer); then the deferred sampling of the first layer (its sampled weight
never formed) and the unseen reads that are caught and redone."""

from collections import Counter
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import foovb.optimizer
from foovb import FOOVB
from foovb.engine import Step

pytestmark = pytest.mark.usefixtures("single_thread")

F64 = torch.float64
ROWS = 8  # fewer than every layer's inputs + 1: the low-rank route applies to all three layers


class Net(nn.Module):
    """12-16-16-3 MLP (`width` for 16); `twice`: the middle layer is applied twice (shared weights); `unused`: a
    layer that the forward never calls."""

    def __init__(self, twice: bool = False, unused: bool = False, width: int = 16, bias: bool = True):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(12, width, bias=bias), nn.Linear(width, width), nn.Linear(width, 3)
        self.unused = nn.Linear(width, width) if unused else None
        self.twice = twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        if self.twice:
            h = torch.tanh(self.fc2(h))
        return self.fc3(h)


def batch(dtype=F64):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 12, generator=gen, dtype=dtype), torch.randint(3, (ROWS,), generator=gen)


def run_step(dense: bool, closure_of, *, dtype=F64, antithetic=False, k=4, seed=0, loss_reduction="auto",
             defer=True, loads=None, diagonal_output_factor=None, **net):
    """One step(closure) of a fresh model; returns (statistics per block, posterior after, blocks that used the
    low-rank route). `defer=False`: every sampled weight is formed before the closure runs (no factored
    forward); `loads`: a Counter that receives the layer names whose sampled weights were formed."""
    torch.manual_seed(seed)
    model = Net(**net).to(dtype)
    opt = FOOVB(model, "kronecker", mc_samples=k, seed=seed, antithetic=antithetic, loss_reduction=loss_reduction,
                secant_check=False,  # K closure calls per step (the check's is one more, at the new mean)
                diagonal_output_factor=diagonal_output_factor)
    opt._defer_linear_samples = defer
    if loads is not None:
        for block in opt.blocks:
            name = next(n for n, m in model.named_modules() if m is block.module)
            original = block.load_sample
            block.load_sample = lambda noise, original=original, name=name: (loads.update([name]), original(noise))
    recorded, factored = {}, set()
    apply_update, accumulate = foovb.optimizer.apply_update, Step._accumulate_captured

    def record(stats, *rest):
        recorded.update({opt.blocks.index(b): s for b, s in stats.items()})
        return apply_update(stats, *rest)

    def captured(capture, block, pending, noise):
        if dense:
            return False
        used = accumulate(capture, block, pending, noise)
        if used:
            factored.add(opt.blocks.index(block))
        return used

    with (mock.patch.object(Step, "_accumulate_captured", staticmethod(captured)),  # the engine's low-rank route
          mock.patch.object(foovb.optimizer, "apply_update", record)):
        opt.step(closure_of(model, *batch(dtype)))
    names = {i: n for i, b in enumerate(opt.blocks) for n, m in model.named_modules() if m is b.module}
    state = {names[i]: {key: v.clone() for key, v in b.state.items()} for i, b in enumerate(opt.blocks)}
    return {names[i]: s for i, s in recorded.items()}, state, {names[i] for i in factored}


def summed(model, x, y):
    def closure():
        loss = F.cross_entropy(model(x), y, reduction="sum")
        loss.backward()
        return loss
    return closure


def assert_same(a, b, rtol=1e-10):
    (stats_a, state_a, _), (stats_b, state_b, _) = a, b
    assert stats_a.keys() == stats_b.keys()
    for name in stats_a:
        for key in ("psi_sum", "psi_a_phi"):
            torch.testing.assert_close(stats_a[name][key], stats_b[name][key], rtol=rtol, atol=rtol)
        torch.testing.assert_close(stats_a[name]["psi_b_phi"].to_dense(), stats_b[name]["psi_b_phi"].to_dense(),
                                   rtol=rtol, atol=rtol)
        for key in state_a[name]:
            torch.testing.assert_close(state_a[name][key], state_b[name][key], rtol=rtol, atol=rtol)


@pytest.mark.parametrize("antithetic", [False, True])
def test_low_rank_statistics_equal_dense(antithetic):
    low = run_step(False, summed, antithetic=antithetic)
    assert low[2] == {"fc1", "fc2", "fc3"}
    first = low[0]["fc1"]["psi_b_phi"]  # the batch is every sample's input: rank ROWS, not K * ROWS
    assert first.dense is None and first.rank == ROWS
    later = low[0]["fc2"]["psi_b_phi"]  # per-sample inputs: ranks add up (dense once they reach n = 17)
    assert later.dense is not None or later.rank == 4 * ROWS
    assert_same(low, run_step(True, summed, antithetic=antithetic))


def test_low_rank_statistics_equal_dense_with_a_diagonal_output_factor():
    """diagonal_output_factor: the output layer's sums keep only the diagonal of sum_k Psi_k A Phi_k^T, the same
    from Delta and X (the low-rank route) as from the dense gradients."""
    low = run_step(False, summed, diagonal_output_factor=True)
    assert low[2] == {"fc1", "fc2", "fc3"}
    assert low[0]["fc3"]["psi_a_phi"].shape == (3,) and low[0]["fc2"]["psi_a_phi"].shape == (16, 16)
    assert_same(low, run_step(True, summed, diagonal_output_factor=True))
    full = run_step(True, summed, diagonal_output_factor=False)
    torch.testing.assert_close(low[0]["fc3"]["psi_a_phi"], torch.diagonal(full[0]["fc3"]["psi_a_phi"]))


def test_mean_loss_scaled_like_the_dense_gradient():
    def mean(model, x, y):
        def closure():
            loss = F.cross_entropy(model(x), y)  # a mean: the optimizer multiplies the gradients by ROWS
            loss.backward()
            return loss
        return closure

    low = run_step(False, mean)
    assert low[2] == {"fc1", "fc2", "fc3"}
    assert_same(low, run_step(True, mean))
    assert_same(low, run_step(False, summed))  # and the summed loss's statistics


@pytest.mark.parametrize("defer", [True, False])
def test_a_hook_on_a_layers_output_is_in_its_delta(defer):
    """A hook the user puts on a Linear's output (here halving its gradient) ran after the capture's own: the
    weight's gradient had it, the captured Delta did not, and the covariance statistics disagreed with the mean's
    (input_sqrt_cov off by 1.7e-3 after one step)."""
    def halve_gradient(module, inputs, out):
        out.register_hook(lambda g: 0.5 * g)  # returns None: the output stays as it is

    def hooked(model, x, y):
        model.fc1.register_forward_hook(halve_gradient)
        return summed(model, x, y)

    low = run_step(False, hooked, defer=defer)
    assert low[2] == {"fc1", "fc2", "fc3"}
    assert_same(low, run_step(True, hooked, defer=defer))


@pytest.mark.parametrize("defer", [True, False])
def test_an_input_buffer_refilled_for_every_sample_is_read_anew(defer):
    """A closure that writes each sample's (augmented) batch into one buffer: without a bias X_aug was the buffer
    itself, so the cached input always matched (stale X_aug A and outputs for later samples) and sample 0's
    statistic changed when the buffer did. The same as a closure that passes a fresh tensor each time."""
    def augmenting(fresh):
        def closure_of(model, x, y):
            noise, buffer = torch.Generator().manual_seed(3), torch.empty_like(x)

            def closure():
                buffer.copy_(x + 0.5 * torch.randn(x.shape, generator=noise, dtype=x.dtype))
                loss = F.cross_entropy(model(buffer.clone() if fresh else buffer), y, reduction="sum")
                loss.backward()
                return loss
            return closure
        return closure_of

    in_place = run_step(False, augmenting(False), defer=defer, bias=False)
    assert in_place[2] == {"fc1", "fc2", "fc3"}
    assert_same(in_place, run_step(False, augmenting(True), defer=defer, bias=False))
    assert_same(in_place, run_step(True, augmenting(False), defer=defer, bias=False))


def test_float32_matches_dense():
    low = run_step(False, summed, dtype=torch.float32)
    assert low[2] == {"fc1", "fc2", "fc3"}
    assert_same(low, run_step(True, summed, dtype=torch.float32), rtol=1e-4)


def test_layer_called_twice_falls_back():
    low = run_step(False, summed, twice=True)
    assert low[2] == {"fc1", "fc3"}
    assert_same(low, run_step(True, summed, twice=True))


def test_unused_layer_falls_back():
    low = run_step(False, summed, unused=True)
    assert low[2] == {"fc1", "fc2", "fc3"}
    assert_same(low, run_step(True, summed, unused=True))


def weight_penalty(model, x, y):
    def closure():
        loss = F.cross_entropy(model(x), y, reduction="sum") + model.fc1.weight.square().sum()
        loss.backward()
        return loss
    return closure


def clipped(model, x, y):
    def closure():
        loss = F.cross_entropy(model(x), y, reduction="sum")
        loss.backward()
        nn.utils.clip_grad_norm_([model.fc2.weight], 1e-3)  # changes .grad after backward
        return loss
    return closure


def input_gradient_penalty(model, x, y):
    def closure():
        inputs = x.clone().requires_grad_()
        loss = F.cross_entropy(model(inputs), y, reduction="sum")
        (grad,) = torch.autograd.grad(loss, inputs, create_graph=True)
        total = loss + grad.square().sum()
        total.backward()
        return total
    return closure


@pytest.mark.parametrize(("closure_of", "factored"), [(weight_penalty, {"fc2", "fc3"}), (clipped, {"fc1", "fc3"}),
                                                      (input_gradient_penalty, set())])
def test_gradient_other_than_delta_x_falls_back(closure_of, factored):
    low = run_step(False, closure_of, loss_reduction="sum")  # a summed loss plus a penalty
    assert low[2] == factored
    assert_same(low, run_step(True, closure_of, loss_reduction="sum"))


def test_sequential_equals_batched_with_low_rank_closure():
    torch.manual_seed(0)
    models = [Net().double() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [FOOVB(m, "kronecker", mc_samples=4, seed=3) for m in models]
    x, y = batch()
    for _ in range(2):
        opts[0].step(summed(models[0], x, y))
        opts[1].step_batched(x, y, lambda out, t: F.cross_entropy(out, t, reduction="sum"))
    for a, b in zip(opts[0].blocks, opts[1].blocks, strict=True):
        for key in a.state:
            torch.testing.assert_close(a.state[key], b.state[key], rtol=1e-10, atol=1e-10)


def test_hooks_removed_after_the_step():
    torch.manual_seed(0)
    model = Net().double()
    opt = FOOVB(model, "kronecker", mc_samples=2, seed=0)
    x, y = batch()
    opt.step(summed(model, x, y))
    assert all(not p._backward_hooks and not p._post_accumulate_grad_hooks for p in model.parameters())
    out = model.fc1(x)
    assert not out._backward_hooks
    F.cross_entropy(model(x), y).backward()  # a backward outside a step changes nothing of the optimizer's
    assert opt._pending is None


# ---------------------------------------------------------------------------------------------------------
# Deferred sampling: the first layer's sampled weight is never formed; its output comes in factored form
# ---------------------------------------------------------------------------------------------------------
def mean_loss(model, x, y):
    def closure():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss
    return closure


def reads_weights(seen):
    """A closure that reads fc1's values around the forward (.detach(), .data): they must be the sample's."""
    def closure_of(model, x, y):
        def closure():
            seen.append(model.fc1.weight.detach().clone())
            loss = F.cross_entropy(model(x), y, reduction="sum")
            seen.append(model.fc1.bias.data.clone())
            loss.backward()
            return loss
        return closure
    return closure_of


def in_another_thread(model, x, y):
    """The forward runs in a worker thread, where the optimizer's torch function mode is not active."""
    def closure():
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(1) as pool:
            loss = F.cross_entropy(pool.submit(model, x).result(), y, reduction="sum")
        loss.backward()
        return loss
    return closure


@pytest.mark.parametrize(("closure_of", "net", "first_formed"), [
    (summed, {}, False), (mean_loss, {}, False), (summed, {"twice": True}, False), (summed, {"unused": True}, False),
    (weight_penalty, {}, True), (clipped, {}, False), (input_gradient_penalty, {}, True)])
@pytest.mark.parametrize("antithetic", [False, True])
def test_deferred_sampling_equals_forming_every_sample(closure_of, net, first_formed, antithetic):
    """The factored first layer (and lazily formed other layers) give the same statistics and posterior as
    forming every sampled weight before the closure; fc1's weight is formed only where the closure uses it
    outside its F.linear on the batch (a penalty on it, or an input that needs a gradient)."""
    loads = Counter()
    reduction = "sum" if closure_of in (weight_penalty, input_gradient_penalty) else "auto"  # a sum plus a penalty
    deferred = run_step(False, closure_of, antithetic=antithetic, loads=loads, loss_reduction=reduction, **net)
    assert_same(deferred, run_step(False, closure_of, antithetic=antithetic, defer=False, loss_reduction=reduction,
                                   **net))
    assert (loads["fc1"] > 0) == first_formed
    # 8 rows into 16 -> 16: forming W (p n (p + n) flops) is cheaper than the factored form with the input's gradient
    assert loads["fc2"] == loads["fc3"] == 4


@pytest.mark.parametrize(("closure_of", "redone"), [(summed, False), (mean_loss, False), (clipped, False),
                                                    (weight_penalty, False), (input_gradient_penalty, True)])
@pytest.mark.parametrize("antithetic", [False, True])
def test_a_wide_inner_layer_is_factored_with_its_inputs_gradient(closure_of, redone, antithetic):
    """8 rows into a 64 -> 64 layer: fc2's output and its input's gradient Delta W come in factored form (issue 39:
    the LeNet's 1250 -> 500 layer), giving the statistics and posterior of forming every sample. A backward that
    builds a graph through it (a gradient penalty on the input) would miss W's part of that graph: the first
    sample stops there and the step is redone with every sample formed."""
    loads = Counter()
    reduction = "sum" if closure_of in (weight_penalty, input_gradient_penalty) else "auto"
    deferred = run_step(False, closure_of, antithetic=antithetic, loads=loads, loss_reduction=reduction, width=64)
    assert_same(deferred, run_step(False, closure_of, antithetic=antithetic, defer=False, loss_reduction=reduction,
                                   width=64))
    assert loads["fc2"] == (4 if redone else 0)
    assert loads["fc3"] == 4 + int(redone)  # 64 -> 3: forming it is cheaper (in the stopped first sample too)


def test_values_read_in_the_closure_are_the_samples():
    deferred, loaded = [], []
    loads = Counter()
    assert_same(run_step(False, reads_weights(deferred), loads=loads),
                run_step(False, reads_weights(loaded), defer=False))
    assert loads["fc1"] == 4 and len(deferred) == 8  # read before the forward: formed for every sample
    for a, b in zip(deferred, loaded, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    means = run_step(False, summed)[1]["fc1"]["mean"]  # not the posterior mean: a sample
    assert not torch.allclose(deferred[0], means[:, :12])


def test_a_nan_from_the_data_is_refused_and_keeps_deferral_on():
    """A non-finite loss is redone with every weight formed, in case a deferred weight was read unseen; when the
    redone sample is non-finite too (the data), the step is refused as in the other families, and deferral (the
    fast route) stayed off for good before."""
    torch.manual_seed(0)
    model = Net().double()
    opt = FOOVB(model, "kronecker", mc_samples=4, seed=0, antithetic=False, secant_check=False)
    x, y = batch()
    x = x.clone()
    x[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite"):
        opt.step(summed(model, x, y))
    assert opt._defer_linear_samples and opt.steps_taken == 0


def test_a_use_the_capture_cannot_see_is_redone_with_formed_samples():
    """A forward in another thread reads the parameters unseen (unsampled values): the gradient that the
    capture did not give is caught, the sample redone with every weight formed, and deferral stays off."""
    torch.manual_seed(0)
    model = Net().double()
    opt = FOOVB(model, "kronecker", mc_samples=4, seed=0, antithetic=False, secant_check=False)
    calls = []
    closure = in_another_thread(model, *batch())
    opt.step(lambda: calls.append(1) or closure())
    assert len(calls) == 5 and not opt._defer_linear_samples  # the first sample twice, then formed samples
    reference = run_step(False, in_another_thread, defer=False)[1]
    for name, block in zip(("fc1", "fc2", "fc3"), opt.blocks, strict=True):
        for key in block.state:
            torch.testing.assert_close(block.state[key], reference[name][key], rtol=1e-10, atol=1e-10)


def paired_runs(closure_of, steps=2, loss_reduction="auto"):
    """The same closure stepped with deferred samples and with every sample formed first: (posterior states,
    closure calls, whether still deferring) of each."""
    results = []
    for defer in (True, False):
        torch.manual_seed(0)
        model = Net().double()
        opt = FOOVB(model, "kronecker", mc_samples=4, seed=0, antithetic=False, loss_reduction=loss_reduction,
                    secant_check=False)
        opt._defer_linear_samples = defer
        calls = []
        closure = closure_of(model, *batch())
        for _ in range(steps):
            opt.step(lambda closure=closure, calls=calls: calls.append(1) or closure())
        assert all(torch.equal(p, m) for b in opt.blocks for p, m in zip(b.params, b.mean_values(), strict=True))
        results.append(([v.clone() for b in opt.blocks for v in b.state.values()], len(calls),
                        opt._defer_linear_samples))
    for a, b in zip(results[0][0], results[1][0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    return results


def checkpointed(model, x, y):
    """Non-reentrant activation checkpointing: backward recomputes fc1's forward where the mode is inactive."""
    from torch.utils.checkpoint import checkpoint

    def closure():
        h = checkpoint(lambda t: torch.tanh(model.fc1(t)), x, use_reentrant=False)
        loss = F.cross_entropy(model.fc3(torch.tanh(model.fc2(h))), y, reduction="sum")
        loss.backward()
        return loss
    return closure


def functorch_grad(model, x, y):
    """torch.func.grad over the model's parameters (wrapped: unseen by the mode), then assigned to .grad."""
    def loss_of(params):
        loss = F.cross_entropy(torch.func.functional_call(model, params, (x,)), y, reduction="sum")
        return loss, loss

    def closure():
        grads, loss = torch.func.grad(loss_of, has_aux=True)(dict(model.named_parameters()))
        for name, p in model.named_parameters():
            p.grad = grads[name]
        return loss
    return closure


def backward_hook_reads_weight(model, x, y):
    """A tensor hook during backward scales the errors by fc1's weight norm (read where the mode is off)."""
    def closure():
        out = model.fc1(x)
        out.register_hook(lambda g: g * model.fc1.weight.norm())
        loss = F.cross_entropy(model.fc3(torch.tanh(model.fc2(torch.tanh(out)))), y, reduction="sum")
        loss.backward()
        return loss
    return closure


@pytest.mark.parametrize("closure_of", [checkpointed, functorch_grad, backward_hook_reads_weight, in_another_thread])
def test_unseen_reads_of_a_deferred_weight_are_caught_and_redone(closure_of):
    """Reads that the capture cannot see get NaN (the deferred weight's placeholder), which the non-finite check
    catches: the sample is redone with formed weights, the result is the reference's, and deferral stops."""
    (_, calls, still), (_, reference_calls, _) = paired_runs(closure_of, loss_reduction="sum")
    assert calls == reference_calls + 1 and not still  # one redone sample, then every sample formed


def clipped_first_layer(model, x, y):
    def closure():
        loss = F.cross_entropy(model(x), y, reduction="sum")
        loss.backward()
        nn.utils.clip_grad_norm_(model.fc1.parameters(), 1e-3)  # changes the factored layer's .grad in place
        return loss
    return closure


def two_backward_passes(model, x, y):
    def closure():
        loss = F.cross_entropy(model(x), y, reduction="sum")
        loss.backward(retain_graph=True)
        loss.backward()  # gradients of 2 L: summed over both passes
        return 2 * loss
    return closure


def linear_by_keywords(model, x, y):
    def closure():
        h = torch.tanh(F.linear(input=x, weight=model.fc1.weight, bias=model.fc1.bias))
        loss = F.cross_entropy(model.fc3(torch.tanh(model.fc2(h))), y, reduction="sum")
        loss.backward()
        return loss
    return closure


@pytest.mark.parametrize("closure_of", [clipped_first_layer, two_backward_passes, linear_by_keywords])
def test_seen_changes_of_the_gradient_are_not_redone(closure_of):
    """Clipping after backward, two backward passes and F.linear called by keywords are seen: no sample is
    redone (the closure runs K times per step, its side effects once) and deferral stays on."""
    (_, calls, still), (_, reference_calls, _) = paired_runs(closure_of, loss_reduction="sum")
    assert calls == reference_calls == 8 and still
