"""The README's Python examples run as pasted."""

import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import torch

from foovb_suite.cli import build_parser
from foovb_suite.config import load_config
from foovb_suite.runner import build_learner
from foovb_suite.scenarios import VisionMix

README = Path(__file__).parent.parent / "README.md"


def test_readme_python_blocks_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no python example"
    for index, code in enumerate(blocks):
        exec(compile(code, f"README.md python block {index}", "exec"), {})


def readme_run_commands() -> list[list[str]]:
    """Every `foovb run ...` of the README (inline code, possibly wrapped over lines, and bash blocks), as argv."""
    text = README.read_text()
    spans = re.findall(r"`(foovb run [^`]*)`", text)
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        spans += [line for line in block.splitlines() if line.startswith("foovb run ")]
    commands = [shlex.split(" ".join(span.split()), comments=True)[2:] for span in spans]
    return [argv for argv in commands if argv[0].endswith(".yaml")]  # not the synopsis `foovb run CONFIG [...]`


def test_readme_run_commands_build_their_learner() -> None:
    """A pasted command must not fail on a stale config path, key or hyperparameter name: each one parses,
    validates and builds its model and learner (no data, no training)."""
    commands = readme_run_commands()
    assert len(commands) > 50, "the README's result tables lost their commands"
    checked = set()
    for argv in commands:
        args = build_parser().parse_args(["run", *argv])
        if (args.config, *args.set) in checked:
            continue
        checked.add((args.config, *args.set))
        config = load_config(README.parent / args.config, args.set)
        s = config.scenario
        if s.kind == "vision_mix":
            stream = SimpleNamespace(num_tasks=s.num_tasks, task_aware=True, input_shape=VisionMix.input_shape,
                                     num_classes=10)
        else:
            stream = SimpleNamespace(num_tasks=s.num_tasks, task_aware=False,
                                     input_shape=(1024 if s.pad_to_32 else 784,), num_classes=10)
        build_learner(config, stream, torch.device("cpu"))  # raises on an unknown or invalid hyperparameter


def test_readme_and_docs_links_point_to_files() -> None:
    """Relative links (and `docs/...` paths in code spans) of README.md and docs/*.md name files that exist."""
    root = README.parent
    missing = []
    for page in [README, *sorted((root / "docs").glob("*.md"))]:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if not target.startswith(("http://", "https://")) and not (page.parent / target).exists():
                missing.append(f"{page.name}: {target}")
        missing += [f"{page.name}: {path}" for path in re.findall(r"`(docs/[^`\s{}*]+)`", text)
                    if not (root / path).exists()]
    assert not missing, missing
