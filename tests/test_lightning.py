"""FOOVB inside a PyTorch Lightning Trainer (issue 28): automatic optimization with the mean loss of
`training_step`, an LR scheduler on the mean step, LearningRateMonitor, gradient accumulation refused, and
checkpoint + resume identical to an uninterrupted run. Small MNIST subset, CPU, a few seconds each."""

from __future__ import annotations

import csv
import types
import warnings

import pytest

L = pytest.importorskip("lightning")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.callbacks import LearningRateMonitor  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch import nn  # noqa: E402

from foovb import FOOVB  # noqa: E402
from foovb_suite.data import MNIST_MEAN, MNIST_STD, load_mnist  # noqa: E402

N_TRAIN, N_TEST, BATCH = 1024, 1000, 128  # 8 steps per epoch
K = 4  # even: antithetic pairs (recommended preset)
MEAN_STEP = 0.7  # the recommended diagonal eta, the scheduler's base "lr"
STEP_SIZE, GAMMA = 4, 0.7  # StepLR on optimizer steps: eta *= 0.7 after steps 4, 8, 12

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*number of training batches.*")


@pytest.fixture(scope="module")
def mnist():
    data = load_mnist()

    def prepare(images):
        return ((images.float() / 255 - MNIST_MEAN) / MNIST_STD).flatten(1)

    return (prepare(data.train_images[:N_TRAIN]), data.train_labels[:N_TRAIN],
            prepare(data.test_images[:N_TEST]), data.test_labels[:N_TEST])


def make_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 10))


def make_scheduler(opt: FOOVB):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=STEP_SIZE, gamma=GAMMA)


def loader(x, y):  # no shuffling: the Lightning run and the manual loop see the same batches in the same order
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)


class Classifier(L.LightningModule):
    def __init__(self, init_seed: int = 0, foovb_seed: int = 0):
        super().__init__()
        self.net = make_net(init_seed)
        self.foovb_seed = foovb_seed

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)  # the MEAN over the batch: FOOVB rescales it to the sum
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = FOOVB(self, mc_samples=K, mean_step=MEAN_STEP, seed=self.foovb_seed)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": make_scheduler(opt), "interval": "step"}}


class Snapshots(L.Callback):
    """After every optimizer step: the posterior (mean and std of every parameter) and the mean step."""

    def __init__(self):
        self.posteriors: list[list[torch.Tensor]] = []
        self.lrs: list[tuple[float, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        opt = trainer.optimizers[0]
        self.lrs.append((opt.param_groups[0]["lr"], opt.mean_step))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.posteriors.append(posterior_snapshot(trainer.optimizers[0], pl_module.net))


def posterior_snapshot(opt: FOOVB, net: nn.Module) -> list[torch.Tensor]:
    views = [opt.posterior(p) for p in net.parameters()]
    return [v.mean.clone() for v in views] + [v.std.clone() for v in views]


def trainer(tmp_path, **kwargs) -> L.Trainer:
    options = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                   num_sanity_val_steps=0)
    return L.Trainer(**{**options, **kwargs})


def manual_run(x, y, steps: int, scheduled: bool = True) -> tuple[list[list[torch.Tensor]], nn.Module]:
    """The plain torch loop: a SUMMED loss, loss_reduction="sum", opt.step(closure), the scheduler after every
    step, the same initial weights, seed and batches. Returns the posterior after every step."""
    net = make_net(0)
    opt = FOOVB(net, mc_samples=K, mean_step=MEAN_STEP, seed=0, loss_reduction="sum")
    scheduler = make_scheduler(opt) if scheduled else None
    snapshots = []
    batches = [batch for _ in range(steps // len(loader(x, y)) + 1) for batch in loader(x, y)]
    for xb, yb in batches[:steps]:
        def closure(xb=xb, yb=yb):
            loss = F.cross_entropy(net(xb), yb, reduction="sum")
            loss.backward()
            return loss

        opt.step(closure)
        if scheduler is not None:
            scheduler.step()
        snapshots.append(posterior_snapshot(opt, net))
    return snapshots, net


def accuracy(net: nn.Module, x, y) -> float:
    with torch.no_grad():
        return (net(x).argmax(1) == y).float().mean().item()


def test_lightning_learns_and_takes_the_summed_loss_steps(mnist, tmp_path):
    """Two epochs in a Trainer with the mean loss: the posterior after every step is that of the manual loop with
    the summed loss (the mean is rescaled by the batch size, exactly up to float rounding), and the network
    learns: test accuracy far above chance and equal to the manual loop's."""
    x, y, x_test, y_test = mnist
    model, snapshots = Classifier(), Snapshots()
    trainer(tmp_path, max_epochs=2, callbacks=[snapshots]).fit(model, loader(x, y))
    steps = 2 * N_TRAIN // BATCH
    assert len(snapshots.posteriors) == steps
    manual, manual_net = manual_run(x, y, steps)
    for step in range(STEP_SIZE + 2):  # the strong check: the same steps (the last ones with the scheduled eta)
        for got, want in zip(snapshots.posteriors[step], manual[step], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for got, want in zip(snapshots.posteriors[-1], manual[-1], strict=True):  # float drift stays small
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    model.eval()
    acc, manual_acc = accuracy(model, x_test, y_test), accuracy(manual_net, x_test, y_test)
    assert acc > 0.5, f"test accuracy {acc:.3f} after {steps} steps (chance 0.1)"
    assert abs(acc - manual_acc) <= 0.002, (acc, manual_acc)
    # the schedule matters: without it the first step with the reduced eta is another one
    unscheduled, _ = manual_run(x, y, STEP_SIZE + 1, scheduled=False)
    assert not all(torch.allclose(a, b, rtol=1e-3, atol=1e-4)
                   for a, b in zip(unscheduled[STEP_SIZE], manual[STEP_SIZE], strict=True))


def test_scheduler_sets_the_mean_step_and_lr_monitor_logs_it(mnist, tmp_path):
    """StepLR changes param_groups[0]["lr"] (= opt.mean_step) on schedule; LearningRateMonitor logs it."""
    x, y, _, _ = mnist
    steps = 7
    monitor, snapshots = LearningRateMonitor(logging_interval="step", log_momentum=True), Snapshots()
    logger = CSVLogger(tmp_path, name="logs")
    model = Classifier()
    trainer(tmp_path, max_steps=steps, logger=logger, log_every_n_steps=1,
            callbacks=[monitor, snapshots]).fit(model, loader(x, y))
    expected = [MEAN_STEP * GAMMA ** (step // STEP_SIZE) for step in range(steps)]
    assert [lr for lr, _ in snapshots.lrs] == pytest.approx(expected)
    assert [eta for _, eta in snapshots.lrs] == pytest.approx(expected)  # mean_step is that "lr"
    opt = model.trainer.optimizers[0]
    assert opt.mean_step == pytest.approx(MEAN_STEP * GAMMA ** (steps // STEP_SIZE))
    assert opt.steps_taken == steps
    assert list(monitor.lrs) == ["lr-FOOVB"]
    assert monitor.lrs["lr-FOOVB"] == pytest.approx(expected)
    with open(f"{logger.log_dir}/metrics.csv", newline="") as handle:
        logged = [float(row["lr-FOOVB"]) for row in csv.DictReader(handle) if row.get("lr-FOOVB")]
    assert logged == pytest.approx(expected)


def test_gradient_accumulation_is_refused(mnist, tmp_path):
    x, y, _, _ = mnist
    model = Classifier()
    # FOOVB's own error (not a failure further on, e.g. the loss divided by 2 that "auto" cannot read)
    with pytest.raises(RuntimeError, match="already computed.*accumulate_grad_batches > 1"):
        trainer(tmp_path, max_steps=2, accumulate_grad_batches=2).fit(model, loader(x, y))
    opt = model.trainer.optimizers[0]
    assert opt.steps_taken == 0  # refused before any update
    for p in model.net.parameters():
        torch.testing.assert_close(opt.posterior(p).mean, p.detach())
    for got, want in zip(model.net.parameters(), make_net(0).parameters(), strict=True):
        assert torch.equal(got, want)


def test_checkpoint_resume_is_identical_to_an_uninterrupted_run(mnist, tmp_path):
    """One epoch, trainer.save_checkpoint, a fresh module (other initial weights and FOOVB seed: only the
    checkpoint can make them agree) resumed to two epochs == two epochs uninterrupted: weights, posterior,
    noise generator, step count and the scheduled mean step. The checkpoint also loads with weights_only=True."""
    x, y, _, _ = mnist
    full = Classifier()
    trainer(tmp_path / "full", max_epochs=2).fit(full, loader(x, y))

    first = Classifier()
    first_trainer = trainer(tmp_path / "first", max_epochs=1)
    first_trainer.fit(first, loader(x, y))
    path = tmp_path / "epoch1.ckpt"
    first_trainer.save_checkpoint(path)

    # only safe types in the checkpoint (fit(ckpt_path=...) loads it with torch.load's default, weights_only=True
    # since torch 2.6)
    checkpoint = torch.load(path, weights_only=True)
    saved = checkpoint["optimizer_states"][0]
    assert saved["foovb"]["steps_taken"] == N_TRAIN // BATCH
    assert saved["param_groups"][0]["lr"] == pytest.approx(MEAN_STEP * GAMMA ** (N_TRAIN // BATCH // STEP_SIZE))

    resumed = Classifier(init_seed=1, foovb_seed=1)
    assert not torch.equal(resumed.net[0].weight, first.net[0].weight)
    trainer(tmp_path / "resumed", max_epochs=2).fit(resumed, loader(x, y), ckpt_path=path)

    for got, want in zip(resumed.net.parameters(), full.net.parameters(), strict=True):
        assert torch.equal(got, want)
    opt, full_opt = resumed.trainer.optimizers[0], full.trainer.optimizers[0]
    assert opt.steps_taken == full_opt.steps_taken == 2 * N_TRAIN // BATCH
    assert opt.mean_step == full_opt.mean_step
    assert torch.equal(opt.generator.get_state(), full_opt.generator.get_state())
    for got, want in zip(posterior_snapshot(opt, resumed.net), posterior_snapshot(full_opt, full.net), strict=True):
        assert torch.equal(got, want)
    state, full_state = opt.state_dict(), full_opt.state_dict()
    assert state["param_groups"] == full_state["param_groups"]
    assert state["state"].keys() == full_state["state"].keys()
    for index, entries in state["state"].items():
        assert entries.keys() == full_state["state"][index].keys()
        for key, value in entries.items():
            assert torch.equal(value, full_state["state"][index][key]), (index, key)


class LoadsWeightsOnTrainStart(Classifier):
    """Loads weights into the module after Lightning built the optimizer (configure_optimizers runs first)."""

    def __init__(self, weights: dict):
        super().__init__()
        self.weights = weights

    def on_train_start(self):
        self.net.load_state_dict(self.weights)


def test_weights_loaded_after_the_optimizer_was_built_are_trained(mnist, tmp_path):
    """Issue 35: the loaded weights were silently replaced by the optimizer's copy of the initial ones. Now the
    run trains the loaded weights: the same posterior as a run whose module starts from them."""
    x, y, _, _ = mnist
    pretrained = make_net(seed=7).state_dict()
    late, late_snapshots = LoadsWeightsOnTrainStart(pretrained), Snapshots()
    trainer(tmp_path / "late", max_steps=3, callbacks=[late_snapshots]).fit(late, loader(x, y))
    early, early_snapshots = Classifier(), Snapshots()
    early.net.load_state_dict(pretrained)
    trainer(tmp_path / "early", max_steps=3, callbacks=[early_snapshots]).fit(early, loader(x, y))
    for got, want in zip(late_snapshots.posteriors[-1], early_snapshots.posteriors[-1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class ManualClassifier(Classifier):
    """Manual optimization, IVON's Lightning recipe: K `sampled_params(train=True)` blocks on the optimizer
    Lightning hands back, `manual_backward`, then `opt.step()`."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        for _ in range(K):
            with opt.sampled_params(train=True):
                self.manual_backward(F.cross_entropy(self.net(x), y))
        opt.step()
        self.lr_schedulers().step()


def test_manual_optimization_with_sampled_params_blocks_takes_the_plain_loops_steps(mnist, tmp_path):
    """LightningOptimizer copies the optimizer's __dict__, so the blocks' pending step stayed on the copy, and its
    step() passes a closure that only runs hooks: the closure was called K times as a training closure
    (TypeError: it returned None). Now the same posteriors as the plain loop, and Lightning counts the steps."""
    x, y, _, _ = mnist
    steps = 10
    snapshots = Snapshots()
    model = ManualClassifier()
    fit = trainer(tmp_path, max_steps=steps, callbacks=[snapshots])
    fit.fit(model, loader(x, y))
    assert fit.global_step == steps and fit.optimizers[0].steps_taken == steps
    manual, _ = manual_run(x, y, steps)
    for step in range(steps):
        for got, want in zip(snapshots.posteriors[step], manual[step], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_attributes_written_through_lightnings_optimizer_wrapper_reach_the_optimizer():
    """LightningOptimizer forwards reads to the optimizer and keeps what is written through it: a state dict
    loaded through `self.optimizers()` set its step sizes on the wrapper (the optimizer stepped with the old
    ones), and `distribute(self.optimizers(), ...)` left the optimizer without its reducer."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    net = make_net(0)
    opt = FOOVB(net, mc_samples=K, mean_step=MEAN_STEP, seed=0)
    saved = FOOVB(make_net(1), mc_samples=K, mean_step=0.1, seed=1).state_dict()
    wrapper = LightningOptimizer(opt)
    wrapper.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == opt.mean_step == wrapper.mean_step == 0.1
    assert torch.equal(opt.posterior(net[0].weight).mean, make_net(1)[0].weight.detach())
    reducer = object()
    wrapper.statistics_reducer = reducer
    assert opt.statistics_reducer is reducer


class Unscheduled(Classifier):
    def configure_optimizers(self):
        return FOOVB(self, mc_samples=K, mean_step=MEAN_STEP, seed=self.foovb_seed)


class SkipsOddBatches(Unscheduled):
    """Lightning's documented skip: training_step returns None (no backward) on every odd batch."""

    def training_step(self, batch, batch_idx):
        return None if batch_idx % 2 else super().training_step(batch, batch_idx)


def test_a_training_step_returning_none_skips_the_batch(mnist, tmp_path):
    """training_step returning None ran into FOOVB's "the closure must return the loss tensor" (a review): a closure
    that returns None without calling backward() now takes no step, as a torch optimizer without gradients, and the
    run equals one over the even batches alone; one that called backward() and returned None stays a TypeError."""
    x, y, _, _ = mnist
    skipping = SkipsOddBatches()
    trainer(tmp_path / "skip", max_epochs=1).fit(skipping, loader(x, y))
    assert skipping.trainer.optimizers[0].steps_taken == N_TRAIN // BATCH // 2
    even = torch.cat([torch.arange(i * BATCH, (i + 1) * BATCH) for i in range(0, N_TRAIN // BATCH, 2)])
    plain = Unscheduled()
    trainer(tmp_path / "even", max_epochs=1).fit(plain, loader(x[even], y[even]))
    for got, want in zip(posterior_snapshot(skipping.trainer.optimizers[0], skipping.net),
                         posterior_snapshot(plain.trainer.optimizers[0], plain.net), strict=True):
        torch.testing.assert_close(got, want)
    net = make_net(0)
    opt = FOOVB(net, seed=0)

    def forgets_to_return():
        opt.zero_grad()
        F.cross_entropy(net(x[:BATCH]), y[:BATCH]).backward()

    with pytest.raises(TypeError, match=r"got NoneType \(it called backward\(\): return the loss\)"):
        opt.step(forgets_to_return)
    # under foovb.distributed a process cannot skip alone: its peers would wait in the step's all-reduce
    opt.statistics_reducer = types.SimpleNamespace(samples=range(opt.mc_samples))
    with pytest.raises(TypeError, match="every process takes every step together"):
        opt.step(lambda: None)
