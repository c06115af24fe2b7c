"""Every option an error message tells a user to set exists where the message sends them: each `--flag` and each
`key: value` hint in the strings of the project's raise statements (and of the modules that word the CLI's errors)
resolves against the parser that takes it: the CLI's (`python -m src.cli fit --help`, the classes' own arguments for
`init_args`), the forecast's, the lab's or torchrun's."""

import argparse
import ast
import contextlib
import dataclasses
import inspect
import io
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest

ROOT = Path(__file__).resolve().parent.parent
FLAG = re.compile(r"(?<![\w-])--([a-z][\w-]*(?:\.[\w-]+)*)")
# `key: value` with a key that is dotted or has an underscore (a plain word before a colon is prose)
KEY_VALUE = re.compile(r"(?<![\w.-])([a-z]+_[a-z_]*|[a-z_]+(?:\.[a-z_]+)+): (?=[\w\[\"'])")
# a key of the CLI's config named in prose ("model.init_args.lr must be > 0")
CONFIG_KEY = re.compile(r"(?<![\w.-])((?:model|trainer|data)\.[a-z_]+(?:\.[a-z_]+)*)")
# whole-message modules: every string in them is part of a message
MESSAGE_MODULES = ("src/run/errors.py", "src/run/trainer_choices.py")
# words that name a strategy, a function or a file the message is about, not a setting
NOT_SETTINGS = {"split_allreduce", "claim_global_batch", "data.pkl"}


def _strings(node: ast.AST):
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            yield n.value


def _hints() -> list[tuple[str, str, str]]:
    """(file, "flag" or "key", name) for every hint in the project's messages."""
    found = set()
    for path in sorted((ROOT / "src").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        texts = [s for s in _strings(tree)] if rel in MESSAGE_MODULES else [
            "".join(_strings(n.exc)) for n in ast.walk(tree) if isinstance(n, ast.Raise) and n.exc is not None]
        for text in texts:
            found |= {(rel, "flag", m.group(1)) for m in FLAG.finditer(text)}
            found |= {(rel, "key", m.group(1)) for m in KEY_VALUE.finditer(text)}
            found |= {(rel, "key", m.group(1).rstrip(".")) for m in CONFIG_KEY.finditer(text)}
    return sorted(found)


def _parameters(*classes: type) -> set[str]:
    """Each class's init_args, and `group.field` for an option group (a dataclass such as `compression`)."""
    names = set()
    for cls in classes:
        for name, parameter in inspect.signature(cls.__init__).parameters.items():
            names.add(name)
            if dataclasses.is_dataclass(parameter.annotation):
                names |= {f"{name}.{f.name}" for f in dataclasses.fields(parameter.annotation)}
    return names - {"self", "args", "kwargs"}


def _cli_keys() -> set[str]:
    """The CLI's keys as `fit --help` lists them, and the init_args of the classes this project configures."""
    from src.cli import main
    from src.models.classifier import ImageClassifier, LeNetClassifier, ResNet18Classifier
    from src.run.logger import RunLogger
    from src.strategies import CompressedDDPStrategy, PipelineStrategy, SplitAllreduceStrategy, TensorParallelStrategy
    from src.strategies.fsdp import CPUFSDPStrategy

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["fit", "--help"])
    keys = set(re.findall(r"--([\w.]+)", out.getvalue()))
    keys |= {f"trainer.{p}" for p in _parameters(pl.Trainer)}
    keys |= {f"trainer.strategy.init_args.{p}" for p in _parameters(SplitAllreduceStrategy, CompressedDDPStrategy,
                                                                          PipelineStrategy, TensorParallelStrategy,
                                                                          CPUFSDPStrategy)}
    keys |= {f"trainer.logger.init_args.{p}" for p in _parameters(RunLogger)}
    keys |= {f"model.init_args.{p}" for p in _parameters(ImageClassifier, LeNetClassifier, ResNet18Classifier)}
    return keys | {"model.class_path", "trainer.strategy.class_path", "trainer.logger.class_path"}


def _parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    flags = {o.lstrip("-") for a in parser._actions for o in a.option_strings}
    for action in parser._actions:  # subcommands
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= _parser_flags(sub)
    return flags


def _forecast_flags() -> set[str]:
    from dataclasses import fields

    from src.scaling.predictor import Calibration, Overrides, Paths, Question

    return {f.name for cls in (Question, Overrides, Paths, Calibration) for f in fields(cls)} | {"config"}


def test_every_hint_in_an_error_message_names_a_real_option():
    from torch.distributed.run import get_args_parser

    from src.lab.__main__ import build_parser

    cli = _cli_keys()
    top = {k for k in cli if "." not in k}
    other = {"forecast": _forecast_flags(), "lab": _parser_flags(build_parser()),
             "torchrun": _parser_flags(get_args_parser())}
    settings = {k.rsplit(".", 1)[-1] for k in cli}  # a bare `zero_stage: 1` names an init_arg by its own name
    hints, unresolved = _hints(), []
    for file, kind, name in hints:
        if kind == "flag" and "." in name:
            ok = name in cli
        elif kind == "flag":
            ok = name in top or any(name in flags for flags in other.values())
        elif "." in name:  # a full key, or a group's field by the group's name (`compression.kind: none`)
            ok = name in cli or any(k.endswith(f".init_args.{name}") for k in cli) or name in NOT_SETTINGS
        else:
            ok = name in settings or name in NOT_SETTINGS
        if not ok:
            unresolved.append(f"{file}: {'--' if kind == 'flag' else ''}{name}{'' if kind == 'flag' else ': '}")
    assert len(hints) > 40, hints  # the control: the scan finds the hints (51 when this was written)
    assert not unresolved, unresolved
