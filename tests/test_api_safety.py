"""What a user combining FOOVB with standard PyTorch tools gets: the loss scale read from the loss (mean or sum),
presets, a pretrained model kept, gradient accumulation refused, `lr` for schedulers, booleans, batch norm."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import FAMILIES, all_equal, mlp, mlp_batch, params_snapshot, posterior_snapshot
from torch import nn

from foovb import FOOVB
from foovb.optimizer import PRESETS, loss_reduction_of
from foovb.reduction import loss_scale


def _closure(model, loss_fn, detach=False):
    def closure():
        loss = loss_fn(model)
        loss.backward()
        return loss.detach().clone() if detach else loss  # Lightning's closure returns a detached copy

    return closure


X, Y = mlp_batch(rows=8)
WEIGHT = torch.tensor([0.5, 1.0, 2.0])


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


def test_the_batched_path_reads_the_reduction_too():
    """step_batched's loss_fn sees K stacked batches: a mean over all their elements (MSE over 3 outputs) is
    rescaled by K rows outputs, the same step as the summed loss."""
    targets = torch.randn(8, 3)
    snapshots = []
    for reduction in ("sum", "mean"):
        model = mlp(seed=0)
        opt = FOOVB(model, "kronecker", 4, seed=3)
        opt.step_batched(X, targets, lambda out, t, r=reduction: F.mse_loss(out, t, reduction=r))
        snapshots.append(posterior_snapshot(opt))
    for got, want in zip(snapshots[1], snapshots[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


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


@pytest.mark.parametrize("family", FAMILIES)
def test_construction_keeps_a_pretrained_model_by_default(family):
    model = mlp(seed=5)
    before = params_snapshot(model)
    opt = FOOVB(model, family)
    assert all_equal(params_snapshot(model), before)
    assert all_equal([opt.posterior(p).mean for p in model.parameters()], before)
    FOOVB(model, family, preset="paper", seed=0)  # the paper's initialisation is one argument away
    assert not all_equal(params_snapshot(model), before)


@pytest.mark.parametrize("family", FAMILIES)
def test_presets_fill_what_is_not_given(family):
    opt = FOOVB(mlp(), family)
    recommended = PRESETS["recommended"][family]
    group = opt.param_groups[0]
    assert (group["lr"], group["cov_step"], group["antithetic"]) == (
        recommended["mean_step"], recommended["cov_step"], recommended["antithetic"])
    assert group["antithetic"] and group["implicit_mean"]  # measured recipes, not the paper's
    paper = FOOVB(mlp(), family, preset="paper", cov_step=0.5).param_groups[0]
    assert (paper["lr"], paper["cov_step"], paper["antithetic"], paper["std_growth"], paper["implicit_mean"]) == (
        1.0, 0.5, False, "paper", False)


def test_gradient_accumulation_is_refused_and_a_step_leaves_no_gradient():
    model = mlp()
    opt = FOOVB(model)
    closure = _closure(model, lambda m: F.cross_entropy(m(X), Y))
    opt.step(closure)
    assert all(p.grad is None for p in model.parameters())  # so the next step sees no stale gradients
    F.cross_entropy(model(X), Y).backward()  # a batch accumulated outside the step
    before = posterior_snapshot(opt)
    with pytest.raises(RuntimeError, match="accumulate_grad_batches"):
        opt.step(closure)
    with pytest.raises(RuntimeError, match="gradient accumulation"):
        opt.step_batched(X, Y)
    assert all_equal(posterior_snapshot(opt), before)
    opt.zero_grad(set_to_none=False)  # zero gradients are no accumulation
    opt.step(closure)


def test_lr_schedulers_scale_the_mean_step():
    """param_groups' "lr" is eta: a scheduler that halves it gives the step of an optimizer built with half."""
    models = [mlp(seed=0), mlp(seed=0)]
    opts = [FOOVB(models[0], "diagonal", 4, seed=2), FOOVB(models[1], "diagonal", 4, mean_step=0.35, seed=2)]
    scheduler = torch.optim.lr_scheduler.LambdaLR(opts[0], lambda epoch: 0.5)  # lr = 0.7 * 0.5 from the start
    assert opts[0].mean_step == pytest.approx(0.35) and scheduler.get_last_lr() == [pytest.approx(0.35)]
    for model, opt in zip(models, opts, strict=True):
        opt.step(_closure(model, lambda m: F.cross_entropy(m(X), Y)))
    assert all_equal(posterior_snapshot(opts[0]), posterior_snapshot(opts[1]))
    unscheduled = FOOVB(mlp(seed=0), "diagonal", 4, seed=2)
    unscheduled.step(_closure(unscheduled.model, lambda m: F.cross_entropy(m(X), Y)))
    assert not all_equal(posterior_snapshot(unscheduled), posterior_snapshot(opts[1]))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_warm_up_from_lr_0_keeps_the_mean_and_still_updates_the_covariance(family):
    """eta = 0 is a step size (transformers' linear warm-up, LambdaLR(i / w), starts there): the mean stays, the
    covariance update of Lemmas 1-2 runs as with any eta (it does not read eta), and the schedule carries on."""
    model, reference = mlp(seed=0), mlp(seed=0)
    opt, ref = FOOVB(model, family, 4, seed=2), FOOVB(reference, family, 4, seed=2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: i / 4)
    means = [p.detach().clone() for p in model.parameters()]
    opt.step(_closure(model, lambda m: F.cross_entropy(m(X), Y)))
    ref.step(_closure(reference, lambda m: F.cross_entropy(m(X), Y)))
    assert all_equal([p.detach() for p in model.parameters()], means)  # eta = 0: the mean did not move
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):  # the covariance is eta's twin's
        torch.testing.assert_close(opt.posterior(p).std, ref.posterior(q).std, rtol=0, atol=0)
    fresh = mlp(seed=0)
    prior = FOOVB(fresh, family, 4, seed=2)
    assert not all_equal([opt.posterior(p).std for p in model.parameters()],
                         [prior.posterior(p).std for p in fresh.parameters()])  # it did update
    scheduler.step()
    opt.step(_closure(model, lambda m: F.cross_entropy(m(X), Y)))  # eta = 0.25 x the preset's: the mean moves
    assert not all_equal([p.detach() for p in model.parameters()], means)


def test_step_batched_is_an_optimizer_step_for_schedulers_and_step_hooks():
    """A scheduler after step_batched warns of no "lr_scheduler.step() before optimizer.step()", and the
    optimizer's step hooks run, as for step(closure)."""
    import warnings

    model = mlp(seed=0)
    opt = FOOVB(model, "diagonal", 2, seed=0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    calls = []
    opt.register_step_post_hook(lambda optimizer, args, kwargs: calls.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            opt.step_batched(X, Y)
            scheduler.step()
    assert calls == [1, 1] and opt.param_groups[0]["lr"] == pytest.approx(0.7 / 4)


def test_a_cosine_schedule_down_to_0_runs_and_a_negative_or_nan_lr_is_refused():
    model = mlp(seed=0)
    opt = FOOVB(model, "diagonal", 2, seed=0)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=2, eta_min=0.0)
    used = []
    for _ in range(3):  # the last step runs at lr 0
        used.append(opt.param_groups[0]["lr"])
        opt.step(_closure(model, lambda m: F.cross_entropy(m(X), Y)))
        scheduler.step()
    assert used == [0.7, pytest.approx(0.35), pytest.approx(0.0, abs=1e-12)]
    for bad in (-1e-3, math.nan, math.inf):
        opt.param_groups[0]["lr"] = bad
        with pytest.raises(ValueError, match=r"'lr'.*mean_step.*must be a finite number >= 0"):
            opt.step(_closure(model, lambda m: F.cross_entropy(m(X), Y)))
    with pytest.raises(ValueError, match="mean_step must be a finite number >= 0"):
        FOOVB(model, mean_step=-0.1)


def test_batch_norm_running_statistics_are_updated_once_with_the_samples_average():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))
    bn = model[1]
    opt = FOOVB(model, "diagonal", 4, seed=1, std_init=0.3)
    seen = []
    hook = model[0].register_forward_hook(lambda module, inputs, out: seen.append(out.detach().clone()))
    opt.step(_closure(model, lambda m: F.cross_entropy(m(X), Y)))
    hook.remove()
    assert len(seen) == 4
    momentum = bn.momentum
    batch_means = torch.stack([out.mean(0) for out in seen])
    batch_vars = torch.stack([out.var(0, unbiased=True) for out in seen])
    torch.testing.assert_close(bn.running_mean, momentum * batch_means.mean(0))  # from 0
    torch.testing.assert_close(bn.running_var, (1 - momentum) + momentum * batch_vars.mean(0))  # from 1
    assert int(bn.num_batches_tracked) == 1


def test_an_update_that_overflows_is_undone():
    """Finite statistics whose update overflows (the paper's sigma growth on a strongly concave loss, float32):
    FloatingPointError, and the posterior and the model are left as they were."""
    lin = nn.Linear(3, 1, bias=False)
    opt = FOOVB(lin, "diagonal", 2, preset="paper", std_init=1e3, loss_reduction="sum", seed=0)
    posterior, params = posterior_snapshot(opt), params_snapshot(lin)

    def concave():
        loss = -1e30 * lin.weight.square().sum()
        loss.backward()
        return loss

    with pytest.raises(FloatingPointError, match="overflowed"):
        opt.step(concave)
    assert all_equal(posterior_snapshot(opt), posterior) and all_equal(params_snapshot(lin), params)
    assert opt.steps_taken == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_an_update_that_raises_midway_changes_nothing(family):
    """Out of memory in the second layer's decomposition (or a LinAlgError, Ctrl-C): the first layer's update and
    the failing one's mean were kept, the mixed posterior loaded into the model, and a retry updated them twice."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    opt = FOOVB(model, family, 2, seed=0)
    posterior, params = posterior_snapshot(opt), params_snapshot(model)
    last = opt.blocks[-1]
    update = last.update

    def out_of_memory(stats, *args):
        update(stats, *args)  # its own state changed, then the failure
        raise torch.OutOfMemoryError("simulated: no memory for the workspace")

    last.update = out_of_memory
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))

    def closure():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    with pytest.raises(torch.OutOfMemoryError):
        opt.step(closure)
    assert all_equal(posterior_snapshot(opt), posterior) and all_equal(params_snapshot(model), params)
    assert opt.steps_taken == 0
    last.update = update
    opt.step(closure)  # the retry is one step
    assert opt.steps_taken == 1 and not all_equal(posterior_snapshot(opt), posterior)


@pytest.mark.parametrize("family", FAMILIES)
def test_your_own_loop_with_sampled_params_equals_step_with_a_closure(family):
    """IVON-style: K `sampled_params(train=True)` blocks, then step(), give step(closure)'s update and loss."""
    results = []
    for own_loop in (False, True):
        model = mlp(seed=0)
        opt = FOOVB(model, family, 4, seed=6)
        for _ in range(2):
            if own_loop:
                for _ in range(opt.mc_samples):
                    with opt.sampled_params(train=True):
                        F.cross_entropy(model(X), Y).backward()
                loss = opt.step()
            else:
                loss = opt.step(_closure(model, lambda m: F.cross_entropy(m(X), Y)))
        results.append((posterior_snapshot(opt), params_snapshot(model), loss))
    assert all_equal(results[0][0], results[1][0]) and all_equal(results[0][1], results[1][1])
    assert results[0][2] == pytest.approx(results[1][2])


def test_sampled_params_training_blocks_are_counted_and_a_failure_abandons_the_step():
    model = mlp(seed=0)
    opt = FOOVB(model, "diagonal", 2, seed=6)
    before = posterior_snapshot(opt)
    with pytest.raises(ValueError, match="or mc_samples `with optimizer.sampled_params"):
        opt.step()
    with opt.sampled_params(train=True):
        F.cross_entropy(model(X), Y).backward()
    with pytest.raises(RuntimeError, match="1 of 2 sampled_params"):  # with or without a closure
        opt.step(_closure(model, lambda m: F.cross_entropy(m(X), Y)))
    with opt.sampled_params(train=True):
        F.cross_entropy(model(X), Y).backward()
    with pytest.raises(RuntimeError, match="1 of 2 sampled_params"):
        opt.step()
    assert all_equal(posterior_snapshot(opt), before) and opt.steps_taken == 0
    for _ in range(2):  # all K blocks, then a closure that trains: refused, the blocks' step is kept
        with opt.sampled_params(train=True):
            F.cross_entropy(model(X), Y).backward()
    with pytest.raises(RuntimeError, match="the closure trained"):
        opt.step(_closure(model, lambda m: F.cross_entropy(m(X), Y)))
    assert all(p.grad is None for p in model.parameters())
    assert all_equal(posterior_snapshot(opt), before) and opt.steps_taken == 0
    hooks_ran = []
    opt.step(lambda: hooks_ran.append(True))  # a closure that does not train (Lightning's manual optimization)
    assert hooks_ran == [True] and opt.steps_taken == 1
    before = posterior_snapshot(opt)
    with pytest.raises(KeyError), opt.sampled_params(train=True):  # a failing block: the step is abandoned
        raise KeyError("data")
    assert all_equal(posterior_snapshot(opt), before)  # the model holds the mean again, nothing was updated
    assert all_equal([opt.posterior(p).mean for p in model.parameters()], params_snapshot(model))
    for _ in range(2):
        with opt.sampled_params(train=True):
            F.cross_entropy(model(X), Y).backward()
    with pytest.raises(RuntimeError, match="all 2 Monte Carlo samples"), opt.sampled_params(train=True):
        pass
    opt.step()
    assert opt.steps_taken == 2 and not all_equal(posterior_snapshot(opt), before)
    with pytest.raises(ValueError, match="seed is for inspection"), opt.sampled_params(train=True, seed=1):
        pass


@pytest.mark.parametrize("family", ["diagonal", "kronecker"])
def test_step_batched_evaluates_conv_models_one_sample_at_a_time_on_the_cpu(family, monkeypatch):
    """On the CPU the K samples of a Conv2d stacked (one grouped convolution) are slower than K convolutions
    (docs/performance.md): step_batched of a model with a Conv2d takes step(closure)'s route, with its update;
    the same model on another device (meta here, for a GPU) is stacked."""
    import foovb.engine as engine

    def cnn(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3))

    x, y = torch.randn(5, 1, 6, 6), torch.randint(3, (5,))
    batched, sequential = cnn(0), cnn(0)
    opts = [FOOVB(batched, family, 4, seed=1), FOOVB(sequential, family, 4, seed=1)]
    with monkeypatch.context() as patch:
        patch.setattr(engine, "SampledNetwork", None)  # the stacked evaluation is not used
        loss = opts[0].step_batched(x, y, F.cross_entropy)
    assert loss == pytest.approx(opts[1].step(_closure(sequential, lambda m: F.cross_entropy(m(x), y))))
    assert all_equal(posterior_snapshot(opts[0]), posterior_snapshot(opts[1]))
    assert engine.stacking_is_slower(opts[0].blocks)
    for block in opts[0].blocks:
        block.state["mean"] = block.state["mean"].to("meta")
    assert not engine.stacking_is_slower(opts[0].blocks)


def test_step_batched_evaluates_wide_layers_one_sample_at_a_time(monkeypatch):
    """A diagonal layer of WIDE_LAYER weights or more: step_batched takes step(closure)'s route (measured faster),
    with step(closure)'s update; the paper's MLP (78,400 weights in its widest layer) stays stacked."""
    import foovb.engine as optimizer_module  # where the stacked evaluation (SampledNetwork) is used

    def wide(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 400), nn.ReLU(), nn.Linear(400, 400), nn.ReLU(), nn.Linear(400, 3))

    assert 400 * 400 >= optimizer_module.WIDE_LAYER > 784 * 100
    batched, sequential = wide(0), wide(0)
    opts = [FOOVB(batched, "diagonal", 4, seed=1), FOOVB(sequential, "diagonal", 4, seed=1)]
    with monkeypatch.context() as patch:
        patch.setattr(optimizer_module, "SampledNetwork", None)  # the stacked evaluation is not used
        loss = opts[0].step_batched(X, Y, F.cross_entropy)
    assert loss == pytest.approx(opts[1].step(_closure(sequential, lambda m: F.cross_entropy(m(X), Y))))
    assert all_equal(posterior_snapshot(opts[0]), posterior_snapshot(opts[1]))
    narrow = FOOVB(mlp(), "diagonal", 4, seed=1)
    monkeypatch.setattr(optimizer_module, "SampledNetwork", None)
    with pytest.raises(TypeError):  # small layers are stacked (SampledNetwork is called)
        narrow.step_batched(X, Y)
    assert optimizer_module.stacking_is_slower(opts[0].blocks)
    for block in opts[0].blocks:  # the CPU measurement's rule: a posterior on another device (a GPU) is stacked
        block.state["mean"] = block.state["mean"].to("meta")
    assert not optimizer_module.stacking_is_slower(opts[0].blocks)
    noises = optimizer_module.draw_noise(opts[0].blocks, 7, range(4), antithetic=True)  # no generator on meta:
    for block in opts[0].blocks:  # the CPU's draws, moved to the posterior's device
        assert noises[block].device.type == "meta" and noises[block].shape == (4, *block.noise_shape)
