"""step_prior (foovb/calibration.py): the mean step's prior K times the sampling prior. Checked against a dense
(Sigma^-1 - 1/v0 + 1/(K v0))^-1 in every family, against the plain optimizer at K = 1, composed with calibrate_prior,
through a failed first step, a state dict and bad values."""

import math

import pytest
import torch
from conftest import ce_closure
from torch import nn

from foovb import FOOVB
from foovb.calibration import STEP_PRIOR_MAX_FEATURES, step_prior_blocks, variance_per_weight

pytestmark = pytest.mark.usefixtures("single_thread")


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(64, 10, generator=generator), torch.randint(0, 3, (64,), generator=generator)


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 6), nn.Tanh(), nn.Linear(6, 3))


def dense_covariance(block) -> torch.Tensor:
    """Sigma of a block, with its mean (p x n) read row-major: Sigma = B B^T (x) A A^T for the matrix family."""
    if block.family == "kronecker":
        a, b = block.state["input_sqrt_cov"].double(), block.state["output_sqrt_cov"].double()
        return torch.kron(b @ b.T, a @ a.T)
    if block.family == "full":
        a = block.state["sqrt_cov"].double()
        return a @ a.T
    return torch.diag(block.state["std"].double().flatten().square())


@pytest.mark.parametrize("family", ["diagonal", "kronecker", "full"])
def test_the_mean_step_takes_a_prior_k_times_wider(family):
    """The same samples and the same updated covariance Sigma as the plain optimizer; the mean step is
    (Sigma^-1 - 1/v0 + 1/(K v0))^-1 E[g] against its Sigma E[g], with v0 the prior's variance per weight."""
    x, y = data()
    settings = {"alpha": 0.5} if family == "kronecker" else {"std_init": 0.3}
    widened, plain = (FOOVB(net(), family, mean_step=0.7, seed=3, step_prior=factor, secant_check=False, **settings)
                      for factor in (8, 1))
    starts = [block.state["mean"].clone() for block in widened.blocks]
    priors = [float(variance_per_weight(block)) for block in widened.blocks]
    for opt in (widened, plain):
        opt.step(ce_closure(opt.model, x, y, reduction="mean"))
    output_layer = widened.blocks[-1].module
    for block, plain_block, start, prior in zip(widened.blocks, plain.blocks, starts, priors, strict=True):
        if block.module is output_layer:  # the output layer (weight and bias) takes the algorithm's step
            assert "uncalibrated_prior_variance" not in block.state
            torch.testing.assert_close(block.state["mean"], plain_block.state["mean"], rtol=0, atol=0)
            continue
        expected_prior = 0.09 if family != "kronecker" else 2 * 0.5 / (block.params[0].shape[1] + 2)
        assert prior == pytest.approx(expected_prior, rel=1e-5)
        assert float(block.state["uncalibrated_prior_variance"]) == pytest.approx(8 * expected_prior, rel=1e-5)
        for key, value in plain_block.state.items():
            if key != "mean":
                torch.testing.assert_close(block.state[key], value)
        sigma = dense_covariance(block)
        swapped = torch.linalg.inv(torch.linalg.inv(sigma) - torch.eye(len(sigma), dtype=torch.float64)
                                   * (1 / prior - 1 / (8 * prior)))
        plain_step = (plain_block.state["mean"] - start).double().flatten()
        expected = swapped @ torch.linalg.solve(sigma, plain_step)  # E[g] from the plain step Sigma E[g]
        step = (block.state["mean"] - start).double().flatten()
        torch.testing.assert_close(step, expected, rtol=1e-4, atol=1e-7)
        assert step.norm() > 1.5 * plain_step.norm()  # the first steps are wider, not a rounding difference


def test_the_recommended_factors():
    """FOOVB(model) (the matrix-variate preset) widens the mean step's prior 64 times since session 54, its fallback
    diagonal tensors too; the diagonal preset 16 times (docs/results/step_prior_64.md)."""
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    opt = FOOVB(model)
    assert opt.step_prior == 64.0 and FOOVB(net(), "diagonal").step_prior == 16.0
    norm = next(block for block in opt.blocks if block.module is model[1])
    priors = norm.mean_step_priors()
    assert norm.family == "diagonal" and float(priors[1] / priors[0]) == pytest.approx(64.0)


@pytest.mark.parametrize("family", ["diagonal", "kronecker", "full"])
def test_a_factor_of_one_is_off(family):
    """step_prior=1 (the paper preset's) takes the algorithm's step Sigma E[g]: no prior to swap in any block,
    before or after a step."""
    x, y = data()
    opt = FOOVB(net(), family, seed=4, step_prior=1)
    opt.step(ce_closure(opt.model, x, y, reduction="mean"))
    assert opt.step_prior == 1.0 and FOOVB(net(), family, preset="paper").step_prior == 1.0
    assert all(block.mean_step_priors() == () for block in opt.blocks)


def test_with_calibrate_prior_the_step_prior_is_k_times_the_uncalibrated_one():
    """The calibration shrinks the sampling prior v0 by f; V stays K times the prior before it (K v0 / f)."""
    x, y = data()
    opt = FOOVB(net(), "kronecker", calibrate_prior=0.3, step_prior=4, seed=0)
    before = [float(variance_per_weight(block)) for block in opt.blocks]
    opt.step(ce_closure(opt.model, x, y, reduction="mean"))
    assert 0 < opt.prior_scale < 0.5
    for block, prior, factor in zip(opt.blocks, before, (4, 1), strict=True):  # hidden, output layers
        assert float(block.state["calibrated_prior_variance"]) == pytest.approx(opt.prior_scale * prior, rel=1e-5)
        assert float(block.state["uncalibrated_prior_variance"]) == pytest.approx(factor * prior, rel=1e-5)


def test_a_failed_first_step_after_the_calibration_keeps_the_step_prior():
    """The undo of the calibration puts back the entries step_prior set at construction (it used to drop them)."""
    x, y = data()
    opt = FOOVB(net(), "kronecker", calibrate_prior=0.3, step_prior=4, seed=0)
    before = {(index, key): value.clone() for index, block in enumerate(opt.blocks)
              for key, value in block.state.items() if key != "mean"}
    calls = []

    def failing() -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:  # the calibration's call, the first sample's, then this one
            raise RuntimeError("a data loader's error")
        return ce_closure(opt.model, x, y, reduction="mean")()

    with pytest.raises(RuntimeError, match="data loader"):
        opt.step(failing)
    after = {(index, key): value for index, block in enumerate(opt.blocks)
             for key, value in block.state.items() if key != "mean"}
    assert after.keys() == before.keys()
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)


def test_the_state_dict_round_trips_and_other_settings_are_refused():
    x, y = data()
    opt = FOOVB(net(), "kronecker", step_prior=16, seed=0)
    opt.step(ce_closure(opt.model, x, y, reduction="mean"))
    saved = opt.state_dict()
    loaded = FOOVB(net(1), "kronecker", step_prior=16, seed=9)
    loaded.load_state_dict(saved)
    for optimizer in (opt, loaded):
        optimizer.step(ce_closure(optimizer.model, x, y, reduction="mean"))
    for p, q in zip(opt.model.parameters(), loaded.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for other in (1, 4):
        with pytest.raises(ValueError, match="step_prior: saved 16.0"):
            FOOVB(net(), "kronecker", step_prior=other).load_state_dict(saved)
    legacy = FOOVB(net(), "kronecker", step_prior=1).state_dict()
    del legacy["param_groups"][0]["step_prior"]  # saved before the setting existed: the algorithm's step
    FOOVB(net(), "kronecker", step_prior=1).load_state_dict(legacy)
    with pytest.raises(ValueError, match="step_prior: saved 1.0, here 16.0"):
        FOOVB(net(), "kronecker", step_prior=16).load_state_dict(legacy)


@pytest.mark.parametrize("value", [0.5, 0, -1, math.inf, math.nan, "16", True])
def test_bad_values_are_refused(value):
    with pytest.raises(ValueError, match="step_prior must be a finite number >= 1"):
        FOOVB(net(), step_prior=value)


@pytest.mark.parametrize("mode", ["data", "mc"])
def test_distribute_takes_it_in_both_modes(tmp_path, mode):
    """Not refused (as calibrate_prior is in data mode): the swap is a function of the reduced statistics and of the
    state every process shares; one process steps as the undistributed optimizer does."""
    from datetime import timedelta

    import torch.distributed as dist

    from foovb.distributed import distribute

    x, y = data()
    plain = FOOVB(net(), "kronecker", 4, step_prior=16, seed=0)
    plain.step(ce_closure(plain.model, x, y))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        opt = FOOVB(net(), "kronecker", 4, step_prior=16, seed=0)
        distribute(opt, mode)
        opt.step(ce_closure(opt.model, x, y))
    finally:
        dist.destroy_process_group()
    for p, q in zip(opt.model.parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_wider_steps_train_the_grids_regression_net_further():
    """The grid's 1-64-64-1 tanh net on its first region of y = sin(2x): step_prior=16 (with the secant check, as the
    grid measured it; the output layer takes the algorithm's step) ends 40 steps at under 0.7 times the loss of the
    algorithm's step (with the check too; 0.62 times when this was written)."""
    generator = torch.Generator().manual_seed(0)
    x = -3 + 2 * torch.rand(64, 1, generator=generator)
    y = torch.sin(2 * x)
    final = {}
    for name, factor in (("wider", 16), ("algorithm", 1)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
        opt = FOOVB(model, seed=0, step_prior=factor, secant_check=True)
        for _ in range(40):
            def closure(model: nn.Module = model) -> torch.Tensor:
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss

            opt.step(closure)
        final[name] = float(torch.nn.functional.mse_loss(model(x), y).detach())
    assert final["wider"] < 0.7 * final["algorithm"]


def test_a_factor_that_overflows_the_dtype_is_refused():
    with pytest.raises(ValueError, match="step_prior=1e\\+39 times the prior's variance per weight .* overflows"):
        FOOVB(net(), "kronecker", step_prior=1e39)


def test_a_state_dict_without_the_step_priors_entries_is_refused():
    """Dropped entries would turn the option off silently (the entries are optional for calibrate_prior)."""
    saved = FOOVB(net(), "kronecker", step_prior=16).state_dict()
    saved["state"][0].pop("uncalibrated_prior_variance")  # the hidden layer's (the output layer holds none)
    with pytest.raises(ValueError, match="has no 'uncalibrated_prior_variance' for the kronecker posterior of "
                                         "parameter 0 .* step_prior widens"):
        FOOVB(net(), "kronecker", step_prior=16).load_state_dict(saved)


def test_a_first_update_that_overflows_names_the_step_prior():
    """The layer named is the one with the widest mean step's prior: the hidden layer's prior is the narrower
    (variance 2 / 16 against 2 / 9), 16 times wider in its mean step; the output layer takes no step prior."""
    x, y = data()
    opt = FOOVB(net(), "full", step_prior=16, mean_step=1e36, seed=0)
    with pytest.raises(FloatingPointError, match="At the first update, layer '0' .* smaller step_prior") as error:
        opt.step(ce_closure(opt.model, x, y))
    assert "std_growth" not in str(error.value)  # the full family's sigma does not grow
    opt = FOOVB(net(), "full", step_prior=1.5, mean_step=1e36, seed=0)
    with pytest.raises(FloatingPointError, match="At the first update, layer '2'") as error:
        opt.step(ce_closure(opt.model, x, y))
    assert "step_prior" not in str(error.value)  # the output layer's step is the algorithm's


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_variances_are_swapped_in_float32(dtype):
    """1/v - 1/v0 cancels where v is near v0: in half precision it was off by up to 24% (bfloat16)."""
    from foovb.linalg import prior_swapped

    prior, new_prior = torch.tensor(0.01, dtype=dtype), torch.tensor(10.0, dtype=dtype)
    variances = torch.linspace(0.0095, 0.01, 50).to(dtype)
    exact = 1 / (1 / variances.double() - 1 / prior.double() + 1 / new_prior.double())
    swapped = prior_swapped(variances, prior, new_prior)
    assert swapped.dtype == dtype
    torch.testing.assert_close(swapped.double(), exact, rtol=1e-2, atol=0)


@pytest.mark.parametrize("family", ["diagonal", "kronecker", "auto"])
def test_the_output_layer_and_wide_matrix_layers_take_the_algorithms_step(family):
    """step_prior widens every block but the last module's (weight and bias alike) and but matrix-variate layers
    with a factor wider than posterior="auto" makes (1,024 inputs and the bias); a norm layer's diagonal blocks in
    the matrix-variate family are widened, and so is "auto"'s widest matrix-variate layer."""
    model = nn.Sequential(nn.Linear(STEP_PRIOR_MAX_FEATURES + 1, 8), nn.Tanh(), nn.Linear(8, 8), nn.LayerNorm(8),
                          nn.Linear(8, 3))  # the first layer's input factor: 1,025 inputs + 1 (bias)
    opt = FOOVB(model, family, step_prior=4)
    widened = {name: bool(block.mean_step_priors()) for block in opt.blocks
               for name, module in model.named_modules() if module is block.module}
    assert widened == {"0": family != "kronecker", "2": True, "3": True, "4": False}  # "auto": 0 is diagonal
    widest = FOOVB(nn.Sequential(nn.Linear(STEP_PRIOR_MAX_FEATURES, 8), nn.Linear(8, 3)), "auto", step_prior=4)
    assert widest.blocks[0].family == "kronecker" and widest.blocks[0].mean_step_priors()
    assert FOOVB(nn.Linear(4, 2), family, step_prior=4).blocks[0].mean_step_priors() == ()  # only an output layer


@pytest.mark.parametrize(("inputs", "outputs", "bias"), [(3, STEP_PRIOR_MAX_FEATURES + 1, True),
                                                          (STEP_PRIOR_MAX_FEATURES + 1, 3, False)])
def test_step_prior_leaves_matrix_variate_layers_exactly_as_wide_as_auto_leaves_diagonal(inputs, outputs, bias):
    """posterior="kronecker" on a layer "auto" makes diagonal by one unit (1,025 outputs; 1,025 inputs without a
    bias, whose input factor is no wider than a 1,024-input layer's with its bias): the algorithm's step, as the
    docs say; one unit narrower it is widened."""
    torch.manual_seed(0)
    layer = nn.Linear(inputs, outputs, bias=bias)
    model = nn.Sequential(layer, nn.Linear(layer.out_features, 2))
    assert FOOVB(model, "auto").blocks[0].family == "diagonal"
    assert FOOVB(model, "kronecker", step_prior=4).blocks[0].mean_step_priors() == ()
    narrower = nn.Linear(layer.in_features - (layer.in_features > 3), layer.out_features - (layer.out_features > 3),
                         bias=False)
    opt = FOOVB(nn.Sequential(narrower, nn.Linear(narrower.out_features, 2)), "kronecker", step_prior=4)
    assert opt.blocks[0].family == "kronecker" and opt.blocks[0].mean_step_priors()


class HeadFirst(nn.Module):
    """The output layer registered before the body: the last registered layer is the body's."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6, 3)
        self.body = nn.Sequential(nn.Linear(10, 6), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@pytest.mark.parametrize(("family", "settings"), [("diagonal", {}), ("auto", {}),
                                                   ("auto", {"step_prior": 1})])  # the diagonal output factor
def test_an_output_layer_registered_before_the_body_is_named_at_the_first_step(family, settings, recwarn):
    x, y = data()
    torch.manual_seed(0)
    model = HeadFirst()
    optimizer = FOOVB(model, family, seed=0, **settings)
    with pytest.warns(UserWarning, match=r"called 'head' last.*registered with trainable parameters, 'body\.0'.*"
                                         r"`layer = model\.head; del model\.head; model\.head = layer`"):
        optimizer.step(ce_closure(model, x, y))
    recwarn.clear()
    optimizer.step(ce_closure(model, x, y))
    assert not [w for w in recwarn if "called" in str(w.message)]  # once
    layer = model.head
    del model.head
    model.head = layer  # moved last, as the warning says: no warning
    FOOVB(model, family, seed=0, **settings).step(ce_closure(model, x, y))
    assert not [w for w in recwarn if "called" in str(w.message)]


def test_no_warning_where_no_setting_treats_the_output_layer_apart(recwarn):
    x, y = data()
    torch.manual_seed(0)
    model = HeadFirst()
    FOOVB(model, "diagonal", seed=0, step_prior=1).step(ce_closure(model, x, y))
    assert not [w for w in recwarn if "called" in str(w.message)]


def test_a_layer_recomputed_in_backward_is_not_taken_for_the_last_one_called(recwarn):
    """Activation checkpointing runs the checkpointed layers again inside backward()."""
    from torch.utils.checkpoint import checkpoint

    x, y = data()
    model = net()

    def closure():
        hidden = checkpoint(model[0], x, use_reentrant=False)
        loss = torch.nn.functional.cross_entropy(model[2](model[1](hidden)), y, reduction="sum")
        loss.backward()
        return loss

    FOOVB(model, seed=0).step(closure)
    assert not [w for w in recwarn if "called" in str(w.message)]


def test_a_nested_head_is_moved_by_the_models_child_that_holds_it(recwarn):
    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.top = nn.ModuleDict({"head": nn.Linear(6, 3)})
            self.body = nn.Sequential(nn.Linear(10, 6), nn.Tanh())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.top["head"](self.body(x))

    x, y = data()
    torch.manual_seed(0)
    model = Nested()
    with pytest.warns(UserWarning, match=r"called 'top.head' last.*`layer = model\.top; del model\.top; "
                                         r"model\.top = layer` moves 'top', which holds it, last"):
        FOOVB(model, seed=0).step(ce_closure(model, x, y))
    layer = model.top
    del model.top
    model.top = layer
    recwarn.clear()
    FOOVB(model, seed=0).step(ce_closure(model, x, y))
    assert not [w for w in recwarn if "called" in str(w.message)]


def test_step_batched_names_an_output_layer_registered_before_the_body_too():
    x, y = data()
    torch.manual_seed(0)
    model = HeadFirst()
    with pytest.warns(UserWarning, match=r"called 'head' last.*'body\.0'"):
        FOOVB(model, seed=0).step_batched(x, y, torch.nn.functional.cross_entropy)


def test_attentions_own_projections_take_the_algorithms_step():
    """nn.MultiheadAttention's in-projection (query, key, value) is not widened; its out_proj, a Linear, is."""
    model = nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), nn.Flatten(),
                          nn.Linear(8 * 3, 2))
    optimizer = FOOVB(model, seed=0)
    attention = model[0].self_attn
    widened = {id(p) for block in step_prior_blocks(optimizer.blocks) for p in block.params}
    assert id(attention.in_proj_weight) not in widened and id(attention.in_proj_bias) not in widened
    assert id(attention.out_proj.weight) in widened and id(model[0].linear1.weight) in widened
    x, y = torch.randn(16, 3, 8), torch.randint(0, 2, (16,))
    before = variance_per_weight(next(b for b in optimizer.blocks if attention.in_proj_weight in b.params))
    optimizer.step(ce_closure(model, x, y))  # trains: the projections' step is the algorithm's
    assert torch.isfinite(attention.in_proj_weight).all() and before > 0
