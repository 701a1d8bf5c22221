"""foovb.optimizer.FOOVB's API: construction (the presets and the paper's defaults, a pretrained model kept),
hyperparameter validation, what step and step_batched require and return, step hooks, and the step sizes in
param_groups that schedulers change (a warm-up from lr 0, a cosine schedule to 0). The update itself:
tests/test_posteriors.py; the sample loop: tests/test_engine.py; state dicts: tests/test_persistence.py."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    F64,
    FAMILIES,
    PAPER,
    all_equal,
    ce_closure,
    mlp,
    mlp_batch,
    params_snapshot,
    posterior_snapshot,
)
from conftest import model_closure as _closure
from conftest import take_steps as _steps
from torch import nn

from foovb import FOOVB
from foovb.optimizer import PRESETS

pytestmark = pytest.mark.usefixtures("single_thread")

X, Y = mlp_batch(rows=8)


# ---------------------------------------------------------------------------------------------------------
# Construction: presets, defaults, validation
# ---------------------------------------------------------------------------------------------------------
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


def test_defaults_are_the_papers_settings():
    """K = 10 Monte Carlo samples (paper, "Algorithms": "The $K=10$ MC samples", foo-vb.tex l. 376; appendix
    l. 861), sigma_init = 0.047 and alpha = 0.5 (appendix "Discrete permuted MNIST", l. 867-868)."""
    model = mlp()
    opt = FOOVB(model, "diagonal", seed=0, **PAPER)
    assert opt.posterior_family == "diagonal" and opt.mc_samples == 10
    group = opt.param_groups[0]
    assert (group["mc_samples"], group["std_init"], group["alpha"]) == (10, 0.047, 0.5)
    for p in model.parameters():
        assert torch.equal(opt.posterior(p).std, torch.full_like(p, 0.047))
    layer = nn.Linear(4, 3)
    std = FOOVB(layer, "kronecker", seed=0, **PAPER).posterior(layer.weight).std  # sqrt(2 (1 - alpha) / (n_in + 2))
    torch.testing.assert_close(std, torch.full_like(std, math.sqrt(2 * (1 - 0.5) / (4 + 2))))


BAD_KWARGS = [
    ("posterior", {"posterior": "gaussian"}),
    ("mc_samples", {"mc_samples": 0}),
    ("mc_samples", {"mc_samples": -1}),
    ("mc_samples", {"mc_samples": 2.5}),
    ("mc_samples", {"mc_samples": True}),
    ("std_init", {"std_init": 0.0}),
    ("std_init", {"std_init": -1.0}),
    ("std_init", {"std_init": float("nan")}),
    ("std_init", {"std_init": float("inf")}),
    ("alpha", {"alpha": 0.0}),
    ("alpha", {"alpha": 1.0}),
    ("alpha", {"alpha": float("nan")}),
    ("mean_step", {"mean_step": -0.5}),
    ("mean_step", {"mean_step": float("inf")}),
    ("cov_step", {"cov_step": 0.0}),
    ("cov_step", {"cov_step": float("nan")}),
    ("loss_reduction", {"loss_reduction": "avg"}),
    ("init", {"init": "xavier"}),
    ("max_full_params", {"posterior": "full", "max_full_params": 0}),
    ("antithetic", {"mc_samples": 3, "antithetic": True}),
    ("std_growth", {"std_growth": True}),
    ("cov_momentum", {"cov_momentum": -0.1}),
    ("cov_momentum", {"cov_momentum": 1.0}),
    ("cov_momentum", {"cov_momentum": float("nan")}),
    ("std_init", {"std_init": "0.1"}),
    ("std_init", {"std_init": 1e300}),
    ("max_full_params", {"posterior": "full", "max_full_params": float("nan")}),
    ("seed", {"seed": 1.5}),
    ("antithetic", {"antithetic": "false"}),  # a string is not a boolean (it would be truthy)
    ("antithetic", {"antithetic": 1}),
    ("preset", {"preset": "best"}),
    ("std_growth applies to the diagonal family only", {"posterior": "kronecker", "std_growth": "none"}),
    ("cov_momentum applies to the diagonal family only", {"posterior": "full", "cov_momentum": 0.5}),
    ("alpha applies to the kronecker family", {"posterior": "diagonal", "alpha": 0.3}),
    ("max_full_params applies to the full family only", {"max_full_params": 10}),
    ("posterior must be one of", {"posterior": "matrix"}),
]


BAD_IDS = [f"{name}={next(iter(kwargs.values()))}" for name, kwargs in BAD_KWARGS]


@pytest.mark.parametrize("name, kwargs", BAD_KWARGS, ids=BAD_IDS)
def test_invalid_hyperparameters_raise(name, kwargs):
    with pytest.raises(ValueError, match=name):
        FOOVB(mlp(), **{**PAPER, **kwargs})


def test_a_torch_optimizers_arguments_and_misspellings_are_told_what_to_pass():
    """A user porting from Adam: lr, weight_decay, model.parameters() each get a one-line TypeError naming FOOVB's
    counterpart; a misspelt setting gets the closest valid name."""
    with pytest.raises(TypeError, match=r"'lr' \(.*mean_step.*param_groups"):
        FOOVB(mlp(), lr=1e-3)
    with pytest.raises(TypeError, match=r"arguments 'weight_decay' \(.*prior.*\), 'betas'"):
        FOOVB(mlp(), weight_decay=1e-4, betas=(0.9, 0.999))
    with pytest.raises(TypeError, match="'mean_stp' \\(did you mean 'mean_step'\\?\\)"):
        FOOVB(mlp(), mean_stp=0.5)
    with pytest.raises(TypeError, match=r"not FOOVB\(model.parameters\(\)\)\), got generator"):
        FOOVB(mlp().parameters())
    with pytest.raises(TypeError, match=r"got list of parameter groups: FOOVB takes no per-group learning rates"):
        FOOVB([{"params": mlp().parameters(), "lr": 0.1}])


def test_a_lazy_module_before_its_first_forward_is_told_to_run_one():
    """nn.LazyLinear's parameters have no shape until a forward: torch's 'uninitialized parameter' error came from
    deep inside the construction (a user's trial, session 55); after one forward FOOVB takes the model."""
    model = nn.Sequential(nn.LazyLinear(6), nn.ReLU(), nn.Linear(6, 3))
    with pytest.raises(ValueError, match=r"^0.weight, 0.bias: not initialised yet .* run one forward pass"):
        FOOVB(model)
    model(torch.randn(2, 4))
    assert [tuple(block.params[0].shape) for block in FOOVB(model).blocks] == [(6, 4), (3, 6)]


def test_full_family_too_large_layer_reports_memory():
    with pytest.raises(ValueError, match=r"\d+\.\d+ GiB") as err:
        FOOVB(nn.Linear(100, 50), "full", **PAPER)  # 5050 > 4096 parameters
    assert "max_full_params" in str(err.value)
    with pytest.raises(ValueError, match="GiB"):
        FOOVB(nn.Linear(30, 20), "full", max_full_params=619, **PAPER)
    FOOVB(nn.Linear(30, 20), "full", max_full_params=620, **PAPER)  # exactly at the limit is accepted


# ---------------------------------------------------------------------------------------------------------
# step and step_batched: what they require and return, hooks
# ---------------------------------------------------------------------------------------------------------
def test_step_requires_closure_and_batch_size():
    model = mlp()
    with pytest.raises(ValueError, match="closure"):
        FOOVB(model, "diagonal", **PAPER).step()
    x, y = mlp_batch()
    opt = FOOVB(model, "diagonal", loss_reduction="mean", preset="paper")

    def scaled_mean_closure():  # the square root of a mean: its number of terms cannot be read from the loss
        loss = F.cross_entropy(model(x), y).sqrt()
        loss.backward()
        return loss

    with pytest.raises(ValueError, match=f"batch_size={len(x)}"):
        opt.step(scaled_mean_closure)
    with pytest.raises(ValueError, match="rows"):
        opt.step_batched(x, y[:-1])
    with pytest.raises(ValueError, match="chunk_size"):
        opt.step_batched(x, y, chunk_size=0)
    with pytest.raises(ValueError, match="empty batch"):
        opt.step_batched(x[:0], y[:0])
    with pytest.raises(ValueError, match="with loss_reduction='sum'"):  # a summed loss is not rescaled
        FOOVB(model, "diagonal", **PAPER).step(ce_closure(model, x, y), batch_size=len(x))


def test_step_returns_the_mean_loss_as_a_tensor_as_torch_optimizers_do():
    """torch optimizers return the closure's loss tensor: `loss.item()` must work (it failed on a Python float)."""
    torch.manual_seed(0)
    model = mlp()
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    opt = FOOVB(model, mc_samples=4, seed=0)
    losses = []

    def closure() -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.ndim == 0 and not loss.requires_grad
    assert len(losses) == 5  # the 4 samples', then the secant check's at the new mean (not in the step's loss)
    assert loss.item() == pytest.approx(sum(losses[:4]) / 4)
    batched = opt.step_batched(x, y, F.cross_entropy)
    assert isinstance(batched, torch.Tensor) and math.isfinite(batched.item())


def test_step_and_step_batched_return_the_mean_loss_over_the_samples():
    """Both paths return (1/K) sum_k L(theta_k), the loss the closure returns averaged over the K samples: under
    "mean" not rescaled by the batch size (the gradients are), under "sum" not summed over a chunk's samples. The
    same seed draws the same samples: the paths agree, and the "sum" value is r times the "mean" one."""
    x, y = mlp_batch()
    x = x.double()
    returned = {}
    for reduction in ("sum", "mean"):
        model = mlp(dtype=F64)
        opt = FOOVB(model, "diagonal", 4, loss_reduction=reduction, seed=5, preset="paper")
        closure, losses = ce_closure(model, x, y, reduction), []

        def recording_closure(closure=closure, losses=losses):
            loss = closure()
            losses.append(loss.item())
            return loss

        returned[reduction] = opt.step(recording_closure, batch_size=len(y) if reduction == "mean" else None)
        assert len(losses) == 4 and returned[reduction] == pytest.approx(sum(losses) / 4, rel=1e-12)
        for chunk in (None, 3):
            batched = FOOVB(mlp(dtype=F64), "diagonal", 4, loss_reduction=reduction, seed=5, preset="paper")
            assert batched.step_batched(x, y, chunk_size=chunk) == pytest.approx(returned[reduction], rel=1e-9)
    assert returned["sum"] == pytest.approx(len(y) * returned["mean"], rel=1e-9)


def test_step_hooks_run_for_both_paths():
    model = mlp()
    opt = FOOVB(model, "diagonal", 2, seed=0, **PAPER)
    calls = []
    opt.register_step_pre_hook(lambda optimizer, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda optimizer, args, kwargs: calls.append("post"))
    x, y = mlp_batch()
    opt.step(ce_closure(model, x, y))
    opt.step_batched(x, y)
    assert calls == ["pre", "post"] * 2


# ---------------------------------------------------------------------------------------------------------
# Step sizes in param_groups and schedulers
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_step_sizes_in_param_groups_are_the_ones_used(family):
    """Changing mean_step / cov_step in param_groups (what a schedule does) equals building with them;
    the structural hyperparameters cannot be changed there."""
    models, opts = {}, {}
    for tag in ("built", "changed"):
        models[tag] = mlp(seed=0)
        steps = {"mean_step": 0.3, "cov_step": 0.5} if tag == "built" else {}
        opts[tag] = FOOVB(models[tag], family, 3, seed=4, **steps, **PAPER)
    opts["changed"].param_groups[0].update(lr=0.3, cov_step=0.5)
    for tag in opts:
        _steps(models[tag], opts[tag], 0, 2)
    assert all_equal(posterior_snapshot(opts["built"]), posterior_snapshot(opts["changed"]))
    untouched = FOOVB(mlp(seed=0), family, 3, seed=4, **PAPER)
    assert not all_equal(posterior_snapshot(opts["built"]), posterior_snapshot(untouched))
    opt = opts["changed"]
    x, y = mlp_batch()
    opt.param_groups[0]["mc_samples"] = 5
    with pytest.raises(ValueError, match="mc_samples.*fixed at construction"):
        opt.step(ce_closure(models["changed"], x, y))
    opt.param_groups[0]["mc_samples"] = 3
    opt.param_groups[0]["std_init"] = 5.0  # used at construction only: changing it later is refused too
    with pytest.raises(ValueError, match="std_init.*fixed at construction"):
        opt.step_batched(x, y)
    opt.param_groups[0]["std_init"] = 0.047
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="'lr'.*mean_step"):
        opt.step_batched(x, y)
    opt.param_groups[0]["lr"] = 0.3
    # a torch optimizer's key written in by hand was never read (a helper's trial, session 50); zero is harmless
    opt.param_groups[0]["weight_decay"] = 0.0
    opt.step_batched(x, y)
    opt.param_groups[0]["weight_decay"] = 1e-4
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['weight_decay'\] = 0.0001, but FOOVB has no "
                                         r"weight_decay: the prior regularises"):
        opt.step_batched(x, y)
    with pytest.raises(ValueError, match="parameter groups cannot be added"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


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


def test_gradients_left_by_earlier_training_are_dropped_at_construction():
    """Pretrained with Adam, then FOOVB(model): the last Adam step's gradients were refused at the first step as
    "already computed" (gradient accumulation's error). FOOVB never uses gradients from before it existed, so it
    drops them; a backward() after construction is still refused (tests/test_calibration.py)."""
    x, y = mlp_batch(rows=8)
    model = mlp(seed=0)
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    F.cross_entropy(model(x), y).backward()
    adam.step()
    pretrained = [p.detach().clone() for p in model.parameters()]
    opt = FOOVB(model, seed=0)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), pretrained, strict=True))  # the kept mean
    opt.step(_closure(model, lambda m: F.cross_entropy(m(x), y)))
    assert opt.steps_taken == 1
