"""The front page stays one a newcomer reads in minutes: README.md and benchmarks/README.md have a size limit, and
README's tables a row count and a row length (details go to benchmarks/README.md and docs/)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARKS = ROOT / "benchmarks" / "README.md"


def _tables(text: str) -> list[list[str]]:
    """Each markdown table's body rows (header and `|---|` rule left out), in order."""
    tables, current = [], None
    for line in text.splitlines():
        if line.startswith("|"):
            if current is None:
                current = []
                tables.append(current)
            current.append(line)
        else:
            current = None
    return [table[2:] for table in tables]


def test_readme_is_at_most_150_lines():
    assert len(README.read_text().splitlines()) <= 150


def test_readme_tables_have_at_most_12_rows_of_at_most_300_characters():
    tables = _tables(README.read_text())
    assert tables, "README.md has no table: the check below would pass on nothing"
    for table in tables:
        assert len(table) <= 12, f"a README table has {len(table)} rows: {table[0][:80]}"
        long = [row[:80] for row in table if len(row) > 300]
        assert not long, f"README table rows over 300 characters: {long}"


def test_the_tables_found_are_the_readme_tables():
    """The parser splits tables at non-table lines and drops their header and rule."""
    text = "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n\n| c |\n|---|\n| 5 |\n"
    assert _tables(text) == [["| 1 | 2 |", "| 3 | 4 |"], ["| 5 |"]]


def test_benchmarks_readme_is_at_most_700_lines():
    assert len(BENCHMARKS.read_text().splitlines()) <= 700
