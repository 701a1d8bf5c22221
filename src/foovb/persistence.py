"""FOOVB's persistence: its state dict (the posterior, the noise generator, the hyperparameters), its loading with
every value checked before anything changes, and the refusal to be copied or pickled whole."""

from __future__ import annotations

import torch

from .calibration import step_prior_blocks
from .presets import LEGACY_FIXED, check_state_dict

__all__ = ["Persistence"]


class Persistence(torch.optim.Optimizer):
    """The state-dict methods of `FOOVB` (which sets `blocks`, `generator`, `steps_taken`, `prior_scale`, `_fixed`,
    `_pending`, `_progress`, `_adopt_model_weights` and `load_mean_into_model`)."""

    def state_dict(self) -> dict:
        """The posterior, the noise generator and the hyperparameters. The tensors are copies: later steps do
        not change a saved state dict."""
        self._adopt_model_weights()
        state = super().state_dict()
        state["state"] = {index: {key: value.clone() for key, value in param_state.items()}
                          for index, param_state in state["state"].items()}
        state["foovb"] = {"generator": self.generator.get_state(), "steps_taken": self.steps_taken,
                          "prior_scale": self.prior_scale}
        return state

    def __getstate__(self) -> dict:
        """Copying or pickling a FOOVB (copy.deepcopy, torch.save(opt)) kept torch's param_groups and state only: the
        copy had no model, posterior blocks or noise generator, and failed at its first step. Refused instead."""
        raise TypeError("a FOOVB cannot be copied or pickled (copy.deepcopy, pickle, torch.save of the optimizer): "
                        "it holds the model and its posterior; save opt.state_dict() and the model's state_dict, and "
                        "load them into a FOOVB built on the copy of the model")

    def __setstate__(self, state: dict) -> None:
        """torch's load_state_dict ends here. Through a wrapper that forwards attribute reads to the optimizer
        (Lightning's LightningOptimizer), the optimizer's own param_groups and state are updated in place: set on
        the wrapper, the loaded step sizes were its alone, and the optimizer stepped with the old ones."""
        if "_progress" not in vars(self) and hasattr(self, "_progress"):  # read through a wrapper (not unpickling)
            self.param_groups[:] = state["param_groups"]
            self.state.clear()
            self.state.update(state["state"])
            return
        super().__setstate__(state)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a `state_dict` of a FOOVB built with the same family, K and options on the same architecture,
        with valid values (`check_state_dict`: finite, stds > 0, the parameters' dtypes, a generator state torch
        accepts), all checked before anything changes: a refused load changes nothing. The step sizes ("lr", the
        mean step, and "cov_step") are taken from it, as torch optimizers do with their learning rates. The tensors
        are copied."""
        if self._pending is not None:
            raise RuntimeError("load_state_dict while a step is under way (sampled_params(train=True) blocks ran, or "
                               "inside a step's closure): its samples came from the current posterior; call step() "
                               "first, or load before the blocks")
        if not isinstance(state_dict, dict) or not {"state", "param_groups", "foovb"} <= state_dict.keys():
            raise ValueError("not a FOOVB state dict (it needs 'state', 'param_groups' and 'foovb' entries)")
        state_dict = dict(state_dict)
        check_state_dict(state_dict, self._fixed, len(self.param_groups[0]["params"]), self.blocks,
                         {id(p): i for i, p in enumerate(self.param_groups[0]["params"])}, self.generator,
                         step_prior_blocks(self.blocks) if self.step_prior > 1 else (),
                         {id(p): name for name, p in self.model.named_parameters()})
        extra = state_dict.pop("foovb")
        state_dict["param_groups"] = [{**LEGACY_FIXED, **group} for group in state_dict["param_groups"]]
        super().load_state_dict(state_dict)
        self.generator.set_state(extra["generator"])
        self.steps_taken = int(extra["steps_taken"])
        self.prior_scale = float(extra.get("prior_scale", 1.0))  # saved before calibrate_prior existed: none
        for block in self.blocks:
            loaded = self.state[block.params[0]]
            block.state.clear()
            block.state.update({key: value.clone() for key, value in loaded.items()})
            self.state[block.params[0]] = block.state
        self.load_mean_into_model()
