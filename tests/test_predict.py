"""foovb.predict (posterior-mean and sampled-network probabilities, their uncertainty) and FOOVB.sampled_params."""

import numpy as np
import pytest
import torch
from conftest import (
    FAMILIES,
    PAPER,
    all_equal,
    cnn,
    cnn_batch,
    make_generator,
    mlp,
    mlp_batch,
    params_snapshot,
    posterior_snapshot,
)
from torch import nn
from torch.func import functional_call

import foovb.predict as predict_module
from foovb import FOOVB
from foovb.predict import predict, sample_probabilities, uncertainty, uncertainty_from_samples

pytestmark = pytest.mark.usefixtures("single_thread")

K = 6


def trained(family, model=None, std_init=0.1, seed=0):
    model = mlp(seed=0) if model is None else model
    opt = FOOVB(model, family, 3, std_init=std_init, seed=seed, **PAPER)
    x, y = mlp_batch()
    opt.step(lambda: _loss_backward(model, x, y))
    return model, opt


def _loss_backward(model, x, y):
    loss = nn.functional.cross_entropy(model(x), y, reduction="sum")
    loss.backward()
    return loss


def sampled_parameters(opt, noises, k):
    """{name: value} of sample k, from the blocks' TRANSFORM applied to the given noise."""
    names = {id(p): n for n, p in opt.model.named_parameters()}
    values = {}
    for block, noise in noises.items():
        for param, value in zip(block.params, block.sample(noise[k : k + 1]), strict=True):
            values[names[id(param)]] = value[0]
    return values


@pytest.mark.parametrize("family", FAMILIES)
def test_predict_mean_and_batched_samples(family):
    model, opt = trained(family)
    x, _ = mlp_batch(seed=5, rows=7)
    posterior, params = posterior_snapshot(opt), params_snapshot(model)
    pred = predict(opt, x, K, seed=3)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(pred.mean, torch.softmax(model(x), -1))
    assert pred.samples.shape == (K, 7, 3)
    assert bool((pred.samples >= 0).all())
    torch.testing.assert_close(pred.samples.sum(-1), torch.ones(K, 7))
    # Sample k is the network theta = mu + A eps_k with eps_k = draw_noise(seed, k), evaluated layer by layer
    # (for kronecker Linear layers without ever forming W_k).
    noises = opt.draw_noise(3, range(K))
    for k in range(K):
        with torch.no_grad():
            logits = functional_call(model, sampled_parameters(opt, noises, k), (x,))
        torch.testing.assert_close(pred.samples[k], torch.softmax(logits, -1), atol=1e-5, rtol=1e-4)
    # Chunking does not change the draws; prediction leaves posterior and model untouched.
    torch.testing.assert_close(sample_probabilities(opt, x, K, seed=3, chunk_size=4), pred.samples)
    assert all_equal(posterior_snapshot(opt), posterior) and all_equal(params_snapshot(model), params)
    assert predict(opt, x).samples is None


@pytest.mark.parametrize("family", FAMILIES)
def test_sample_probabilities_seeding_and_spread(family):
    _, opt = trained(family)
    x, _ = mlp_batch(seed=5)
    first = sample_probabilities(opt, x, K, seed=1)
    assert torch.equal(first, sample_probabilities(opt, x, K, seed=1))
    assert not torch.allclose(first, sample_probabilities(opt, x, K, seed=2))
    mean = predict(opt, x).mean
    assert (first - mean).abs().max() > 1e-3  # std > 0: the sampled networks differ from the mean one
    assert (first[0] - first[1]).abs().max() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_sample_probabilities_default_seed_draws_the_networks_of_predict(family):
    """Without a seed, sample_probabilities draws the networks whose probabilities predict(..., num_samples)
    reports: both default to seed 0."""
    _, opt = trained(family)
    x, _ = mlp_batch(seed=5)
    default = sample_probabilities(opt, x, K)
    assert torch.equal(default, predict(opt, x, K).samples)
    assert torch.equal(default, sample_probabilities(opt, x, K, seed=0))


@pytest.mark.parametrize("family", FAMILIES)
def test_negligible_std_samples_equal_mean(family):
    model, opt = trained(family, std_init=1e-8)
    if family == "kronecker":  # its initial factors come from alpha: shrink them directly
        for block in opt.blocks:
            for key in ("input_sqrt_cov", "output_sqrt_cov"):
                block.state[key] = block.state[key] * 1e-5
    assert max(opt.posterior(p).std.max().item() for p in model.parameters()) < 1e-7
    x, _ = mlp_batch(seed=5)
    pred = predict(opt, x, K)
    torch.testing.assert_close(pred.samples, pred.mean.expand(K, -1, -1), atol=1e-6, rtol=0)


def test_predict_uses_eval_mode_and_restores_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Dropout(0.5), nn.Linear(6, 3))
    _, opt = trained("diagonal", model=model)
    x, _ = mlp_batch(seed=5)
    model.train()
    first, second = predict(opt, x, K), predict(opt, x, K)
    assert model.training and all(m.training for m in model.modules())
    assert torch.equal(first.mean, second.mean) and torch.equal(first.samples, second.samples)  # no dropout
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(first.mean, torch.softmax(model(x), -1))
    predict(opt, x, K)
    assert not model.training
    model.train()

    def failing(_):
        raise RuntimeError("output_fn failed")

    with pytest.raises(RuntimeError, match="output_fn failed"):
        predict(opt, x, K, output_fn=failing)
    assert model.training
    model[2].eval()  # mixed modes (e.g. a frozen dropout) are restored module by module
    predict(opt, x, K)
    assert [m.training for m in model.modules()] == [True, True, True, False, True]


def test_custom_output_fn_and_invalid_sample_count():
    model, opt = trained("kronecker")
    x, _ = mlp_batch(seed=5)
    pred = predict(opt, x, K, output_fn=lambda logits: logits.log_softmax(-1))
    torch.testing.assert_close(pred.samples.exp().sum(-1), torch.ones(K, x.shape[0]))
    with pytest.raises(ValueError, match="num_samples"):
        sample_probabilities(opt, x, 0)
    with pytest.raises(ValueError, match="num_samples"):
        predict(opt, x, -3)


@pytest.mark.parametrize("family", FAMILIES)
def test_regression_outputs_are_predictions(family):
    """A model with one output per row and output_fn=squeeze: predict() computed it, then refused its (rows,)
    shape."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1))
    opt = FOOVB(model, family, K, seed=0)
    x = torch.randn(8, 4)
    pred = predict(opt, x, K, seed=10, output_fn=lambda out: out.squeeze(-1))
    assert pred.mean.shape == (8,) and pred.samples.shape == (K, 8)
    with torch.no_grad():
        torch.testing.assert_close(pred.mean, model(x).squeeze(-1))
        with opt.sampled_params(seed=3):
            assert not torch.allclose(model(x).squeeze(-1), pred.mean)  # the samples are other networks


def test_prediction_arguments_are_checked_and_seed_none_draws_fresh_networks():
    """seed=None was a TypeError from deep inside the noise mixing; a float count, a TypeError from range()."""
    model, opt = trained("diagonal")
    x, _ = mlp_batch(seed=5)
    first, second = predict(opt, x, K, seed=None).samples, predict(opt, x, K, seed=None).samples
    assert first.shape == (K, x.shape[0], 3) and not torch.equal(first, second)
    numpy_ints = predict(opt, x, np.int64(K), seed=np.int64(3), chunk_size=np.int64(2)).samples
    assert torch.equal(numpy_ints, predict(opt, x, K, seed=3).samples)  # numpy integers are integers
    for arguments, error in (({"num_samples": 4.0}, "num_samples must be an int"),
                             ({"num_samples": K, "seed": 1.5}, "seed must be an int or None"),
                             ({"num_samples": K, "chunk_size": 2.5}, "chunk_size must be an int")):
        with pytest.raises(TypeError, match=error):
            predict(opt, x, **arguments)


class _Residual(nn.Module):
    """A skip connection from the input (x + relu(fc(x))), on inputs of any number of leading dimensions."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + torch.relu(self.fc(x)))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("shape", [(8, 4), (2, 5, 4)])
def test_models_the_stacked_route_cannot_follow_are_predicted_one_network_at_a_time(family, shape):
    """A residual MLP (the input added to a layer's output) and token-wise inputs (batch, tokens, features):
    step(closure) trains them, and predict() raised (a size mismatch, "the batched path supports 2-D inputs")."""
    model = _Residual()
    opt = FOOVB(model, family, K, seed=0)
    x = torch.randn(shape)
    samples = sample_probabilities(opt, x, K, seed=10)
    assert samples.shape == (K, *shape[:-1], 3)
    pred = predict(opt, x, K, seed=10)  # outputs per token too: it wanted (rows, classes)
    assert torch.equal(pred.samples, samples) and pred.mean.shape == (*shape[:-1], 3)
    noises = opt.draw_noise(10, range(K))
    model.eval()
    for k in range(K):  # the networks of draw_noise(seed, range(K)), as on either route
        opt.load_sample(noises, k)
        with torch.no_grad():
            torch.testing.assert_close(samples[k], torch.softmax(model(x), -1))
    opt.load_mean_into_model()


def _layernorm_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.ReLU(), nn.Linear(6, 3))


@pytest.mark.parametrize("family", FAMILIES)
def test_unsupported_module_falls_back_to_sequential_samples(family):
    model, opt = trained(family, model=_layernorm_model())
    x, _ = mlp_batch(seed=5)
    params = params_snapshot(model)
    samples = sample_probabilities(opt, x, K, seed=10)
    assert samples.shape == (K, x.shape[0], 3)
    torch.testing.assert_close(samples.sum(-1), torch.ones(K, x.shape[0]))
    assert all_equal(params_snapshot(model), params)  # the mean is restored after the samples
    model.eval()
    noises = opt.draw_noise(10, range(K))
    for k in range(K):  # sample k is the network of row k of draw_noise(seed, range(K)), as in the batched route
        opt.load_sample(noises, k)
        with torch.no_grad():
            torch.testing.assert_close(samples[k], torch.softmax(model(x), -1))
    opt.load_mean_into_model()
    assert torch.equal(samples, sample_probabilities(opt, x, K, seed=10))
    assert (samples[0] - samples[1]).abs().max() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("make_model", [lambda: mlp(seed=0), _layernorm_model], ids=["batched", "sequential"])
def test_sampled_networks_inside_autocast_are_the_sampled_networks(family, make_model):
    """Each sampled network is cast afresh inside an enclosing autocast region (its cache would otherwise hold
    the first network's weights): the samples match the float32 ones to bf16 precision."""
    model, opt = trained(family, model=make_model())
    x, _ = mlp_batch(seed=5)
    exact = sample_probabilities(opt, x, K, seed=10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = sample_probabilities(opt, x, K, seed=10)
    torch.testing.assert_close(low.float(), exact, rtol=0, atol=0.02)
    assert (exact[0] - exact[1]).abs().max() > 0.05  # distinct networks, so a stale cache would show


def test_batched_and_fallback_prediction_paths_draw_the_same_networks(monkeypatch):
    _, opt = trained("diagonal")
    x, _ = mlp_batch(seed=5)
    batched = sample_probabilities(opt, x, K, seed=10)

    def unsupported(blocks, model):
        raise ValueError("forced fallback")

    monkeypatch.setattr(predict_module, "check_batched_support", unsupported)
    fallback = sample_probabilities(opt, x, K, seed=10)
    torch.testing.assert_close(fallback, batched, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# FOOVB.sampled_params
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_params_loads_a_sample_and_restores_the_mean(family):
    model, opt = trained(family)
    mean = params_snapshot(model)
    with opt.sampled_params(seed=4):
        inside = params_snapshot(model)
    assert all(not torch.equal(a, b) for a, b in zip(inside, mean, strict=True))
    assert all_equal(params_snapshot(model), mean)
    expected = sampled_parameters(opt, opt.draw_noise(4, range(1)), 0)
    for (name, _), value in zip(model.named_parameters(), inside, strict=True):
        torch.testing.assert_close(value, expected[name])
    with opt.sampled_params(seed=4):
        assert all_equal(params_snapshot(model), inside)  # seeded
    with opt.sampled_params():
        unseeded = params_snapshot(model)
    assert not all_equal(unseeded, inside)
    with pytest.raises(KeyError, match="boom"):
        with opt.sampled_params(seed=5):
            assert not all_equal(params_snapshot(model), mean)
            raise KeyError("boom")
    assert all_equal(params_snapshot(model), mean)


def test_sampled_params_seed_is_checked_as_predicts():
    """A numpy seed overflowed deep in the noise mixing, a float was a TypeError from '&', and True was taken
    as 1 (predict refuses it)."""
    model, opt = trained("diagonal")
    with opt.sampled_params(seed=np.int64(3)):
        numpy_seeded = params_snapshot(model)
    with opt.sampled_params(seed=3):
        assert all_equal(params_snapshot(model), numpy_seeded)
    for seed in (0.5, True, "3"):
        with pytest.raises(TypeError, match="seed must be an int or None"):
            with opt.sampled_params(seed=seed):
                pass


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4 + 2, 3)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, z = inputs
        return self.fc(torch.cat([x, z], -1))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tuple_of_inputs_is_predicted_one_network_at_a_time(family):
    """model((x, z)): the stacked route read inputs.shape, an AttributeError it did not fall back from."""
    model = _TwoInputs()
    opt = FOOVB(model, family, 4, seed=0)
    inputs = (torch.randn(5, 4), torch.randn(5, 2))
    pred = predict(opt, inputs, K, seed=2)
    noises = opt.draw_noise(2, range(K))
    for k in range(K):
        opt.load_sample(noises, k)
        with torch.no_grad():
            torch.testing.assert_close(pred.samples[k], torch.softmax(model(inputs), -1))
    opt.load_mean_into_model()


def test_passing_the_model_instead_of_the_optimizer_is_a_type_error():
    model, opt = trained("diagonal")
    x, _ = mlp_batch()
    for function in (predict, sample_probabilities):
        with pytest.raises(TypeError, match="takes the FOOVB optimizer"):
            function(model, x, 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_conv_model_samples_one_network_at_a_time_on_the_cpu(family, monkeypatch):
    """A model with a Conv2d on the CPU: the sampled networks are evaluated one at a time (stacked, measured
    slower there), with the draws and probabilities of the stacked route."""
    model = cnn(seed=0)
    opt = FOOVB(model, family, 3, std_init=0.05, seed=0, **PAPER)
    opt.step(lambda: _loss_backward(model, *cnn_batch()))
    x, _ = cnn_batch(seed=5, rows=3)
    with monkeypatch.context() as patch:
        patch.setattr(predict_module, "SampledNetwork", None)  # the stacked route is not taken
        sequential = sample_probabilities(opt, x, K, seed=3)
    monkeypatch.setattr(predict_module, "stacking_is_slower", lambda blocks: False)  # as on a GPU
    stacked = sample_probabilities(opt, x, K, seed=3)
    torch.testing.assert_close(sequential, stacked, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(stacked[0], stacked[1])  # K different networks


@pytest.mark.parametrize("family", FAMILIES)
def test_predictions_under_autocast_have_one_dtype(family):
    """Under bfloat16 autocast the mean was bfloat16 and the samples float32 (diagonal, full) or bfloat16."""
    model, opt = trained(family)
    x, _ = mlp_batch(seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pred = predict(opt, x, K)
    assert pred.samples.dtype == pred.mean.dtype


# ---------------------------------------------------------------------------------------------------------
# Uncertainty: predictive entropy H(p̄), expected entropy (1/K) Σ_k H(p_k), mutual information their difference
# ---------------------------------------------------------------------------------------------------------
LOG2 = float(np.log(2))


def _binary_entropy(q: float) -> float:
    return float(-q * np.log(q) - (1 - q) * np.log(1 - q))


def _dirichlet_samples(num_samples: int, rows: int, classes: int, concentration: float, seed: int) -> torch.Tensor:
    """(K, r, C) random class probabilities: sharp (one-hot-like) for a small concentration, flat for a large one."""
    torch.manual_seed(seed)
    return torch.distributions.Dirichlet(torch.full((classes,), concentration)).sample((num_samples, rows)).double()


def test_uncertainty_closed_forms_on_hand_built_probabilities():
    """Identical samples: no epistemic part, whatever their entropy. Disagreeing one-hot samples: all of it."""
    quarter = torch.tensor([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]], dtype=torch.float64)
    agreeing = uncertainty_from_samples(quarter.expand(4, -1, -1))
    torch.testing.assert_close(agreeing.predictive_entropy, torch.tensor([1.5 * LOG2, 0.0], dtype=torch.float64))
    torch.testing.assert_close(agreeing.expected_entropy, agreeing.predictive_entropy)
    assert torch.equal(agreeing.mutual_information, torch.zeros(2, dtype=torch.float64))
    torch.testing.assert_close(agreeing.probabilities, quarter)

    one_hot = torch.tensor([[[1.0, 0.0, 0.0]], [[0.0, 1.0, 0.0]]])  # K = 2 networks, one input, 3 classes
    disagreeing = uncertainty_from_samples(one_hot)
    torch.testing.assert_close(disagreeing.predictive_entropy, torch.tensor([LOG2]))
    assert torch.equal(disagreeing.expected_entropy, torch.zeros(1))
    torch.testing.assert_close(disagreeing.mutual_information, torch.tensor([LOG2]))
    torch.testing.assert_close(disagreeing.probabilities, torch.tensor([[0.5, 0.5, 0.0]]))

    # confident networks that disagree, 0.9/0.1 against 0.1/0.9: I = log 2 − H(0.9)
    confident = uncertainty_from_samples(torch.tensor([[[0.9, 0.1]], [[0.1, 0.9]]], dtype=torch.float64))
    torch.testing.assert_close(confident.predictive_entropy, torch.tensor([LOG2], dtype=torch.float64))
    torch.testing.assert_close(confident.expected_entropy, torch.tensor([_binary_entropy(0.9)], dtype=torch.float64))
    torch.testing.assert_close(confident.mutual_information,
                               torch.tensor([LOG2 - _binary_entropy(0.9)], dtype=torch.float64))

    # C networks each sure of another class: H(p̄) = I = log C; uniform networks: H(p̄) = log C, I = 0
    classes = 5
    spread = uncertainty_from_samples(torch.eye(classes)[:, None, :])
    torch.testing.assert_close(spread.mutual_information, torch.tensor([np.log(classes)], dtype=torch.float32))
    flat = uncertainty_from_samples(torch.full((3, 1, classes), 1 / classes))
    torch.testing.assert_close(flat.predictive_entropy, torch.tensor([np.log(classes)], dtype=torch.float32))
    assert torch.equal(flat.mutual_information, torch.zeros(1))


@pytest.mark.parametrize(("num_samples", "classes", "concentration"),
                         [(2, 2, 0.3), (10, 10, 0.1), (10, 10, 1.0), (7, 3, 50.0), (1, 4, 1.0)])
def test_uncertainty_bounds_and_sample_order(num_samples, classes, concentration):
    """0 <= I = H(p̄) − E_k H(p_k) <= min(log C, log K), H(p̄) <= log C, from the raw entropies (not the clipped
    I), on random probabilities; the decomposition does not depend on the order of the samples."""
    samples = _dirichlet_samples(num_samples, 500, classes, concentration, seed=classes)
    result = uncertainty_from_samples(samples)
    assert result.predictive_entropy.shape == result.mutual_information.shape == (500,)
    tolerance = 1e-12
    assert bool((result.predictive_entropy - result.expected_entropy >= -tolerance).all())  # Jensen
    assert bool((result.predictive_entropy <= np.log(classes) + tolerance).all())
    assert bool((result.expected_entropy >= 0).all())
    bound = min(np.log(classes), np.log(num_samples))
    assert bool((result.mutual_information >= 0).all()) and bool((result.mutual_information <= bound + tolerance).all())
    torch.testing.assert_close(result.mutual_information,
                               (result.predictive_entropy - result.expected_entropy).clamp_min(0), rtol=0, atol=0)
    def entropy(probabilities):  # 0 log 0 = 0 (a sharp Dirichlet draw can underflow to 0)
        return -(probabilities * probabilities.log()).nan_to_num().sum(-1)

    torch.testing.assert_close(result.predictive_entropy, entropy(samples.mean(0)))
    torch.testing.assert_close(result.expected_entropy, entropy(samples).mean(0))
    if num_samples == 1:
        assert torch.equal(result.mutual_information, torch.zeros(500, dtype=torch.float64))
    shuffled = uncertainty_from_samples(samples[torch.randperm(num_samples, generator=make_generator(0))])
    for field in ("probabilities", "predictive_entropy", "expected_entropy", "mutual_information"):
        torch.testing.assert_close(getattr(shuffled, field), getattr(result, field), rtol=0, atol=1e-12)


def test_uncertainty_keeps_leading_shape_and_dtype_and_refuses_non_probabilities():
    samples = _dirichlet_samples(3, 8, 4, 1.0, seed=0).float().reshape(3, 2, 4, 4)  # (K, rows, tokens, classes)
    result = uncertainty_from_samples(samples)
    assert result.predictive_entropy.shape == result.expected_entropy.shape == (2, 4)
    assert result.probabilities.shape == (2, 4, 4) and result.mutual_information.dtype == torch.float32
    torch.testing.assert_close(result.mutual_information.flatten(),
                               uncertainty_from_samples(samples.flatten(1, 2)).mutual_information)
    logits = torch.randn(3, 5, 4)
    for not_probabilities in (logits, logits.log_softmax(-1), torch.full((3, 5, 4), float("nan"))):
        with pytest.raises(ValueError, match="must be class probabilities"):
            uncertainty_from_samples(not_probabilities)
    for bad_shape in (torch.ones(4), torch.ones(0, 5, 4), torch.ones(3, 5, 0)):
        with pytest.raises(ValueError, match=r"shape \(K, \.\.\., C\)"):
            uncertainty_from_samples(bad_shape)


@pytest.mark.parametrize("family", FAMILIES)
def test_uncertainty_of_the_posterior_is_that_of_predicts_samples(family):
    """uncertainty(opt, x, K) decomposes the probabilities of predict's K sampled networks; it is computed per
    input (a row alone gives the same numbers) and leaves the posterior, the weights and the modes as they were."""
    model, opt = trained(family)
    x, _ = mlp_batch(seed=5, rows=7)
    posterior, params = posterior_snapshot(opt), params_snapshot(model)
    model.train()
    result = uncertainty(opt, x, K, seed=3)
    samples = predict(opt, x, K, seed=3).samples
    expected = uncertainty_from_samples(samples)
    for field in ("probabilities", "predictive_entropy", "expected_entropy", "mutual_information"):
        assert torch.equal(getattr(result, field), getattr(expected, field))
    torch.testing.assert_close(result.probabilities, samples.mean(0))
    assert bool((result.mutual_information > 1e-4).all())  # the sampled networks disagree: std > 0
    assert all_equal(posterior_snapshot(opt), posterior) and all_equal(params_snapshot(model), params)
    assert model.training and all(m.training for m in model.modules())
    row = uncertainty(opt, x[2:3], K, seed=3)
    torch.testing.assert_close(row.mutual_information, result.mutual_information[2:3], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(uncertainty(opt, x, K, seed=3, chunk_size=4).mutual_information,
                               result.mutual_information, atol=1e-6, rtol=1e-5)
    assert not torch.equal(uncertainty(opt, x, K, seed=4).mutual_information, result.mutual_information)


def test_uncertainty_arguments_are_checked_and_autocast_probabilities_are_accepted():
    model, opt = trained("diagonal")
    x, _ = mlp_batch(seed=5)
    with pytest.raises(TypeError, match="takes the FOOVB optimizer"):
        uncertainty(model, x, 2)
    with pytest.raises(ValueError, match="num_samples"):
        uncertainty(opt, x, 0)
    exact = uncertainty(opt, x, K)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bfloat16 probabilities sum to 1 only to ~3e-3
        low = uncertainty(opt, x, K)
    torch.testing.assert_close(low.predictive_entropy.float(), exact.predictive_entropy, rtol=0, atol=0.05)


def test_a_one_output_model_needs_an_output_fn():
    """The default output_fn is a softmax over the classes: over a regression net's one output it was 1 for every
    input (and uncertainty()'s entropies 0), without a word; refused, naming the output_fn to pass."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = FOOVB(model, mc_samples=4, seed=0)
    x = torch.randn(5, 4)
    for call in (lambda: predict(opt, x), lambda: predict(opt, x, 4), lambda: uncertainty(opt, x, 4)):
        with pytest.raises(ValueError, match=r"one output per row, whose softmax is always 1.*output_fn"):
            call()
    values = predict(opt, x, 4, output_fn=lambda out: out.squeeze(-1))
    assert values.mean.shape == (5,) and values.samples.shape == (4, 5)
    torch.testing.assert_close(values.mean, model(x).squeeze(-1).detach())


class _DictOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = mlp(seed=0)

    def forward(self, x):
        return {"logits": self.body(x), "features": x}


def test_a_model_that_returns_a_dict_or_tuple_needs_an_output_fn_and_uncertainty_takes_one():
    """A user's trial (session 56): predict() and uncertainty() on a model returning a dict failed with "'dict' object
    has no attribute 'shape'" inside the default softmax, and uncertainty() had no output_fn. A ValueError names
    output_fn; with one, both give the logits' softmax, uncertainty() that of predict()'s samples."""
    model = _DictOutput()
    opt = FOOVB(model, mc_samples=4, seed=0)
    x, _ = mlp_batch()
    for call in (lambda: predict(opt, x), lambda: predict(opt, x, 3), lambda: uncertainty(opt, x, 3)):
        with pytest.raises(ValueError, match=r"returns a dict, not a tensor of class logits: pass output_fn"):
            call()
    probabilities = lambda out: out["logits"].softmax(-1)  # noqa: E731
    got = predict(opt, x, 3, output_fn=probabilities)
    torch.testing.assert_close(got.mean, model.body(x).softmax(-1).detach())
    measured = uncertainty(opt, x, 3, output_fn=probabilities)
    torch.testing.assert_close(measured.probabilities, got.samples.mean(0))


def test_step_batched_takes_tensors_only():
    """step_batched([x], y) failed with "'list' object has no attribute 'shape'" in the engine: one ValueError naming
    step(closure)."""
    model = mlp(seed=0)
    opt = FOOVB(model, mc_samples=4, seed=0)
    x, y = mlp_batch()
    for inputs, targets, name in (([x], y, "inputs"), (x, y.tolist(), "targets")):
        with pytest.raises(ValueError, match=rf"one tensor of {name} .* got a list: .* use step\(closure\)"):
            opt.step_batched(inputs, targets)
    assert all_equal(params_snapshot(model), params_snapshot(mlp(seed=0)))
