"""Class paths that moved: the config.yaml of a run saved before a class moved still loads, through one table.

The CLI's parser reads every config (the files given with `--config`, and dict values on the command line) with
`load_config`, which rewrites a `class_path` found in `OLD_CLASS_PATHS` to where the class lives now. The user's
file is never changed; only the parsed copy is. A class that moves gets one line here instead of a module left at
its old path.
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

#: the jsonargparse parser mode under which `load_config` reads values (YAML, as the default mode)
PARSER_MODE = "yaml_current_class_paths"


def current_class_paths(value: Any) -> Any:
    """`value` (what YAML gave: dicts, lists, scalars) with every `class_path` of `OLD_CLASS_PATHS` replaced by
    the class's current path, at any depth; everything else as it was."""
    if isinstance(value, dict):
        return {key: OLD_CLASS_PATHS.get(item, item) if key == "class_path" and isinstance(item, str)
                else current_class_paths(item) for key, item in value.items()}
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
