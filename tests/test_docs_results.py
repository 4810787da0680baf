"""The README's results table quotes docs/performance.md: every figure in it (a decimal such as
"1.41x", "69.5", "3.33 s") must appear in docs/performance.md, so a README figure changed without
the measured source fails here. And docs/performance.md stays a page a user skims: the current
results only, the dated runs in docs/archive/performance-log.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PERFORMANCE_LIMIT = 260  # lines

FIGURE = re.compile(r"\d+(?:,\d{3})*\.\d+x?")  # 1.41x, 0.955x, 119.5, 1,234.5; not 8, 2026-11-27


def results_table(readme: str) -> list[list[str]]:
    """The cells of the first table under the README's `## Results`, header and rule left out."""
    section = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def figures(rows: list[list[str]]) -> list[str]:
    """The figures of the table: its cells after the first (which says what was measured)."""
    return [f for row in rows for cell in row[1:] for f in FIGURE.findall(cell)]


def quoted(figure: str, text: str) -> bool:
    """Whether `figure` stands in `text` as a number of its own (1.41x is not in 11.41x or 1.415x)."""
    return re.search(rf"(?<![\d.,]){re.escape(figure)}(?![\d])", text) is not None


def test_every_readme_result_is_in_performance_md():
    rows = results_table((ROOT / "README.md").read_text())
    found = figures(rows)
    assert len(rows) >= 3 and len(found) >= 6, rows  # the parser found the table
    performance = (ROOT / "docs" / "performance.md").read_text()
    missing = [f for f in found if not quoted(f, performance)]
    assert not missing, f"README.md's results quote figures docs/performance.md does not hold: {missing}"


def test_performance_md_is_short():
    lines = (ROOT / "docs" / "performance.md").read_text().splitlines()
    assert len(lines) <= PERFORMANCE_LIMIT, (
        f"docs/performance.md has {len(lines)} lines (limit {PERFORMANCE_LIMIT}): "
        "move older runs to docs/archive/performance-log.md"
    )


def test_a_changed_figure_fails():
    readme = "# x\n\n## Results\n\n| measured | result |\n|---|---|\n| a | 1.41x (57.94 tok/s) |\n\n## Next\n"
    rows = results_table(readme)
    assert figures(rows) == ["1.41x", "57.94"]
    assert quoted("1.41x", "ran **1.41x** the target") and quoted("57.94", "| 57.94 |")
    assert not quoted("1.41x", "11.41x, 1.415x") and not quoted("1.4", "1.41x") and not quoted("57.94", "157.94")
