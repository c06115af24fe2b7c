"""One clear line for each way a run can be set up wrong: the CLI prints these instead of a traceback."""

import ast
import difflib
import os
import re
import sys
from pathlib import Path

import yaml
from lightning.pytorch.cli import LightningArgumentParser

from src.run.class_paths import GROUPED_OPTIONS
from src.run.config_keys import (accepted_options, class_path_of, close_keys, config_paths, file_with_key,
                                  file_with_list_item)
from src.file_kinds import what_is
from src.run.trainer_choices import add_choices_to_help, explain

DEBUG_ENV = "FMNIST_DEBUG"


class ConfigError(Exception):
    """A bad command line or config file; `suggestions` are valid keys close to a mistyped one."""

    def __init__(self, message: str, suggestions: list[str] | None = None) -> None:
        super().__init__(message)
        self.suggestions = suggestions or []


class RaisingArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, raising `ConfigError` instead of printing usage and exiting, so that one handler
    reports every error; for an unknown key it looks up the nearest valid ones (difflib)."""

    invocation_dir: str | None = None  # jsonargparse parses a config file from inside the file's folder

    def parse_args(self, *args, **kwargs):
        """jsonargparse's, after noting the folder it starts in, against which `--config` paths are relative."""
        RaisingArgumentParser.invocation_dir = os.getcwd()
        return super().parse_args(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None):
        unknown = re.search(r"(?:unrecognized arguments: --|does not accept option ')([\w.]+)", message)
        if unknown and unknown.group(1).split(".")[0] in ("optimizer", "lr_scheduler"):
            raise ConfigError(f"there is no --{unknown.group(1)} option: the optimizer and lr schedule are part of "
                              "the model's recipe; set model.init_args.optimizer (sgd, adam, adamw), "
                              "model.init_args.lr and model.init_args.scheduler instead") from ex
        # what src.cli.run parses (it sets sys.argv), to find the file a key came from
        argv, folder = sys.argv[1:], RaisingArgumentParser.invocation_dir or os.getcwd()
        nested = _unknown_init_arg(message, argv, folder, getattr(self, "default_config_files", None) or [])
        if nested:
            raise ConfigError(*nested) from ex
        suggestions = []
        if unknown:
            parsers = [self, *getattr(getattr(self, "_subcommands_action", None), "choices", {}).values()]
            keys = {a.dest for p in parsers for a in p._actions if a.dest and a.dest != "help"}
            flat = unknown.group(1).replace(".init_args.", ".")  # init_args of a class given without class_path
            suggestions = difflib.get_close_matches(flat, sorted(keys), n=3, cutoff=0.75)
            source = file_with_key(unknown.group(1).split("."), argv, folder)
            message = f"config file {source}: {message}" if source else message
            tops = sorted({k.split(".")[0] for k in keys} - {"config", "print_config", "print_shtab", "subcommand"})
            top = unknown.group(1).split(".")[0]
            if top not in tops and not suggestions:  # e.g. a YAML file of another tool
                message += f"; {top!r} is not a config key: a config's top-level keys are {', '.join(tops)} (see " \
                           "configs/lenet.yaml)"
        raise ConfigError(message, suggestions) from ex

    def add_lightning_class_args(self, lightning_class, nested_key, subclass_mode=False, required=True):
        """Lightning's, plus the accepted strategy and accelerator names in the trainer's `--help`."""
        added = super().add_lightning_class_args(lightning_class, nested_key, subclass_mode, required)
        if nested_key == "trainer":
            add_choices_to_help(self)
        return added


def _unknown_init_arg(message: str, argv: list[str], folder: str,
                      defaults: list[str]) -> tuple[str, list[str]] | None:
    """(message, suggestions) for jsonargparse's "Parser key "model": ... Option 'x' is not accepted", a key
    under a class_path's init_args that the class does not take: its class, its file and the nearest keys."""
    key, option = re.search(r'Parser key "([\w.]+)"', message), re.search(r"Option '(\w+)' is not accepted", message)
    if not key or not option:
        return None
    key, option = key.group(1), option.group(1)
    given = re.search(r"^\s*Given value: ([\[{].*)\s*$", message, re.MULTILINE)
    try:
        given = ast.literal_eval(given.group(1)) if given else None
    except (ValueError, SyntaxError):
        given = None
    parts = key.split(".")
    if isinstance(given, list):  # e.g. trainer.callbacks: the item whose init_args hold the option
        items = [i for i in given if isinstance(i, dict) and option in (i.get("init_args") or {})]
        if items and isinstance(items[-1].get("class_path"), str):
            class_path = items[-1]["class_path"]
            name, options = accepted_options(class_path)
            source = file_with_list_item(parts, class_path, option, argv, folder)
            where = f"config file {source}: " if source else "on the command line: "
            close = close_keys(option, options)
            return (f"{where}{key}: init_args.{option} is not an option of {name or class_path}"
                    + ("" if close or not options else f"; its options are {', '.join(options)}"),
                    [f"init_args.{c}" for c in close])
    class_path = class_path_of(key, given, argv, folder, [str(d) for d in defaults])
    name, options = accepted_options(class_path) if class_path else ("", [])
    source, written = file_with_key([*parts, "init_args", option], argv, folder), f"{key}.init_args.{option}"
    if source is None and file_with_key([*parts, option], argv, folder):
        source, written = file_with_key([*parts, option], argv, folder), f"{key}.{option}"
    where = f"config file {source}: " if source else "on the command line: "
    text = f"{where}{written} is not an option of {name or class_path or key}"
    grouped = [f"{group}.{keys[option]}" for group, keys in GROUPED_OPTIONS.get(class_path or "", {}).items()
               if option in keys]
    if grouped:  # a flat option that joined a group: saved configs are translated, the command line is not
        return text + ": it moved into an option group", [f"{key}.init_args.{grouped[0]}"]
    close = close_keys(option, options)
    if options and not close:
        text += f"; its options are {', '.join(options)}"
    return text, [f"{key}.init_args.{c}" for c in close]


def check_config_files(argv: list[str]) -> None:
    """Read every `--config` file named in `argv` before the CLI does, so an error can name the file.

    Raises:
        ConfigError: A file that is missing, unreadable, empty, not valid YAML (with its line and column),
            or not a mapping of keys.
    """
    for name in config_paths(argv):
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"config file {name} does not exist (or is not a file): it is {what_is(path)}"
                              f"{_nearest_files(path)}")
        try:
            text = path.read_text()
        except UnicodeDecodeError as err:
            raise ConfigError(f"config file {name} is not a YAML config: it is {what_is(path)}; give a YAML file of "
                              "trainer:, model: and data: keys, e.g. configs/lenet.yaml") from err
        except OSError as err:
            raise ConfigError(f"config file {name} cannot be read: {err}") from err
        if not text.strip():
            raise ConfigError(f"config file {name} is empty: give it trainer:, model: or data: keys, or drop it")
        try:
            content = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(err, "problem", None) or str(err)
            raise ConfigError(f"config file {name} is not valid YAML{where}: {problem}") from err
        if not isinstance(content, dict):
            raise ConfigError(f"config file {name} is YAML but not a config: it holds a {type(content).__name__}, and "
                          "a config is a mapping of keys (trainer:, model:, data:), e.g. configs/lenet.yaml")


def _nearest_files(path: Path) -> str:
    """" (did you mean a or b?)" with up to 3 YAML files near `path`'s name in its folder (or, for a folder that
    does not exist, in configs/ and configs/strategy/); with none close, the YAML files its folder holds."""
    folders = [path.parent] if path.parent.is_dir() else [Path("configs"), Path("configs/strategy")]
    files = sorted(str(f) for folder in folders for f in folder.glob("*.y*ml"))
    by_name = {Path(f).name: f for f in files}
    close = difflib.get_close_matches(path.name, list(by_name), n=3, cutoff=0.6)
    if close:
        return f" (did you mean {' or '.join(by_name[c] for c in close)}?)"
    return f"; {path.parent}/ holds {', '.join(by_name)}" if path.parent.is_dir() and by_name else ""


_LITERAL = re.compile(r"Expected a typing\.Literal\[([^\]]*)\]\. Got value: (\S+)")
# a value an option does not take, and where this project offers it instead
_OFFERED_ELSEWHERE = {("zero_stage", "3"): "ZeRO stage 3 (the parameters partitioned too) is FSDP's FULL_SHARD: "
                                           "--config configs/strategy/fsdp_cpu_full_shard.yaml"}


def describe_choice(text: str) -> str | None:
    """For jsonargparse's "Parser key "trainer.strategy": Parser key "zero_stage": Expected a typing.Literal[0, 1,
    2]. Got value: 3": "trainer.strategy.init_args.zero_stage 3 is not one of 0, 1, 2", with where the project
    offers that value when it does; None for any other message."""
    found = _LITERAL.search(text)
    keys = re.findall(r'Parser key "([\w.]+)"', text)
    if not found or not keys:
        return None
    choices = [c.strip().strip("'\"") for c in found.group(1).split(",")]
    value = found.group(2).strip("'\"")
    key = ".init_args.".join(keys)  # a nested key is an init_arg of the class given for the outer one
    message = f"{key} {value if value.isdigit() else repr(value)} is not one of {', '.join(choices)}"
    elsewhere = _OFFERED_ELSEWHERE.get((keys[-1], value))
    return f"{message}; {elsewhere}" if elsewhere else message


_INIT_ARG_FIRST = re.compile(r'Parser key "([\w.]+)":.*Expected a dot import path string: (\S+).*'
                             r"NestedArg\(key='(\w+)'", re.S)


def describe_init_arg_first(text: str) -> str | None:
    """For an init_arg given while the key still holds a name, not a class (`--trainer.strategy.init_args.allreduce`
    before the overlay that sets the class): which order works; None for any other message."""
    found = _INIT_ARG_FIRST.search(text)
    if not found:
        return None
    key, name, arg = found.groups()
    return (f"{key}.init_args.{arg} is given while {key} is {name!r}, which takes no init_args; give it after the "
            f"--config overlay that sets {key} to a class (the later argument wins), or set --{key}.class_path first")


_NOISE = (re.compile(r"^\s*(Given value( type)?|Subtypes): "), re.compile(r"^\s*- Expected a <class 'NoneType'>"),
          re.compile(r"^\s*- Expected a <class 'str'>$"), re.compile(r"^\s*Does not validate against any of the"),
          re.compile(r"^\s*Errors:$"), re.compile(r"^\s*- Expected a dot import path string"))


def condense(message: str) -> str:
    """Keep the lines of a jsonargparse message that say what is wrong; drop its dump of every type it tried."""
    lines = [ln.strip(" -") for ln in message.splitlines() if ln.strip() and not any(p.search(ln) for p in _NOISE)]
    lines = [ln.rstrip(":") for ln in lines]
    return ": ".join(dict.fromkeys(lines)) or message.strip()


_PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe|Socket Timeout|timed out|Timeout|"
                        r"communicator was aborted|DistNetworkError", re.IGNORECASE)


def describe_lost_rank(text: str) -> str | None:
    """If `text` is a collective failing because another process vanished, say which rank was lost.

    Reads this process's rank and the world size from the (still initialised) default process group; with
    two processes the lost rank is the other one, with more it is one of the others.
    """
    import torch.distributed as dist

    if not _PEER_LOST.search(text) or not (dist.is_available() and dist.is_initialized()):
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    others = [r for r in range(world) if r != rank]
    lost = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {', '.join(map(str, others))}"
    detail = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0])[:160]  # drop gloo's source-file prefix
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0"  # torchrun's elastic agent restarts the job
    then = "torchrun restarts the job while it has restarts left (--ckpt_path auto resumes it)" if restarts else \
        "then restart the whole job with --ckpt_path last"
    return (f"training lost {lost}: it died or stopped answering during a collective, so this process (rank {rank} of "
            f"{world}) stops too. Look at {lost}'s log for why; {then}. [{detail}]")


def describe(err: BaseException) -> str:
    """The message to print for `err`: condensed for config errors, the exception's own text otherwise."""
    text = str(err).strip() or type(err).__name__
    lost = describe_lost_rank(text)
    if lost:
        return lost
    # a name, GPUs the machine lacks, a value an option does not take, an init_arg before its class
    explained = explain(text) or describe_choice(text) or describe_init_arg_first(text)
    if explained:
        return explained
    if isinstance(err, ConfigError) or "Union subtypes" in text or text.startswith("Parser key"):
        text = condense(text)
        suggestions = getattr(err, "suggestions", None)
        return text + (f" (did you mean {' or '.join(suggestions)}?)" if suggestions else "")
    if type(err).__name__ == "MisconfigurationException":
        return text
    if isinstance(err, (ValueError, RuntimeError, OSError, KeyError)) and not type(err).__module__.startswith("torch"):
        return text
    return f"{type(err).__name__}: {text}"
