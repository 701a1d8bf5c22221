"""foovb.priors, the initial posterior: the default prior std (std_init="xavier"): each layer's
sqrt(2 / (fan_in + fan_out)), from the shapes only, on fresh, pretrained and degenerate models; the model's weights
stay the prior mean; embeddings; the default posterior "auto"; and the initialisations of the means and stds (the
paper's, "bgd", "alpha", "keep": paper appendix "Implementation details")."""

import math

import pytest
import torch
from conftest import FAMILIES, PAPER, all_equal, mlp, params_snapshot
from torch import nn

from foovb import FOOVB
from foovb.priors import AUTO_MAX_FEATURES, PAPER_STD_INIT, xavier_std

pytestmark = pytest.mark.usefixtures("single_thread")


def paper_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10))


def small_cnn(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 6, 5), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 4 * 4, 10))


def stds(opt: FOOVB, model: nn.Module) -> list[torch.Tensor]:
    return [opt.posterior(p).std for p in model.parameters()]


def test_xavier_std_is_the_paper_sigma_init_on_its_first_layer_and_grows_towards_the_head():
    layer = nn.Linear(784, 100)
    assert xavier_std(layer.weight) == pytest.approx(math.sqrt(2 / 884))
    assert xavier_std(layer.weight) == pytest.approx(PAPER_STD_INIT, rel=0.013)  # the paper's 0.047 is this layer's
    assert xavier_std(layer.bias, layer) == xavier_std(layer.weight)  # a bias takes its weight's fans
    head = nn.Linear(100, 10)
    assert xavier_std(head.weight) == pytest.approx(math.sqrt(2 / 110))  # 0.135: ~3x the first layer's


def test_xavier_std_of_convolutions_counts_the_kernel_and_groups():
    conv = nn.Conv2d(4, 8, (3, 5), groups=2)  # weight (8, 2, 3, 5): fan_in 2 * 15, fan_out 8 * 15
    assert xavier_std(conv.weight) == pytest.approx(math.sqrt(2 / (30 + 120)))
    # the std of torch's Xavier-normal initialisation of the same weight (1,000 draws of its 240 entries)
    draws = torch.stack([nn.init.xavier_normal_(torch.empty(8, 2, 3, 5)) for _ in range(1000)])
    assert draws.std().item() == pytest.approx(xavier_std(conv.weight), rel=0.02)


@pytest.mark.parametrize("wrap", ["spectral_norm", "weight_norm"])
def test_a_parametrized_layers_bias_takes_its_weights_fans(wrap):
    """A user's trial (session 56): after torch.nn.utils.parametrizations.spectral_norm or weight_norm the weight is
    no direct parameter of the layer, so its bias took the paper's 0.047 (8x narrower than the plain layer's 0.378).
    It takes the fans of the weight's largest original tensor (weight_norm's direction, not its magnitude)."""
    layer = getattr(torch.nn.utils.parametrizations, wrap)(nn.Linear(6, 8))
    assert xavier_std(layer.bias, layer) == pytest.approx(math.sqrt(2 / 14)) == xavier_std(nn.Linear(6, 8).weight)
    model = nn.Sequential(layer, nn.ReLU(), nn.Linear(8, 3))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    assert FOOVB(model, seed=0).posterior(layer.bias).std.mean().item() == pytest.approx(math.sqrt(2 / 14))
    # FOOVB(model) evaluated the computed weight, which advanced spectral_norm's power iteration (its vector u)
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())


@pytest.mark.parametrize("param", [torch.ones(6), torch.tensor(1.0), torch.empty(0, 3)])
def test_parameters_without_fans_take_the_paper_sigma_init(param):
    assert xavier_std(param, nn.BatchNorm2d(6)) == PAPER_STD_INIT


@pytest.mark.parametrize("family", ["diagonal", "full"])
def test_the_default_prior_is_per_layer_and_the_weights_are_kept(family):
    model = paper_mlp() if family == "diagonal" else nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 3))
    before = [p.detach().clone() for p in model.parameters()]
    opt = FOOVB(model, family)
    assert opt.param_groups[0]["std_init"] == "xavier"
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    linears = [m for m in model if isinstance(m, nn.Linear)]
    for module in linears:
        want = math.sqrt(2 / (module.in_features + module.out_features))
        for param in (module.weight, module.bias):
            std = opt.posterior(param).std
            torch.testing.assert_close(std, torch.full_like(std, want))
    widths = [opt.posterior(m.weight).std[0, 0].item() for m in linears]
    assert widths == sorted(widths)  # narrower layers towards the head: wider priors


def test_pretrained_scaled_and_zero_weights_get_the_same_finite_prior_and_stay_the_mean():
    reference = paper_mlp(0)
    want = stds(FOOVB(reference, "diagonal"), reference)
    pretrained = paper_mlp(1)
    with torch.no_grad():
        pretrained[0].weight.mul_(10)  # a trained layer of another scale
        pretrained[2].weight.zero_()  # no usable scale at all
        pretrained[4].bias.fill_(3.0)  # constant
    before = [p.detach().clone() for p in pretrained.parameters()]
    default = FOOVB(pretrained)  # posterior="auto": matrix-variate layers, the weights still the mean
    assert all(torch.equal(p, b) and torch.equal(default.posterior(p).mean, b)
               for p, b in zip(pretrained.parameters(), before, strict=True))
    opt = FOOVB(pretrained, "diagonal")
    got = stds(opt, pretrained)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all() and torch.equal(g, w)
        assert 0.04 < g.min() and g.max() < 0.14  # the MLP's range: 0.0476 .. 0.135
    assert all(torch.equal(p, b) and torch.equal(opt.posterior(p).mean, b)
               for p, b in zip(pretrained.parameters(), before, strict=True))


def test_norm_layers_take_the_paper_sigma_init_and_convolutions_their_own():
    model = small_cnn()
    opt = FOOVB(model, "diagonal")
    assert opt.posterior(model[1].weight).std.unique().tolist() == [pytest.approx(PAPER_STD_INIT)]
    conv_std = opt.posterior(model[0].bias).std
    torch.testing.assert_close(conv_std, torch.full_like(conv_std, math.sqrt(2 / (25 + 150))))


def test_the_matrix_variate_fallback_blocks_use_the_per_layer_rule():
    wide = nn.Linear(5, 1100)  # "auto", the kronecker family's settings: a layer over 1,024 wide falls back to diagonal
    opt = FOOVB(wide)  # (an nn.LSTM did before session 55, when "auto" kept recurrent layers diagonal)
    assert [block.family for block in opt.blocks] == ["diagonal", "diagonal"]
    std = opt.posterior(wide.weight).std  # (1100, 5): fan_in 5, fan_out 1100
    torch.testing.assert_close(std, torch.full_like(std, math.sqrt(2 / 1105)))


def test_one_number_or_the_paper_preset_still_gives_one_std_everywhere():
    model = paper_mlp()
    for opt in (FOOVB(model, "diagonal", std_init=0.02), FOOVB(model, "diagonal", preset="paper", init="keep")):
        values = torch.cat([s.flatten() for s in stds(opt, model)]).unique()
        assert values.numel() == 1 and values.item() == pytest.approx(opt.param_groups[0]["std_init"])


@pytest.mark.parametrize("bad", ["Xavier", "glorot", "", -0.1, math.nan, True])
def test_std_init_is_a_positive_number_or_xavier(bad):
    with pytest.raises(ValueError, match="std_init must be a number .* or 'xavier'"):
        FOOVB(paper_mlp(), std_init=bad)


def test_a_state_dict_with_the_per_layer_prior_round_trips():
    model = paper_mlp()
    opt = FOOVB(model, mc_samples=2, seed=0)
    x, y = torch.randn(16, 784), torch.randint(10, (16,))

    def closure():
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    state = opt.state_dict()
    other = paper_mlp(3)
    restored = FOOVB(other, mc_samples=2, seed=0)
    restored.load_state_dict(state)
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(opt.posterior(p).std, restored.posterior(q).std)


@pytest.mark.parametrize("family", ["diagonal", "kronecker"])
@pytest.mark.parametrize("table", [nn.Embedding, nn.EmbeddingBag])
def test_an_embedding_table_is_a_linear_layer_on_one_hot_inputs(family, table):
    """fan_in 1 (one active input per row), fan_out the embedding's width, whatever the vocabulary's size: with
    the (vocabulary, width) fans a 20,000-word table got std 0.01 and its rows barely moved."""
    torch.manual_seed(0)
    model = nn.Sequential(table(20_000, 32), nn.Linear(32, 2))
    opt = FOOVB(model, family)
    assert opt.posterior(model[0].weight).std.unique().tolist() == pytest.approx([math.sqrt(2 / 33)])
    small = table(10, 32)
    assert xavier_std(small.weight, small) == pytest.approx(math.sqrt(2 / 33))


@pytest.mark.slow  # 60 steps of a 20,000-row embedding: 2-3 s single-threaded, 3x the slowest unmarked test
def test_a_large_embedding_table_learns_a_lookup_with_the_default_prior():
    """200 of 20,000 tokens, each with a random label, 60 steps of 64: the table's rows must move to fit them."""
    torch.manual_seed(0)
    labels = torch.randint(0, 2, (200,))
    model = nn.Sequential(nn.Embedding(20_000, 32), nn.Flatten(), nn.Linear(32, 2))
    opt = FOOVB(model, seed=0)
    generator = torch.Generator().manual_seed(0)
    for _ in range(60):
        tokens = torch.randint(0, 200, (64, 1), generator=generator)

        def closure(tokens=tokens):
            loss = nn.functional.cross_entropy(model(tokens), labels[tokens[:, 0]])
            loss.backward()
            return loss

        opt.step(closure)
    with torch.no_grad():
        accuracy = (model(torch.arange(200)[:, None]).argmax(1) == labels).float().mean().item()
    assert accuracy > 0.85  # 0.65 with the vocabulary as fan_out (std 0.01), 0.94 now


class _Bag(nn.Module):
    """Mean of token embeddings (padding index 0), then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table, self.head = nn.Embedding(20, 8, padding_idx=0), nn.Linear(8, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(tokens).mean(1))


@pytest.mark.parametrize("family", ["diagonal", "kronecker", "full"])
def test_an_embeddings_padding_row_stays_fixed_in_every_sampled_network(family):
    """torch never changes the padding row (it gets no gradient); with a prior std it stayed at that std and added
    noise on every padding token of every sampled network (a bag-of-words model's sampled accuracy fell with the
    padding length). Its std is 0 now, and a pretrained value there is kept."""
    model = _Bag()
    with torch.no_grad():
        model.table.weight[0] = 0.25  # a value the user put there
    opt = FOOVB(model, family, 4, seed=0)
    tokens = torch.cat([torch.randint(1, 20, (16, 5)), torch.zeros(16, 7, dtype=torch.long)], 1)
    labels = (tokens[:, 0] > 10).long()

    def closure():
        loss = torch.nn.functional.cross_entropy(model(tokens), labels)
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    view = opt.posterior(model.table.weight)
    assert torch.equal(view.std[0], torch.zeros(8)) and bool((view.std[1:] > 0.1).all())
    assert torch.equal(view.mean[0], torch.full((8,), 0.25))
    for seed in range(3):
        with opt.sampled_params(seed=seed):
            assert torch.equal(model.table.weight[0], torch.full((8,), 0.25))


class _ScaledTable(nn.Embedding):
    """An embedding table with a second trainable tensor in the same module (a per-dimension scale)."""

    def __init__(self) -> None:
        super().__init__(10, 4, padding_idx=2)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) * self.scale


@pytest.mark.parametrize("family", ["diagonal", "kronecker", "full"])
def test_the_padding_row_is_found_beside_another_tensor_of_the_module(family):
    """The table's block was taken to be the module's last: the scale got std 0 (never trained) instead."""
    torch.manual_seed(0)
    model = nn.Sequential(_ScaledTable(), nn.Linear(4, 2))
    opt = FOOVB(model, family, 2, seed=0)
    table = opt.posterior(model[0].weight).std
    assert torch.equal(table[2], torch.zeros(4)) and bool((table[[0, 1, 3]] > 0).all())
    assert bool((opt.posterior(model[0].scale).std > 0).all())


def families(opt: FOOVB) -> dict[str, str]:
    names = {id(p): name for name, p in opt.model.named_parameters()}
    return {names[id(p)]: block.family for block in opt.blocks for p in block.params}


def test_the_default_posterior_is_matrix_variate_where_affordable_and_diagonal_elsewhere():
    """posterior="auto": Algorithm 3 for float Linear / Conv2d layers with at most AUTO_MAX_FEATURES inputs (fan_in)
    and outputs, the diagonal posterior for every other tensor."""
    torch.manual_seed(0)
    # only the shapes matter here (the model is not run)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, AUTO_MAX_FEATURES),
                          nn.Linear(AUTO_MAX_FEATURES, 3), nn.LayerNorm(3),
                          nn.Linear(3, AUTO_MAX_FEATURES + 1, bias=False), nn.Linear(AUTO_MAX_FEATURES + 1, 2),
                          nn.Conv2d(113, 8, 3), nn.Conv2d(1, 8, (1, 1025)))
    opt = FOOVB(model)
    assert opt.posterior_family == "auto"
    assert families(opt) == {
        "0.weight": "kronecker", "0.bias": "kronecker", "1.weight": "diagonal", "1.bias": "diagonal",
        "3.weight": "kronecker", "3.bias": "kronecker",  # 1024 outputs
        "4.weight": "kronecker", "4.bias": "kronecker",  # 1024 inputs
        "5.weight": "diagonal", "5.bias": "diagonal",
        "6.weight": "diagonal",  # 1025 outputs
        "7.weight": "diagonal", "7.bias": "diagonal",  # 1025 inputs
        "8.weight": "kronecker", "8.bias": "kronecker",  # fan_in 113 x 3 x 3 = 1017
        "9.weight": "diagonal", "9.bias": "diagonal",  # fan_in 1 x 1 x 1025
    }


def test_the_default_posterior_falls_back_where_the_matrix_family_refuses():
    """Where posterior="kronecker" raises (half-precision factors, a frozen bias beside a trainable weight), the
    default takes the diagonal posterior for that layer; an explicit kronecker still raises."""
    torch.manual_seed(0)
    half = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2)).bfloat16()
    assert set(families(FOOVB(half)).values()) == {"diagonal"}
    with pytest.raises(ValueError, match="bfloat16"):
        FOOVB(half, "kronecker")
    frozen_bias = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 2))
    frozen_bias[0].bias.requires_grad_(False)
    assert families(FOOVB(frozen_bias)) == {"0.weight": "diagonal", "1.weight": "kronecker", "1.bias": "kronecker"}
    with pytest.raises(ValueError, match="frozen bias"):
        FOOVB(frozen_bias, "kronecker")


def test_the_default_posterior_is_the_kronecker_family_on_a_model_it_covers():
    """On a model whose every layer is affordable, posterior="auto" takes the same steps as posterior="kronecker"
    (the same settings, the same noise); a state dict of one does not load into the other."""
    data, labels = torch.randn(32, 20), torch.randint(0, 3, (32,))
    trained = {}
    for posterior in ("auto", "kronecker"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 3))
        opt = FOOVB(model, posterior, mc_samples=4, seed=3)
        for _ in range(3):
            def closure(model: nn.Module = model) -> torch.Tensor:
                loss = nn.functional.cross_entropy(model(data), labels)
                loss.backward()
                return loss
            opt.step(closure)
        trained[posterior] = (model, opt)
    for auto, kron in zip(trained["auto"][0].parameters(), trained["kronecker"][0].parameters(), strict=True):
        assert torch.equal(auto, kron)
    with pytest.raises(ValueError, match="posterior: saved 'kronecker', here 'auto'"):
        FOOVB(trained["auto"][0], mc_samples=4).load_state_dict(trained["kronecker"][1].state_dict())


def test_the_default_posterior_initialises_its_diagonal_layers_with_the_paper_preset():
    """preset="paper" re-initialises every layer: the matrix-variate ones draw their means (Implementation
    details), the diagonal fallback ones get the paper's N(0, 2 / (fan_in + fan_out))."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(AUTO_MAX_FEATURES + 10, 20), nn.Linear(20, 5))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    opt = FOOVB(model, preset="paper", seed=0)
    assert families(opt)["0.weight"] == "diagonal" and families(opt)["1.weight"] == "kronecker"
    assert model[0].weight.std().item() == pytest.approx(xavier_std(model[0].weight), rel=0.05)
    assert torch.equal(model[0].bias, torch.zeros(20))


# ---------------------------------------------------------------------------------------------------------
# Initialisation (paper appendix "Implementation details")
# ---------------------------------------------------------------------------------------------------------
def _check_normal_sample(values, std):
    """Mean 0 and standard deviation `std`, to 6 standard errors (SE of the std ~ std / sqrt(2 N))."""
    n = values.numel()
    assert abs(values.mean().item()) < 6 * std / math.sqrt(n)
    assert abs(values.std().item() / std - 1) < 6 / math.sqrt(2 * n)


@pytest.mark.parametrize("family", ["diagonal", "full"])
def test_paper_init_diagonal_and_full(family):
    torch.manual_seed(0)
    if family == "diagonal":
        model = nn.Sequential(nn.Linear(400, 500), nn.Conv2d(32, 64, 3))
    else:
        model = nn.Sequential(nn.Linear(40, 50))
    opt = FOOVB(model, family, std_init=0.03, seed=0, **PAPER)
    for module in model:
        fan_in, fan_out = module.weight[0].numel(), module.weight.shape[0] * module.weight[0, 0].numel()
        _check_normal_sample(module.weight.detach(), math.sqrt(2 / (fan_in + fan_out)))
        assert torch.equal(module.bias.detach(), torch.zeros_like(module.bias))
        for p in (module.weight, module.bias):
            torch.testing.assert_close(opt.posterior(p).std, torch.full_like(p, 0.03), rtol=1e-6, atol=0)


def test_bgd_init_draws_biases_with_fan_out_variance():
    """init="bgd": the paper's weights and the BGD code's biases N(0, 2 / (1 + fan_out)). The last layer has
    fan_in >> fan_out, where 2 / (1 + fan_out) is 5x 2 / (fan_in + fan_out)."""
    model = nn.Sequential(nn.Linear(30, 4000), nn.Conv2d(3, 500, 3), nn.Linear(2000, 500))
    FOOVB(model, "diagonal", init="bgd", seed=0, **PAPER)
    for module in model:
        fan_in, fan_out = module.weight[0].numel(), module.weight.shape[0] * module.weight[0, 0].numel()
        _check_normal_sample(module.weight.detach(), math.sqrt(2 / (fan_in + fan_out)))
        _check_normal_sample(module.bias.detach(), math.sqrt(2 / (1 + fan_out)))


@pytest.mark.parametrize("family", ["diagonal", "full"])
def test_alpha_init_matches_the_matrix_variate_family(family):
    """init="alpha": per layer, means N(0, 2 alpha / (n_in + 2)) and the prior std of the matrix-variate
    family at initialisation, sqrt(2 (1 - alpha) / (n_in + 2)); parameters outside Linear/Conv keep std_init."""
    alpha = 0.3
    (n_in0, n_out0), (c_in, c_out) = ((400, 500), (32, 64)) if family == "diagonal" else ((30, 40), (4, 5))

    def layers():
        return [nn.Linear(n_in0, n_out0), nn.Conv2d(c_in, c_out, 3)]

    model = nn.Sequential(*layers(), nn.GroupNorm(1, c_out))
    opt = FOOVB(model, family, std_init=0.03, init="alpha", alpha=alpha, seed=0, **PAPER)
    for module, twin in zip(model[:2], layers(), strict=True):
        n_in = module.weight[0].numel()
        kronecker = FOOVB(twin, "kronecker", alpha=alpha, seed=0, **PAPER)
        if family == "diagonal":  # enough draws for a distribution check
            _check_normal_sample(module.weight.detach(), math.sqrt(2 * alpha / (n_in + 2)))
        for index, p in enumerate((module.weight, module.bias)):
            expected = kronecker.posterior(kronecker.blocks[0].params[index]).std
            torch.testing.assert_close(opt.posterior(p).std, expected)
            assert not torch.equal(p.detach(), torch.zeros_like(p))  # biases are drawn too
    for p in model[2].parameters():
        torch.testing.assert_close(opt.posterior(p).std, torch.full_like(p, 0.03), rtol=1e-6, atol=0)


# n_in = 2: the mean's variance 2 alpha / (n_in + 2) is 3/4 of 2 alpha / (n_in + 1), visible in 6000 draws
@pytest.mark.parametrize("module", [nn.Linear(400, 500), nn.Conv2d(32, 64, 3), nn.Linear(2, 2000)],
                         ids=["linear", "conv", "linear-2-inputs"])
def test_paper_init_kronecker(module):
    alpha = 0.3
    opt = FOOVB(module, "kronecker", alpha=alpha, seed=0, **PAPER)
    block = opt.blocks[0]
    n_in = module.weight[0].numel()
    _check_normal_sample(block.state["mean"], math.sqrt(2 * alpha / (n_in + 2)))
    for key in ("input_sqrt_cov", "output_sqrt_cov"):
        factor = block.state[key]
        assert torch.equal(factor, torch.diag(factor.diagonal()))
    a_diag, b_diag = block.state["input_sqrt_cov"].diagonal(), block.state["output_sqrt_cov"].diagonal()
    torch.testing.assert_close(torch.outer(b_diag, a_diag) ** 2,
                               torch.full((b_diag.numel(), a_diag.numel()), 2 * (1 - alpha) / (n_in + 2)))
    # marginal Var(W_ij) = 2 alpha / (n_in + 2) (mean) + 2 (1 - alpha) / (n_in + 2) (posterior) = 2/(n_in + 2)
    std = opt.posterior(module.weight).std
    torch.testing.assert_close(std, torch.full_like(std, math.sqrt(2 * (1 - alpha) / (n_in + 2))))
    assert torch.equal(module.weight.detach(), block.mean_values()[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_init_keep_keeps_model_weights_and_paper_init_is_seeded(family):
    model = mlp(seed=4)
    before = params_snapshot(model)
    FOOVB(model, family, init="keep", **PAPER)
    assert all_equal(params_snapshot(model), before)
    inits = []
    for seed in (1, 1, 2):
        model = mlp(seed=4)
        FOOVB(model, family, seed=seed, **PAPER)
        inits.append(params_snapshot(model))
    assert not all_equal(inits[0], before)
    assert all_equal(inits[0], inits[1]) and not all_equal(inits[0], inits[2])
