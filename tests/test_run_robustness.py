"""Runs in the real world (issue 36): checkpoints carry a format and a digest and anything else is refused in one
line, one writer per run directory, SIGTERM checkpoints like Ctrl-C, checkpoints at most `checkpoint_minutes`
apart, a full disk named, and every user-caused failure of the CLI one `foovb: error:` line."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import TINY
from test_run_recovery import _checkpoint_iteration, _cli_run, _modes, _patch_observe, no_plots  # noqa: F401

from foovb_suite import rundir
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
    for name in ("config.yaml", "checkpoint.pt"):
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
        for options in ((), ("learner.kind=sgd", "learner.params={lr: 0.01}")):
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


def test_sigterm_checkpoints_after_the_iteration_and_prints_the_resume_command(config_file, tmp_path, capfd,
                                                                             monkeypatch):
    out = tmp_path / "r"
    uninterrupted = tmp_path / "u"
    run(config_from_dict(TINY), uninterrupted, progress=False)
    handler = signal.getsignal(signal.SIGTERM)
    with monkeypatch.context() as patch:
        _patch_observe(patch, 11, lambda learner: signal.raise_signal(signal.SIGTERM))
        assert _cli_run(config_file, out) == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is handler
    err = capfd.readouterr().err
    assert "Traceback" not in err and "foovb: SIGTERM: stopping after this iteration" in err
    assert f"foovb: stopped by SIGTERM: saved a checkpoint after 12 of 20 iterations in {out / 'checkpoint.pt'}; " \
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
    from foovb_suite import runner

    drawn = []

    def draw(kind: str):
        def plot(*args, **kwargs):
            if not drawn:
                signal.raise_signal(signal.SIGTERM)
            drawn.append(kind)
        return plot

    for kind in ("average_accuracy", "first_task_accuracy", "accuracy_matrix"):
        monkeypatch.setattr(runner.plots, f"plot_{kind}", draw(kind))

    def undeferred(signum, frame):
        raise AssertionError("the SIGTERM was not deferred: it would have stopped the process")

    handler = signal.signal(signal.SIGTERM, undeferred)  # stands for the default action, which ends pytest
    try:
        summary = run(config_from_dict(TINY), tmp_path / "r", progress=False)
        assert signal.getsignal(signal.SIGTERM) is undeferred
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert drawn == ["average_accuracy", "first_task_accuracy", "accuracy_matrix"] * len(summary["modes"])


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


def test_debug_shows_the_traceback(config_file, tmp_path):
    config_file.write_text(config_file.read_text() + "checkpoint_every: 5\n")
    from foovb_suite.cli import main
    from foovb_suite.config import ConfigError

    with pytest.raises(ConfigError, match="given twice"):
        main(["--debug", "run", str(config_file), "--out", str(tmp_path / "r"), "--no-progress"])


def test_a_checkpoint_of_another_model_is_one_error_line(config_file, damaged, tmp_path, capfd):
    other = tmp_path / "other"
    run(config_from_dict({**TINY, "model": {"kind": "mlp", "hidden": [8]}}), other, progress=False, stop_after=3)
    (damaged / "checkpoint.pt").write_bytes((other / "checkpoint.pt").read_bytes())
    assert _cli_run(config_file, damaged, "--resume") == 2
    assert "does not fit this run's learner and model" in _one_error_line(capfd)


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
