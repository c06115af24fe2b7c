"""Where a config key came from (which `--config` file, or the command line) and which keys a class accepts, for
the message about a misspelled key: jsonargparse names neither for a key under a class_path's init_args."""

import difflib
import importlib
import inspect
from pathlib import Path
from typing import Any

import yaml


def config_paths(argv: list[str]) -> list[str]:
    """The `--config` / `-c` / `--config=` files named in `argv`, in order (a later file overrides an earlier)."""
    paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config", "-c")]
    return paths + [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]


def _load(path: str | Path, folder: str) -> Any:
    try:
        return yaml.safe_load(Path(folder, path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None


def _lookup(content: Any, parts: list[str]) -> Any:
    """content[parts[0]][parts[1]]..., or None where a level is missing."""
    for part in parts:
        if not isinstance(content, dict) or part not in content:
            return None
        content = content[part]
    return content


def file_with_key(parts: list[str], argv: list[str], folder: str) -> str | None:
    """The last `--config` file of `argv` that holds the nested key `parts` (e.g. ["model", "init_args",
    "momentun"]), as `argv` names it, or None when no file does (the key came from the command line).

    Args:
        parts: The key's levels.
        argv: The command line.
        folder: The folder relative `--config` paths start from (jsonargparse changes the working directory to a
            config file's folder while it parses the file).
    """
    found = None
    for path in config_paths(argv):
        parent = _lookup(_load(path, folder), parts[:-1])
        if isinstance(parent, dict) and parts[-1] in parent:
            found = path
    return found


def file_with_list_item(parts: list[str], class_path: str, option: str, argv: list[str], folder: str) -> str | None:
    """The last `--config` file of `argv` whose list under the key `parts` (e.g. trainer.callbacks, or
    `callbacks+:`, which appends) has an item of `class_path` with `option` in its init_args; None when none has."""
    found = None
    for path in config_paths(argv):
        parent = _lookup(_load(path, folder), parts[:-1])
        if not isinstance(parent, dict):
            continue
        for items in (parent.get(parts[-1]), parent.get(parts[-1] + "+")):
            if isinstance(items, list) and any(isinstance(i, dict) and i.get("class_path") == class_path and
                                               option in (i.get("init_args") or {}) for i in items):
                found = path
    return found


def class_path_of(key: str, given: Any, argv: list[str], folder: str, defaults: list[str]) -> str | None:
    """The class_path configured for `key` (e.g. "model", "trainer.strategy"): from the value being parsed, else
    the last one on the command line, else the last config file (`defaults` first) that sets it (relative paths
    from `folder`, as in `file_with_key`)."""
    if isinstance(given, dict) and isinstance(given.get("class_path"), str):
        return given["class_path"]
    flags = (f"--{key}.class_path", f"--{key}")
    from_argv = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in flags]
    from_argv += [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] in flags and "=" in a]
    if from_argv and "." in from_argv[-1]:
        return from_argv[-1]
    found = None
    for path in [*defaults, *config_paths(argv)]:
        value = _lookup(_load(path, folder), key.split("."))
        value = value.get("class_path") if isinstance(value, dict) else None
        found = value if isinstance(value, str) else found
    return found


def accepted_options(class_path: str) -> tuple[str, list[str]]:
    """(class name, the init_args keys it accepts), as jsonargparse reads them (following **kwargs to the
    parents' __init__); ("", []) for a class that cannot be imported."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return "", []
    try:
        from jsonargparse import ArgumentParser

        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(cls, fail_untyped=False)
        keys = [a.dest for a in parser._actions if a.dest not in ("help", "config") and "." not in a.dest]
    except Exception:  # a signature jsonargparse cannot read: the plain one
        keys = [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
    return name, keys


def close_keys(word: str, keys: list[str]) -> list[str]:
    """Up to 3 of `keys` closest to `word` (difflib's ratio >= 0.6)."""
    return difflib.get_close_matches(word, sorted(set(keys)), n=3, cutoff=0.6)
