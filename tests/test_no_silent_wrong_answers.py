"""Standard patterns that used to give a wrong answer silently (issue 35), one test per pattern: weights written
into the model after the optimizer was built, how the loss was reduced (sums, scaled means, label smoothing,
micro-batches inside the closure, a regulariser), and layers frozen after construction."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import FAMILIES, all_equal, mlp, mlp_batch, posterior_snapshot

from foovb import FOOVB
from foovb.predict import predict

X, Y = mlp_batch(rows=8)


def closure_of(model, loss_fn, x=X, y=Y):
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
    model = mlp(seed=seed)
    opt = FOOVB(model, family, 4, seed=3, **options)
    opt.step(closure_of(model, loss_fn))
    return opt


# -- weights written into the model between steps --------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_weights_loaded_after_construction_are_the_mean_of_the_next_step(family):
    """model.load_state_dict after FOOVB(model): the next step starts from the loaded weights, as it does for an
    optimizer built on the loaded model (the prior std is shape-only, so both posteriors are identical)."""
    pretrained = mlp(seed=5).state_dict()
    model = mlp(seed=0)
    opt = FOOVB(model, family, 4, seed=3)
    opt.step(closure_of(model, summed_ce))  # a step before the load: its mean is replaced, its covariance kept
    model.load_state_dict(pretrained)
    for name, param in model.named_parameters():  # seen at once by posterior() and state_dict()
        assert torch.equal(opt.posterior(param).mean, pretrained[name])
    seen = []

    def closure():
        seen.append([p.detach().clone() for p in model.parameters()])
        return closure_of(model, summed_ce)()

    opt.step(closure)
    # the samples are drawn around the loaded weights: their average over an antithetic pair is the loaded mean
    for a, b, want in zip(seen[0], seen[1], pretrained.values(), strict=True):
        torch.testing.assert_close((a + b) / 2, want, rtol=1e-5, atol=1e-6)
    moved = [p.detach() - w for p, w in zip(model.parameters(), pretrained.values(), strict=True)]
    assert 0 < max(float(m.abs().max()) for m in moved) < 0.5  # a step from the loaded weights, not back


@pytest.mark.parametrize("family", FAMILIES)
def test_a_load_before_the_first_step_gives_the_step_of_an_optimizer_built_after_it(family):
    pretrained = mlp(seed=5).state_dict()
    late = mlp(seed=0)
    late_opt = FOOVB(late, family, 4, seed=3)
    late.load_state_dict(pretrained)
    late_opt.step(closure_of(late, summed_ce))
    early = mlp(seed=0)
    early.load_state_dict(pretrained)
    early_opt = FOOVB(early, family, 4, seed=3)
    early_opt.step(closure_of(early, summed_ce))
    assert all_equal(posterior_snapshot(late_opt), posterior_snapshot(early_opt))
    assert all_equal(list(late.parameters()), list(early.parameters()))


def test_sampled_predictions_and_the_state_dict_use_weights_written_after_construction():
    pretrained = mlp(seed=5).state_dict()
    model = mlp(seed=0)
    opt = FOOVB(model, "kronecker", 4, seed=3)
    model.load_state_dict(pretrained)
    reference_model = mlp(seed=0)
    reference_model.load_state_dict(pretrained)
    reference = FOOVB(reference_model, "kronecker", 4, seed=3)
    got, want = predict(opt, X, 3, seed=1), predict(reference, X, 3, seed=1)
    assert torch.equal(got.samples, want.samples) and torch.equal(got.mean, want.mean)
    with opt.sampled_params(seed=2), reference.sampled_params(seed=2):
        assert all_equal(list(model.parameters()), list(reference_model.parameters()))
    saved = opt.state_dict()["state"]
    assert all_equal([saved[i]["mean"] for i in sorted(saved)],
                     [s["mean"] for s in (reference.state_dict()["state"][i] for i in sorted(saved))])


def test_non_finite_or_moved_weights_written_after_construction_are_errors():
    model = mlp()
    opt = FOOVB(model, "diagonal", 4)
    before = posterior_snapshot(opt)
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite values written into the model"):
        opt.step(closure_of(model, summed_ce))
    assert all_equal(posterior_snapshot(opt), before)
    model = mlp()
    opt = FOOVB(model, "kronecker", 4)
    model.double()
    with pytest.raises(ValueError, match="moved or cast .* after the optimizer was built"):
        opt.step(closure_of(model, summed_ce, x=X.double()))


# -- how the loss was reduced ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("loss_fn", "summed"), [
    # a .sum() or .mean() over a one-element mean, also reshaped, cloned or cast: the mean (a .mean() was read as a
    # mean over 1 term: steps batch-size times too small, silently)
    (lambda out, y: F.cross_entropy(out, y).sum(), summed_ce),
    (lambda out, y: F.cross_entropy(out, y).mean(), summed_ce),
    (lambda out, y: torch.nn.CrossEntropyLoss()(out, y).reshape(1).mean(), summed_ce),
    (lambda out, y: F.cross_entropy(out, y).clone().view(1).squeeze(), summed_ce),
    (lambda out, y: F.cross_entropy(out.double(), y).float(), summed_ce),
    (lambda out, y: F.cross_entropy(out, y, reduction="sum").mean(), summed_ce),
    (lambda out, y: F.cross_entropy(out, y).expand(1).mean(), summed_ce),
    (lambda out, y: F.cross_entropy(out, y).view(1, 1).t().repeat(1, 1).mean(), summed_ce),
    # label smoothing keeps a mean over the batch
    (lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1),
     lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1, reduction="sum")),
    # a mean or a sum written by hand (a sum divided by the batch's rows, a mean times them)
    (lambda out, y: summed_ce(out, y) / len(y), summed_ce),
    (lambda out, y: F.cross_entropy(out, y) * len(y), summed_ce),
    (lambda out, y: -out.log_softmax(-1)[torch.arange(len(y)), y].mean(), summed_ce),
    # per-example losses summed over the batch's rows
    (lambda out, y: F.cross_entropy(out, y, reduction="none").sum(), summed_ce),
])
def test_scaled_means_and_row_sums_take_the_step_of_the_summed_loss(family, loss_fn, summed):
    assert_same_posterior(one_step(loss_fn, family), one_step(summed, family))


def test_a_constant_times_a_mean_is_refused_with_both_readings_and_each_fix_works():
    """loss / 2: is the 1/2 part of each example's loss, or does it scale the batch (the gradient-accumulation
    recipe (loss / k).backward() per micro-batch)? Reading it either way was silently wrong for the other."""
    model = mlp()
    with pytest.raises(ValueError, match=r"0.5 times a mean over 8 terms.*The first: step\(closure, batch_size=8\); "
                                         r"the second: step\(closure, batch_size=16\)"):
        FOOVB(model, "diagonal", 4).step(closure_of(model, lambda out, y: F.cross_entropy(out, y) / 2))
    # the accumulation recipe over 2 micro-batches of 4 rows, with the batch's size declared: the one-batch step
    model = mlp(seed=0)
    opt = FOOVB(model, "diagonal", 4, seed=3)

    def accumulate():
        for rows in (slice(0, 4), slice(4, 8)):
            (F.cross_entropy(model(X[rows]), Y[rows]) / 2).backward()
        return torch.tensor(0.0)

    opt.step(accumulate, batch_size=8)
    assert_same_posterior(opt, one_step(summed_ce))
    # 1/2 of each example's loss: batch_size=8 gives the step of the summed halved loss
    model = mlp(seed=0)
    opt = FOOVB(model, "diagonal", 4, seed=3)
    opt.step(closure_of(model, lambda out, y: F.cross_entropy(out, y) / 2), batch_size=8)
    assert_same_posterior(opt, one_step(lambda out, y: summed_ce(out, y) / 2, loss_reduction="sum"))


def test_a_loss_multiplied_by_a_non_finite_constant_is_a_non_finite_loss():
    """(not "nan times a mean: a Gaussian's 1/2 or the batch's scale?")"""
    model = mlp()
    opt = FOOVB(model, "diagonal", 4)
    before = posterior_snapshot(opt)
    with pytest.raises(FloatingPointError, match="non-finite values in the"):
        opt.step(closure_of(model, lambda out, y: F.cross_entropy(out, y) * float("nan")))
    assert all_equal(posterior_snapshot(opt), before)


def test_a_gradient_given_to_backward_scales_the_loss():
    """loss.backward(g) gives the gradients of g * loss: g = 2 was ignored (a step twice too large, silently)."""
    def closure_with_gradient(model, value):
        def closure():
            loss = F.cross_entropy(model(X), Y)
            loss.backward(torch.tensor(value))
            return loss
        return closure

    model = mlp()
    with pytest.raises(ValueError, match="the loss is 2 times a mean over 8 terms"):
        FOOVB(model, "diagonal", 4).step(closure_with_gradient(model, 2.0))
    model = mlp(seed=0)
    opt = FOOVB(model, "diagonal", 4, seed=3)
    opt.step(closure_with_gradient(model, 1.0))
    assert_same_posterior(opt, one_step(summed_ce))


@pytest.mark.parametrize("call", [
    lambda loss: torch.autograd.backward(loss),
    lambda loss: torch.autograd.backward([loss]),
    lambda loss: torch.autograd.backward(tensors=(loss,), grad_tensors=(None,)),
    lambda loss: torch.autograd.backward(loss / 2, grad_tensors=torch.tensor(2.0)),
    lambda loss: torch.autograd.backward((loss * 2,), [torch.tensor(0.5)]),
    lambda loss: torch.autograd.backward([loss * 2], grad_tensors=(g for g in [torch.tensor(0.5)])),
])
def test_torch_autograd_backward_is_read_as_loss_backward(call):
    """torch.autograd.backward hands the loss as a tuple and the gradients as grad_tensors=: it was skipped, and
    the step refused (or, with batch_size=, took whatever factor the user guessed)."""
    model = mlp(seed=0)
    opt = FOOVB(model, "diagonal", 4, seed=3)

    def closure():
        loss = F.cross_entropy(model(X), Y)
        call(loss)
        return loss

    opt.step(closure)
    assert_same_posterior(opt, one_step(summed_ce))


def test_torch_autograd_backward_with_a_gradient_of_two_is_twice_the_mean():
    model = mlp()

    def closure():
        loss = F.cross_entropy(model(X), Y)
        torch.autograd.backward(loss, grad_tensors=torch.tensor(2.0))
        return loss

    with pytest.raises(ValueError, match="the loss is 2 times a mean over 8 terms"):
        FOOVB(model, "diagonal", 4).step(closure)


def test_gradients_filled_without_backward_are_refused_with_the_ways_to_say_the_reduction():
    model = mlp()

    def closure():
        loss = F.cross_entropy(model(X), Y)
        grads = torch.autograd.grad(loss, list(model.parameters()))  # gradients written by hand: not seen
        for parameter, grad in zip(model.parameters(), grads, strict=True):
            parameter.grad = grad
        return loss

    with pytest.raises(ValueError, match=r"without calling backward\(\) .* step\(closure, batch_size=8\)"):
        FOOVB(model, "diagonal", 4).step(closure)
    model = mlp(seed=0)
    opt = FOOVB(model, "diagonal", 4, seed=3)
    opt.step(closure, batch_size=8)
    assert_same_posterior(opt, one_step(summed_ce))


@pytest.mark.parametrize("offset", [
    lambda loss: loss + 1.0, lambda loss: 1.0 + loss, lambda loss: loss - torch.tensor(3.0),
    lambda loss: loss + F.cross_entropy(torch.zeros(8, 3), Y)])  # a constant tensor: no gradient
def test_a_mean_loss_plus_a_constant_is_the_mean(offset):
    """A constant added to the loss has no gradient: the step is the mean's (it was refused as a mean plus
    "something else")."""
    assert_same_posterior(one_step(lambda out, y: offset(F.cross_entropy(out, y))), one_step(summed_ce))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_label_smoothing_on_a_batch_of_one_row_is_the_batchs_loss(reduction):
    """It was refused on one row ("adds a mean over 1 terms to something else"): a data-parallel shard of one row
    then failed on that process alone. On more rows the same loss is still read as before."""
    def smoothed(red):
        return lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1, reduction=red)

    def one_row_step(loss_fn):
        model = mlp(seed=0)
        opt = FOOVB(model, "diagonal", 4, seed=3)
        opt.step(closure_of(model, loss_fn, X[:1], Y[:1]))
        return opt

    assert_same_posterior(one_row_step(smoothed(reduction)), one_row_step(smoothed("sum")))
    assert_same_posterior(one_step(smoothed(reduction)), one_step(smoothed("sum")))


def test_a_mean_over_a_stack_of_means_is_refused():
    model = mlp()
    with pytest.raises(ValueError, match=r"a .mean\(\) over a stack of values"):
        FOOVB(model, "diagonal", 4).step(closure_of(model, lambda out, y: torch.stack(
            [F.cross_entropy(out[:4], y[:4]), F.cross_entropy(out[4:], y[4:])]).mean()))


def test_a_sum_over_a_stack_of_losses_is_refused_with_the_batch_size_fix():
    """torch.stack([mean, regulariser]).sum() was taken as the batch's sum (updates 8x too small here)."""
    model = mlp()
    opt = FOOVB(model, "diagonal", 4)
    before = posterior_snapshot(opt)
    with pytest.raises(ValueError, match=r"step\(closure, batch_size=8\)"):
        opt.step(closure_of(model, lambda out, y: torch.stack(
            [F.cross_entropy(out, y), 1e-3 * model[0].weight.square().sum()]).sum()))
    assert all_equal(posterior_snapshot(opt), before)
    with pytest.raises(ValueError, match="a .sum\\(\\) over 4 leading rows, but the model's input has 8 rows"):
        opt.step(closure_of(model, lambda out, y: F.cross_entropy(out, y, reduction="none")[:4].sum()))


def test_a_regularised_mean_is_refused_and_its_fix_gives_the_regularised_sum():
    """mean + regulariser: the error names step(closure, batch_size=8), whose step is that of the summed loss
    plus 8 regularisers; loss_reduction='sum' (the error of 1.0 suggested it) is refused for it."""
    def regularised_mean(out, y, model):
        return F.cross_entropy(out, y) + 1e-2 * model[0].weight.square().sum()

    model = mlp()
    with pytest.raises(ValueError, match=r"adds a mean over 8 terms .* step\(closure, batch_size=8\)"):
        FOOVB(model, "diagonal", 4).step(closure_of(model, lambda o, y: regularised_mean(o, y, model)))
    with pytest.raises(ValueError, match=r"loss_reduction='sum' .* batch_size=8"):
        FOOVB(model, "diagonal", 4, loss_reduction="sum").step(
            closure_of(model, lambda o, y: regularised_mean(o, y, model)))
    fixed_model = mlp(seed=0)
    fixed = FOOVB(fixed_model, "diagonal", 4, seed=3)
    fixed.step(closure_of(fixed_model, lambda o, y: regularised_mean(o, y, fixed_model)), batch_size=8)
    summed_model = mlp(seed=0)
    summed = FOOVB(summed_model, "diagonal", 4, seed=3, loss_reduction="sum")
    summed.step(closure_of(summed_model, lambda o, y: summed_ce(o, y) + 8e-2 * summed_model[0].weight.square().sum()))
    assert_same_posterior(fixed, summed)


def micro_batch_closure(model, sizes, reduce):
    def closure():
        start, total = 0, 0.0
        for size in sizes:
            out = model(X[start:start + size])
            loss = F.cross_entropy(out, Y[start:start + size], reduction=reduce)
            loss.backward()
            total, start = total + float(loss.detach()), start + size
        return torch.tensor(total)

    return closure


@pytest.mark.parametrize("family", FAMILIES)
def test_micro_batches_inside_the_closure_are_scaled_each_or_refused(family):
    """Gradient accumulation inside the closure: summed micro-batch losses, or means over equal micro-batches,
    take the one-batch step; means over unequal ones (6 + 2 rows) are refused (one scale was applied to both)."""
    reference = one_step(summed_ce, family)
    for sizes, reduce in (((6, 2), "sum"), ((4, 4), "mean")):
        model = mlp(seed=0)
        opt = FOOVB(model, family, 4, seed=3)
        opt.step(micro_batch_closure(model, sizes, reduce))
        assert_same_posterior(opt, reference)
    model = mlp(seed=0)
    opt = FOOVB(model, family, 4, seed=3)
    before = posterior_snapshot(opt)
    with pytest.raises(ValueError, match="backward\\(\\) 2 times on losses of different scales"):
        opt.step(micro_batch_closure(model, (6, 2), "mean"))
    assert all_equal(posterior_snapshot(opt), before)


def test_two_backward_calls_with_an_unreadable_loss_are_refused_naming_the_batch_rows():
    """A cross-entropy mean and 0.01 x a mean over the (rows x outputs) activations, backward() on each: the advice
    counted the activations as rows (batch_size=rows x outputs), and following it multiplied the cross-entropy's
    gradients by the outputs too. The refusal names the batch's rows; following it trains."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 20), torch.randint(0, 2, (64,))

    def train(batch_size: int | None) -> float:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        opt = FOOVB(model, "diagonal", 4, seed=0)

        def closure() -> torch.Tensor:
            out = model(x)
            cross_entropy = F.cross_entropy(out, y)
            cross_entropy.backward(retain_graph=True)
            penalty = 0.01 * out.square().mean()  # a mean over 64 x 8 activations
            penalty.backward()
            return cross_entropy + penalty

        for _ in range(30):
            opt.step(closure, batch_size=batch_size)
        return float(torch.cat([p.detach().flatten() for p in model.parameters()]).norm())

    with pytest.raises(ValueError, match=r"called backward\(\) 2 times, and loss 2 \(0.01 times a mean over 512 "
                                         r"terms\).*step\(closure, batch_size=64\)$"):
        train(None)
    assert train(64) < 0.5 * train(512)  # the old advice's batch_size inflates the step 8-fold


# -- layers frozen after construction ---------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_a_layer_frozen_after_construction_is_left_out_of_the_step(family):
    """requires_grad_(False) after FOOVB(model): the closure sees that layer at its posterior mean (no sampling
    noise), its posterior does not change, the other layers train as with an optimizer built without it;
    unfreezing it trains it again."""
    model = mlp(seed=0)
    opt = FOOVB(model, family, 4, seed=3)
    frozen_before = [p.detach().clone() for p in model[0].parameters()]
    model[0].requires_grad_(False)
    seen = []

    def closure():
        seen.append([p.detach().clone() for p in model[0].parameters()])
        return closure_of(model, summed_ce)()

    opt.step(closure)
    assert len(seen) == 4 and all(all_equal(s, frozen_before) for s in seen)
    assert all_equal([opt.posterior(p).mean for p in model[0].parameters()], frozen_before)
    assert all_equal(list(model[0].parameters()), frozen_before)
    assert not all_equal(list(model[2].parameters()), list(mlp(seed=0)[2].parameters()))  # the head trained
    model[0].requires_grad_(True)
    opt.step(closure_of(model, summed_ce))
    assert not all_equal(list(model[0].parameters()), frozen_before)


@pytest.mark.parametrize("family", ["diagonal", "kronecker"])
def test_the_batched_step_leaves_a_frozen_layer_out_as_the_sequential_one(family):
    results = []
    for batched in (False, True):
        model = mlp(seed=0)
        opt = FOOVB(model, family, 4, seed=3)
        model[2].requires_grad_(False)
        if batched:
            opt.step_batched(X, Y)
        else:
            opt.step(closure_of(model, summed_ce))
        results.append(opt)
    assert_same_posterior(results[1], results[0])
    assert all_equal([v for p in results[1].model[2].parameters() for v in (results[1].posterior(p).mean,)],
                     list(mlp(seed=0)[2].parameters()))


def test_freezing_half_of_a_matrix_variate_layer_is_refused():
    model = mlp()
    opt = FOOVB(model, "kronecker", 4)
    model[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="weight and bias together"):
        opt.step(closure_of(model, summed_ce))
    model[0].weight.requires_grad_(True)
    opt.step(closure_of(model, summed_ce))  # both trainable again: the step runs


def test_parameters_replaced_after_construction_are_refused():
    """A new head (or load_state_dict(assign=True)) after FOOVB(model): the optimizer would train the old
    tensors while the model uses the new ones; it said "no parameter received a gradient"."""
    model = mlp()
    opt = FOOVB(model, "diagonal", 4)
    model[2] = torch.nn.Linear(6, 3)
    with pytest.raises(ValueError, match="parameters were replaced after the optimizer was built"):
        opt.step(closure_of(model, summed_ce))
    model = mlp()
    opt = FOOVB(model, "kronecker", 4)
    model.load_state_dict(mlp(seed=5).state_dict(), assign=True)
    with pytest.raises(ValueError, match="parameters were replaced"):
        opt.step(closure_of(model, summed_ce))
    # sampling for predictions would draw the old layer too (silently: the new one at its point weights)
    model = mlp()
    opt = FOOVB(model, "diagonal", 4)
    model[2] = torch.nn.Linear(6, 3)
    with pytest.raises(ValueError, match="the optimizer would sample the old ones"):
        predict(opt, X, 2)
    with pytest.raises(ValueError, match="the optimizer would sample the old ones"), opt.sampled_params():
        pass


def test_a_layer_frozen_at_construction_and_unfrozen_later_is_named():
    """It was reported as "parameters were replaced", whose advice (load the state dict into a new FOOVB) fails."""
    model = mlp()
    model[2].requires_grad_(False)
    opt = FOOVB(model, "diagonal", 4)
    model[2].requires_grad_(True)
    with pytest.raises(ValueError, match="frozen \\(requires_grad=False\\) when the optimizer was built"):
        opt.step(closure_of(model, summed_ce))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("read", ["posterior", "state_dict"])
def test_reading_the_posterior_inside_a_sample_changes_nothing(family, read):
    """posterior() / state_dict() inside a closure (Lightning: a sigma logged in training_step) or a
    sampled_params block took the loaded sample for weights written by the user, and made it the mean."""
    def reading(loss_fn, model, opt):
        def loss_with_a_read(out, y):
            opt.posterior(model[0].weight).std.mean() if read == "posterior" else opt.state_dict()
            return loss_fn(out, y)
        return loss_with_a_read

    model = mlp(seed=0)
    opt = FOOVB(model, family, 4, seed=3)
    opt.step(closure_of(model, reading(summed_ce, model, opt)))
    assert_same_posterior(opt, one_step(summed_ce, family))
    model = mlp(seed=0)  # an own loop of sampled_params(train=True) blocks
    opt = FOOVB(model, family, 4, seed=3)
    for _ in range(4):
        with opt.sampled_params(train=True):
            reading(summed_ce, model, opt)(model(X), Y).backward()
    opt.step()
    assert_same_posterior(opt, one_step(summed_ce, family))
    before = posterior_snapshot(opt)  # an inspection block leaves the mean in the model, not its sample
    mean = [p.detach().clone() for p in model.parameters()]
    with opt.sampled_params(seed=1):
        reading(summed_ce, model, opt)(model(X), Y)
    assert all_equal(posterior_snapshot(opt), before)
    assert all_equal([p.detach() for p in model.parameters()], mean)


def test_predictions_inside_a_sample_are_refused():
    """predict() in a closure predicted from the sample (mean route), then restored the mean under the closure."""
    model = mlp()
    opt = FOOVB(model, "diagonal", 4)

    def closure():
        predict(opt, X, 2)
        loss = summed_ce(model(X), Y)
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match=r"predict\(\) inside a step's closure or a sampled_params block"):
        opt.step(closure)
    with pytest.raises(RuntimeError, match=r"sampled_params\(\) inside"), opt.sampled_params():
        with opt.sampled_params():
            pass
    predict(opt, X, 2)  # between steps: fine


def test_step_batched_names_its_own_fix_for_a_regularised_loss():
    model = mlp()
    opt = FOOVB(model, "kronecker", 4)
    with pytest.raises(ValueError, match=r"step_batched: loss_fn must return a mean over the 4 x 8 stacked rows") \
            as error:
        opt.step_batched(X, Y, lambda out, y: F.cross_entropy(out, y) + 1e-3 * model[0].weight.square().sum())
    assert "batch_size=32" not in str(error.value).split("What was read")[0]
