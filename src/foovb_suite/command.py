"""The `foovb` command's entry point. `pip install foovb` installs the command with the optimizer library, which
needs torch alone; the suite behind the command needs the "suite" extra, and without it the command says so in one
line instead of a traceback (also for a dependency imported late: matplotlib by the plots, tqdm by a progress bar)."""

from __future__ import annotations

import sys

# pyproject.toml's "suite" extra: module name -> distribution name
SUITE_DEPENDENCIES = {"numpy": "numpy", "matplotlib": "matplotlib", "yaml": "PyYAML", "tqdm": "tqdm"}


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            from .cli import main as run
        except KeyboardInterrupt:  # Ctrl-C while torch and the suite load: nothing started, no traceback
            print("foovb: interrupted while starting (nothing was run)", file=sys.stderr)
            return 130
        return run(argv)
    except ModuleNotFoundError as error:
        top = (error.name or "").split(".")[0]
        if top not in SUITE_DEPENDENCIES:
            raise
        print(f"foovb: error: the foovb command needs the suite's dependencies ({SUITE_DEPENDENCIES[top]} is not "
              "installed): pip install 'foovb[suite]'", file=sys.stderr)
        return 2
