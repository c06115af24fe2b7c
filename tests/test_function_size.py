"""Functions in `src/` do one job each: none runs over 60 lines, counted from its `def` to its last line with its
docstring, so a reader sees each one whole."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
LIMIT = 60


def long_functions(root: Path, limit: int = LIMIT) -> list[str]:
    """`path:line name (N lines)` for every function or method under `root` longer than `limit` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_src_is_over_60_lines():
    assert long_functions(SRC) == []


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))  # def + 60 lines: 61
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path / "pkg") == ["pkg/m.py:5 long (61 lines)"]
