"""One clear line for each way a run can be set up wrong: the CLI prints these instead of a traceback."""

import difflib
import os
import re
from pathlib import Path

import yaml
from lightning.pytorch.cli import LightningArgumentParser

DEBUG_ENV = "FMNIST_DEBUG"


class ConfigError(Exception):
    """A bad command line or config file; `suggestions` are valid keys close to a mistyped one."""

    def __init__(self, message: str, suggestions: list[str] | None = None) -> None:
        super().__init__(message)
        self.suggestions = suggestions or []


class RaisingArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, raising `ConfigError` instead of printing usage and exiting, so that one handler
    reports every error; for an unknown key it looks up the nearest valid ones (difflib)."""

    def error(self, message: str, ex: Exception | None = None):
        unknown = re.search(r"(?:unrecognized arguments: --|does not accept option ')([\w.]+)", message)
        if unknown and unknown.group(1).split(".")[0] in ("optimizer", "lr_scheduler"):
            raise ConfigError(f"there is no --{unknown.group(1)} option: the optimizer and lr schedule are part of "
                              "the model's recipe; set model.init_args.optimizer (sgd, adam, adamw), "
                              "model.init_args.lr and model.init_args.scheduler instead") from ex
        suggestions = []
        if unknown:
            parsers = [self, *getattr(getattr(self, "_subcommands_action", None), "choices", {}).values()]
            keys = {a.dest for p in parsers for a in p._actions if a.dest and a.dest != "help"}
            suggestions = difflib.get_close_matches(unknown.group(1), sorted(keys), n=3, cutoff=0.75)
        raise ConfigError(message, suggestions) from ex


def check_config_files(argv: list[str]) -> None:
    """Read every `--config` file named in `argv` before the CLI does, so an error can name the file.

    Raises:
        ConfigError: A file that is missing, unreadable, empty, not valid YAML (with its line and column),
            or not a mapping of keys.
    """
    paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config", "-c")]
    paths += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"config file {name} does not exist (or is not a file)")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as err:
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
            raise ConfigError(f"config file {name} must hold a mapping of keys (trainer:, model:, data:), "
                              f"found a {type(content).__name__}")


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
    if isinstance(err, ConfigError) or "Union subtypes" in text or text.startswith("Parser key"):
        text = condense(text)
        suggestions = getattr(err, "suggestions", None)
        return text + (f" (did you mean {' or '.join(suggestions)}?)" if suggestions else "")
    if type(err).__name__ == "MisconfigurationException":
        return text
    if isinstance(err, (ValueError, RuntimeError, OSError, KeyError)) and not type(err).__module__.startswith("torch"):
        return text
    return f"{type(err).__name__}: {text}"
