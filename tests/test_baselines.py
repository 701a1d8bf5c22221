import copy
import math

import pytest
import torch
from torch import nn

from foovb_suite.baselines import (
    BASELINES,
    MASLearner,
    OnlineEWCLearner,
    SGDLearner,
    SILearner,
    make_baseline,
)
from foovb_suite.learners import make_learner
from foovb_suite.metrics import accuracy

CENTERS = torch.tensor([[3.0, 0.0], [-3.0, 0.0], [0.0, 3.0]])


def blobs(num_inputs, generator, centers=CENTERS):
    """Three well separated Gaussian blobs in 2-D: a linearly separable 3-class problem."""
    labels = torch.randint(0, len(centers), (num_inputs,), generator=generator)
    return centers[labels] + 0.5 * torch.randn(num_inputs, 2, generator=generator), labels


def make_batches(num_batches, seed=0, batch_size=16, centers=CENTERS):
    generator = torch.Generator().manual_seed(seed)
    return [blobs(batch_size, generator, centers) for _ in range(num_batches)]


def make_model(seed=0, num_outputs=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, num_outputs))


def parameters_of(learner):
    return [parameter.detach().clone() for parameter in learner.model.parameters()]


def distance(first, second):
    return sum((a - b).square().sum() for a, b in zip(first, second, strict=True)).sqrt().item()


def train(learner, batches, task=0):
    for x, y in batches:
        learner.observe(x, y, task=task)


def tasks_for(num_batches):
    """Task ids of a two-task run (switching half-way), so that SI consolidates at least once."""
    return [0 if index < num_batches // 2 else 1 for index in range(num_batches)]


def run(learner, batches):
    for (x, y), task in zip(batches, tasks_for(len(batches)), strict=True):
        learner.observe(x, y, task=task)


REGULARISED = {"ewc_online": "reg", "mas": "reg", "si": "c"}


@pytest.mark.parametrize("name", sorted(REGULARISED))
def test_zero_regularisation_reduces_exactly_to_sgd(name):
    batches = make_batches(8)
    sgd = SGDLearner(make_model(), lr=0.1)
    run(sgd, batches)
    unregularised = make_baseline(name, make_model(), lr=0.1, **{REGULARISED[name]: 0.0})
    run(unregularised, batches)
    for expected, actual in zip(parameters_of(sgd), parameters_of(unregularised), strict=True):
        assert torch.equal(expected, actual)
    # ... and the regulariser is not a no-op when switched on
    regularised = make_baseline(name, make_model(), lr=0.1, **{REGULARISED[name]: 10.0})
    run(regularised, batches)
    assert distance(parameters_of(sgd), parameters_of(regularised)) > 1e-3


class HandWrittenOptimizer:
    """The update direction and per-parameter step size ``s`` of SGD / Adam / Adagrad (torch defaults), written
    out from their papers' recursions: the optimiser's step is ``-s * direction``."""

    def __init__(self, kind, lr):
        self.kind, self.lr, self.count, self.first, self.second = kind, lr, 0, 0.0, 0.0

    def update(self, gradient):
        self.count += 1
        if self.kind == "sgd":
            return gradient, torch.full_like(gradient, self.lr)
        if self.kind == "adagrad":
            self.second = self.second + gradient.square()
            return gradient, self.lr / (self.second.sqrt() + 1e-10)
        self.first = 0.9 * self.first + 0.1 * gradient
        self.second = 0.999 * self.second + 0.001 * gradient.square()
        corrected_first = self.first / (1 - 0.9**self.count)
        corrected_second = self.second / (1 - 0.999**self.count)
        return corrected_first, self.lr / (corrected_second.sqrt() + 1e-8)


def last_regularised_step(learner, optimizer: str, lr: float):
    """Train `learner` on six batches beside a hand-written copy of its inner optimiser; return, for the last step,
    the importance it used, the parameters before and after it, and the optimiser's (direction, step size)."""
    hand_written = {name: HandWrittenOptimizer(optimizer, lr) for name in learner.trainable_parameters}
    for x, y in make_batches(6):
        importance = {name: value.clone() for name, value in learner.importance.items()}
        before = {name: p.detach().clone() for name, p in learner.model.named_parameters()}
        data_gradients = torch.autograd.grad(
            nn.functional.cross_entropy(learner.model(x), y), list(learner.model.parameters())
        )
        metric = {name: hand_written[name].update(g) for name, g in zip(before, data_gradients, strict=True)}
        learner.observe(x, y)
    assert all(value.sum() > 0 for value in importance.values())
    after = {name: p.detach().clone().requires_grad_() for name, p in learner.model.named_parameters()}
    return importance, before, metric, after


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adagrad"])
def test_ewc_step_minimises_linearised_loss_plus_closed_form_penalty_in_the_optimisers_metric(optimizer):
    """theta_{t+1} = argmin direction.(theta - theta_t) + sum (theta - theta_t)^2 / (2 s) + penalty(theta), with
    penalty = reg/2 sum F (theta - theta_t)^2 and (direction, s) of the optimiser (for SGD the gradient and lr),
    checked through its stationarity condition with the penalty gradient from autograd."""
    lr, reg = 0.05, 5.0
    fisher, before, metric, after = last_regularised_step(
        OnlineEWCLearner(make_model(), lr=lr, reg=reg, optimizer=optimizer), optimizer, lr)
    penalty = sum(reg / 2 * (fisher[name] * (after[name] - before[name]).square()).sum() for name in after)
    penalty_gradients = dict(zip(after, torch.autograd.grad(penalty, list(after.values())), strict=True))
    for name, (direction, step_size) in metric.items():
        displacement = after[name].detach() - before[name]
        torch.testing.assert_close(direction + penalty_gradients[name], -displacement / step_size,
                                   atol=1e-6, rtol=1e-4)
    # the penalty acted: the step differs from the optimiser's own step -s * direction
    assert any(not torch.allclose(after[name].detach() - before[name], -s * d, atol=1e-7, rtol=1e-3)
               for name, (d, s) in metric.items())


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adagrad"])
def test_mas_step_is_the_closed_form_proximal_step_of_its_penalty(optimizer):
    """MAS penalises reg * sum Omega (theta - theta_t)^2 (curvature 2 reg, no 1/2): its step is
    theta_t - s * direction / (1 + s * 2 * reg * Omega), the minimiser of the linearised loss plus the penalty in the
    optimiser's metric, checked in closed form and through the stationarity condition with autograd."""
    lr, reg = 0.05, 5.0
    omega, before, metric, after = last_regularised_step(
        MASLearner(make_model(), lr=lr, reg=reg, optimizer=optimizer), optimizer, lr)
    for name, (direction, step_size) in metric.items():
        expected = before[name] - step_size * direction / (1 + step_size * 2 * reg * omega[name])
        torch.testing.assert_close(after[name].detach(), expected, atol=1e-6, rtol=1e-4)
    penalty = sum(reg * (omega[name] * (after[name] - before[name]).square()).sum() for name in after)
    penalty_gradients = dict(zip(after, torch.autograd.grad(penalty, list(after.values())), strict=True))
    for name, (direction, step_size) in metric.items():
        displacement = after[name].detach() - before[name]
        torch.testing.assert_close(direction + penalty_gradients[name], -displacement / step_size,
                                   atol=1e-5, rtol=1e-4)  # float32 / s
    assert any(not torch.allclose(after[name].detach() - before[name], -s * d, atol=1e-7, rtol=1e-3)
               for name, (d, s) in metric.items())


def test_ewc_fisher_is_the_decayed_sum_of_per_sample_fishers_of_model_sampled_labels():
    gamma, batch_size = 0.5, 16
    learner = OnlineEWCLearner(make_model(), lr=0.1, reg=1.0, gamma=gamma, seed=3)
    label_generator = torch.Generator().manual_seed(3)
    expected = {name: torch.zeros_like(p) for name, p in learner.model.named_parameters()}
    for x, y in make_batches(2, batch_size=batch_size):
        reference = copy.deepcopy(learner.model)
        logits = reference(x)
        probabilities = torch.softmax(logits.detach(), dim=1)
        sampled = torch.multinomial(probabilities, 1, generator=label_generator).squeeze(1)
        gradients = torch.autograd.grad(
            -nn.functional.cross_entropy(logits, sampled), list(reference.parameters())
        )
        for (name, _), gradient in zip(reference.named_parameters(), gradients, strict=True):
            expected[name] = gamma * expected[name] + batch_size * gradient.square()
        learner.observe(x, y)
        for name, value in expected.items():
            torch.testing.assert_close(learner.importance[name], value)


def test_mas_importance_is_abs_gradient_of_squared_output_norm():
    model = make_model()
    reference = copy.deepcopy(model)
    learner = MASLearner(model, lr=0.1, reg=1.0)
    (x, y), *_ = make_batches(1)
    gradients = torch.autograd.grad(reference(x).square().sum(dim=1).mean(), list(reference.parameters()))
    learner.observe(x, y)
    for (name, _), gradient in zip(reference.named_parameters(), gradients, strict=True):
        torch.testing.assert_close(learner.importance[name], gradient.abs())


def test_mas_per_sample_importance_is_mean_of_per_sample_abs_gradients():
    """The MAS paper's Omega = (1/B) sum_n |grad ||f(x_n)||^2|, checked against one autograd call per sample."""
    model = make_model()
    reference = copy.deepcopy(model)
    learner = MASLearner(model, lr=0.1, reg=1.0, importance="per_sample")
    (x, y), *_ = make_batches(1)
    expected = {name: torch.zeros_like(parameter) for name, parameter in reference.named_parameters()}
    for sample in x:
        gradients = torch.autograd.grad(reference(sample[None]).square().sum(), list(reference.parameters()))
        for (name, _), gradient in zip(reference.named_parameters(), gradients, strict=True):
            expected[name] += gradient.abs() / len(x)
    batch_learner = MASLearner(copy.deepcopy(reference), lr=0.1, reg=1.0)
    batch_importance = batch_learner._batch_importance(batch_learner.model(x), x, None)
    learner.observe(x, y)
    for name, value in expected.items():
        torch.testing.assert_close(learner.importance[name], value)
        # triangle inequality: the batch-mean gradient's |.| is at most the mean of the per-sample |.|
        assert bool((batch_importance[name] <= value + 1e-6).all())
    assert any(bool((batch_importance[name] < 0.9 * expected[name]).any()) for name in expected)


def test_mas_per_sample_importance_rejects_parameters_outside_linear_layers():
    model = nn.Sequential(nn.Linear(2, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    with pytest.raises(ValueError, match=r"\['1.bias', '1.weight'\]"):
        MASLearner(model, importance="per_sample")
    MASLearner(model)  # the batch estimate takes any model


class SharedLayerModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(3, 3)

    def forward(self, x):
        return self.shared(torch.tanh(self.shared(x)))


def test_mas_per_sample_importance_rejects_a_linear_layer_applied_twice():
    learner = MASLearner(SharedLayerModel(), importance="per_sample")
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    with pytest.raises(ValueError, match="more than once"):
        learner.observe(x, y)


def test_strong_ewc_moves_parameters_less_than_sgd_on_a_second_task():
    first_task = make_batches(40, seed=1)
    second_task = make_batches(40, seed=2, centers=CENTERS.flip(0))  # same inputs, permuted labels
    movements = {}
    for name, learner in {
        "sgd": SGDLearner(make_model(), lr=0.1),
        "ewc": OnlineEWCLearner(make_model(), lr=0.1, reg=1000.0),
    }.items():
        train(learner, first_task)
        end_of_first_task = parameters_of(learner)
        train(learner, second_task)
        movements[name] = distance(end_of_first_task, parameters_of(learner))
    assert movements["ewc"] < 0.5 * movements["sgd"]


def linear_cross_entropy_gradient(weight, x, y):
    """Closed form d/dW of mean cross-entropy of logits x W^T: (softmax - onehot)^T x / B."""
    residual = torch.softmax(x @ weight.T, dim=1) - nn.functional.one_hot(y, weight.shape[0]).float()
    return residual.T @ x / len(x)


def test_si_importance_equals_hand_computed_path_integral():
    lr, xi = 0.5, 0.1
    torch.manual_seed(0)
    model = nn.Linear(2, 3, bias=False)
    learner = SILearner(model, lr=lr, c=1.0, xi=xi)
    batches = make_batches(4)
    weight = model.weight.detach().clone()
    initial_weight = weight.clone()
    path_integral = torch.zeros_like(weight)
    for x, y in batches[:3]:
        learner.observe(x, y, task=0)
        gradient = linear_cross_entropy_gradient(weight, x, y)
        update = -lr * gradient
        path_integral -= gradient * update
        weight = weight + update
    torch.testing.assert_close(learner.path_integral["weight"], path_integral)
    assert torch.all(learner.importance["weight"] == 0)
    learner.observe(*batches[3], task=1)  # task switch: consolidation of task 0 before the step
    expected_importance = path_integral / ((weight - initial_weight).square() + xi)
    assert torch.all(learner.importance["weight"] >= 0)
    assert learner.importance["weight"].sum() > 0
    torch.testing.assert_close(learner.importance["weight"], expected_importance)
    torch.testing.assert_close(learner.anchor["weight"], weight)


def test_si_consolidation_resets_the_path_integral():
    learner = SILearner(make_model(), lr=0.1)
    batches = make_batches(4)
    train(learner, batches[:3], task=0)
    assert all(value.abs().sum() > 0 for value in learner.path_integral.values())
    learner._consolidate()
    assert all(torch.all(value == 0) for value in learner.path_integral.values())


def test_si_importance_increment_at_each_switch_uses_only_the_finished_tasks_path_integral():
    """Three tasks: the importance added at the second switch is max(0, omega_1 / (Delta_1^2 + xi)) with omega_1 the
    path integral of the second task alone (its steps' -g * delta_theta, g the unregularised gradient)."""
    lr, c, xi = 0.2, 1.0, 0.1
    learner = SILearner(make_model(), lr=lr, c=c, xi=xi)
    batches = make_batches(9)
    importances, path_integrals = [], []
    for task in range(3):
        start = {name: p.detach().clone() for name, p in learner.model.named_parameters()}
        path_integral = {name: torch.zeros_like(p) for name, p in learner.model.named_parameters()}
        for x, y in batches[3 * task : 3 * task + 3]:
            before = {name: p.detach().clone() for name, p in learner.model.named_parameters()}
            gradients = torch.autograd.grad(
                nn.functional.cross_entropy(learner.model(x), y), list(learner.model.parameters())
            )
            learner.observe(x, y, task=task)  # at a task's first step: consolidation of the previous task first
            importances.append({name: value.clone() for name, value in learner.importance.items()})
            for (name, parameter), gradient in zip(learner.model.named_parameters(), gradients, strict=True):
                path_integral[name] -= gradient * (parameter.detach() - before[name])
        end = {name: p.detach().clone() for name, p in learner.model.named_parameters()}
        path_integrals.append((path_integral, {name: end[name] - start[name] for name in end}))
    # importance after the first step of task 2 (consolidation of task 1) minus that during task 1
    increment = {name: importances[6][name] - importances[5][name] for name in importances[6]}
    omega_1, change_1 = path_integrals[1]
    for name, value in increment.items():
        expected = (omega_1[name] / (change_1[name].square() + xi)).clamp_min(0)
        torch.testing.assert_close(value, expected)
    assert any(value.sum() > 0 for value in increment.values())
    # the first switch likewise uses task 0's path integral
    omega_0, change_0 = path_integrals[0]
    for name, value in importances[3].items():
        torch.testing.assert_close(value, (omega_0[name] / (change_0[name].square() + xi)).clamp_min(0))


def test_si_clips_negative_path_integrals_to_zero_importance():
    learner = SILearner(make_model(), lr=0.1)
    batches = make_batches(4)
    train(learner, batches[:3], task=0)
    learner.path_integral["0.weight"][0, 0] = -1.0  # e.g. momentum carried the weight against its gradient
    learner.observe(*batches[3], task=1)
    assert learner.importance["0.weight"][0, 0] == 0
    assert torch.all(learner.importance["0.weight"] >= 0) and learner.importance["0.weight"].sum() > 0


def test_si_step_uses_autograd_gradient_of_its_penalty():
    lr = 0.2
    learner = SILearner(make_model(), lr=lr, c=5.0)
    batches = make_batches(8)
    train(learner, batches[:6], task=0)
    train(learner, batches[6:7], task=1)  # consolidated, anchor at the end of task 0, now moved away
    assert learner.penalty().item() > 0
    x, y = batches[7]
    parameters = list(learner.model.parameters())
    before = [p.detach().clone() for p in parameters]
    data_gradients = torch.autograd.grad(nn.functional.cross_entropy(learner.model(x), y), parameters)
    penalty_gradients = torch.autograd.grad(learner.penalty(), parameters)
    path_integral_before = {name: value.clone() for name, value in learner.path_integral.items()}
    learner.observe(x, y, task=1)
    for (name, parameter), start, data_gradient, penalty_gradient in zip(
        learner.model.named_parameters(), before, data_gradients, penalty_gradients, strict=True
    ):
        torch.testing.assert_close(parameter.detach(), start - lr * (data_gradient + penalty_gradient))
        # the path integral uses the gradient of the unregularised loss (Zenke et al. 2017, eq. 3)
        expected_path_integral = path_integral_before[name] - data_gradient * (parameter.detach() - start)
        torch.testing.assert_close(learner.path_integral[name], expected_path_integral)


def test_si_needs_task_ids():
    learner = SILearner(make_model())
    with pytest.raises(ValueError, match="task"):
        learner.observe(*make_batches(1)[0])


LEARNING_RATES = {"sgd": 0.1, "adam": 0.01, "adagrad": 0.1, "ewc_online": 0.1, "mas": 0.1, "si": 0.1}


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_state_dict_round_trip_continues_identically(name):
    extra = {"optimizer": "adam"} if name in REGULARISED else {}  # exercise optimiser state too
    batches = make_batches(10)
    original = make_baseline(name, make_model(seed=0), lr=LEARNING_RATES[name] / 10, **extra)
    run(original, batches[:4])
    saved = copy.deepcopy(original.state_dict())
    run(original, batches[4:])  # tasks 0, 0, 0, 1, 1, 1: SI consolidates after the resume point

    resumed = make_baseline(name, make_model(seed=1), lr=LEARNING_RATES[name] / 10, **extra)
    resumed.load_state_dict(saved)
    run(resumed, batches[4:])
    for expected, actual in zip(parameters_of(original), parameters_of(resumed), strict=True):
        assert torch.equal(expected, actual)
    resumed_method_state = resumed.state_dict()["method"]
    for key, value in original.state_dict()["method"].items():
        if isinstance(value, dict):
            for tensor_name, tensor in value.items():
                assert torch.equal(tensor, resumed_method_state[key][tensor_name])


def test_loading_another_learners_state_raises():
    state = SGDLearner(make_model()).state_dict()
    with pytest.raises(ValueError, match="sgd"):
        MASLearner(make_model()).load_state_dict(state)


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_each_learner_learns_a_separable_problem(name):
    learner = make_baseline(name, make_model(), lr=LEARNING_RATES[name])
    train(learner, make_batches(150, seed=5), task=0)
    x, y = blobs(300, torch.Generator().manual_seed(6))
    assert accuracy(learner.predict(x), y, "mean") > 0.9  # chance: 1/3


def test_predict_returns_probabilities_without_gradient_and_restores_the_mode():
    model = nn.Sequential(nn.Linear(2, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    learner = SGDLearner(model)
    x, _ = make_batches(1)[0]
    model.train()
    first, second = learner.predict(x), learner.predict(x)
    assert model.training
    assert torch.equal(first.mean, second.mean)  # eval mode: dropout off
    assert not first.mean.requires_grad and first.samples is None
    torch.testing.assert_close(first.mean.sum(dim=1), torch.ones(len(x)))
    model.eval()
    learner.predict(x)
    assert not model.training


def test_multi_head_slices_the_task_head():
    model = make_model(num_outputs=6)
    learner = SGDLearner(model, lr=0.1, num_heads=2, classes_per_head=3)
    x, y = make_batches(1)[0]
    with torch.no_grad():
        expected = torch.softmax(model(x)[:, 3:6], dim=1)
    torch.testing.assert_close(learner.predict(x, task=1).mean, expected)
    head_weights = model[2].weight.detach().clone()
    learner.observe(x, y, task=1)
    assert torch.equal(model[2].weight[:3], head_weights[:3])  # head 0 untouched
    assert not torch.equal(model[2].weight[3:], head_weights[3:])
    with pytest.raises(ValueError, match="task"):
        learner.predict(x)
    with pytest.raises(ValueError, match="out of range"):
        learner.observe(x, y, task=2)
    with pytest.raises(ValueError, match="logits"):
        SGDLearner(make_model(num_outputs=5), num_heads=2, classes_per_head=3).predict(x, task=0)


@pytest.mark.parametrize("kind, extra", [("adam", {}), ("adagrad", {}), ("ewc_online", {"optimizer": "adam"}),
                                         ("mas", {"optimizer": "adam"}), ("si", {"optimizer": "adam"})])
def test_a_step_moves_only_the_task_head(kind, extra):
    """All heads are one nn.Linear, so an old head's gradient is zero, not None: Adam's momentum moved it for
    about ten steps after a task switch (a head of its own takes no step). Its rows, and their optimiser state,
    stay as they were; the new head and the shared layers learn."""
    model = make_model(num_outputs=6)
    learner = make_baseline(kind, model, lr=0.01, num_heads=2, classes_per_head=3, **extra)
    batches = make_batches(6)
    for x, y in batches[:3]:
        learner.observe(x, y, task=0)
    head, shared = model[2], model[0].weight.detach().clone()
    rows = [head.weight.detach()[:3].clone(), head.bias.detach()[:3].clone()]
    state = [value[:3].clone() for p in (head.weight, head.bias) for value in learner.optimizer.state[p].values()
             if value.dim() > 0]
    new_head = head.weight.detach()[3:].clone()
    for x, y in batches[3:]:
        learner.observe(x, y, task=1)
    assert torch.equal(head.weight[:3], rows[0]) and torch.equal(head.bias[:3], rows[1])
    after = [value[:3] for p in (head.weight, head.bias) for value in learner.optimizer.state[p].values()
             if value.dim() > 0]
    assert state and all(torch.equal(a, b) for a, b in zip(after, state, strict=True))
    assert not torch.equal(head.weight[3:], new_head) and not torch.equal(model[0].weight, shared)


def test_a_multi_head_model_needs_its_heads_in_its_last_linear():
    with pytest.raises(ValueError, match="last nn.Linear has 5 outputs"):
        SGDLearner(make_model(num_outputs=5), num_heads=2)
    with pytest.raises(ValueError, match="2 \\* 4 logits"):
        SGDLearner(make_model(num_outputs=6), num_heads=2, classes_per_head=4)


def test_factory_rejects_unknown_names_and_invalid_hyperparameters():
    with pytest.raises(ValueError, match="ewc_online"):  # the message lists the known names
        make_baseline("ewc", make_model())
    with pytest.raises(ValueError, match="momentum"):
        make_baseline("sgd", make_model(), momentum=0.9)
    invalid = [
        ("sgd", {"lr": -1.0}, "lr"),
        ("ewc_online", {"gamma": 0.0}, "gamma"),
        ("ewc_online", {"reg": -1.0}, "reg"),
        ("mas", {"optimizer": "rmsprop"}, "optimizer"),
        ("mas", {"importance": "per_weight"}, "importance"),
        ("si", {"xi": 0.0}, "xi"),
        ("si", {"c": -0.1}, "c"),
        ("adam", {"num_heads": 0}, "num_heads"),
    ]
    for name, hyperparameters, parameter in invalid:
        with pytest.raises(ValueError, match=parameter):
            make_baseline(name, make_model(), **hyperparameters)
    learner = make_baseline("ewc_online", make_model(), lr=0.01, reg=0.1)
    assert isinstance(learner, OnlineEWCLearner) and learner.name == "ewc_online"
    assert (learner.reg, learner.optimizer.param_groups[0]["lr"]) == (0.1, 0.01)


def test_the_run_seed_reaches_online_ewc_fisher_labels() -> None:
    """make_learner passes the run's seed to baselines that draw random numbers (online EWC's sampled labels)."""
    generators = [make_learner("ewc_online", make_model(), seed=seed).label_generator for seed in (0, 7, 7)]
    assert [g.initial_seed() for g in generators] == [0, 7, 7]
    assert generators[0].device.type == "cpu"  # a CPU generator whatever the model's device: portable state
    assert make_learner("sgd", make_model(), seed=7).name == "sgd"  # baselines without randomness take no seed


def test_online_ewc_refuses_a_gpu_generator_state_before_changing_anything() -> None:
    learner = make_learner("ewc_online", make_model(), seed=0)
    state = copy.deepcopy(learner.state_dict())
    state["method"]["label_generator"] = torch.zeros(16, dtype=torch.uint8)  # a CUDA (Philox) state's size
    state["model"] = {name: value + 1 for name, value in state["model"].items()}
    before = copy.deepcopy(learner.model.state_dict())
    with pytest.raises(ValueError, match="not a CPU generator"):
        learner.load_state_dict(state)
    assert all(torch.equal(before[name], value) for name, value in learner.model.state_dict().items())



@pytest.mark.parametrize("batched", [True, False])
def test_foovb_learner_observe_returns_the_mean_per_example_cross_entropy(batched) -> None:
    """FOO-VB optimises the summed cross-entropy, but observe() reports the per-example mean (as the baselines do):
    about ln 10 for 10 classes at initialisation, whatever the batch size."""
    generator = torch.Generator().manual_seed(0)
    for batch_size in (8, 64):
        torch.manual_seed(0)
        learner = make_learner("foovb", nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 10)),
                               mc_samples=2, eval_samples=0, batched=batched)
        x, y = 0.1 * torch.randn(batch_size, 4, generator=generator), torch.randint(0, 10, (batch_size,))
        loss = learner.observe(x, y)
        assert float(loss) == pytest.approx(math.log(10), abs=0.3)


def test_the_foovb_learner_adds_the_output_anchor_only_when_asked():
    """output_anchor=0 is the plain learner (same update); > 0 changes it, the same on the batched and sequential
    paths; a negative strength is a ValueError."""
    torch.manual_seed(3)
    x, y = torch.randn(16, 2), torch.randint(3, (16,))
    finals = {}
    for anchor, batched in ((None, True), (0.0, True), (5.0, True), (5.0, False)):
        options = {} if anchor is None else {"output_anchor": anchor}
        learner = make_learner("foovb", make_model(), posterior="diagonal", mc_samples=4, batched=batched, **options)
        for _ in range(5):
            learner.observe(x, y)
        finals[anchor, batched] = parameters_of(learner)
    assert all(torch.equal(a, b) for a, b in zip(finals[None, True], finals[0.0, True], strict=True))
    assert not all(torch.allclose(a, b) for a, b in zip(finals[None, True], finals[5.0, True], strict=True))
    for a, b in zip(finals[5.0, True], finals[5.0, False], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="output_anchor"):
        make_learner("foovb", make_model(), output_anchor=-1.0)
