"""Which parameters a step trains, and from where, as the user changes the model around the optimizer (issue 35):
weights written into the model after construction (the next step's mean), layers frozen at or after construction
(left out of the step, on both paths), parameters replaced, and the posterior read or predicted from inside a
sample (the loaded sample is not taken for written weights)."""

import pytest
import torch
from conftest import (
    F64,
    FAMILIES,
    PAPER,
    TOLERANCE,
    all_equal,
    assert_same_posterior,
    ce_closure,
    closure_of,
    mlp,
    mlp_batch,
    one_step,
    posterior_snapshot,
    summed_ce,
)

from foovb import FOOVB
from foovb.predict import predict

pytestmark = pytest.mark.usefixtures("single_thread")

X, Y = mlp_batch(rows=8)


# -- weights written into the model between steps -----------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_weights_loaded_after_construction_are_the_mean_of_the_next_step(family):
    """model.load_state_dict after FOOVB(model): the next step starts from the loaded weights, as it does for an
    optimizer built on the loaded model (the prior std is shape-only, so both posteriors are identical)."""
    pretrained = mlp(seed=5).state_dict()
    model = mlp(seed=0)
    opt = FOOVB(model, family, 4, seed=3, mean_step=0.1)  # steps short against the distance between the two nets
    opt.step(closure_of(model, summed_ce))  # a step before the load: its mean is replaced, its covariance kept
    replaced = [p.detach().clone() for p in model.parameters()]
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
    for param, loaded, old in zip(model.parameters(), pretrained.values(), replaced, strict=True):
        # a step from the loaded weights, not back to the replaced mean
        assert 0 < float((param - loaded).norm()) < 0.5 * float((param - old).norm())


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


# -- layers frozen at construction --------------------------------------------------------------------------------
def test_kronecker_rejects_frozen_bias_with_trainable_weight():
    model = mlp()
    model[0].bias.requires_grad_(False)
    with pytest.raises(ValueError, match="frozen bias"):
        FOOVB(model, "kronecker", **PAPER)


def _frozen_weight_mlp():
    model = mlp(seed=0, dtype=F64)
    model[0].weight.requires_grad_(False)  # e.g. a pretrained feature layer whose bias is still trained
    return model, model[0].weight.detach().clone()


def test_paper_init_leaves_frozen_weight_alone():
    model, frozen = _frozen_weight_mlp()
    FOOVB(model, "diagonal", init="paper", seed=0, **PAPER)
    assert torch.equal(model[0].weight.detach(), frozen)


def test_kronecker_training_leaves_frozen_weight_alone():
    model, frozen = _frozen_weight_mlp()
    x, y = mlp_batch()
    x = x.double()
    try:
        opt = FOOVB(model, "kronecker", 3, init="keep", seed=0, **PAPER)
    except ValueError:  # rejecting the configuration, like a frozen bias, would be fine too
        return
    seen = []
    closure = ce_closure(model, x, y)

    def recording_closure():
        seen.append(torch.equal(model[0].weight.detach(), frozen))
        return closure()

    opt.step(recording_closure)
    opt.step_batched(x, y)
    assert all(seen), "the frozen weight was replaced by samples during step()"
    assert torch.equal(model[0].weight.detach(), frozen)


@pytest.mark.parametrize("family", ["diagonal", "full"])
def test_batched_path_with_frozen_weight_matches_sequential(family):
    x, y = mlp_batch()
    x = x.double()
    runs = []
    for batched in (False, True):
        model, frozen = _frozen_weight_mlp()
        opt = FOOVB(model, family, 3, init="keep", seed=0, **PAPER)
        try:
            opt.step_batched(x, y) if batched else opt.step(ce_closure(model, x, y))
        except ValueError as err:  # a clear refusal would be acceptable
            assert "frozen" in str(err) or "requires_grad" in str(err)
            return
        assert torch.equal(model[0].weight.detach(), frozen)
        runs.append(posterior_snapshot(opt))
    for got, want in zip(runs[1], runs[0], strict=True):
        torch.testing.assert_close(got, want, **TOLERANCE[F64])


# -- layers frozen after construction -----------------------------------------------------------------------------
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
    assert len(seen) == 4 + opt.secant_check and all(all_equal(s, frozen_before) for s in seen)
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


# -- the posterior read inside a sample ---------------------------------------------------------------------------
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
