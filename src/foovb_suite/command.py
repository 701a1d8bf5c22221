"""The `foovb` command's entry point. `pip install foovb` installs the command with the optimizer library, which
needs torch alone; the suite behind the command needs the "suite" extra, and without it the command says so in one
line instead of a traceback."""

from __future__ import annotations

import sys

SUITE_DEPENDENCIES = ("numpy", "matplotlib", "yaml", "tqdm")  # pyproject.toml's "suite" extra, by module name


def main(argv: list[str] | None = None) -> int:
    try:
        from .cli import main as run
    except ModuleNotFoundError as error:
        if error.name not in SUITE_DEPENDENCIES:
            raise
        print(f"foovb: error: the foovb command needs the suite's dependencies ({error.name} is not installed): "
              "pip install 'foovb[suite]'", file=sys.stderr)
        return 2
    return run(argv)
