"""Functions in `src/` do one job each: none runs over 60 lines, counted from its `def` to its last line with its
docstring, so a reader sees each one whole, and none takes over 8 parameters outside the `__init__` of the classes
built from a config (whose parameters are the config keys)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
LIMIT = 60


def functions(root: Path) -> list[tuple[str, ast.FunctionDef, ast.ClassDef | None]]:
    """(path relative to root's parent, function or method, its class or None) for every function under `root`, by
    file and line."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        owner = {id(f): c for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}
        defs = sorted((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))),
                      key=lambda n: n.lineno)
        found += [(str(path.relative_to(root.parent)), n, owner.get(id(n))) for n in defs]
    return found


def long_functions(root: Path, limit: int = LIMIT) -> list[str]:
    """`path:line name (N lines)` for every function or method under `root` longer than `limit` lines."""
    sized = [(path, node, node.end_lineno - node.lineno + 1) for path, node, _ in functions(root)]
    return [f"{path}:{node.lineno} {node.name} ({lines} lines)" for path, node, lines in sized if lines > limit]


def test_no_function_in_src_is_over_60_lines():
    assert long_functions(SRC) == []


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))  # def + 60 lines: 61
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path / "pkg") == ["pkg/m.py:5 long (61 lines)"]


# the classes the CLI builds from a config file: their `__init__` takes one parameter per config key
CONFIG_CLASSES = {"SplitAllreduceStrategy", "ImageClassifier", "FashionMNISTDataModule"}
MAX_PARAMETERS = 8


def wide_functions(root: Path, limit: int = MAX_PARAMETERS) -> list[str]:
    """`path:line name (N parameters)` for every function or method under `root` that takes more than `limit`
    parameters (self and cls aside; *args and **kwargs count one each), the `__init__` of CONFIG_CLASSES aside."""
    found = []
    for path, node, owner in functions(root):
        if node.name == "__init__" and owner is not None and owner.name in CONFIG_CLASSES:
            continue
        a = node.args
        names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs) if p.arg not in ("self", "cls")]
        count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
        if count > limit:
            found.append(f"{path}:{node.lineno} {node.name} ({count} parameters)")
    return found


def test_no_function_in_src_takes_over_8_parameters_outside_the_config_classes():
    assert wide_functions(SRC) == []


def test_the_check_finds_a_wide_function(tmp_path):
    (tmp_path / "pkg").mkdir()
    nine = ", ".join(f"a{i}" for i in range(9))
    (tmp_path / "pkg" / "m.py").write_text(
        f"def narrow(self, {', '.join(f'a{i}' for i in range(8))}):\n    pass\n\n\n"
        f"class ImageClassifier:\n    def __init__(self, {nine}):\n        pass\n\n\n"
        f"class Other:\n    def __init__(self, {nine}):\n        pass\n\n\ndef wide(*args, {nine}):\n    pass\n")
    # the config class's __init__ (line 6) and the 8-parameter method pass; another class's __init__ does not
    assert wide_functions(tmp_path / "pkg") == ["pkg/m.py:11 __init__ (9 parameters)",
                                                "pkg/m.py:15 wide (10 parameters)"]
