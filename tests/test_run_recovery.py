"""Getting a run back: a diverging run stops with advice and a checkpoint, Ctrl-C saves one and exits with 130, the
checkpoint loads with torch.load's default weights_only=True, and the trained model/learner load from a run
directory."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import signal
import sys

import numpy as np
import pytest
import torch
import yaml
from conftest import TINY

from foovb.predict import predict
from foovb_suite import factories, outputs, plots, runner
from foovb_suite.cli import main
from foovb_suite.config import ConfigError, config_from_dict
from foovb_suite.loading import load_learner, load_model
from foovb_suite.rundir import CheckpointError
from foovb_suite.runner import run

# FOO-VB with the paper's growing sigma, no antithetic pairs and a huge initial std: non-finite within a few steps
DIVERGING_FOOVB = ["learner.params.posterior=diagonal", "learner.params.std_init=1.0",
                   "learner.params.std_growth=paper", "learner.params.antithetic=false"]


@pytest.fixture(scope="module", autouse=True)
def no_plots():
    """The runs of this file draw no plots (the slowest part of their outputs; tests/test_runner.py checks them)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in dir(plots):
            if name.startswith("plot_"):
                patch.setattr(plots, name, lambda *args, **kwargs: None)
        yield


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, no_plots):
    """The directory of the tiny run without interruption."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "r"
    run(config_from_dict(TINY), run_dir, progress=False)
    return run_dir


def _modes(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())["modes"]


def _cli_run(config_file, out, *options: str) -> int:
    sets = [part for option in options for part in ("--set", option) if not option.startswith("--")]
    return main(["run", str(config_file), *sets, "--out", str(out), "--no-progress",
                 *(option for option in options if option.startswith("--"))])


def _patch_observe(monkeypatch, at_call: int, action) -> None:
    """The learners that `run` builds from now on call `action(learner)` at their `at_call`-th observe (0-based;
    in a fresh run, the iteration), before the step, and take the step if it returns None, else return its value."""
    build = factories.build_learner

    def build_and_patch(config, scenario, device):
        learner = build(config, scenario, device)
        observe, calls = learner.observe, []

        def patched(x, y, task=None):
            calls.append(None)
            result = action(learner) if len(calls) - 1 == at_call else None
            return observe(x, y, task) if result is None else result

        learner.observe = patched
        return learner

    monkeypatch.setattr(runner, "build_learner", build_and_patch)


def _raise(error: BaseException):
    def action(learner):
        raise error

    return action


def _checkpoint_iteration(run_dir) -> int:
    return torch.load(run_dir / "checkpoint.pt")["iteration"]  # weights_only=True, torch.load's default


def test_a_diverging_foovb_run_stops_with_advice_and_keeps_its_last_good_state(config_file, tmp_path, capsys) -> None:
    out = tmp_path / "diverged"
    assert _cli_run(config_file, out, *DIVERGING_FOOVB) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("foovb: error: training diverged after ")
    assert "non-finite" in err and "the posterior was left unchanged" in err
    for advice in ("a larger learner.params.mc_samples (now 4; at least 4)", "std_growth=none or capped",
                   "a smaller learner.params.std_init (now 1)", "antithetic=true", "another --out"):
        assert advice in err
    failed_at = _checkpoint_iteration(out)
    assert f"after {failed_at} of 20 iterations (task 1 of 2)" in err
    assert f"the state after {failed_at} iterations is saved in {out / 'checkpoint.pt'}" in err
    assert f"load_learner({str(out)!r})" in err and "--resume retries from it" in err
    # the failed step changed nothing: the checkpoint's posterior is that of a run stopped before it, and finite
    # (an update that overflows is undone too)
    reference = tmp_path / "reference"
    config = config_from_dict(yaml.safe_load((out / "config.yaml").read_text()))
    assert run(config, reference, progress=False, stop_after=failed_at) == {"interrupted_at": failed_at}
    saved, expected = (torch.load(d / "checkpoint.pt")["learner"]["optimizer"]["state"] for d in (out, reference))
    for index, state in expected.items():
        for key, value in state.items():
            torch.testing.assert_close(saved[index][key], value, rtol=0, atol=0)
            assert torch.isfinite(saved[index][key]).all()
    # --resume retries from there with new noise (and diverges again, later or at the same iteration)
    assert _cli_run(config_file, out, *DIVERGING_FOOVB, "--resume") in (0, 1)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert _checkpoint_iteration(out) >= failed_at


def test_a_refused_step_leaves_a_checkpoint_that_resumes_exactly(config_file, tmp_path, capsys, monkeypatch,
                                                                uninterrupted) -> None:
    """A step refused as non-finite after 13 iterations (past the evaluation at 10 and the checkpoint at 7): the
    checkpoint holds the learner, the records and the STDs after 13, and the resumed run ends as an uninterrupted
    one."""
    out = tmp_path / "r"
    with monkeypatch.context() as patch:
        _patch_observe(patch, 13, _raise(FloatingPointError("non-finite values in the loss at step 13")))
        assert _cli_run(config_file, out) == 1
    err = capsys.readouterr().err
    assert "training diverged after 13 of 20 iterations (task 2 of 2): non-finite values in the loss" in err
    assert _checkpoint_iteration(out) == 13
    assert _cli_run(config_file, out, "--resume") == 0
    assert capsys.readouterr().out.endswith(f"outputs in {out}\nmodel: foovb_suite.load_model({str(out)!r}) "
                                            "(learner: load_learner)\n")
    assert _modes(out) == _modes(uninterrupted)


def test_a_nan_loss_keeps_the_last_checkpoint_and_advises_a_smaller_learning_rate(config_file, tmp_path,
                                                                                   capsys, monkeypatch) -> None:
    # a real baseline divergence, before the first checkpoint
    out = tmp_path / "sgd"
    assert _cli_run(config_file, out, "learner.kind=sgd", "learner.params={lr: 10000}") == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "(task 1 of 2): the loss is nan" in err
    assert "a smaller learner.params.lr (now 10000)" in err
    assert "no checkpoint had been written yet (nothing to resume)" in err
    assert not (out / "checkpoint.pt").exists()
    # a learner that took the step and returned a NaN loss: the checkpoint after 7 iterations stays as it was
    out = tmp_path / "nan"
    _patch_observe(monkeypatch, 9, lambda learner: float("nan"))
    assert _cli_run(config_file, out) == 1
    err = capsys.readouterr().err
    assert "training diverged after 9 of 20 iterations (task 1 of 2): the loss is nan" in err
    assert f"the last checkpoint, after 7 of 20 iterations, is kept in {out / 'checkpoint.pt'}" in err
    assert _checkpoint_iteration(out) == 7


@pytest.mark.parametrize(("at_call", "kept"), [(13, 10), (19, 14)])  # the step before a periodic checkpoint (14),
# before the final evaluation (20)
def test_a_step_that_leaves_non_finite_weights_stops_the_run_before_it_is_saved_or_evaluated(
        config_file, tmp_path, capsys, monkeypatch, at_call, kept) -> None:
    """A baseline's observe returns the loss computed before its step: a step that made the weights NaN passed the
    loss check, was checkpointed, and evaluated as chance-level accuracy in a finished run's summary."""
    def nan_weights(learner):
        with torch.no_grad():
            next(learner.model.parameters()).fill_(float("nan"))
        return 0.5

    out = tmp_path / "sgd"
    _patch_observe(monkeypatch, at_call, nan_weights)
    assert _cli_run(config_file, out, "learner.kind=sgd", "learner.params={lr: 0.1}") == 1
    err = capsys.readouterr().err
    assert f"training diverged after {at_call + 1} of 20 iterations" in err
    assert "the model's weights are not finite after the last step" in err
    assert _checkpoint_iteration(out) == kept and not (out / "summary.json").exists()


def _ctrl_c(times: int):
    def action(learner):
        for _ in range(times):
            signal.raise_signal(signal.SIGINT)  # its Python handler runs before raise_signal returns

    return action


@pytest.mark.parametrize(("times", "saved_at", "saved"), [
    (1, 12, "saved a checkpoint after 12 of 20 iterations in "),  # the iteration under way finishes, is saved
    (2, 10, "the last checkpoint, after 10 of 20 iterations, is kept in "),  # a second one stops at once:
    # the last checkpoint is the evaluation's
])
def test_ctrl_c_saves_a_checkpoint_and_prints_the_command_that_resumes_it(config_file, tmp_path, capfd, monkeypatch,
                                                                         uninterrupted, times, saved_at,
                                                                         saved) -> None:
    out = tmp_path / "r"
    handler = signal.getsignal(signal.SIGINT)
    with monkeypatch.context() as patch:
        _patch_observe(patch, 11, _ctrl_c(times))
        assert _cli_run(config_file, out) == 130
    assert signal.getsignal(signal.SIGINT) is handler
    err = capfd.readouterr().err
    assert "Traceback" not in err and "foovb: Ctrl-C: stopping after this iteration" in err
    command = f"foovb run {config_file} --out {out} --resume --no-progress"
    assert f"foovb: interrupted: {saved}{out / 'checkpoint.pt'}; resume with: {command}\n" in err
    assert _checkpoint_iteration(out) == saved_at
    assert main(shlex.split(command)[1:]) == 0
    assert _modes(out) == _modes(uninterrupted)


class _ReaderGone(io.TextIOBase):
    """stderr whose reader has left (`2>&1 | tee log`, tee stopped by the same Ctrl-C)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


@pytest.fixture
def stderr_reader_leaves(monkeypatch):
    """An observe action that makes stderr a stream whose reader is gone (sys.stderr and file descriptor 2), then
    sends `signals` SIGINTs; file descriptor 2 is restored after the test."""
    saved = os.dup(2)

    def leave(signals: int):
        def action(learner):
            reader, writer = os.pipe()
            os.close(reader)
            os.dup2(writer, 2)
            os.close(writer)
            monkeypatch.setattr(sys, "stderr", _ReaderGone())
            for _ in range(signals):
                signal.raise_signal(signal.SIGINT)

        return action

    yield leave
    os.dup2(saved, 2)
    os.close(saved)


@pytest.mark.parametrize("progress", [False, True])
def test_ctrl_c_with_stderr_through_a_stopped_pipe_still_checkpoints(config_file, tmp_path, monkeypatch, uninterrupted,
                                                                     stderr_reader_leaves, progress) -> None:
    """The signal handler's message to stderr raised BrokenPipeError inside the step under way: the run exited 0
    (taken for `foovb configs | head`) without its checkpoint, losing the work since the last one."""
    out = tmp_path / "r"
    _patch_observe(monkeypatch, 11, stderr_reader_leaves(1))
    assert main(["run", str(config_file), "--out", str(out), *([] if progress else ["--no-progress"])]) == 130
    assert _checkpoint_iteration(out) == 12 and not (out / "summary.json").exists()
    monkeypatch.undo()
    assert main(["run", str(config_file), "--out", str(out), "--resume", "--no-progress"]) == 0
    assert _modes(out) == _modes(uninterrupted)


def test_a_progress_bar_whose_reader_left_does_not_stop_the_run(config_file, tmp_path, monkeypatch, uninterrupted,
                                                                stderr_reader_leaves) -> None:
    """The progress bar's BrokenPipeError ended the run (exit 0, no outputs); it goes on and finishes."""
    out = tmp_path / "r"
    _patch_observe(monkeypatch, 11, stderr_reader_leaves(0))
    assert main(["run", str(config_file), "--out", str(out)]) == 0
    assert _modes(out) == _modes(uninterrupted)


def test_ctrl_c_before_the_first_checkpoint_saves_nothing(config_file, tmp_path, capsys, monkeypatch) -> None:
    _patch_observe(monkeypatch, 3, _raise(KeyboardInterrupt()))
    assert _cli_run(config_file, tmp_path / "r") == 130
    assert capsys.readouterr().err == "foovb: interrupted: no checkpoint had been written yet (nothing to resume)\n"


def test_a_run_stopped_while_writing_its_outputs_is_not_finished_and_resume_writes_them(uninterrupted, tmp_path,
                                                                                      monkeypatch) -> None:
    """A full disk (or a kill) after the accuracy matrices: summary.json, which marks a run finished, was written
    before stds.npz and the plots, so the run looked finished with outputs missing, and a rerun was refused."""
    run_dir = tmp_path / "r"
    write = outputs.write_atomically

    def full_disk_at_stds(data: bytes, path) -> None:
        if path.name == "stds.npz":
            raise OSError(28, f"no space left to write {path}")
        write(data, path)

    monkeypatch.setattr(outputs, "write_atomically", full_disk_at_stds)
    with pytest.raises(OSError, match="no space left"):
        run(config_from_dict(TINY), run_dir, progress=False)
    assert (run_dir / "accuracy_matrix_mean.csv").is_file()
    assert not (run_dir / "summary.json").exists() and not (run_dir / "stds.npz").exists()
    monkeypatch.setattr(outputs, "write_atomically", write)
    run(config_from_dict(TINY), run_dir, resume=True, progress=False)
    assert _modes(run_dir) == _modes(uninterrupted)
    saved, want = np.load(run_dir / "stds.npz"), np.load(uninterrupted / "stds.npz")
    assert saved.files == want.files and all(np.array_equal(saved[key], want[key]) for key in want.files)


def test_checkpoints_load_with_torch_load_defaults(uninterrupted, tmp_path) -> None:
    """weights_only=True (torch.load's default) loads a finished and an interrupted run's checkpoint, STDs included."""
    interrupted = tmp_path / "r"
    assert run(config_from_dict(TINY), interrupted, progress=False, stop_after=12) == {"interrupted_at": 12}
    for run_dir, iteration in ((uninterrupted, 20), (interrupted, 12)):
        state = torch.load(run_dir / "checkpoint.pt")
        assert state["iteration"] == iteration and "iteration_10" in state["stds"]


def _test_accuracy(model: torch.nn.Module) -> list[float]:
    """`model`'s accuracy on the test examples of each task that TINY's evaluations use."""
    scenario = factories.build_scenario(config_from_dict(TINY))
    accuracy = []
    with torch.no_grad():
        for task in range(scenario.num_tasks):
            x, y = (t[: TINY["evaluation"]["test_subset"]] for t in scenario.test_set(task))
            accuracy.append((model(x).argmax(1) == y).float().mean().item())
    return accuracy


def _last_evaluation(run_dir) -> dict:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def test_the_model_and_learner_load_from_a_finished_run(uninterrupted) -> None:
    rng = torch.get_rng_state()
    model = load_model(uninterrupted)
    assert torch.equal(torch.get_rng_state(), rng)
    assert not model.training
    np.testing.assert_allclose(_test_accuracy(model), _last_evaluation(uninterrupted)["accuracy"]["mean"], rtol=0,
                               atol=1e-7)
    learner = load_learner(uninterrupted)
    np.testing.assert_array_equal(learner.posterior_std(), np.load(uninterrupted / "stds.npz")["iteration_20"])
    x = torch.randn(5, 784)
    prediction = predict(learner.optimizer, x, 10)
    assert prediction.samples.shape == (10, 5, 10)
    torch.testing.assert_close(prediction.mean, torch.softmax(model(x), 1))


def test_a_baseline_model_loads_and_a_directory_without_checkpoint_is_refused(tmp_path) -> None:
    out = tmp_path / "sgd"
    run(config_from_dict({**TINY, "learner": {"kind": "sgd", "params": {"lr": 0.05}}}), out, progress=False)
    np.testing.assert_allclose(_test_accuracy(load_model(out)), _last_evaluation(out)["accuracy"]["mean"], rtol=0,
                               atol=1e-7)
    with pytest.raises(FileNotFoundError, match=f"{tmp_path} has no checkpoint.pt"):
        load_learner(tmp_path)


def test_the_divergence_advice_names_the_per_layer_prior() -> None:
    from types import SimpleNamespace

    from foovb import FOOVB
    from foovb_suite.loop import _divergence_advice

    advice = _divergence_advice(SimpleNamespace(optimizer=FOOVB(torch.nn.Linear(3, 2))))
    assert "a learner.params.std_init below the layers' own (now xavier: sqrt(2 / (fan_in + fan_out))" in advice
    assert "a smaller learner.params.std_init (now 0.047)" in _divergence_advice(
        SimpleNamespace(optimizer=FOOVB(torch.nn.Linear(3, 2), preset="paper")))


@pytest.mark.parametrize(("content", "says"), [
    ("scenario: [", "is damaged \\(config.yaml: invalid YAML \\(while parsing"),
    ("- a", "is damaged \\(config: expected a mapping"),
    ("scenario: {kind: nope}", "is damaged \\(scenario.kind: unknown scenario"), (None, "is missing")])
def test_a_damaged_saved_config_is_one_error_line_naming_it(uninterrupted, config_file, tmp_path, capsys, content,
                                                             says) -> None:
    """--resume, `foovb compare` and load_learner read the run directory's config.yaml: a damaged or missing one
    was a yaml traceback, or an error about a key that did not say which file held it."""
    run_dir = tmp_path / "r"
    shutil.copytree(uninterrupted, run_dir)
    saved = run_dir / "config.yaml"
    if content is None:
        saved.unlink()
    else:
        saved.write_text(content)
    for command in (["run", str(config_file), "--out", str(run_dir), "--resume", "--no-progress"],
                    ["compare", str(run_dir), "--out", str(tmp_path / "compare")]):
        assert main(command) == 2
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and error[0].startswith(f"foovb: error: {saved}")
        assert re.search(says, error[0]) and error[0].endswith("or start the run in a new directory")
    with pytest.raises(ConfigError, match=re.escape(str(saved))):
        load_learner(run_dir)


def test_finite_weights_whose_logits_overflow_stop_the_run_at_the_evaluation(config_file, tmp_path, capsys,
                                                                            monkeypatch) -> None:
    """Weights finite but huge (a baseline at a far too large learning rate): the logits overflow, the test NLL is
    NaN and the accuracy chance-level; such a run finished with exit 0 and a summary (a helper's trial, session
    50). It stops at the evaluation instead, before anything is saved with it."""
    def huge_weights(learner):
        with torch.no_grad():
            for param in learner.model.parameters():
                param.mul_(1e30)
        return 0.5

    out = tmp_path / "sgd"
    _patch_observe(monkeypatch, 9, huge_weights)  # the step before the evaluation after 10 iterations
    assert _cli_run(config_file, out, "learner.kind=sgd", "learner.params={lr: 0.1}") == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "training diverged after 10 of 20 iterations" in err
    assert "the model's outputs on the test set of task(s) [1, 2] are not finite" in err and "NaN log-likelihood" in err
    assert _checkpoint_iteration(out) == 7 and not (out / "summary.json").exists()


def test_files_copied_from_another_runs_directory_are_refused_by_compare_and_load_model(uninterrupted, tmp_path,
                                                                                          capsys) -> None:
    """A run of another seed, same name, scenario and learner: its config.yaml, its results or its checkpoint copied
    into the run's directory were taken as the run's (compare grouped them as two seeds; load_model gave the other
    run's weights)."""
    other = tmp_path / "other"
    run(config_from_dict({**TINY, "seed": 7}), other, progress=False)
    for copied, says in ((["config.yaml"], "config.yaml is not the config summary.json was written under (seed: "
                                           "summary.json 0, config.yaml 7)"),
                         (["summary.json", "metrics.jsonl"], "summary.json belongs to run "),
                         (["checkpoint.pt"], "checkpoint.pt belongs to run ")):
        mixed = tmp_path / f"mixed_{copied[0]}"
        shutil.copytree(uninterrupted, mixed)
        for name in copied:
            shutil.copy(other / name, mixed / name)
        if copied == ["checkpoint.pt"]:
            with pytest.raises(CheckpointError, match=re.escape(says)):
                load_model(mixed)
            continue
        assert main(["compare", str(mixed), str(other), "--out", str(tmp_path / "cmp")]) == 2
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and says in error[0], error
    assert main(["compare", str(uninterrupted), str(other), "--out", str(tmp_path / "cmp")]) == 0  # their own files
    load_model(other)


def test_resume_of_a_finished_run_rewrites_nothing(uninterrupted, tmp_path, monkeypatch, capsys) -> None:
    """--resume with other threads on a finished run rewrote summary.json's hardware and config.yaml's threads as
    if the run had trained so (after loading the data again); now it says so and leaves the files."""
    copy = tmp_path / "finished"
    shutil.copytree(uninterrupted, copy)
    before = {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file()}
    monkeypatch.setattr(runner, "build_scenario", lambda config: pytest.fail("the data were loaded"))
    summary = run(config_from_dict({**TINY, "threads": 2}), copy, resume=True, progress=False)
    assert summary == json.loads(before["summary.json"])
    assert "holds a finished run: nothing to resume" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file()} == before
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="the config differs"):  # a changed config is still refused
        run(config_from_dict({**TINY, "seed": 3}), copy, resume=True, progress=False)
    (copy / "metrics.jsonl").write_text("")  # damaged outputs: the resume rebuilds them from the checkpoint
    run(config_from_dict(TINY), copy, resume=True, progress=False)
    assert (copy / "metrics.jsonl").read_bytes() == before["metrics.jsonl"]


def test_resume_rebuilds_outputs_deleted_or_changed_and_warns_of_a_damaged_checkpoint(uninterrupted, tmp_path,
                                                                                     capsys) -> None:
    """A user's trial (session 56): an accuracy matrix deleted, emptied or copied over from another run after the run
    finished was left so by --resume ("nothing to resume"), although docs/suite.md says it rebuilds the outputs;
    summary.json records each output's SHA-256 since, and --resume rebuilds what differs. A truncated checkpoint of a
    finished run now draws a warning (load_model would fail later)."""
    copy = tmp_path / "finished"
    shutil.copytree(uninterrupted, copy)
    before = {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file()}
    recorded = json.loads(before["summary.json"])["outputs"]
    assert {"metrics.csv", "accuracy_matrix_mean.csv"} <= recorded.keys()
    (copy / "accuracy_matrix_mean.csv").unlink()
    (copy / "metrics.csv").write_text("iteration,stage\n")
    run(config_from_dict(TINY), copy, resume=True, progress=False)
    assert "metrics.csv, accuracy_matrix_mean.csv missing or changed since the run wrote them: rebuilding" in \
        capsys.readouterr().err
    for name in ("accuracy_matrix_mean.csv", "metrics.csv"):
        assert (copy / name).read_bytes() == before[name]
    checkpoint = (copy / "checkpoint.pt").read_bytes()
    (copy / "checkpoint.pt").write_bytes(checkpoint[: len(checkpoint) // 2])
    run(config_from_dict(TINY), copy, resume=True, progress=False)
    err = capsys.readouterr().err
    assert "results are whole, but its checkpoint cannot give the trained model" in err
    assert "holds a finished run: nothing to resume" in err


def test_run_files_deleted_during_the_run_are_restored_at_its_end(uninterrupted, tmp_path, monkeypatch) -> None:
    """An `rm` of config.yaml and run.json while the run trained: it finished with exit 0 but could be neither
    compared nor resumed (config.yaml missing)."""
    out = tmp_path / "r"

    def delete(learner):
        (out / "config.yaml").unlink()
        (out / "run.json").unlink()

    _patch_observe(monkeypatch, 5, delete)
    run(config_from_dict(TINY), out, progress=False)
    assert (out / "config.yaml").read_text() == (uninterrupted / "config.yaml").read_text()
    assert json.loads((out / "run.json").read_text())["run_id"] == json.loads((out / "summary.json").read_text())[
        "run"]["id"]
    assert main(["compare", str(out), "--out", str(tmp_path / "cmp")]) == 0
    assert run(config_from_dict(TINY), out, resume=True, progress=False)["modes"] == _modes(out)
