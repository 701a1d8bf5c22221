"""The result pages' generated tables agree with the run outputs under docs/results/ (scripts/results_tables.py),
and the pages keep their shape: one page per scenario, at most 400 lines, opening with its main table."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SPEC = importlib.util.spec_from_file_location("results_tables", ROOT / "scripts" / "results_tables.py")
results_tables = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(results_tables)
PAGES = sorted((ROOT / "docs" / "results").glob("*.md"))


def test_the_pages_agree_with_their_outputs(capsys: pytest.CaptureFixture[str]) -> None:
    """`python scripts/results_tables.py --check`: every generated table is what its outputs give."""
    assert results_tables.main(["--check"]) == 0, capsys.readouterr().err


def test_the_pages_have_generated_tables() -> None:
    """The check above must have something to check: the tables with outputs behind them stay generated."""
    blocks = {page.name: len(results_tables.BLOCK.findall(page.read_text())) for page in PAGES}
    for name in ("vision_mix.md", "discrete_pmnist.md", "discrete_baselines.md", "continuous_pmnist.md"):
        assert blocks[name] >= 1, f"docs/results/{name} lost its generated tables"
    assert sum(blocks.values()) >= 15


def generated_page(tmp_path: Path) -> tuple[Path, str]:
    """A copy of the vision-mix page (a generated seed table) and its text."""
    text = (ROOT / "docs" / "results" / "vision_mix.md").read_text()
    page = tmp_path / "vision_mix.md"
    page.write_text(text)
    return page, text


def test_a_number_that_disagrees_with_the_outputs_fails(tmp_path: Path) -> None:
    page, text = generated_page(tmp_path)
    row = next(line for line in text.splitlines() if line.startswith("| MAS |"))
    page.write_text(text.replace(row, row.replace("| 92.68 |", "| 92.69 |"), 1))
    rewritten, errors, differences = results_tables.process(page, results_tables.Outputs(results_tables.RESULTS))
    assert not errors
    assert len(differences) == 1 and "92.69" in differences[0] and "92.68" in differences[0]
    assert rewritten == text  # the rewrite restores the outputs' number


def test_a_row_without_outputs_is_an_error(tmp_path: Path) -> None:
    page, text = generated_page(tmp_path)
    page.write_text(text.replace("aware_mas_s0", "aware_mas_s9", 1))
    _, errors, _ = results_tables.process(page, results_tables.Outputs(results_tables.RESULTS))
    assert len(errors) == 1 and "aware_mas_s9" in errors[0]


def test_typed_rows_and_cells_are_kept(tmp_path: Path) -> None:
    """A `-` row key and a `-` column spec leave the typed text alone; emphasis stays on the same numbers."""
    page = tmp_path / "page.md"
    page.write_text("<!-- table: folder=mnist_fashion_aware columns=-,mean_range rows=aware_sgd_s0 - -->\n"
                    "| learner | average |\n|---|---|\n| SGD, typed | **1.00** (0.00-2.00) |\n"
                    "| typed row | | \n<!-- /table -->\n")
    text, errors, _ = results_tables.process(page, results_tables.Outputs(results_tables.RESULTS))
    assert not errors
    assert "| SGD, typed | **84.91** (84.05-85.42) |\n| typed row | | \n" in text


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_a_page_is_short_and_opens_with_its_table(page: Path) -> None:
    lines = page.read_text().splitlines()
    assert len(lines) <= 400, f"{page.name} has {len(lines)} lines"
    assert lines[0].startswith("# ")
    first_table = next(i for i, line in enumerate(lines) if line.startswith("|"))
    before = re.sub(r"<!--.*?-->", "", "\n".join(lines[1:first_table]), flags=re.S)  # the table's marker
    assert len([line for line in before.splitlines() if line.strip()]) <= 5, \
        f"{page.name}: more than a caption before its main table"
