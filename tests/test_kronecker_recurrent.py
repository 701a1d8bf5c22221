"""The matrix-variate family on recurrent layers (posterior="kronecker", session 52; "auto" since session 55):
one block per weight matrix with its bias (weight_ih_l0 with bias_ih_l0, weight_hh_l0 with bias_hh_l0, an LSTM's
projection alone), and the update of Algorithm 3 on them against a direct computation from each sample's gradients
(autograd at the sampled weights, rebuilt from the step's noise)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_algorithm_3_step, make_generator, random_sqrt
from torch import nn

from foovb import FOOVB
from foovb.posteriors import KroneckerBlock

pytestmark = pytest.mark.usefixtures("single_thread")

F64 = torch.float64


class Reader(nn.Module):
    """A recurrent layer read at its last step, then a Linear head."""

    def __init__(self, kind: str, **options):
        super().__init__()
        self.rnn = getattr(nn, kind)(3, 5, batch_first=True, **options)
        width = options.get("proj_size") or 5
        self.head = nn.Linear(width * (2 if options.get("bidirectional") else 1), 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def families(model: nn.Module, opt: FOOVB) -> list[tuple[str, list[str]]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [(block.family, [names[id(p)] for p in block.params]) for block in opt.blocks]


@pytest.mark.parametrize(("kind", "options", "matrices"), [
    ("GRU", {}, [["rnn.weight_ih_l0", "rnn.bias_ih_l0"], ["rnn.weight_hh_l0", "rnn.bias_hh_l0"]]),
    ("RNN", {"bias": False}, [["rnn.weight_ih_l0"], ["rnn.weight_hh_l0"]]),
    ("LSTM", {"proj_size": 2}, [["rnn.weight_ih_l0", "rnn.bias_ih_l0"], ["rnn.weight_hh_l0", "rnn.bias_hh_l0"],
                                ["rnn.weight_hr_l0"]]),
    ("LSTM", {"num_layers": 2, "bidirectional": True},
     [[f"rnn.weight_{m}_l{layer}{d}", f"rnn.bias_{m}_l{layer}{d}"] for layer in (0, 1) for d in ("", "_reverse")
      for m in ("ih", "hh")]),
])
def test_every_weight_matrix_of_a_recurrent_layer_is_a_matrix_variate_block(kind, options, matrices):
    torch.manual_seed(0)
    model = Reader(kind, **options)
    got = families(model, FOOVB(model, "kronecker"))
    assert sorted(names for family, names in got if family == "kronecker") == sorted(
        matrices + [["head.weight", "head.bias"]])
    assert all(family == "kronecker" for family, _ in got)
    assert families(model, FOOVB(model)) == got  # "auto" too since session 55 (the recurrent layer diagonal before)


def test_auto_keeps_a_recurrent_layer_diagonal_where_one_of_its_matrices_is_over_1024_wide():
    """An LSTM's weight_hh has 4 x hidden rows: 256 units are matrix-variate under "auto", 257 leave the whole layer
    diagonal (as a Linear over 1,024 wide); "kronecker" takes any width."""
    for hidden, family in ((256, "kronecker"), (257, "diagonal")):
        model = nn.LSTM(3, hidden)
        assert {block.family for block in FOOVB(model).blocks} == {family}
    assert {block.family for block in FOOVB(nn.LSTM(3, 257), "kronecker").blocks} == {"kronecker"}


def test_a_state_dict_saved_when_auto_made_recurrent_layers_diagonal_says_so(monkeypatch):
    """FOOVB(model) made recurrent layers diagonal before session 55: its state dicts are refused with the reason."""
    from foovb import priors

    torch.manual_seed(0)
    model = Reader("GRU")
    auto = priors.auto_matrix_variate
    with monkeypatch.context() as patch:
        patch.setattr(priors, "auto_matrix_variate", lambda module, matrices: (
            not isinstance(module, nn.RNNBase) and auto(module, matrices)))
        saved = FOOVB(model).state_dict()
    with pytest.raises(ValueError, match=r"holds a diagonal posterior where this FOOVB keeps the kronecker posterior "
                                         r"of parameter 0 \('rnn.weight_ih_l0'.*nn.RNN / nn.GRU / nn.LSTM layers"):
        FOOVB(model).load_state_dict(saved)


def test_a_frozen_recurrent_weight_leaves_its_bias_diagonal_and_a_frozen_bias_is_refused():
    """As for a Linear layer. The whole layer went diagonal, silently, when any of its tensors was frozen."""
    torch.manual_seed(0)
    model = Reader("GRU")
    model.rnn.weight_hh_l0.requires_grad_(False)
    got = families(model, FOOVB(model, "kronecker"))
    assert ("kronecker", ["rnn.weight_ih_l0", "rnn.bias_ih_l0"]) in got and ("diagonal", ["rnn.bias_hh_l0"]) in got
    assert not any("rnn.weight_hh_l0" in names for _, names in got)
    model.rnn.weight_hh_l0.requires_grad_(True)
    model.rnn.bias_ih_l0.requires_grad_(False)
    with pytest.raises(ValueError, match="'rnn': a frozen bias with a trainable weight is not supported"):
        FOOVB(model, "kronecker")


def test_freezing_half_of_a_recurrent_matrix_after_building_names_the_pair():
    torch.manual_seed(0)
    model = Reader("LSTM")
    opt = FOOVB(model, "kronecker")
    model.rnn.weight_hh_l0.requires_grad_(False)
    x, y = torch.randn(4, 6, 3), torch.randint(0, 2, (4,))

    def closure():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    with pytest.raises(ValueError, match="LSTM covers its weight_hh_l0 and bias_hh_l0 together"):
        opt.step(closure)


def test_cells_are_matrix_variate_and_weight_normed_layers_diagonal():
    torch.manual_seed(0)
    cell = nn.GRUCell(3, 4)
    assert families(cell, FOOVB(cell, "kronecker")) == [("kronecker", ["weight_ih", "bias_ih"]),
                                                         ("kronecker", ["weight_hh", "bias_hh"])]
    assert families(cell, FOOVB(cell)) == families(cell, FOOVB(cell, "kronecker"))  # "auto" (since session 55)
    plain = nn.RNNCell(3, 4, bias=False)  # (the whole cell went diagonal: its missing biases read as computed)
    assert families(plain, FOOVB(plain, "kronecker")) == [("kronecker", ["weight_ih"]), ("kronecker", ["weight_hh"])]
    with warnings.catch_warnings():  # torch's deprecation of weight_norm (still the form users have)
        warnings.simplefilter("ignore", FutureWarning)
        normed = nn.utils.weight_norm(nn.LSTM(3, 4), "weight_hh_l0")  # weight_hh_l0 computed: as a Linear's
    assert {family for family, _ in families(normed, FOOVB(normed, "kronecker"))} == {"diagonal"}


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
def test_recurrent_update_matches_algorithm_3_from_each_samples_gradient(kind):
    """One step on a summed cross-entropy: rebuild Phi_k of every block from the step's noise stream, set the
    sampled weights W_k = M + B Phi_k A^T, take each sample's gradients Psi_k by autograd, and the paper's update:
    M <- M - B B^T E1 A A^T, Sigma_1 <- Lemma 2 with E2 = mean Psi^T B Phi / p, Sigma_2 with E3 = mean Psi A Phi^T / n
    (prior's covariance in the mean step, no step prior or secant check)."""
    torch.manual_seed(0)
    model = Reader(kind).double()
    k_samples = 3
    opt = FOOVB(model, "kronecker", k_samples, init="keep", loss_reduction="sum", antithetic=False,
                implicit_mean=False, cov_step=1.0, mean_step=1.0, secant_check=False, step_prior=1,
                diagonal_output_factor=False, seed=3)
    gen = make_generator(2)
    for block in opt.blocks:
        block.state["mean"].copy_(0.5 * torch.randn(block.state["mean"].shape, generator=gen, dtype=F64))
        for key in ("input_sqrt_cov", "output_sqrt_cov"):
            block.state[key] = 0.3 * random_sqrt(block.state[key].shape[0], gen)
    opt.load_mean_into_model()
    x = torch.randn(4, 6, 3, generator=gen, dtype=F64)
    y = torch.randint(0, 2, (4,), generator=gen)
    before = {block: {key: block.state[key].clone() for key in ("mean", "input_sqrt_cov", "output_sqrt_cov")}
              for block in opt.blocks}
    probe = torch.Generator()  # the step's seed is the next draw of the optimizer's generator (FOOVB._next_seed)
    probe.set_state(opt.generator.get_state())
    noise = opt.draw_noise(int(torch.randint(2**62, (1,), generator=probe).item()), range(k_samples))
    psi = {block: [] for block in opt.blocks}
    for k in range(k_samples):
        with torch.no_grad():
            for block in opt.blocks:
                m, a, b = (before[block][key] for key in ("mean", "input_sqrt_cov", "output_sqrt_cov"))
                for param, value in zip(block.params, block.split(m + b @ noise[block][k] @ a.T), strict=True):
                    param.copy_(value)
        model.zero_grad()
        F.cross_entropy(model(x), y, reduction="sum").backward()
        for block in opt.blocks:
            psi[block].append(block.join([p.grad[None] for p in block.params])[0])
    model.zero_grad()
    opt.load_mean_into_model()

    def closure():
        loss = F.cross_entropy(model(x), y, reduction="sum")
        loss.backward()
        return loss

    opt.step(closure)
    recurrent = [block for block in opt.blocks if block.module is model.rnn]
    assert len(recurrent) == 2 and all(isinstance(block, KroneckerBlock) for block in recurrent)
    for block in opt.blocks:
        m, a, b = (before[block][key] for key in ("mean", "input_sqrt_cov", "output_sqrt_cov"))
        assert_algorithm_3_step(block, m, a, b, psi[block], noise[block], mean_rtol=1e-9, cov_rtol=1e-8)
