"""The README's performance tables are exactly what benchmarks.readme_table writes from the
committed result files, so no figure there lacks a results file behind it."""

from __future__ import annotations

import pytest

from benchmarks import readme_table


def test_readme_tables_are_generated_from_committed_results() -> None:
    assert readme_table.main(["--check"]) == 0, "run: python -m benchmarks.readme_table"


def test_rewrite_replaces_only_the_marked_block() -> None:
    readme = f"intro\n{readme_table.BEGIN}\nold 391 tok/s\n{readme_table.END}\noutro\n"
    block = f"{readme_table.BEGIN}\nnew\n{readme_table.END}"
    assert readme_table.rewrite(readme, block) == f"intro\n{block}\noutro\n"
    with pytest.raises(ValueError, match="markers"):
        readme_table.rewrite("no markers here", block)
