"""The output anchor (`foovb.anchor`): a Gaussian pseudo-likelihood on the outputs at the posterior mean. On a linear
model it is exactly a Gaussian likelihood whose observation is the mean's output: the exact posterior keeps the
mean and adds strength X^T X to the precision; its reductions and the batched path give the same step; on a solved
task it keeps contracting the covariance where the cross-entropy has stopped."""

import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import F64, PAPER, ce_closure, make_generator
from torch import nn

from foovb import FOOVB, sampled
from foovb.anchor import output_anchor, output_reference, solved_fraction

pytestmark = pytest.mark.usefixtures("single_thread")


@contextlib.contextmanager
def _stacked(samples):
    """As inside step_batched's pass of `samples` stacked samples (`sampled.stacked_samples`)."""
    token = sampled._STACKED.set(samples)
    try:
        yield
    finally:
        sampled._STACKED.reset(token)


def test_on_a_linear_model_the_anchor_is_exact_bayes_with_the_means_output_observed():
    """f(theta) = X theta: the anchor strength/2 ||X (theta - mu)||^2 is the likelihood of observing f(mu) with noise
    variance 1/strength, so the exact posterior keeps the mean and has precision V0^-1 I + strength sum_t X_t^T X_t.
    With antithetic pairs E[g] over a pair is exactly 0 (the gradient is linear in eps): the mean never moves."""
    d, v0, strength, batches, rows = 3, 0.25, 0.5, 40, 5
    gen = make_generator(3)
    x = torch.randn(batches * rows, d, generator=gen, dtype=F64)
    lin = nn.Linear(d, 1, bias=False).double()
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[0.3, -0.2, 0.1]], dtype=F64))
    prior_mean = lin.weight.detach().clone().flatten()
    opt = FOOVB(lin, "full", 200, std_init=math.sqrt(v0), init="keep", seed=5, antithetic=True, cov_step=1.0,
                **PAPER)
    for t in range(batches):
        xb = x[t * rows:(t + 1) * rows]
        reference = output_reference(opt, xb)

        def closure(xb=xb, reference=reference):
            loss = output_anchor(lin(xb), reference, strength, reduction="sum")
            loss.backward()
            return loss

        opt.step(closure)
    view = opt.posterior(lin.weight)
    exact_cov = torch.linalg.inv(torch.eye(d, dtype=F64) / v0 + strength * x.T @ x)
    assert torch.allclose(view.mean.flatten(), prior_mean, atol=1e-12)
    relative = torch.linalg.matrix_norm(view.covariance() - exact_cov) / torch.linalg.matrix_norm(exact_cov)
    assert relative < 0.2  # the tolerance of the exact-Bayes regression test (same K, fewer batches)
    assert torch.trace(exact_cov) < 0.1 * d * v0  # the anchor moved the covariance far from the prior


def _classifier(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def _anchored_step(model, opt, x, y, reduction, strength=2.0, batched=False, chunk_size=None):
    reference = output_reference(opt, x)

    def loss_fn(out, target):
        return F.cross_entropy(out, target, reduction=reduction) + output_anchor(out, reference, strength, reduction)

    if batched:
        return opt.step_batched(x, y, loss_fn, chunk_size=chunk_size)

    def closure():
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    return opt.step(closure)


@pytest.mark.parametrize("posterior", ["diagonal", "kronecker"])
def test_mean_and_sum_reductions_and_the_batched_path_give_the_same_step(posterior):
    """Also with the K samples stacked two at a time (chunk_size=2)."""
    gen = make_generator(1)
    x, y = torch.randn(12, 5, generator=gen), torch.randint(3, (12,), generator=gen)
    finals = []
    for reduction, batched, chunk in (("sum", False, None), ("mean", False, None), ("sum", True, None),
                                      ("mean", True, None), ("mean", True, 2)):
        model = _classifier()
        opt = FOOVB(model, posterior, 4, seed=2)
        for _ in range(3):
            _anchored_step(model, opt, x, y, reduction, batched=batched, chunk_size=chunk)
        finals.append([(opt.posterior(p).mean, opt.posterior(p).std) for p in model.parameters()])
    for other in finals[1:]:
        for (mean, std), (mean_other, std_other) in zip(finals[0], other, strict=True):
            torch.testing.assert_close(mean_other, mean, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(std_other, std, rtol=1e-4, atol=1e-7)


def test_the_anchor_keeps_contracting_the_covariance_on_a_solved_task():
    """After a separable task is learned, the cross-entropy's curvature has vanished: its steps leave the first
    layer's std nearly where it is, while the anchored steps shrink it (docs/theory.md, "The output anchor")."""
    gen = make_generator(4)
    x = torch.randn(64, 5, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    model = _classifier()
    opt = FOOVB(model, "diagonal", 8, seed=0)
    for _ in range(300):
        opt.step(ce_closure(model, x, y, reduction="mean"))
    assert (model(x).argmax(1) == y).float().mean() > 0.97
    state = copy.deepcopy(opt.state_dict())
    first = model[0].weight

    def std_after(strength):
        opt.load_state_dict(state)
        before = opt.posterior(first).std.mean()
        for _ in range(20):
            _anchored_step(model, opt, x, y, "mean", strength)
        return float(opt.posterior(first).std.mean() / before)

    plain, anchored = std_after(0.0), std_after(2.0)
    assert plain > 0.95  # measured 0.98: the solved task's cross-entropy barely contracts
    assert 1 - anchored > 5 * (1 - plain)  # measured 0.59: the anchor contracts twenty times as much


def test_output_reference_leaves_the_model_as_it_was_and_refuses_a_loaded_sample():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    opt = FOOVB(model, "diagonal", 2, seed=0)
    x = torch.randn(8, 4)
    buffers = [b.clone() for b in model.buffers()]
    reference = output_reference(opt, x)
    assert not reference.requires_grad and reference.shape == (8, 2)
    assert all(torch.equal(b, saved) for b, saved in zip(model.buffers(), buffers, strict=True))

    def closure():
        output_reference(opt, x)

    with pytest.raises(RuntimeError, match="before optimizer.step"):
        opt.step(closure)


def test_output_anchor_names_a_bad_argument():
    reference = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="strength"):
        output_anchor(torch.zeros(4, 3), reference, -1.0)
    with pytest.raises(ValueError, match="reduction"):
        output_anchor(torch.zeros(4, 3), reference, 1.0, "none")
    with pytest.raises(ValueError, match="strength"):
        output_anchor(torch.zeros(4, 3), reference, math.inf)
    with pytest.raises(TypeError, match="tensors"):
        output_anchor((torch.zeros(4, 3),), reference, 1.0)
    with pytest.raises(ValueError, match="do not match the reference"):
        output_anchor(torch.zeros(6, 3), reference, 1.0)
    with pytest.raises(ValueError, match="another batch"):  # 8 rows are two samples of 4 only in step_batched
        output_anchor(torch.zeros(8, 3), reference, 1.0)
    with pytest.raises(ValueError, match="repeated ones"):
        output_anchor(torch.zeros(4, 3), reference, 1.0, targets=torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match="ignore_index"):
        output_anchor(torch.zeros(4, 3), reference, 1.0, targets=torch.tensor([0, 1, -100, 2]))
    with _stacked(2):
        stacked = output_anchor(torch.ones(8, 3), reference, 2.0, "sum")  # two stacked samples of the 4 rows
    assert float(stacked) == pytest.approx(0.5 * 2.0 * 8 * 3)
    assert float(output_anchor(torch.ones(4), torch.zeros(4), 2.0)) == pytest.approx(1.0)  # 1-D outputs: one per row


def test_solved_fraction_is_zero_at_chance_and_one_when_certain():
    chance, certain, wrong = torch.zeros(4), torch.tensor([20.0, 0, 0, 0]), torch.tensor([0.0, 20, 0, 0])
    halfway = torch.log(torch.tensor([0.625, 0.125, 0.125, 0.125]))  # p(target) 0.625: (0.625 - 1/4) / (3/4)
    weights = solved_fraction(torch.stack([chance, certain, wrong, halfway]), torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(weights, torch.tensor([0.0, 1.0, 0.0, 0.5]), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="class indices"):
        solved_fraction(torch.zeros(4, 3), torch.zeros(4))


def test_a_weighted_anchor_leaves_an_untrained_network_free_and_repeats_its_weights_for_stacked_samples():
    targets = torch.tensor([0, 1, 2])
    reference = torch.tensor([[0.0, 0.0, 0.0], [0.0, 9.0, 0.0], [9.0, 0.0, 0.0]])  # chance, solved, wrong
    outputs = (reference + 1.0).requires_grad_()
    anchor = output_anchor(outputs, reference, 2.0, "sum", targets=targets)
    anchor.backward()
    assert outputs.grad[0].abs().sum() == 0 and outputs.grad[2].abs().sum() == 0  # chance and wrong: no anchor
    assert float(anchor.detach()) == pytest.approx(0.5 * 2.0 * float(solved_fraction(reference, targets)[1]) * 3)
    with _stacked(2):
        stacked = output_anchor(torch.cat([outputs, outputs]).detach(), reference, 2.0, "sum", targets=targets)
    assert float(stacked) == pytest.approx(2 * float(anchor.detach()))
