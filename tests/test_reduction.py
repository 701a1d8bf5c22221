"""foovb.reduction: the loss scale read from the loss's autograd graph (issue 35). What each loss is read as (a mean
over n terms, a sum, a scaled mean, label smoothing, per-example sums, loss.backward(g), torch.autograd.backward, a
constant added), the step each gives (that of the summed loss, on both paths), and what is refused with its fix (a
constant times a mean, a regularised mean, stacks of losses, unequal micro-batches, declared reductions the loss
contradicts, gradients filled without backward); the loss spy's module hooks."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    FAMILIES,
    all_equal,
    assert_same_posterior,
    closure_of,
    mlp,
    mlp_batch,
    one_step,
    params_snapshot,
    posterior_snapshot,
    summed_ce,
)
from conftest import model_closure as _closure
from torch import nn

from foovb import FOOVB
from foovb.optimizer import loss_reduction_of
from foovb.reduction import loss_scale

pytestmark = pytest.mark.usefixtures("single_thread")

X, Y = mlp_batch(rows=8)
WEIGHT = torch.tensor([0.5, 1.0, 2.0])


# ---------------------------------------------------------------------------------------------------------
# What the loss is read as
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("loss_fn", "kind", "terms", "mean_inside"), [
    (lambda out: F.cross_entropy(out, Y), "mean", 8, math.nan),
    (lambda out: F.cross_entropy(out, Y, reduction="sum"), "sum", math.nan, math.nan),  # trusted
    (lambda out: F.cross_entropy(out, Y, weight=WEIGHT), "mean", float(WEIGHT[Y].sum()), math.nan),
    (lambda out: F.cross_entropy(out, torch.where(torch.arange(8) < 3, -100, Y)), "mean", 5, math.nan),
    (lambda out: F.cross_entropy(out, Y, label_smoothing=0.1), "mean", 8, math.nan),
    (lambda out: F.nll_loss(out.log_softmax(-1), Y), "mean", 8, math.nan),
    (lambda out: -out.log_softmax(-1)[torch.arange(8), Y].mean(), "mean", 8, math.nan),
    (lambda out: F.mse_loss(out, torch.zeros(8, 3)), "mean", 24, math.nan),
    (lambda out: F.binary_cross_entropy_with_logits(out, torch.ones(8, 3), reduction="sum"), "sum", math.nan,
     math.nan),
    (lambda out: out.square().mean(), "mean", 24, math.nan),
    (lambda out: out.square().sum(1).mean(), "mean", 8, math.nan),
    (lambda out: out.square().sum(), "sum", 8, math.nan),  # a .sum() over 8 leading rows
    (lambda out: 0.5 * out.square().sum(), "sum", 8, math.nan),
    (lambda out: F.cross_entropy(out, Y, reduction="none").sum(), "sum", 8, math.nan),
    (lambda out: F.cross_entropy(out, Y, reduction="none").sum() / 8, "mean", 8, math.nan),
    (lambda out: F.cross_entropy(out, Y).sum(), "mean", 8, math.nan),  # the sum of one mean is the mean
    (lambda out: F.cross_entropy(out, Y).mean(), "mean", 8, math.nan),  # so is its mean
    (lambda out: (F.cross_entropy(out, Y) + out.square().sum()).mean(), "AddBackward0", math.nan, 8),
    (lambda out: F.cross_entropy(out, Y) / 1, "mean", 8, math.nan),  # Lightning's division by accumulate_grad_batches
    (lambda out: F.cross_entropy(out, Y) / 2, "mean", 8, math.nan),  # a mean of halved terms
    (lambda out: F.cross_entropy(out, Y) * torch.tensor(3.0), "mean", 8, math.nan),
    (lambda out: F.cross_entropy(out, Y) + 0.1 * out.square().sum(), "AddBackward0", math.nan, 8),
    (lambda out: torch.stack([F.cross_entropy(out, Y), out.square().sum()]).sum(), "a .sum() over a stack of values",
     math.nan, math.nan),
    (lambda out: out.square().sum().sqrt(), "SqrtBackward0", math.nan, math.nan),
    # each row's loss is already its mean over the 3 classes: torch's mean is over the 8 rows (24 before session 56)
    (lambda out: F.multi_margin_loss(out, Y), "mean", 8, math.nan),
    (lambda out: F.multilabel_margin_loss(out, torch.stack([Y, torch.full_like(Y, -1), Y], 1)), "mean", 8, math.nan),
    (lambda out: F.multi_margin_loss(out[0], Y[0]), "mean", 1, math.nan),
    (lambda out: F.soft_margin_loss(out, torch.ones(8, 3)), "mean", 24, math.nan),  # a mean over the values
])
def test_loss_reduction_is_read_from_the_loss(loss_fn, kind, terms, mean_inside):
    found = loss_reduction_of(loss_fn(mlp()(X)))
    assert found.kind == kind
    assert found.terms == pytest.approx(terms, nan_ok=True)
    assert found.mean_inside == pytest.approx(mean_inside, nan_ok=True)


@pytest.mark.parametrize("reduce", [torch.sum, torch.mean])
def test_a_one_element_sum_or_mean_of_an_unread_loss_is_the_loss_of_a_batch_of_one_row_only(reduce):
    """The per-example loss of a batch of one row, summed or averaged, is L_n; the same reduction of anything
    else that has one element (loss.clamp(max=50).sum(), losses[:1].mean() of a larger batch) is refused, even
    when the closure also called the model on one row."""
    per_example = reduce(F.cross_entropy(mlp()(X[:1]), Y[:1], reduction="none"))
    assert loss_scale(loss_reduction_of(per_example), "auto", None, frozenset({1})) == 1.0
    for loss, operation in ((per_example, "NllLossBackward0"),
                            (reduce(F.cross_entropy(mlp()(X), Y).clamp(max=50)), "ClampBackward1"),
                            (reduce(F.cross_entropy(mlp()(X), Y, reduction="none")[:1]), "SliceBackward0")):
        for rows in ({8}, {8, 1}):
            with pytest.raises(ValueError, match=f"its last operation: {operation}"):
                loss_scale(loss_reduction_of(loss), "auto", None, frozenset(rows))


# ---------------------------------------------------------------------------------------------------------
# The step of a mean, scaled or summed loss is the summed loss's
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("detach", [False, True])
def test_a_mean_loss_takes_the_same_step_as_the_summed_loss(family, detach):
    """auto (the default): F.cross_entropy's mean, weighted or not, is rescaled to the summed NLL, also when the
    closure returns a detached copy of the loss (as Lightning's does)."""
    snapshots = []
    for loss_fn in (lambda m: F.cross_entropy(m(X), Y, reduction="sum"), lambda m: F.cross_entropy(m(X), Y),
                    lambda m: F.cross_entropy(m(X), Y, weight=WEIGHT) * 0 + F.cross_entropy(m(X), Y)):
        model = mlp(seed=0)
        opt = FOOVB(model, family, 4, seed=3)
        try:
            opt.step(_closure(model, loss_fn, detach))
        except ValueError as error:  # the third adds means over different terms: auto cannot read it
            assert "cannot be read" in str(error) and "step(closure, batch_size=8)" in str(error)
            assert all_equal(params_snapshot(model), params_snapshot(mlp(seed=0)))  # nothing changed
            continue
        snapshots.append(posterior_snapshot(opt))
    assert len(snapshots) == 2
    for got, want in zip(snapshots[1], snapshots[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # the weighted mean is rescaled by its total weight: the step of the weighted summed loss
    steps = []
    for reduction in ("sum", "mean"):
        model = mlp(seed=0)
        opt = FOOVB(model, family, 4, seed=3)
        opt.step(_closure(model, lambda m, r=reduction: F.cross_entropy(m(X), Y, weight=WEIGHT, reduction=r)))
        steps.append(posterior_snapshot(opt))
    for got, want in zip(steps[1], steps[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss_fn", [
    lambda out, reduction: F.multi_margin_loss(out, Y, reduction=reduction),
    lambda out, reduction: F.multilabel_margin_loss(out, torch.stack([Y, torch.full_like(Y, -1), Y], 1),
                                                    reduction=reduction),
])
def test_margin_losses_mean_takes_the_summed_step(loss_fn):
    """A user's trial (session 56): F.multi_margin_loss's and F.multilabel_margin_loss's mean was read as a mean over
    the rows' 24 values, while torch averages over the 8 rows (each row's loss is its mean over the classes), so the
    likelihood was 3 times too strong, silently, and batch_size=8 was refused. Now the mean, the sum and the mean with
    batch_size=8 take one step."""
    steps = []
    for reduction, batch_size in (("sum", None), ("mean", None), ("mean", 8)):
        model = mlp(seed=0)
        opt = FOOVB(model, "diagonal", 4, seed=3, secant_check=False)
        opt.step(_closure(model, lambda m, r=reduction: loss_fn(m(X), r)), batch_size=batch_size)
        steps.append(posterior_snapshot(opt))
    for other in steps[1:]:
        for got, want in zip(other, steps[0], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_ctc_losss_mean_is_refused_and_its_sum_is_taken():
    """F.ctc_loss's mean divides each sequence's loss by its target length before averaging: the batch size times it
    is no likelihood (it was taken as one, about the target length too weak, silently). Refused, with or without a
    batch_size, naming reduction='sum'; the sum trains."""
    steps, lengths = 5, torch.tensor([1, 2, 3, 1, 2, 3, 1, 2])
    targets = torch.randint(1, 3, (8, 3), generator=torch.Generator().manual_seed(0))

    def ctc(out: torch.Tensor, reduction: str, zero_infinity: bool = False) -> torch.Tensor:
        log_probs = F.log_softmax(out.repeat(1, steps).view(8, steps, 3), -1).transpose(0, 1)
        return F.ctc_loss(log_probs, targets, torch.full((8,), steps), lengths, reduction=reduction,
                          zero_infinity=zero_infinity)

    for batch_size, zero_infinity in ((None, False), (8, False), (None, True)):  # nn.CTCLoss(zero_infinity=True)
        model = mlp(seed=0)
        opt = FOOVB(model, "diagonal", 4, seed=3)
        with pytest.raises(ValueError, match="ctc_loss's reduction='mean'.* use reduction='sum'"):
            opt.step(_closure(model, lambda m, z=zero_infinity: ctc(m(X), "mean", z)), batch_size=batch_size)
        assert all_equal(params_snapshot(model), params_snapshot(mlp(seed=0)))
    model = mlp(seed=0)
    FOOVB(model, "diagonal", 4, seed=3).step(_closure(model, lambda m: ctc(m(X), "sum")))
    assert not all_equal(params_snapshot(model), params_snapshot(mlp(seed=0)))


def test_the_batched_path_reads_the_reduction_too():
    """step_batched's loss_fn sees K stacked batches: a mean over all their elements (MSE over 3 outputs) is
    rescaled by K rows outputs, the same step as the summed loss (in float64: the two losses' gradients differ by
    float32's rounding, which the step prior's wide first step carries to 1e-5)."""
    targets = torch.randn(8, 3, dtype=torch.float64)
    snapshots = []
    for reduction in ("sum", "mean"):
        model = mlp(seed=0).double()
        opt = FOOVB(model, "kronecker", 4, seed=3)
        opt.step_batched(X.double(), targets, lambda out, t, r=reduction: F.mse_loss(out, t, reduction=r))
        snapshots.append(posterior_snapshot(opt))
    for got, want in zip(snapshots[1], snapshots[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


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


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("options", [{"weight": WEIGHT}, {"ignore_index": 1}, {"weight": WEIGHT, "ignore_index": 1}])
def test_label_smoothing_with_class_weights_or_ignored_targets_is_the_mean_over_their_total(family, options):
    """torch divides such a loss by the targets' total weight (or the count of those not ignored), its smoothing
    term too: the step of reduction="sum". It was refused as a mean plus something else, with the advice
    batch_size=rows, which was accepted and gave a likelihood rows / total times too strong."""
    def smoothed(reduction):
        return lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1, reduction=reduction, **options)

    assert_same_posterior(one_step(smoothed("mean"), family), one_step(smoothed("sum"), family))
    if "ignore_index" not in options:  # a sum over a weight's rows divided by the same total: a regulariser
        model = mlp(seed=0)
        assert model[0].weight.shape[0] != len(Y)
        with pytest.raises(ValueError, match="adds a mean over .* terms to something else"):
            FOOVB(model, family, 4, seed=3).step(closure_of(model, lambda out, y: F.cross_entropy(
                out, y, weight=WEIGHT) + model[0].weight.square().sum() / WEIGHT[y].sum()))


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


def _step_on(loss_fn, x, y, batch_size=None, **options):
    """The diagonal optimizer after one step of loss_fn(model(x), y) on mlp(0) (K = 4, seed 3)."""
    model = mlp(seed=0)
    opt = FOOVB(model, "diagonal", 4, seed=3, **options)
    opt.step(closure_of(model, loss_fn, x, y), batch_size=batch_size)
    return opt


def test_weighted_smoothing_on_flattened_tokens_or_one_row_and_masked_means_take_the_summed_step():
    """The review's cases: label smoothing with ignored targets over per-token logits flattened to (rows x tokens,
    classes) (the smoothing's sum runs over 4 times the input's rows); weighted label smoothing on a batch of one
    row (the last batch of an epoch), read as a mean over the target's weight, not over 1 row; a loss function's
    sum divided by the count kept, with that count as batch_size (it was refused as "a sum"); a mean with float
    weights whose total is 8 up to rounding, with batch_size=8 (it was refused by an exact comparison)."""
    tokens, ignored = X.reshape(2, 4, 4), Y.clone()
    ignored[[1, 6]] = -100

    def flat(reduction):
        return lambda out, y: F.cross_entropy(out.reshape(-1, 3), y, ignore_index=-100, label_smoothing=0.1,
                                              reduction=reduction)

    assert_same_posterior(_step_on(flat("mean"), tokens, ignored),
                          _step_on(flat("sum"), tokens, ignored, loss_reduction="sum"))

    def weighted(reduction):
        return lambda out, y: F.cross_entropy(out, y, weight=WEIGHT, label_smoothing=0.1, reduction=reduction)

    assert_same_posterior(_step_on(weighted("mean"), X[:1], Y[:1]), _step_on(weighted("sum"), X[:1], Y[:1]))

    def counted(out, y):
        return F.cross_entropy(out, y, ignore_index=-100, reduction="sum") / (y != -100).sum()

    assert_same_posterior(_step_on(counted, X, ignored, batch_size=6),
                          _step_on(lambda out, y: F.cross_entropy(out, y, ignore_index=-100, reduction="sum"), X,
                                   ignored))
    importance = torch.full((8,), 0.1) / 0.1  # 1.0000000 each, in float32: sums to 8 up to rounding
    _step_on(lambda out, y: (importance * F.cross_entropy(out, y, reduction="none")).sum() / importance.sum(), X, Y,
             batch_size=8)


def test_micro_batches_of_unequal_means_divided_by_their_number_name_reduction_sum():
    """(loss / 3).backward() over micro-batches of 3, 3 and 2 rows: no one batch_size gives the summed step (it
    was advised 'batch_size=2 or 3')."""
    model = mlp(seed=0)

    def closure():
        for start, stop in ((0, 3), (3, 6), (6, 8)):
            (F.cross_entropy(model(X[start:stop]), Y[start:stop]) / 3).backward()
        return torch.tensor(0.0)

    with pytest.raises(ValueError, match=r"backward\(\) 3 times, each on 0.333333 times a mean, over 3, 3, 2 terms: "
                                         r".*No one batch_size .* reduction='sum' for each micro-batch"):
        FOOVB(model, "diagonal", 4, seed=3).step(closure)


def test_micro_batch_means_divided_by_their_number_name_the_whole_batch_first():
    """The common recipe `(loss / k).backward()` per micro-batch: refused (the 1/k could be each example's), naming
    the whole batch's k n rows first, the fix that gives the one-batch step, and the micro-batch's n second (the
    advice used to name n alone: a step with a likelihood k times too weak)."""
    def divided(model):
        def closure():
            for start in (0, 2, 4, 6):
                loss = F.cross_entropy(model(X[start:start + 2]), Y[start:start + 2]) / 4
                loss.backward()
            return loss
        return closure

    model = mlp(seed=0)
    opt = FOOVB(model, "diagonal", 4, seed=3)
    with pytest.raises(ValueError, match=r"backward\(\) 4 times, each on 0.25 times a mean over 2 terms.*The first: "
                                         r"step\(closure, batch_size=8\) \(the whole batch: 4 x 2\).*the second: "
                                         r"step\(closure, batch_size=2\)$"):
        opt.step(divided(model))
    model = mlp(seed=0)
    opt = FOOVB(model, "diagonal", 4, seed=3)
    opt.step(divided(model), batch_size=8)
    assert_same_posterior(opt, one_step(summed_ce, "diagonal"))


# ---------------------------------------------------------------------------------------------------------
# What cannot be read is refused, naming its fix
# ---------------------------------------------------------------------------------------------------------
def test_declared_reductions_that_contradict_the_loss_are_errors():
    model = mlp()
    with pytest.raises(ValueError, match="loss_reduction='sum' .* but it is a mean over 8 terms: use reduction='sum'"):
        FOOVB(model, loss_reduction="sum").step(_closure(model, lambda m: F.cross_entropy(m(X), Y)))
    # a mean plus a regulariser declared a sum (what the error of 1.0 suggested): refused, with the one right fix
    with pytest.raises(ValueError, match=r"adds other terms to a mean over 8 terms .*: keep loss_reduction='auto' "
                                         r"and call step\(closure, batch_size=8\)"):
        FOOVB(model, loss_reduction="sum").step(
            _closure(model, lambda m: F.cross_entropy(m(X), Y) + 1e-3 * m[0].weight.square().sum()))
    with pytest.raises(ValueError, match="says the loss is a mean, but it is a sum"):
        FOOVB(model, loss_reduction="mean").step(
            _closure(model, lambda m: F.cross_entropy(m(X), Y, reduction="sum")), batch_size=8)
    # a regularised mean with its batch size declared: the step of the regularised sum
    snapshots = []
    for reduction, batch_size in (("sum", None), ("mean", 8)):
        model = mlp(seed=0)
        opt = FOOVB(model, "diagonal", 4, loss_reduction=reduction, seed=1)
        scale = 1.0 if reduction == "sum" else 1.0 / 8
        opt.step(_closure(model, lambda m, s=scale: s * (F.cross_entropy(m(X), Y, reduction="sum")
                                                         + m[0].weight.square().sum())), batch_size=batch_size)
        snapshots.append(posterior_snapshot(opt))
    for got, want in zip(snapshots[1], snapshots[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


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


def test_two_backward_calls_with_an_unreadable_loss_are_refused_naming_the_batch_rows():
    """A cross-entropy mean and 0.01 x a mean over the (rows x outputs) activations, backward() on each: the advice
    counted the activations as rows (batch_size=rows x outputs), and following it multiplied the cross-entropy's
    gradients by the outputs too. The refusal names the batch's rows; following it trains, and the old advice is
    refused (a batch_size that contradicts the cross-entropy's readable mean over 64 rows)."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 20), torch.randint(0, 2, (64,))

    def train(batch_size: int | None) -> float:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        opt = FOOVB(model, "diagonal", 4, seed=0, secant_check=False, curvature_damping=False)  # steps that scale

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
    assert math.isfinite(train(64))
    # the old advice's batch_size (it inflated the step 8-fold) contradicts the cross-entropy's readable mean
    with pytest.raises(ValueError, match=r"batch_size=512\) says the loss is a mean over 512 terms, but it is a mean "
                                         r"over 64"):
        train(512)


def test_step_batched_names_its_own_fix_for_a_regularised_loss():
    model = mlp()
    opt = FOOVB(model, "kronecker", 4)
    with pytest.raises(ValueError, match=r"step_batched: loss_fn must return a mean over the 4 x 8 stacked rows") \
            as error:
        opt.step_batched(X, Y, lambda out, y: F.cross_entropy(out, y) + 1e-3 * model[0].weight.square().sum())
    assert "batch_size=32" not in str(error.value).split("What was read")[0]


# ---------------------------------------------------------------------------------------------------------
# The loss spy's module hooks
# ---------------------------------------------------------------------------------------------------------
def test_the_loss_spys_module_hooks_live_only_as_long_as_an_optimizer():
    """The global module hooks that read the batch's rows are registered once for all live optimizers (not per step:
    torch.compile guards on them) and removed with the last one; the mean-loss scale is still read."""
    import gc

    from torch.nn.modules import module as torch_module

    from foovb import reduction

    def our_hooks():
        return (sum(h is reduction._enter_module for h in torch_module._global_forward_pre_hooks.values())
                + sum(h is reduction._leave_module for h in torch_module._global_forward_hooks.values()))

    gc.collect()
    held = reduction._HOOK_HOLDERS[0]  # optimizers of other tests that are still alive
    model = nn.Linear(3, 2)
    first, second = FOOVB(model, "diagonal", 2, seed=0), FOOVB(nn.Linear(3, 2), "diagonal", 2, seed=0)
    assert reduction._HOOK_HOLDERS[0] == held + 2 and our_hooks() == 2
    x, y = torch.randn(8, 3), torch.randint(2, (8,))

    def closure():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    first.step(closure)
    first.step(closure)
    assert our_hooks() == 2 and first._pending is None
    del first
    gc.collect()
    assert reduction._HOOK_HOLDERS[0] == held + 1 and our_hooks() == 2  # the second optimizer still holds them
    del second
    gc.collect()
    assert reduction._HOOK_HOLDERS[0] == held and our_hooks() == (2 if held else 0)


# ---------------------------------------------------------------------------------------------------------
# Advice that a user follows (a helper's trial, session 50: following the old advice changed the step silently)
# ---------------------------------------------------------------------------------------------------------
def test_a_batch_size_that_contradicts_a_readable_mean_is_refused():
    """batch_size=640 for a cross-entropy mean over 8 rows inflated every step 80-fold without a word; the mean's
    own terms are read, so a batch_size that says otherwise is an error. The same number is accepted."""
    model = mlp()
    opt = FOOVB(model, "diagonal", 4)
    with pytest.raises(ValueError, match=r"batch_size=640\) says the loss is a mean over 640 terms, but it is a "
                                         r"mean over 8 .*drop batch_size"):
        opt.step(closure_of(model, F.cross_entropy), batch_size=640)
    with pytest.raises(ValueError, match=r"mean over 24 .*drop batch_size"):  # F.mse_loss over 3 outputs a row
        opt.step(closure_of(model, lambda out, y: F.mse_loss(out, torch.zeros(8, 3))), batch_size=8)
    opt.step(closure_of(model, F.cross_entropy), batch_size=8)
    assert opt.steps_taken == 1


def test_a_regularised_mean_over_several_values_per_row_names_both_sizes():
    """F.mse_loss over 3 outputs per row plus a regulariser: a plain F.mse_loss is multiplied by its 24 values, so
    the advice names 24 beside the 8 rows, and following it gives the step of the plain loss plus the
    regulariser's 24-fold gradient (the helper's trial took batch_size=8, a likelihood 3x weaker, from the old
    advice)."""
    model = mlp()
    target = torch.zeros(8, 3)

    def regularised(out, y):
        return F.mse_loss(out, target) + 1e-3 * model[0].weight.square().sum()

    with pytest.raises(ValueError, match=r"batch_size=N\) to say it is a mean over N values.*8 if one per row of "
                                         r"the batch.*24 if the mean over 24 values read here is the likelihood's"):
        FOOVB(model, "diagonal", 4).step(closure_of(model, regularised))
    with pytest.raises(ValueError, match=r"batch_size=8\) to say it is a mean over the batch"):  # one value a row
        FOOVB(model, "diagonal", 4).step(closure_of(
            model, lambda out, y: F.cross_entropy(out, y) + 1e-3 * model[0].weight.square().sum()))


def test_a_batch_size_larger_than_anything_the_loss_counts_is_refused():
    """A regularised mean took any batch_size: a full batch's count kept for a smaller last batch, or a dataset size
    (a likelihood 7,500 times too strong: a user's trial), in silence. A count above every count the loss shows (the
    values its mean averages, that over the loss's constant factor, the input's rows) is refused now; smaller ones
    stay taken (the regulariser's own mean, written first, or a multi-task sum, cannot be told from the
    likelihood's: a stricter check of session 57 refused such correct losses)."""
    model = mlp()

    def regularised(out, y):
        return F.cross_entropy(out, y) + 1e-3 * model[0].weight.square().sum()

    for wrong in (9, 64, 60000):
        with pytest.raises(ValueError, match=rf"^step\(closure, batch_size={wrong}\) says the loss is a mean over "
                                             rf"{wrong} terms, more than it can count: its mean averages 8 values; the "
                                             r"model's input has 8 rows\. A count kept from a larger batch"):
            FOOVB(model, "diagonal", 4).step(closure_of(model, regularised), batch_size=wrong)
    target = torch.zeros(8, 3)
    accepted = [  # (loss, count): taken as before
        (regularised, 8),
        (lambda out, y: 1e-3 * model[0].weight.square().mean() + F.cross_entropy(out, y), 8),  # its mean first
        (lambda out, y: F.mse_loss(out, target) + 1e-3 * model[0].weight.square().sum(), 24),  # rows x outputs
        (lambda out, y: F.mse_loss(out, target) + 1e-3 * model[0].weight.square().sum(), 8),  # or the rows
        (lambda out, y: regularised(out, y) / 2, 16),  # 2 micro-batches' whole count (or a Gaussian's 1/2: 8)
    ]
    for loss_fn, count in accepted:
        opt = FOOVB(model, "diagonal", 4)
        opt.step(closure_of(model, loss_fn), batch_size=count)
        assert opt.steps_taken == 1
    with pytest.raises(ValueError, match=r"batch_size=25\) .* more than it can count: its mean averages 24 values"):
        FOOVB(model, "diagonal", 4).step(closure_of(
            model, lambda out, y: F.mse_loss(out, target) + 1e-3 * model[0].weight.square().sum()), batch_size=25)


def test_per_example_losses_are_refused_with_what_to_return():
    model = mlp()
    opt = FOOVB(model, "diagonal", 4)

    def returns_the_vector():
        losses = F.cross_entropy(model(X), Y, reduction="none")
        losses.sum().backward()
        return losses

    with pytest.raises(ValueError, match=r"scalar loss it called backward\(\) on, not a tensor of shape \(8,\)"):
        opt.step(returns_the_vector)
    with pytest.raises(ValueError, match=r"4 x 8 stacked rows.*not a scalar \(a loss function's reduction='none'\?\)"
                                         r": return its mean or its sum") as error:
        opt.step_batched(X, Y, lambda out, y: F.cross_entropy(out, y, reduction="none"))
    assert "batch_size=32" not in str(error.value)  # the stacked rows are no batch_size for step(closure)


def test_an_unreadable_loss_names_the_summed_reduction_too():
    model = mlp()
    with pytest.raises(ValueError, match=r"ClampBackward.*batch_size=8\) if the loss is a mean.*"
                                         r"loss_reduction='sum'\) if it is the batch's summed"):
        FOOVB(model, "diagonal", 4).step(closure_of(model, lambda out, y: F.cross_entropy(out, y).clamp(max=50)))


def test_a_masked_mean_is_named_and_its_count_gives_the_summed_steps():
    """(losses * mask).sum() / mask.sum(): a sum over every term divided by the count of those kept. Its advice was
    loss_reduction='sum' first (a likelihood mask.sum() times too weak); the count is the fix, named first."""
    mask = torch.tensor([1.0, 1, 1, 0, 1, 0, 1, 1])  # 6 of the 8 rows count

    def masked(out, y):
        return (F.cross_entropy(out, y, reduction="none") * mask).sum() / mask.sum()

    model = mlp()
    with pytest.raises(ValueError, match=r"^the loss is 0\.166667 times a sum over 8 terms: for a mean over 6 of the 8 "
                                         r"values summed \(a masked mean, \.sum\(\) / mask\.sum\(\)\), give that count "
                                         r"at every step: step\(closure, batch_size=6\)\. Else"):
        FOOVB(model, "diagonal", 4).step(closure_of(model, masked))
    tokens = mask.reshape(2, 4)  # per-token losses of 2 rows of 4 tokens: the sum runs over 2 rows, the count is 6
    with pytest.raises(ValueError, match=r"for a mean over 6 of the 8 values summed"):
        FOOVB(model, "diagonal", 4).step(closure_of(model, lambda out, y: (
            F.cross_entropy(out, y, reduction="none").reshape(2, 4) * tokens).sum() / tokens.sum()))
    snapshots = []
    for loss_fn, batch_size in ((lambda out, y: (F.cross_entropy(out, y, reduction="none") * mask).sum(), None),
                                (masked, int(mask.sum()))):
        model = mlp()
        opt = FOOVB(model, "diagonal", 4, seed=3, loss_reduction="sum" if batch_size is None else "auto")
        opt.step(closure_of(model, loss_fn), batch_size=batch_size)
        snapshots.append(posterior_snapshot(opt))
    for got, want in zip(snapshots[1], snapshots[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # a batch_size other than the count: the rows (it was called a plain sum), or rows x tokens (it was taken: a
    # likelihood 8 / 6 times too strong)
    for loss_fn, wrong in ((masked, 8), (lambda out, y: (F.cross_entropy(out, y, reduction="none").reshape(2, 4)
                                                          * tokens).sum() / tokens.sum(), 8)):
        model = mlp()
        with pytest.raises(ValueError, match=rf"batch_size={wrong}\) says the loss is a mean over {wrong} terms, but "
                                             r"it is a \.sum\(\) over \d rows divided by 6: .* takes batch_size=6"):
            FOOVB(model, "diagonal", 4).step(closure_of(model, loss_fn), batch_size=wrong)


def test_a_weighted_mean_by_hand_is_named_and_its_fix_is_torchs_weighted_mean():
    """(w * losses).sum() / w.sum() with a total weight that is no count: the error offered loss_reduction='sum'
    first (a likelihood 1 / w.sum() times too weak, a user's trial) and never the weighted mean. It names it now, and
    its fix, the weighted sum, takes the step of F.cross_entropy(..., weight=) (read as the weighted sum too)."""
    class_weights = torch.tensor([0.3, 1.1, 2.0])
    row_weights = class_weights[Y]
    model = mlp()
    with pytest.raises(ValueError, match=r"; a weighted mean \(\(w \* losses\)\.sum\(\) / w\.sum\(\)\): drop the "
                                         r"division, and the step reads the weighted sum as the batch's summed"):
        FOOVB(model, "diagonal", 4).step(closure_of(model, lambda out, y: (
            row_weights * F.cross_entropy(out, y, reduction="none")).sum() / row_weights.sum()))
    assert_same_posterior(one_step(lambda out, y: F.cross_entropy(out, y, weight=class_weights)),
                          one_step(lambda out, y: (row_weights * F.cross_entropy(out, y, reduction="none")).sum()))


def test_a_sum_over_rows_and_tokens_divided_by_their_number_is_their_mean():
    """A (rows, tokens) per-token loss summed and divided by rows x tokens (a masked mean with nothing masked) was
    refused as "0.125 times a sum over 2 terms"; it is the mean over the 8 values, as F.mse_loss over them is."""
    def per_token(out, y):
        losses = F.cross_entropy(out, y, reduction="none").reshape(2, 4)
        return losses.sum() / torch.ones(2, 4).sum()

    snapshots = []
    for loss_fn in (per_token, F.cross_entropy):
        model = mlp()
        opt = FOOVB(model, "diagonal", 4, seed=3)
        opt.step(closure_of(model, loss_fn))
        snapshots.append(posterior_snapshot(opt))
    for got, want in zip(snapshots[1], snapshots[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("setting", [{}, {"loss_reduction": "sum"}, {"loss_reduction": "mean"}, {"batch_size": 8}])
def test_a_loss_scaled_by_a_power_of_two_names_the_grad_scaler_whatever_else_is_said(setting):
    """Every other fix the messages named (batch_size=n, loss_reduction='sum') ran with a likelihood 65,536 times
    too strong."""
    model = mlp()
    batch_size = setting.pop("batch_size", None)
    for loss_fn in (lambda out, y: F.cross_entropy(out, y) * 65536.0,
                    lambda out, y: F.cross_entropy(out, y, reduction="sum") * 65536.0):
        with pytest.raises(ValueError, match=r"65536 times a (mean|sum): a loss scaled by torch\.amp\.GradScaler"):
            FOOVB(model, "diagonal", 4, **setting).step(closure_of(model, loss_fn), batch_size=batch_size)
    with pytest.raises(ValueError, match=r"1000 times a mean over 8 terms\. Whether") as error:  # not a power of 2
        FOOVB(model, "diagonal", 4).step(closure_of(model, lambda out, y: F.cross_entropy(out, y) * 1000.0))
    assert "GradScaler" not in str(error.value)
