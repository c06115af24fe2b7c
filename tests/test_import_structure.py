"""The import structure of `src/`: no two modules import each other, directly or round a longer loop (imports
inside functions included), and the lower layers do not reach up into the strategies or the callbacks."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str], name: str | None = None) -> set[str]:
    """The modules of `src` that `path` (the module `name`) imports anywhere in its body, top level or deferred
    into a function."""
    name = name or _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *filter(None, [base])])
            # `from src.a import b` imports the module src.a.b where there is one, else a name of src.a
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def _graph() -> dict[str, set[str]]:
    files = sorted(SRC.rglob("*.py"))
    modules = {_module_name(f) for f in files}
    return {_module_name(f): _imports(f, modules) for f in files}


def _loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, loops = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return loops


def test_no_module_of_src_imports_one_that_imports_it_back():
    graph = _graph()
    assert "src.cli" in graph and "src.run.logger" in graph["src.run.elastic"]  # the walk sees real imports
    assert _loops(graph) == []


def test_the_loop_finder_sees_a_deferred_import(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _loops(graph) == [["a", "b", "c"]]
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from src.run import logger\n")
    assert _imports(source, {"src.run", "src.run.logger"}, "src.run.elastic") == {"src.run.logger"}


def test_lower_layers_do_not_import_the_strategies_or_the_callbacks():
    graph = _graph()
    low = {m: deps for m, deps in graph.items()
           if m.startswith(("src.run.", "src.data.", "src.models.", "src.timeline.")) or m in ("src.layout",
                                                                                             "src.batch_shares")}
    upward = {m: sorted(d for d in deps if d.startswith(("src.strategies", "src.callbacks", "src.cli")))
              for m, deps in low.items()}
    assert {m: d for m, d in upward.items() if d} == {}
