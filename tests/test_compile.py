"""FOOVB with a torch.compile'd model (issue 39): the model is compiled a bounded number of times, not once per step
(the loss reading's global module hooks were registered anew at every step, and torch.compile guards on them:
every step recompiled, 10x slower diagonal steps), and the matrix-variate family, whose layer errors compiled
code hides, warns and gives the eager update. `model.compile()` (what torch's own warning about the hooks
suggests) too: the loss reading's hook read the input's rows as `x.shape[0]`, which compiled code gave as an int
(a TypeError from inside foovb)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from foovb import FOOVB

pytestmark = pytest.mark.usefixtures("single_thread")


def counting_backend(counter: list):
    """A torch.compile backend that runs the traced graph as is and counts the graphs it was given."""
    def backend(graph_module, example_inputs):  # noqa: ANN001, ANN202
        counter.append(1)
        return graph_module.forward
    return backend


def train(posterior: str, compiled: bool, steps: int, counter: list | None = None,
          graphs_after: list | None = None, in_place: bool = False) -> FOOVB:
    """`steps` steps of a fresh model (compiled: by torch.compile(model), or by model.compile() with `in_place`);
    `graphs_after` receives how many graphs were compiled after each step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3)).double()
    if compiled and in_place:
        model.compile(backend=counting_backend(counter))
    opt = FOOVB(model, posterior, mc_samples=4, seed=0)
    forward = torch.compile(model, backend=counting_backend(counter)) if compiled and not in_place else model
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 12, generator=gen, dtype=torch.float64), torch.randint(3, (8,), generator=gen)

    def closure() -> torch.Tensor:
        loss = F.cross_entropy(forward(x), y)
        loss.backward()
        return loss

    for _ in range(steps):
        opt.step(closure)
        if graphs_after is not None:
            graphs_after.append(len(counter))
    return opt


@pytest.mark.parametrize("posterior", ["diagonal", "kronecker"])
def test_a_compiled_model_is_not_recompiled_at_every_step(posterior):
    torch._dynamo.reset()
    graphs_after: list = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(posterior, True, 8, [], graphs_after)
    assert 0 < graphs_after[1] <= 4  # the samples with and without the loss reading's mode
    assert graphs_after[-1] == graphs_after[1]


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("posterior", ["diagonal", "kronecker"])
def test_a_compiled_model_gets_the_eager_update(posterior, in_place):
    torch._dynamo.reset()
    eager = train(posterior, False, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = train(posterior, True, 3, [], in_place=in_place)
    warned = [w for w in caught if "torch.compile'd code" in str(w.message)]
    assert bool(warned) == (posterior == "kronecker")
    for a, b in zip(eager.blocks, compiled.blocks, strict=True):
        for key in a.state:
            torch.testing.assert_close(a.state[key], b.state[key], rtol=1e-9, atol=1e-12)
