"""Every option an error message tells a user to set exists where the message sends them: each `--flag` and each
`key: value` hint in the strings of the project's raise statements (and of the modules that word the CLI's errors)
resolves against the parser of the program whose code raises it: the CLI's (`python -m src.cli fit --help`, the
classes' own arguments for `init_args`), the forecast's (src/scaling/) or the lab's (src/lab/), or, for a flag, the
parser of a program the message names before it (`torchrun --nnodes N ... -m src.cli fit --config ...`). A bare
`zero_stage: 1` or a group's `compression.kind: none` is an init_arg of the strategy whose module raises it."""

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
# a program a message names: the flags after it may be that program's
PROGRAM_NAMES = {"torchrun": re.compile(r"\btorchrun\b"), "cli": re.compile(r"\bsrc\.cli\b"),
                 "lab": re.compile(r"\bsrc\.lab\b"), "forecast": re.compile(r"\bsrc\.forecast\b")}
# the strategy whose init_args the bare keys of a module name (a module of that strategy alone)
STRATEGY_OF = {"src/strategies/limits.py": "SplitAllreduceStrategy", "src/strategies/partitions.py":
               "SplitAllreduceStrategy", "src/strategies/zero.py": "SplitAllreduceStrategy",
               "src/strategies/pipeline.py": "PipelineStrategy"}


def _strings(node: ast.AST):
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            yield n.value


def _raiser(file: str) -> str:
    """The program whose code is in `file`: src/scaling/ runs under `python -m src.forecast` only, src/lab/ under
    `python -m src.lab`, the rest under the CLI."""
    return "forecast" if file.startswith("src/scaling/") else "lab" if file.startswith("src/lab/") else "cli"


def _hints() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(file, "flag" or "key", name, the programs its message names before it) for every hint in the project's
    messages."""
    found = set()
    for path in sorted((ROOT / "src").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        texts = [s for s in _strings(tree)] if rel in MESSAGE_MODULES else [
            "".join(_strings(n.exc)) for n in ast.walk(tree) if isinstance(n, ast.Raise) and n.exc is not None]
        for text in texts:
            found |= {(rel, "flag", m.group(1), tuple(p for p, named in PROGRAM_NAMES.items()
                                                      if named.search(text, 0, m.start())))
                      for m in FLAG.finditer(text)}
            found |= {(rel, "key", m.group(1), ()) for m in KEY_VALUE.finditer(text)}
            found |= {(rel, "key", m.group(1).rstrip("."), ()) for m in CONFIG_KEY.finditer(text)}
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


def _forecast_flags(monkeypatch) -> set[str]:
    """The options of the parser that `python -m src.forecast` builds, caught where its `main` hands it over."""
    import src.scaling.predictor as predictor

    class Caught(Exception):
        pass

    parsers = []

    def catch(parser, args):
        parsers.append(parser)
        raise Caught

    monkeypatch.setattr(predictor, "parse_options", catch)
    with pytest.raises(Caught):
        predictor.main([])
    return _parser_flags(parsers[0])


def _missing_from(file: str, kind: str, name: str, named: tuple[str, ...], parsers: dict[str, set[str]],
                  cli: set[str]) -> str | None:
    """None where the hint is an option of the parser that takes it (see the module's docstring), else that
    parser in words."""
    from src import strategies

    strategy = STRATEGY_OF.get(file)
    init_args = _parameters(getattr(strategies, strategy)) if strategy else set()
    if name.startswith("trainer.strategy.init_args.") and strategy:  # a key or a flag of its own strategy
        return None if name.removeprefix("trainer.strategy.init_args.") in init_args else f"{strategy}'s init_args"
    if kind == "flag":
        programs = sorted({_raiser(file), *named})
        found = any(name in cli if program == "cli" and "." in name else name in parsers[program]
                    for program in programs)
        return None if found else " or ".join(f"{program}'s parser" for program in programs)
    if name.startswith(("model.", "trainer.", "data.")):
        return None if name in cli or name in NOT_SETTINGS else "the CLI's config"
    if name in init_args or name in NOT_SETTINGS:  # `zero_stage: 1`, `compression.kind: none`
        return None
    return f"{strategy}'s init_args" if strategy else "any strategy's init_args: add the module to STRATEGY_OF"


def test_every_hint_in_an_error_message_names_a_real_option(monkeypatch):
    from torch.distributed.run import get_args_parser

    from src.lab.__main__ import build_parser

    cli = _cli_keys()
    parsers = {"cli": {k for k in cli if "." not in k}, "forecast": _forecast_flags(monkeypatch),
               "lab": _parser_flags(build_parser()), "torchrun": _parser_flags(get_args_parser())}
    # the control: the parsers differ where hints send users to one of them
    assert "nnodes" in parsers["torchrun"] and "nnodes" not in parsers["cli"] | parsers["lab"]
    assert "ckpt_path" in parsers["cli"] and "ckpt_path" not in parsers["forecast"] | parsers["lab"]
    assert "machines" in parsers["lab"] and "machines" not in parsers["cli"]
    hints = _hints()
    unresolved = [f"{file}: {'--' if kind == 'flag' else ''}{name}{'' if kind == 'flag' else ': '} (not in {where})"
                  for file, kind, name, named in hints
                  if (where := _missing_from(file, kind, name, named, parsers, cli)) is not None]
    assert len(hints) > 100, hints  # the control: the scan finds the hints (129 when this was written)
    assert any(named == ("torchrun",) for *_, named in hints)  # and tells which program a message names
    assert not unresolved, unresolved
