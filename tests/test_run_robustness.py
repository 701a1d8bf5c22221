"""Runs in the real world (issue 36): checkpoints carry a format and a digest and anything else is refused in one
line, one writer per run directory, SIGTERM checkpoints like Ctrl-C, checkpoints at most `checkpoint_minutes`
apart, a full disk named, and every user-caused failure of the CLI one `foovb: error:` line."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import TINY
from test_run_recovery import _checkpoint_iteration, _cli_run, _modes, _patch_observe, no_plots  # noqa: F401

from foovb_suite import loading, rundir
from foovb_suite.cli import main
from foovb_suite.config import config_from_dict
from foovb_suite.rundir import RunDirectoryBusy, RunLock, content_digest, load_checkpoint
from foovb_suite.runner import run


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A run stopped after 12 of 20 iterations (its checkpoint is the one the tests damage, each on a copy)."""
    run_dir = tmp_path_factory.mktemp("interrupted") / "r"
    assert run(config_from_dict(TINY), run_dir, progress=False, stop_after=12) == {"interrupted_at": 12}
    return run_dir


@pytest.fixture
def damaged(interrupted, tmp_path):
    """A copy of the interrupted run directory, whose checkpoint a test may overwrite."""
    out = tmp_path / "r"
    out.mkdir()
    for name in ("config.yaml", "checkpoint.pt", "run.json"):
        (out / name).write_bytes((interrupted / name).read_bytes())
    return out


def _one_error_line(capfd) -> str:
    err = capfd.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("foovb: error: "), err
    return lines[0]


def test_checkpoints_carry_a_format_and_the_digest_of_their_content(interrupted):
    state = torch.load(interrupted / "checkpoint.pt")  # still a plain torch checkpoint (weights_only=True)
    assert state["format"] == [rundir.FORMAT, rundir.VERSION]
    assert state["digest"] == content_digest(state)
    assert load_checkpoint(interrupted / "checkpoint.pt")["iteration"] == 12


def test_a_checkpoint_altered_inside_a_valid_file_is_refused(config_file, damaged, capfd):
    """Tensor values changed, the file still a valid torch zip: it loaded and trained on (average accuracy 0.097)."""
    path = damaged / "checkpoint.pt"
    state = torch.load(path)
    first_tensor = next(v for v in state["learner"]["optimizer"]["state"][0].values())
    first_tensor.add_(1.0)
    torch.save(state, path)
    assert _cli_run(config_file, damaged, "--resume") == 2
    assert f"foovb: error: {path} was altered after it was written" in _one_error_line(capfd)
    assert not (damaged / "summary.json").exists()


@pytest.mark.parametrize("damage", ["truncated", "empty", "random bytes", "foreign", "pickled object",
                                    "string version"])
def test_an_unreadable_or_foreign_checkpoint_is_one_error_line(config_file, damaged, capfd, damage):
    path = damaged / "checkpoint.pt"
    content = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(content[: len(content) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "random bytes":
        path.write_bytes(os.urandom(4096))
    elif damage == "foreign":
        torch.save({"model": torch.zeros(3)}, path)  # a valid torch file of something else
    elif damage == "string version":
        state = torch.load(path)
        state["format"] = [rundir.FORMAT, str(rundir.VERSION)]
        torch.save(state, path)
    else:
        torch.save({"learner": object}, path)  # needs weights_only=False: never ours
    assert _cli_run(config_file, damaged, "--resume") == 2
    line = _one_error_line(capfd)
    assert str(path) in line and ("not a readable foovb checkpoint" in line or "not a foovb run checkpoint" in line)
    assert "weights_only=False" not in line  # torch's advice to load untrusted pickles is not passed on


def test_a_second_run_on_a_live_directory_is_refused_with_the_holders_pid(config_file, tmp_path, capfd):
    out = tmp_path / "r"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from foovb_suite.rundir import RunLock\n"
        f"with RunLock({str(out)!r}):\n    print('locked', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        # --resume before the live run's first checkpoint said "no checkpoint at" (a helper's trial, session 50)
        for options in ((), ("learner.kind=sgd", "learner.params={lr: 0.01}"), ("--resume",)):
            assert _cli_run(config_file, out, *options) == 2
            line = _one_error_line(capfd)
            assert f"{out} is in use by another foovb run (pid {holder.pid})" in line
        assert not (out / "config.yaml").exists()  # the refused runs wrote nothing
    finally:
        holder.kill()  # SIGKILL: the operating system releases the lock
        holder.wait()
    assert _cli_run(config_file, out) == 0


def test_a_resume_of_a_directory_whose_run_is_still_going_is_refused(config_file, damaged, capfd):
    with RunLock(damaged):  # this process holds it; the CLI opens the lock file again and is refused
        assert _cli_run(config_file, damaged, "--resume") == 2
    assert "is in use by another foovb run" in _one_error_line(capfd)


def test_a_lock_file_removed_during_a_run_lets_no_second_writer_mix_its_files(tmp_path, monkeypatch):
    """An `rm` of the directory's files while a run holds it, then a second run takes the directory: the first
    stops at its next write, without writing (before: both wrote the same checkpoint and outputs)."""
    out = tmp_path / "r"
    seen = {}

    def intrude(learner) -> None:
        (out / ".foovb.lock").unlink()
        seen["intruder"] = RunLock(out).__enter__()  # the second run: the path is free, so it gets a lock
        seen["checkpoint"] = (out / "checkpoint.pt").read_bytes()  # the one written at iteration 7

    _patch_observe(monkeypatch, 9, intrude)
    try:
        with pytest.raises(RunDirectoryBusy, match="was replaced while this run held it"):
            run(config_from_dict(TINY), out, progress=False)
        assert (out / "checkpoint.pt").read_bytes() == seen["checkpoint"]  # not written after iteration 9
        assert not (out / "summary.json").exists()
    finally:
        seen["intruder"].__exit__(None, None, None)


def test_a_removed_lock_file_is_taken_again_when_no_other_run_took_it(tmp_path):
    with RunLock(tmp_path) as lock:
        (tmp_path / ".foovb.lock").unlink()
        lock.confirm()  # no other run: the lock is taken again, on the file now at the path
        with pytest.raises(RunDirectoryBusy, match=f"pid {os.getpid()}"):
            RunLock(tmp_path).__enter__()
        lock.confirm()  # still ours: nothing changes


def test_a_lock_file_replaced_by_a_finished_run_stops_the_first_run(tmp_path):
    """The second run took the directory after the `rm` and has ended (its lock released): its files must not be
    overwritten by the first run, so the first stops rather than take the lock again."""
    with RunLock(tmp_path) as lock:
        (tmp_path / ".foovb.lock").unlink()
        with RunLock(tmp_path):
            pass
        with pytest.raises(RunDirectoryBusy, match=f"was replaced .*pid {os.getpid()}"):
            lock.confirm()


def test_a_removed_run_directory_is_named(tmp_path):
    with RunLock(tmp_path / "r") as lock:
        for path in (tmp_path / "r").iterdir():
            path.unlink()
        (tmp_path / "r").rmdir()
        with pytest.raises(RunDirectoryBusy, match="run directory .* was removed while this run held it"):
            lock.confirm()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])  # SIGHUP: the terminal or SSH session closed
def test_sigterm_checkpoints_after_the_iteration_and_prints_the_resume_command(config_file, tmp_path, capfd,
                                                                             monkeypatch, signum):
    out = tmp_path / "r"
    uninterrupted = tmp_path / "u"
    run(config_from_dict(TINY), uninterrupted, progress=False)
    handler = signal.getsignal(signum)
    with monkeypatch.context() as patch:
        _patch_observe(patch, 11, lambda learner: signal.raise_signal(signum))
        assert _cli_run(config_file, out) == 128 + signum
    assert signal.getsignal(signum) is handler
    err = capfd.readouterr().err
    name = signal.Signals(signum).name
    assert "Traceback" not in err and f"foovb: {name}: stopping after this iteration" in err
    assert f"foovb: stopped by {name}: saved a checkpoint after 12 of 20 iterations in {out / 'checkpoint.pt'}; " \
           f"resume with: foovb run {config_file} --out {out} --resume --no-progress" in err
    assert _checkpoint_iteration(out) == 12
    assert _cli_run(config_file, out, "--resume") == 0
    assert _modes(out) == _modes(uninterrupted)


def test_a_second_sigterm_stops_at_once_and_says_sigterm(config_file, tmp_path, capfd, monkeypatch):
    """The second signal was reported as Ctrl-C (exit 130, "interrupted"): a scheduler's SIGTERMs read as a user's."""
    out = tmp_path / "r"

    def two_sigterms(learner):
        for _ in range(2):
            signal.raise_signal(signal.SIGTERM)

    with monkeypatch.context() as patch:
        _patch_observe(patch, 11, two_sigterms)
        assert _cli_run(config_file, out) == 128 + signal.SIGTERM
    err = capfd.readouterr().err
    assert "Traceback" not in err
    kept = f"the last checkpoint, after 10 of 20 iterations, is kept in {out / 'checkpoint.pt'}"
    assert f"foovb: stopped by SIGTERM: {kept}" in err
    assert _checkpoint_iteration(out) == 10 and not list(out.glob("*.tmp"))


def test_sigterm_while_the_outputs_are_written_waits_for_them(tmp_path, monkeypatch):
    """A signal during the final plots stopped the process with summary.json written but plots missing."""
    from foovb_suite import outputs

    drawn = []

    def draw(kind: str):
        def plot(*args, **kwargs):
            if not drawn:
                signal.raise_signal(signal.SIGTERM)
            drawn.append(kind)
        return plot

    for kind in ("average_accuracy", "first_task_accuracy", "accuracy_matrix"):
        monkeypatch.setattr(outputs.plots, f"plot_{kind}", draw(kind))

    def undeferred(signum, frame):
        raise AssertionError("the SIGTERM was not deferred: it would have stopped the process")

    handler = signal.signal(signal.SIGTERM, undeferred)  # stands for the default action, which ends pytest
    try:
        summary = run(config_from_dict(TINY), tmp_path / "r", progress=False)
        assert signal.getsignal(signal.SIGTERM) is undeferred
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert drawn == ["average_accuracy", "first_task_accuracy", "accuracy_matrix"] * len(summary["modes"])


def test_signals_while_the_outputs_are_written_say_so_and_resume_writes_them(config_file, tmp_path, capfd,
                                                                           monkeypatch):
    """A first SIGTERM after the last iteration said "stopping after this iteration", then the run ended with exit 0;
    a second one stops at once, and --resume writes the outputs without training again."""
    from foovb_suite import outputs

    def two_sigterms(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)

    out = tmp_path / "r"
    with monkeypatch.context() as patch:
        patch.setattr(outputs.plots, "plot_average_accuracy", two_sigterms)
        assert _cli_run(config_file, out) == 128 + signal.SIGTERM
    err = capfd.readouterr().err
    assert "SIGTERM: training has ended: writing the run's outputs, then exiting" in err
    assert "stopping after this iteration" not in err and "Traceback" not in err
    assert not (out / "summary.json").exists()

    def trains(learner):
        raise AssertionError("--resume trained again")

    with monkeypatch.context() as patch:
        _patch_observe(patch, 0, trains)
        assert _cli_run(config_file, out, "--resume") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["id"] == json.loads((out / "run.json").read_text())["run_id"]


def test_a_new_run_over_an_attempt_killed_before_its_first_checkpoint_is_its_own(config_file, tmp_path, capfd):
    """The killed attempt's run.json was kept: the finished run's summary and checkpoint read as copied from another
    run, and compare, load_model and --resume refused them."""
    out = tmp_path / "r"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"run_id": "0123456789abcdef"}) + "\n")  # what the killed one left
    assert _cli_run(config_file, out) == 0
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    assert run_id != "0123456789abcdef"
    assert json.loads((out / "summary.json").read_text())["run"]["id"] == run_id
    loading.load_model(out)
    capfd.readouterr()
    assert _cli_run(config_file, out, "--resume") == 0
    assert "nothing to resume" in capfd.readouterr().err


def test_checkpoints_are_written_at_most_checkpoint_minutes_apart(tmp_path, monkeypatch):
    """Whatever checkpoint_every says, a SIGKILL loses at most checkpoint_minutes of work."""
    seen = []

    def read_checkpoint(learner):
        seen.append(_checkpoint_iteration(tmp_path / "r"))

    _patch_observe(monkeypatch, 5, read_checkpoint)
    config = config_from_dict({**TINY, "checkpoint_every": 1000, "checkpoint_minutes": 1e-9})
    run(config, tmp_path / "r", progress=False)
    assert seen == [5]  # a few microseconds apart: after each of the 5 iterations before


def test_a_full_disk_is_named_and_keeps_the_last_checkpoint(config_file, damaged, capfd, monkeypatch):
    fsync = os.fsync

    def no_space(fd):  # the disk fills when the checkpoint is written
        if os.readlink(f"/proc/self/fd/{fd}").endswith("checkpoint.pt.tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        fsync(fd)

    before = (damaged / "checkpoint.pt").read_bytes()
    monkeypatch.setattr(rundir.os, "fsync", no_space)
    assert _cli_run(config_file, damaged, "--resume") == 2
    line = _one_error_line(capfd)
    assert f"no space left to write {damaged / 'checkpoint.pt'}" in line and "what it held before is kept" in line
    assert (damaged / "checkpoint.pt").read_bytes() == before
    assert not list(damaged.glob("*.tmp"))


@pytest.mark.parametrize("problem", ["duplicate key", "unwritable output", "subset too large", "corrupt data file"])
def test_user_errors_of_the_cli_are_one_line(config_file, tmp_path, capfd, problem):
    out = tmp_path / "r"
    options = []
    if problem == "corrupt data file":
        folder = tmp_path / "data" / "fashion_mnist"
        folder.mkdir(parents=True)
        for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                     "t10k-labels-idx1-ubyte"):
            (folder / f"{name}.gz").write_bytes(os.urandom(256))
        options = ["scenario={kind: vision_mix, num_tasks: 1, datasets: [fashion_mnist], data_dir: "
                   f"{tmp_path / 'data'}}}", "model={kind: lenet}"]
    elif problem == "duplicate key":
        config_file.write_text(config_file.read_text() + "checkpoint_every: 5\n")
    elif problem == "unwritable output":
        (tmp_path / "a_file").write_text("")
        out = tmp_path / "a_file" / "r"
    else:
        options = ["scenario.train_subset=70000"]
    assert _cli_run(config_file, out, *options) == 2
    line = _one_error_line(capfd)
    expected = {"duplicate key": "the key 'checkpoint_every' is given twice", "unwritable output": "a_file",
                "subset too large": "train_subset must be in [1, 60000], got 70000",
                "corrupt data file": "fashion_mnist"}[problem]
    assert expected in line


@pytest.mark.parametrize("where", ["before the subcommand", "after it"])
def test_debug_shows_the_traceback_with_the_same_exit_status(config_file, tmp_path, capsys, where):
    config_file.write_text(config_file.read_text() + "checkpoint_every: 5\n")

    argv = ["run", str(config_file), "--out", str(tmp_path / "r"), "--no-progress"]
    assert main(["--debug", *argv] if where == "before the subcommand" else [*argv, "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ConfigError" in err
    assert err.rstrip().splitlines()[-1].startswith("foovb: error: ") and "given twice" in err
    assert main(argv[:2] + ["--out", str(tmp_path / "r2"), "--no-progress"]) == 2  # without it: one line
    assert "Traceback" not in capsys.readouterr().err


def test_a_checkpoint_of_another_model_is_one_error_line(config_file, damaged, tmp_path, capfd):
    other = tmp_path / "other"
    run(config_from_dict({**TINY, "model": {"kind": "mlp", "hidden": [8]}}), other, progress=False, stop_after=3)
    (damaged / "checkpoint.pt").write_bytes((other / "checkpoint.pt").read_bytes())
    assert _cli_run(config_file, damaged, "--resume") == 2
    assert "belongs to another run" in _one_error_line(capfd)
    # a checkpoint of version 2 records no run: its model is what gives it away
    state = torch.load(other / "checkpoint.pt")
    del state["run"], state["digest"]
    state["format"] = [rundir.FORMAT, 2]
    torch.save({**state, "digest": content_digest(state)}, damaged / "checkpoint.pt")
    assert _cli_run(config_file, damaged, "--resume") == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and "did not record its run" in err
    assert "does not fit this run's learner and model" in err.splitlines()[-1]


def test_ctrl_c_before_the_run_starts_is_one_line(config_file, tmp_path, capfd, monkeypatch):
    from foovb_suite import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "load_config", interrupted)  # e.g. while torch is still being imported
    assert _cli_run(config_file, tmp_path / "r") == 130
    err = capfd.readouterr().err
    assert err == "foovb: interrupted\n"


def test_yaml_merge_keys_are_read_and_may_be_overridden(tmp_path):
    from foovb_suite.config import load_config

    path = tmp_path / "merged.yaml"
    text = yaml.safe_dump({k: v for k, v in TINY.items() if k != "scenario"}) + (
        "scenario:\n  <<: {kind: discrete_permuted_mnist, num_tasks: 2, batch_size: 64}\n  batch_size: 32\n")
    path.write_text(text)
    config = load_config(path)
    assert (config.scenario.num_tasks, config.scenario.batch_size) == (2, 32)


# A checkpoint belongs to its run (issue "reliability round 3")


def _start(out, stop_after: int = 3, **changes) -> None:
    """A run of TINY with `changes` (top-level keys; learner params as "params"), stopped after `stop_after`
    iterations."""
    params = changes.pop("params", {})
    learner = {**TINY["learner"], **changes.pop("learner", {})}
    learner["params"] = {**learner.get("params", {}), **params}
    config = {**TINY, **changes, "learner": learner}
    assert run(config_from_dict(config), out, progress=False, stop_after=stop_after) == {"interrupted_at": stop_after}


def _snapshot(run_dir) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(run_dir.iterdir()) if path.is_file()}


def test_a_deleted_run_json_is_named_with_how_to_restore_it(config_file, tmp_path, capfd):
    """run.json deleted in the run's own directory: the refusal said the checkpoint "was copied from another run
    directory" (a helper's trial, session 50); it names both cases and the file to restore, which resumes."""
    out = tmp_path / "r"
    _start(out)
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    (out / "run.json").unlink()
    assert _cli_run(config_file, out, "--resume") == 2
    line = _one_error_line(capfd)
    assert f"belongs to run {run_id}, and this directory has no run.json. If this is that run's own directory" in line
    assert f'run.json holding {{"run_id": "{run_id}"}}' in line
    (out / "run.json").write_text(json.dumps({"run_id": run_id}))
    assert _cli_run(config_file, out, "--resume") == 0


def test_a_checkpoint_records_its_run_and_the_config_it_computes_with(interrupted):
    state = torch.load(interrupted / "checkpoint.pt")
    run_id = yaml.safe_load((interrupted / "run.json").read_text())["run_id"]
    assert state["run"]["id"] == run_id and len(run_id) == 16
    saved = yaml.safe_load((interrupted / "config.yaml").read_text())
    assert state["run"]["config"]["seed"] == saved["seed"] and "threads" not in state["run"]["config"]


def test_another_runs_valid_checkpoint_copied_in_is_refused_and_nothing_is_written(config_file, tmp_path, capfd):
    """Seed 7's checkpoint (same architecture) in a seed-0 run directory resumed and finished with seed 7's results
    while config.yaml said seed 0."""
    seed0, seed7 = tmp_path / "seed0", tmp_path / "seed7"
    _start(seed0)
    _start(seed7, seed=7)
    (seed0 / "checkpoint.pt").write_bytes((seed7 / "checkpoint.pt").read_bytes())
    before = _snapshot(seed0)
    assert _cli_run(config_file, seed0, "--resume") == 2
    line = _one_error_line(capfd)
    assert "belongs to another run" in line and str(seed0 / "checkpoint.pt") in line
    assert _snapshot(seed0) == before


def test_a_config_yaml_edited_to_match_a_changed_setting_is_refused(config_file, tmp_path, capfd):
    """--resume refused `--set lr`, but after config.yaml was edited to match, it resumed with the checkpoint's lr
    and config.yaml kept saying the edited one."""
    out = tmp_path / "r"
    _start(out, params={"mean_step": 0.05})
    config = yaml.safe_load((out / "config.yaml").read_text())
    config["learner"]["params"]["mean_step"] = 0.5
    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    before = _snapshot(out)
    assert _cli_run(config_file, out, "learner.params.mean_step=0.5", "--resume") == 2
    line = _one_error_line(capfd)
    assert "learner.params.mean_step: checkpoint 0.05, config.yaml and command line 0.5" in line
    assert _snapshot(out) == before


def test_a_checkpoint_whole_run_directory_copied_elsewhere_resumes(config_file, interrupted, tmp_path):
    """Copying a run directory (run.json with it) is the same run: it resumes."""
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("config.yaml", "checkpoint.pt", "run.json"):
        (copy / name).write_bytes((interrupted / name).read_bytes())
    assert _cli_run(config_file, copy, "--resume") == 0
    assert (copy / "summary.json").is_file()


def _as_version(path, version: int, change=None) -> None:
    """Rewrite the checkpoint at `path` as an earlier foovb wrote it: version 2 (no "run"), or 1 (no format or
    digest either), after `change(state)`."""
    state = torch.load(path)
    del state["run"], state["digest"], state["format"]
    if change is not None:
        change(state)
    torch.save({**state, "format": [rundir.FORMAT, 2], "digest": content_digest(state)} if version == 2 else state,
               path)


def test_a_two_task_checkpoint_in_a_three_task_run_is_refused(config_file, tmp_path, capfd):
    """An earlier checkpoint (no run recorded) of a 2-task run resumed as a 3-task run: a ValueError in _summary."""
    two, three = tmp_path / "two", tmp_path / "three"
    _start(two, stop_after=12)  # past the first task's end: an evaluation of 2 tasks recorded
    _start(three, scenario={**TINY["scenario"], "num_tasks": 3})
    _as_version(two / "checkpoint.pt", 2)
    (three / "checkpoint.pt").write_bytes((two / "checkpoint.pt").read_bytes())
    assert _cli_run(config_file, three, "scenario.num_tasks=3", "--resume") == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err
    assert "does not fit this run's scenario (its evaluations cover [2] tasks, this run has 3)" in err.splitlines()[-1]


def test_nan_weights_in_a_checkpoint_without_a_digest_are_refused(config_file, tmp_path, capfd):
    out = tmp_path / "sgd"
    sgd = ["learner.kind=sgd", "learner.params={lr: 0.05}"]
    _start(out, learner={"kind": "sgd", "params": {"lr": 0.05}})

    def poison(state: dict) -> None:
        weights = next(key for key in state["learner"]["model"] if key.endswith("weight"))
        state["learner"]["model"][weights][0, 0] = float("nan")

    _as_version(out / "checkpoint.pt", 1, poison)
    assert _cli_run(config_file, out, *sgd, "--resume") == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and "holds non-finite weights" in err.splitlines()[-1]


@pytest.mark.parametrize("kind", ["directory", "fifo", "device link"])
def test_a_checkpoint_path_that_is_no_file_is_named_as_what_it_is(config_file, interrupted, tmp_path, capfd, kind):
    out = tmp_path / "r"
    out.mkdir()
    for name in ("config.yaml", "run.json"):
        (out / name).write_bytes((interrupted / name).read_bytes())
    path = out / "checkpoint.pt"
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    assert _cli_run(config_file, out, "--resume") == 2
    line = _one_error_line(capfd)
    want = {"directory": "is a directory", "fifo": "is a named pipe (fifo)",
            "device link": "is a device (a symbolic link to /dev/zero)"}[kind]
    assert f"{path} {want}, not a checkpoint file" in line
    with pytest.raises(FileNotFoundError, match=want.replace("(", r"\(").replace(")", r"\)")):
        loading.load_learner(out)


def test_running_out_of_inodes_says_so(config_file, damaged, capfd, monkeypatch):
    """A file system with bytes free but no inode left was reported as MiB free."""
    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    real_statvfs = os.statvfs

    def no_inodes(path):
        stats = real_statvfs(path)
        return os.statvfs_result((*stats[:6], 0, 0, *stats[8:]))  # f_ffree, f_favail: 0

    monkeypatch.setattr(rundir.os, "fsync", no_space)
    monkeypatch.setattr(rundir.os, "statvfs", no_inodes)
    assert _cli_run(config_file, damaged, "--resume") == 2
    line = _one_error_line(capfd)
    assert f"no space left to write {damaged}" in line and "no free inodes" in line and "MiB" not in line


def test_a_full_disk_at_the_lock_file_names_it(config_file, tmp_path, capfd, monkeypatch):
    """The pid written into the lock file on a full disk: 'No space left on device', no file named."""
    def no_space(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir.os, "write", no_space)
    assert _cli_run(config_file, tmp_path / "r") == 2
    assert f"no space left to write {tmp_path / 'r' / '.foovb.lock'}" in _one_error_line(capfd)


def test_a_billion_laughs_in_the_run_directorys_config_is_refused(config_file, damaged, capfd):
    """--resume reads the run directory's config.yaml with the same bounds as a config given on the command line."""
    from test_runner import _laughs

    (damaged / "config.yaml").write_text(f"name: tiny\nseed: {_laughs(6)}\n")
    assert _cli_run(config_file, damaged, "--resume") == 2
    line = _one_error_line(capfd)
    assert f"{damaged / 'config.yaml'}" in line and "more than 100000 values" in line


def test_a_sighup_that_nohup_ignores_stays_ignored():
    from foovb_suite.signals import deferred_interrupt

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with deferred_interrupt(True) as requested:
            signal.raise_signal(signal.SIGHUP)
            assert requested() is None
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def test_a_full_disk_on_a_new_file_says_nothing_was_written(tmp_path, monkeypatch):
    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir.os, "fsync", no_space)
    with pytest.raises(OSError, match="nothing was written") as error:
        rundir.write_atomically(b"x", tmp_path / "new.json")
    assert "held before" not in str(error.value)
    assert not list(tmp_path.iterdir())


def test_a_second_signal_as_a_checkpoint_is_written_names_the_checkpoint_on_disk(tmp_path, monkeypatch):
    """Stopped between the file's rename and the record of it, the message named the checkpoint before."""
    from foovb_suite import loop as loop_module
    from foovb_suite.signals import RunInterrupted

    calls = []

    def written_then_stopped(state, path):
        rundir.save_checkpoint(state, path)
        calls.append(state["iteration"])
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(loop_module, "save_checkpoint", written_then_stopped)
    out = tmp_path / "r"
    with pytest.raises(RunInterrupted) as stopped:
        run(config_from_dict(TINY), out, progress=False)
    on_disk = torch.load(out / "checkpoint.pt")["iteration"]
    assert on_disk == calls[1] != calls[0]
    assert f"the last checkpoint, after {on_disk} of " in str(stopped.value)
    assert stopped.value.checkpoint_iteration == on_disk


@pytest.mark.parametrize("argv", [["run"], ["run", "demo", "--set"], ["run", "demo", "--sett", "x=1"],
                                  ["compare", "--plot-modes", "foo"], ["bogus"]])
def test_command_line_mistakes_end_with_one_foovb_error_line(argv, capsys) -> None:
    """A user's trial (session 56): argparse's own errors ended with "foovb run: error: ...", unlike every other user
    error of the CLI; now the usage, then one `foovb: error: ...` line naming the --help to read."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    last = capsys.readouterr().err.rstrip("\n").splitlines()[-1]
    assert last.startswith("foovb: error: ") and last.endswith("--help)"), last


def test_a_broken_tensorboard_install_is_one_line(monkeypatch) -> None:
    """A user's trial (session 56): a tensorboard whose import raises something else than ImportError (protobuf's
    TypeError "Descriptors cannot be created directly") gave a traceback; now a ConfigError naming the repair."""
    import builtins

    from foovb_suite.config import ConfigError
    from foovb_suite.tensorboard_log import require_tensorboard

    real_import = builtins.__import__

    def broken(name, *args, **kwargs):
        if name == "tensorboard":
            raise TypeError("Descriptors cannot be created directly.\nIf this call came from a _pb2.py file ...")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", broken)
    with pytest.raises(ConfigError, match=r"^tensorboard is installed but fails to import \(TypeError: Descriptors "
                                          r"cannot be created directly\. If this call") as refusal:
        require_tensorboard()
    assert "\n" not in str(refusal.value)


def test_a_factory_that_calls_sys_exit_is_a_factory_error(tmp_path, monkeypatch, capsys) -> None:
    """A user's trial (session 56): a scenario factory that called sys.exit("usage: bad") ended the CLI with that
    text alone; now one `foovb: error:` line naming the factory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exits.py").write_text("import sys\n\n\ndef make_tasks():\n    sys.exit('usage: bad')\n")
    (tmp_path / "c.yaml").write_text("scenario: {kind: custom, factory: 'exits:make_tasks'}\nlearner: {kind: sgd}\n")
    assert main(["run", "c.yaml", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("foovb: error: scenario.factory 'exits:make_tasks' raised SystemExit: usage: bad") \
        and err.count("\n") == 1, err


def test_an_empty_config_name_a_non_file_and_a_missing_run_directory_say_what_they_are(tmp_path, capsys) -> None:
    """A user's trial (session 56): `foovb run ""` said "config file . is a directory", `foovb run /dev/null` "does not
    exist", `foovb compare MISSING` "has no summary.json (not a finished run)"."""
    (tmp_path / "a_file").write_text("x")
    for argv, says in ((["run", ""], "the config is an empty name"),
                       (["run", "/dev/null"], "config file /dev/null is not a regular file"),
                       (["compare", str(tmp_path / "missing")], f"{tmp_path / 'missing'} does not exist"),
                       (["compare", str(tmp_path / "a_file")], "is a file, not a run directory")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("foovb: error: ") and says in err and err.count("\n") == 1, err
