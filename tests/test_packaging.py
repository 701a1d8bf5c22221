"""What a user gets from `pip install foovb[suite]`: the bundled configs, `foovb configs`, `--version`,
`python -m foovb_suite` and the package data the wheel must carry."""

from __future__ import annotations

import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

import foovb
from foovb_suite.cli import bundled_configs, config_path, main
from foovb_suite.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_bundled_configs_are_the_repository_configs():
    bundled = bundled_configs()
    assert sorted(bundled) == sorted(path.stem for path in (ROOT / "configs").glob("*.yaml"))
    assert {"demo", "discrete_pmnist_foovb_diagonal", "continuous_pmnist_foovb_kronecker"} <= set(bundled)
    for name, path in bundled.items():
        assert path.read_text() == (ROOT / "configs" / f"{name}.yaml").read_text()


def test_a_config_is_a_file_path_or_a_bundled_name(tmp_path):
    assert config_path("demo") == bundled_configs()["demo"]
    assert load_config(config_path("demo")).name == "demo_foovb"
    assert config_path("my.yaml") == Path("my.yaml")  # a path, even one that does not exist (load_config says so)
    assert config_path("runs/demo") == Path("runs/demo")
    with pytest.raises(ConfigError, match=r"'dem' is neither a file nor a bundled config.* demo"):
        config_path("dem")
    own = tmp_path / "myconf"  # an existing file is a file, whatever its name
    own.write_text(bundled_configs()["demo"].read_text())
    assert config_path(str(own)) == own
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        assert config_path("myconf") == Path("myconf") and config_path("./myconf") == Path("myconf")
        # the repository's path to a bundled config, outside a checkout: the error names the bundled name
        with pytest.raises(ConfigError, match=r"configs/demo.yaml does not exist; .*`foovb run demo`"):
            config_path("configs/demo.yaml")
    assert main(["run", "dem", "--out", str(tmp_path / "run")]) == 2
    assert not (tmp_path / "run").exists()


def test_foovb_configs_lists_every_bundled_config_with_its_description(capsys):
    assert main(["configs"]) == 0
    out = capsys.readouterr().out
    for name in bundled_configs():
        assert f"\n{name} " in f"\n{out}"
    assert "Quick demo: discrete task-agnostic permuted MNIST" in out
    assert str(bundled_configs()["demo"].parent) in out


def test_version_and_python_dash_m():
    result = subprocess.run([sys.executable, "-m", "foovb_suite", "--version"], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == f"foovb {foovb.__version__}"


@pytest.mark.parametrize(("missing", "distribution", "command"), [
    ("numpy", "numpy", ["--help"]), ("yaml", "PyYAML", ["--help"]),
    ("matplotlib", "matplotlib", ["plot", "missing.csv"]),  # imported late, by the plots
])
def test_the_command_without_the_suite_extra_names_the_extra(missing, distribution, command, tmp_path):
    """`pip install foovb` installs the command but not the suite's dependencies: one error line, no traceback."""
    blocked = f"import sys; sys.modules[{missing!r}] = None; import runpy; runpy.run_module('foovb_suite')"
    result = subprocess.run([sys.executable, "-c", blocked, *command], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr  # (torch itself warns that it found no NumPy)
    assert result.stderr.strip().splitlines()[-1] == (
        f"foovb: error: the foovb command needs the suite's dependencies ({distribution} is not installed): "
        "pip install 'foovb[suite]'")


def test_the_entry_point_is_the_guarded_command():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["foovb"] == "foovb_suite.command:main"


def test_the_entry_points_import_loads_no_torch_and_a_ctrl_c_while_starting_is_one_line(monkeypatch, capsys):
    """A Ctrl-C in the command's first second (while torch loads) was a 46-line traceback from the entry point's
    `import foovb_suite.command` (a helper's trial, session 50): that import now loads nothing heavy, and the load
    happens inside main, which says so in one line."""
    code = "import sys, foovb_suite.command, foovb_suite; print('torch' in sys.modules, foovb_suite.__version__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", foovb.__version__]
    import builtins

    import foovb_suite.command as command

    real_import = builtins.__import__

    def interrupted_import(name, *args, **kwargs):
        if name == "cli":  # `from .cli import main`
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted_import)
    assert command.main(["--help"]) == 130
    assert capsys.readouterr().err == "foovb: interrupted while starting (nothing was run)\n"


def test_the_wheel_declares_the_package_data_it_needs():
    """setuptools ships only what `package-data` names: the configs and the MNIST files must be among it, and
    the license file must exist (the wheel's metadata names it)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_data = project["tool"]["setuptools"]["package-data"]
    src = ROOT / "src" / "foovb_suite"
    for package, folder in (("foovb_suite", src / "configs"), ("foovb_suite.data", src / "data" / "files")):
        package_dir = src.joinpath(*package.split(".")[1:])
        files = [path.relative_to(package_dir).as_posix() for path in folder.iterdir()]
        assert files and all(any(fnmatch(f, pattern) for pattern in package_data[package]) for f in files), package
    assert (ROOT / project["project"]["license-files"][0]).is_file()


def test_the_package_version_is_the_projects():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"] == foovb.__version__
