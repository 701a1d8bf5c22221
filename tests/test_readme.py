"""The README's and the docs pages' examples run as pasted, and their shell commands are valid.

Checked on README.md, every docs/*.md page and every docs/results/*.md page:
- every ```python block runs (in a temporary directory), except a block announced by an HTML comment
  `<!-- not run: REASON -->` on the line before its fence, which must still compile; a block announced by
  `<!-- run with env: KEY=VALUE ... -->` runs with those environment variables (docs/distributed.md's script
  runs as a one-process torchrun job);
- every `foovb ...`, `python -m foovb_suite ...` and `torchrun ... -m foovb_suite.cli ...` command (inline code,
  possibly wrapped over lines, and bash blocks) parses with the CLI's own parser; a `run` command's config
  (a path or a bundled name) loads with its `--set` overrides and builds its model and learner (no data, no
  training), so a stale config name, key, flag or hyperparameter fails here; the files a page shows whole
  (`<!-- file: NAME -->`, `conftest.page_files`) are there as a reader who saved them has them;
- every `python benchmarks/SCRIPT.py ...` command names an existing script and only flags that script defines;
- relative links, and `docs/...` paths in code spans, name files that exist;
- the README keeps the test command that `.ci/run` runs, verbatim.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import page_files

from foovb_suite.cli import build_parser, config_path
from foovb_suite.config import load_config
from foovb_suite.custom import config_directory
from foovb_suite.factories import build_learner
from foovb_suite.scenarios import VisionMix

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
RESULT_PAGES = sorted((ROOT / "docs" / "results").glob("*.md"))  # one page per scenario, beside the run outputs
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), *RESULT_PAGES]
TEST_COMMAND = 'pip install torch==2.13.0 -e ".[dev]" && python -m pytest -m "not slow"'
NOT_RUN = re.compile(r"<!--\s*not run:[^>]*-->\s*$")
RUN_WITH_ENV = re.compile(r"<!--\s*run with env:([^>]*)-->\s*$")


def python_blocks(page: Path) -> list[tuple[int, str, bool, dict[str, str]]]:
    """(index, code, run, env) of every ```python block of a page: run is False after a `<!-- not run: ... -->`,
    env holds the variables of a `<!-- run with env: KEY=VALUE ... -->`."""
    text = page.read_text()
    blocks = []
    for index, match in enumerate(re.finditer(r"```python\n(.*?)```", text, re.S)):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        env = RUN_WITH_ENV.search(before)
        env = dict(pair.split("=", 1) for pair in env.group(1).split()) if env else {}
        blocks.append((index, match.group(1), not NOT_RUN.search(before), env))
    return blocks


BLOCKS = [(page, *block) for page in PAGES for block in python_blocks(page)]


@pytest.mark.parametrize(("page", "index", "code", "run", "env"), BLOCKS,
                         ids=[f"{block[0].relative_to(ROOT)}:{block[1]}" for block in BLOCKS])
def test_python_blocks_run(page: Path, index: int, code: str, run: bool, env: dict[str, str], tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = compile(code, f"{page.relative_to(ROOT)} python block {index}", "exec")
    if run:
        monkeypatch.chdir(tmp_path)  # blocks may write files (checkpoints)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        exec(compiled, {"__name__": "__readme__"})


def test_readme_has_its_examples() -> None:
    running = [code for _, code, run, _ in python_blocks(README) if run]
    assert len(running) >= 3, "the README lost its quickstart, Lightning or save/load example"
    assert any("FOOVB(model)" in code and "step(closure)" in code for code in running), "no quickstart"
    assert any("import lightning" in code for code in running), "no Lightning example"


def shell_commands(page: Path) -> list[str]:
    """The shell commands of a page: inline code spans and the lines of bash blocks (continuations joined)."""
    text = page.read_text()
    starts = r"(?:foovb |python -m foovb_suite|python benchmarks/|torchrun )"
    commands = [" ".join(span.split()) for span in re.findall(rf"`({starts}[^`]*)`", text)]
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            if re.match(starts, line.strip()):
                commands.append(line.strip())
    return commands


def is_synopsis(argv: list[str]) -> bool:
    """`foovb run CONFIG [--set key=value ...]`: a usage line, not a command."""
    return any(arg.startswith("[") or re.fullmatch(r"[A-Z][A-Z_]*(\.\.\.)?", arg) for arg in argv)


def cli_argv(command: str) -> list[str] | None:
    """The arguments that the `foovb` command receives, or None for a command of another program."""
    argv = shlex.split(command, comments=True)
    if argv[0] == "foovb":
        return argv[1:]
    if argv[:3] == ["python", "-m", "foovb_suite"]:
        return argv[3:]
    if argv[0] == "torchrun" and "-m" in argv:
        module = argv.index("-m")
        assert argv[module + 1] == "foovb_suite.cli", f"torchrun runs a module that is not the CLI: {command}"
        return argv[module + 2:]
    return None


def check_run(argv: list[str], page_files_dir: Path) -> None:
    args = build_parser().parse_args(["run", *argv])
    saved = page_files_dir / args.config  # a config file the page shows whole
    path = saved if saved.is_file() else config_path(args.config)
    config = load_config(path if path.is_absolute() else ROOT / path, args.set)
    s = config.scenario
    if s.kind == "vision_mix":
        stream = SimpleNamespace(num_tasks=s.num_tasks, task_aware=True, input_shape=VisionMix.input_shape,
                                 num_classes=10)
    else:
        stream = SimpleNamespace(num_tasks=s.num_tasks, task_aware=False,
                                 input_shape=(1024 if s.pad_to_32 else 784,), num_classes=10)
    with config_directory(path):  # a custom model's factory, as `foovb run` imports it
        build_learner(config, stream, torch.device("cpu"))  # raises on an unknown or invalid hyperparameter


def check_benchmark(command: str) -> None:
    argv = shlex.split(command, comments=True)
    script = ROOT / argv[1]
    assert script.is_file(), f"no such script: {argv[1]}"
    source = script.read_text()
    for flag in (arg.split("=")[0] for arg in argv[2:] if arg.startswith("--")):
        assert re.search(rf"add_argument\([^)]*[\"']{re.escape(flag)}[\"']", source), \
            f"{argv[1]} has no flag {flag}"
    if script.name == "loop_time.py":  # its first argument is a config, with --set overrides
        sets = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]
        load_config(ROOT / argv[2], sets)


def check_command(command: str, page_files_dir: Path) -> str:
    """Check one command (the page's own files in `page_files_dir`); returns what kind it was ("run", "cli",
    "benchmark", "script", "synopsis", "mention")."""
    if command.startswith("python benchmarks/"):
        check_benchmark(command)
        return "benchmark"
    argv = cli_argv(command)
    if argv is None and command.startswith("torchrun "):
        return "script"  # torchrun launching the user's own script (the python block it follows)
    assert argv is not None, command
    if is_synopsis(argv):
        return "synopsis"
    if len(argv) <= 1 and argv[:1] != ["configs"]:  # prose naming the command: `foovb run` writes
        return "mention"
    parser = build_parser()
    try:
        parser.parse_args(argv)
    except SystemExit as exc:  # argparse's way of refusing a flag or subcommand
        raise AssertionError(f"the CLI refuses {command!r}") from exc
    while argv[0].startswith("--"):  # top-level flags before the subcommand (foovb --debug run ...)
        assert argv[0] in parser._option_string_actions, f"{command!r}: {argv[0]} is not a flag of `foovb`"
        argv = argv[1:]
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    flags = subcommands[argv[0]]._option_string_actions
    for flag in (arg.split("=")[0] for arg in argv[1:] if arg.startswith("--")):
        assert flag in flags, f"{command!r}: {flag} is not a flag of `foovb {argv[0]}` (an abbreviation?)"
    if argv[0] == "run":
        check_run(argv[1:], page_files_dir)
        return "run"
    return "cli"


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_shell_commands_are_valid(page: Path, tmp_path: Path) -> None:
    """A pasted command must not fail on a stale config path, key, flag or hyperparameter name."""
    files = page_files(page)
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    failures, checked = [], {}
    try:
        for command in shell_commands(page):
            if command in checked:
                continue
            try:
                checked[command] = check_command(command, tmp_path)
            except Exception as exc:  # noqa: BLE001 - every failing command is listed, not only the first
                failures.append(f"{command}\n    {type(exc).__name__}: {exc}")
    finally:
        for name in files:  # the page's modules, imported from tmp_path: not the next test's
            sys.modules.pop(Path(name).stem, None)
    assert not failures, f"{page.name}: invalid commands:\n" + "\n".join(failures)


def test_pages_keep_their_commands() -> None:
    """The checks above must have something to check: the pages that hold runnable commands still do."""
    runs = {page.name: sum(1 for c in shell_commands(page) if (a := cli_argv(c)) and a[:1] == ["run"]
                           and not is_synopsis(a)) for page in PAGES}
    assert runs["README.md"] >= 6, "the README lost its demo or recommended-settings commands"
    assert sum(runs[page.name] for page in RESULT_PAGES) > 50, "docs/results/*.md lost the commands of their tables"
    assert runs["distributed.md"] >= 1
    benchmarks = sum(c.startswith("python benchmarks/") for page in PAGES for c in shell_commands(page))
    assert benchmarks >= 4, "docs/performance.md and docs/distributed.md lost their benchmark commands"


def test_readme_keeps_the_ci_test_command() -> None:
    """.ci/run runs the README's test command verbatim (the fast tests), then the slow ones."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[ci.index("# The README's test command:") + 1] == TEST_COMMAND
    assert "python -m pytest -m slow" in ci, ".ci/run must run the slow tests too"
    assert TEST_COMMAND in README.read_text().splitlines(), f"the README must show {TEST_COMMAND!r} verbatim"


def test_readme_and_docs_links_point_to_files() -> None:
    """Relative links (and `docs/...` paths in code spans) of README.md, docs/*.md and docs/results/*.md name files
    that exist."""
    missing = []
    for page in PAGES:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if not target.startswith(("http://", "https://")) and not (page.parent / target).exists():
                missing.append(f"{page.name}: {target}")
        missing += [f"{page.name}: {path}" for path in re.findall(r"`(docs/[^`\s{}*]+)`", text)
                    if not (ROOT / path).exists()]
    assert not missing, missing


def heading_anchors(page: Path) -> set[str]:
    """The #anchors GitHub gives a page's headings (lowercased; punctuation but hyphens and underscores dropped;
    spaces to hyphens; a repeated heading's -1, -2, ...), outside code blocks."""
    anchors: set[str] = set()
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*$", text, flags=re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.replace("`", ""))
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchor, repeat = slug, 0
        while anchor in anchors:
            repeat += 1
            anchor = f"{slug}-{repeat}"
        anchors.add(anchor)
    return anchors


def test_readme_and_docs_link_anchors_name_headings() -> None:
    """A link's #anchor (to a page of the repository or to its own page) names a heading of that page."""
    missing = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            linked = (page.parent / target) if target else page
            if linked.suffix == ".md" and linked.is_file() and anchor not in heading_anchors(linked):
                missing.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    assert not missing, missing
