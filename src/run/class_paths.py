"""Class paths that moved and options that were grouped: the config.yaml of a run saved before still loads,
through two tables.

The CLI's parser reads every config (the files given with `--config`, and dict values on the command line) with
`load_config`, which rewrites a `class_path` found in `OLD_CLASS_PATHS` to where the class lives now, and moves
the flat init_args of `GROUPED_OPTIONS` into their groups (`powersgd_rank: 4` -> `compression: {rank: 4}`). The
user's file is never changed; only the parsed copy is. A class that moves gets one line here instead of a module
left at its old path; an option that joins a group gets one line.
"""

from typing import Any

import yaml
from jsonargparse import get_loader, set_loader

#: old `class_path` -> the class's path now
OLD_CLASS_PATHS: dict[str, str] = {
    "src.run_logger.RunLogger": "src.run.logger.RunLogger",
    "src.class_report.ClassReport": "src.callbacks.class_report.ClassReport",
    "src.prediction_writer.PredictionWriter": "src.callbacks.prediction_writer.PredictionWriter",
    "src.checkpoint_io.AtomicCheckpointIO": "src.run.checkpoints.AtomicCheckpointIO",
}

_OURS = ("SplitAllreduceStrategy", "src.strategies.SplitAllreduceStrategy",
         "src.strategies.split_allreduce.SplitAllreduceStrategy")
_DDP = ("CompressedDDPStrategy", "src.strategies.CompressedDDPStrategy",
        "src.strategies.ddp_compression.CompressedDDPStrategy")
_COMPRESSION = {"compression": "kind", "powersgd_rank": "rank", "powersgd_warmup_steps": "warmup_steps",
                "error_feedback": "error_feedback", "warm_start": "warm_start",
                "min_compression_rate": "min_compression_rate"}
_PROCESSES = {"process_group_backend": "backend", "timeout": "timeout", "start_method": "start_method"}

#: class_path -> {group: {old flat init_arg: its key in the group}}
GROUPED_OPTIONS: dict[str, dict[str, dict[str, str]]] = {
    **{path: {"compression": _COMPRESSION, "processes": _PROCESSES} for path in _OURS},
    **{path: {"compression": _COMPRESSION} for path in _DDP},
}

#: the jsonargparse parser mode under which `load_config` reads values (YAML, as the default mode)
PARSER_MODE = "yaml_current_class_paths"


def grouped(init_args: dict, groups: dict[str, dict[str, str]]) -> dict:
    """`init_args` with the flat keys of each group moved into it. A group given as a dict keeps its own keys
    (they win over flat ones); a plain value of a group (`compression: bf16`, as a saved flat config or a
    shorthand has it) is its first key (`kind`)."""
    out = dict(init_args)
    for group, keys in groups.items():
        value = out.pop(group, None)
        first = next(iter(keys.values()))
        members = dict(value) if isinstance(value, dict) else {} if value is None else {first: value}
        moved = {keys[old]: out.pop(old) for old in list(out) if old in keys}
        if moved or members:
            out[group] = {**moved, **members}
    return out


def current_class_paths(value: Any) -> Any:
    """`value` (what YAML gave: dicts, lists, scalars) with every `class_path` of `OLD_CLASS_PATHS` replaced by
    the class's current path and every flat option of `GROUPED_OPTIONS` in its group, at any depth; everything else
    as it was."""
    if isinstance(value, dict):
        out = {key: OLD_CLASS_PATHS.get(item, item) if key == "class_path" and isinstance(item, str)
               else current_class_paths(item) for key, item in value.items()}
        groups = GROUPED_OPTIONS.get(out.get("class_path"))
        if groups and isinstance(out.get("init_args"), dict):
            out["init_args"] = grouped(out["init_args"], groups)
        return out
    if isinstance(value, list):
        return [current_class_paths(item) for item in value]
    return value


def load_config(text: str) -> Any:
    """jsonargparse's own YAML loader, then `current_class_paths` on what it read."""
    return current_class_paths(get_loader("yaml")(text))


def register() -> str:
    """Make `PARSER_MODE` known to jsonargparse (idempotent) and return it, for a parser's `parser_mode`."""
    set_loader(PARSER_MODE, load_config, exceptions=(yaml.YAMLError,))
    return PARSER_MODE
