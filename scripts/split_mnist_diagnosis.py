"""Which layer forgets on Split MNIST (domain-incremental, Hsu et al.'s protocol; issue 38)?

Trains one learner of a Split MNIST config (default: `configs/split_mnist_foovb_diagonal.yaml`, i.e. `FOOVB(model)`'s
defaults) exactly as `foovb run` does, keeps the network after the first pair, and prints, after the last pair:
* the first pair's test accuracy of the final network, and of the final network with ONE layer put back to its
  values after the first pair (which layer's drift cost the first pair);
* for FOO-VB, per layer: the mean posterior std after each pair, and how far the mean moved from the end of the
  first pair, in units of the std at that point (mean |delta mu| / sigma): what the posterior let move.

    python scripts/split_mnist_diagnosis.py [CONFIG] [--set KEY=VALUE ...] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy

import torch

from foovb_suite.config import load_config
from foovb_suite.factories import build_learner, build_scenario


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def posterior_stds(optimizer, model: torch.nn.Module) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """The marginal posterior std of every named parameter (`FOOVB.posterior`)."""
    return {name: optimizer.posterior(param).std.clone() for name, param in model.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default="configs/split_mnist_foovb_diagonal.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = load_config(args.config, args.overrides)
    torch.manual_seed(config.seed)
    scenario = build_scenario(config)
    learner = build_learner(config, scenario, torch.device("cpu"))
    model = learner.model
    optimizer = getattr(learner, "optimizer", None)
    bayesian = optimizer is not None and hasattr(optimizer, "posterior")
    x1, y1 = scenario.test_set(0)
    after_first, std_first, stds = None, None, []
    ends = list(scenario.eval_points)
    for iteration, batch in scenario.batches():
        learner.observe(batch.x, batch.y, None)
        if iteration + 1 in ends:
            if bayesian:
                std = posterior_stds(optimizer, model)
                stds.append({name: float(s.mean()) for name, s in std.items()})
            if after_first is None:
                after_first = copy.deepcopy(model.state_dict())
                std_first = std if bayesian else None
            accuracies = [accuracy(model, *scenario.test_set(t)) for t in range(scenario.num_tasks)]
            print(f"after pair {ends.index(iteration + 1) + 1} (mean network): "
                  + " ".join(f"{100 * a:.1f}" for a in accuracies), flush=True)
    final = copy.deepcopy(model.state_dict())
    print(f"\nfirst pair, final network: {100 * accuracy(model, x1, y1):.2f}%")
    layers = sorted({name.rsplit('.', 1)[0] for name in final})
    for layer in layers:
        model.load_state_dict({k: (after_first[k] if k.rsplit(".", 1)[0] == layer else v) for k, v in final.items()})
        print(f"  with {layer} put back to its values after the first pair: {100 * accuracy(model, x1, y1):.2f}%")
    model.load_state_dict(final)
    if bayesian:
        print("\nper tensor: mean posterior std after each pair; mean |mu_final - mu_first| / std_first")
        for name in stds[0]:
            moved = float(((final[name] - after_first[name]).abs() / std_first[name]).mean())
            print(f"  {name:12s} " + " ".join(f"{s[name]:.4f}" for s in stds) + f" | moved {moved:.2f} std")


if __name__ == "__main__":
    main()
