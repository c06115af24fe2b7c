"""The names `trainer.strategy` and `trainer.accelerator` accept, in `--help` and in the errors for a misspelled
name or for devices the machine does not have; Lightning's own messages list other names or none."""

import difflib
import os
import re

import torch
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, StrategyRegistry

CPU_OVERLAYS = ("--trainer.accelerator cpu (one device), --config configs/strategy/ddp_cpu.yaml (DDP, 2 processes) "
                "or --config configs/strategy/split_allreduce.yaml (split_allreduce, 2 replicas in one process)")


def strategy_names() -> list[str]:
    """Every `trainer.strategy` name this tool runs: `auto`, and the registered names of one device, Lightning's
    DDP (with its start methods and our compressed variants) and `split_allreduce`; deepspeed, fsdp and xla are
    registered by Lightning (DeepSpeed, XLA and TPU subclass DDP and single-device) but need libraries and
    hardware this tool does not set up."""
    names = [name for name in StrategyRegistry.available_strategies()
             if (issubclass(cls := StrategyRegistry[name]["strategy"], (DDPStrategy, SingleDeviceStrategy))
                 or hasattr(cls, "parallel_layout")) and not re.search("DeepSpeed|XLA|TPU", cls.__name__)]
    return ["auto", *names]


def accelerator_names() -> list[str]:
    """Every `trainer.accelerator` name Lightning accepts; `gpu` is its alias of cuda (or mps)."""
    return ["auto", "cpu", "cuda", "gpu", *sorted(set(AcceleratorRegistry.available_accelerators()) - {"cpu", "cuda"})]


def nearest(word: str, choices: list[str]) -> list[str]:
    """Up to 3 of `choices` closest to `word` (difflib's ratio >= 0.6), best first."""
    return difflib.get_close_matches(word.lower(), choices, n=3, cutoff=0.6)


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = nearest(word, choices)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def describe_machine() -> str:
    """What this machine has for `trainer.accelerator`/`trainer.devices`, e.g. "no CUDA GPU (2 CPU cores; torch
    2.5.1 built without CUDA)" or "1 CUDA GPU: cuda:0 NVIDIA H100"."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
        return f"no CUDA GPU ({os.cpu_count()} CPU cores; torch {torch.__version__} {build})"
    names = ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(count))
    return f"{count} CUDA GPU{'s' if count > 1 else ''}: {names}"


_STRATEGY = re.compile(r"invalid strategy name: `strategy='([^']*)'`")
_ACCELERATOR = re.compile(r"invalid accelerator name: `accelerator='([^']*)'`")
_NO_GPU = re.compile(r"No supported gpu backend found|`(CUDA|MPS)Accelerator` can not run on your system")
_FSDP_NEEDS_GPU = re.compile(r"The strategy `fsdp` requires a GPU accelerator")
FSDP_CPU_OVERLAYS = ("--config configs/strategy/fsdp_cpu_shard_grad_op.yaml (SHARD_GRAD_OP) or --config "
                     "configs/strategy/fsdp_cpu_full_shard.yaml (FULL_SHARD), 2 processes on the CPU")
_TOO_FEW = re.compile(r"You requested gpu: (\[[\d, ]*\])\s+But your machine only has: (\[[\d, ]*\])")


def explain(text: str) -> str | None:
    """Our message for Lightning's error `text` about a strategy or accelerator name or missing GPUs; None for
    any other error (Lightning's own message is kept)."""
    if found := _STRATEGY.search(text):
        name = found.group(1)
        return (f"trainer.strategy {name!r} is not a strategy name{_did_you_mean(name, strategy_names())}; the "
                f"names: {', '.join(strategy_names())} (or a class_path, as in configs/strategy/*.yaml)")
    if found := _ACCELERATOR.search(text):
        name = found.group(1)
        return (f"trainer.accelerator {name!r} is not an accelerator name{_did_you_mean(name, accelerator_names())};"
                f" the names: {', '.join(accelerator_names())}")
    if _FSDP_NEEDS_GPU.search(text):
        return (f"trainer.strategy fsdp is Lightning's FSDP, which runs on GPUs only, and this run is on the CPU "
                f"(this machine has {describe_machine()}). FSDP on the CPU: {FSDP_CPU_OVERLAYS}")
    if _NO_GPU.search(text):
        return (f"trainer.accelerator asks for a GPU, but this machine has {describe_machine()}. "
                f"Run on the CPU: {CPU_OVERLAYS}")
    if found := _TOO_FEW.search(text):
        have = found.group(2).strip("[]")
        count = len([g for g in have.split(",") if g.strip()])
        return (f"trainer.devices asks for GPUs {found.group(1)}, but this machine has {describe_machine()}: set "
                f"--trainer.devices {count} (or fewer), or run on the CPU: {CPU_OVERLAYS}")
    return None


def add_choices_to_help(parser: object) -> None:
    """Append the accepted names to the `--help` text of trainer.strategy and trainer.accelerator in `parser`."""
    lists = {"trainer.strategy": f"Names: {', '.join(strategy_names())}; or a class_path with init_args "
                                 "(configs/strategy/*.yaml).",
             "trainer.accelerator": f"Names: {', '.join(accelerator_names())}."}
    for action in getattr(parser, "_actions", []):
        if action.dest in lists and lists[action.dest] not in (action.help or ""):
            action.help = f"{action.help or ''} {lists[action.dest]}".strip()
