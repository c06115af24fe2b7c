"""File names a reader can trust: no two modules of src/ share a name, and benchmarks/ holds few scripts, each
named in benchmarks/README.md next to what it measures."""

import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_BENCHMARK_SCRIPTS = 16


def _shared_names(root: Path) -> dict[str, list[str]]:
    """The `*.py` file names that more than one module under `root` bears (`__init__.py`, `__main__.py` aside),
    each with the modules' paths relative to `root`."""
    paths = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        if path.name not in ("__init__.py", "__main__.py"):
            paths[path.name].append(path.relative_to(root).as_posix())
    return {name: found for name, found in paths.items() if len(found) > 1}


def test_no_two_modules_of_src_share_a_file_name():
    assert _shared_names(ROOT / "src") == {}


def test_a_shared_file_name_is_found(tmp_path):
    for folder in ("a", "b", "c"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "a" / "report.py").write_text("")
    (tmp_path / "b" / "report.py").write_text("")
    (tmp_path / "c" / "table.py").write_text("")
    assert _shared_names(tmp_path) == {"report.py": ["a/report.py", "b/report.py"]}


def _benchmark_scripts() -> list[str]:
    """The scripts of benchmarks/: every `*.py` file there but the package's `__init__.py`."""
    return sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "__init__.py")


def _scripts_list(readme: str) -> dict[str, str]:
    """The README's "Scripts" list: `- `name.py`: what it measures` lines under a `## Scripts` heading."""
    section = readme.split("\n## Scripts\n", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^- `([\w.]+\.py)`:? (.+)$", section, re.MULTILINE)}


def test_benchmarks_keep_few_scripts_each_listed_in_the_readme_with_what_it_measures():
    scripts = _benchmark_scripts()
    assert 0 < len(scripts) <= MAX_BENCHMARK_SCRIPTS, scripts
    listed = _scripts_list((ROOT / "benchmarks" / "README.md").read_text())
    assert sorted(listed) == scripts  # every script listed, and no script listed that is gone
    assert all(len(what.split()) >= 3 for what in listed.values()), listed


def test_the_overlay_table_lists_every_overlay_with_the_epoch_lines_words():
    """docs/switching-and-scaling.md's overlay table has one row per file of configs/strategy/, and the clause it
    shows for partitioned state is the one the epoch line prints (`ParallelLayout.state_words`, 2 replicas)."""
    import torch

    from src.layout import ParallelLayout

    text = (ROOT / "docs" / "switching-and-scaling.md").read_text()
    rows = re.findall(r"^\| `([\w.]+\.yaml)` \|.*\| `(.*)`.*\|$", text, re.M)
    assert sorted(name for name, _ in rows) == sorted(p.name for p in (ROOT / "configs" / "strategy").glob("*.yaml"))
    cpu = (torch.device("cpu"),)
    said = {ParallelLayout("x", 2, 1, cpu, cpu, "ring", "gloo", **kw).state_words() for kw in (
        {"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 2, "sharding": "SHARD_GRAD_OP"},
        {"zero_stage": 3, "sharding": "FULL_SHARD"})}
    shown = {", " + line.split("(…), ", 1)[1] for _, line in rows
             if re.search(r"\(…\), (zero_stage|SHARD_GRAD_OP|FULL_SHARD)", line)}
    assert shown == said, (shown, said)
