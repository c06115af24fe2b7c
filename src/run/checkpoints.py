"""Checkpoint files: writes that never leave a half-written file, loads that never run code, `--ckpt_path last`
found in any run of the experiment, `--ckpt_path auto` in this run's folder, and a checkpoint checked against the
configured model before a run starts."""

import os
import pickle
import re
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_warn

from src.file_kinds import what_is


def _keep_location(storage: Any, location: Any) -> Any:
    return storage  # Lightning's default: tensors stay where they were saved


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary file in the same folder, fsyncs it, then renames it into place.

    `os.replace` within one folder is atomic on POSIX, so a process killed during a save leaves the
    previous file under that name intact (plus, at worst, a stray `.<name>.tmp-<pid>` that the next save
    of the same name from the same process overwrites). Lightning's default goes through an fsspec
    transaction whose temporary file lives in the system temp folder, and a move across filesystems is a
    copy, which a kill can interrupt half-way.

    Every load goes through torch's weights-only unpickler (tensors and plain data only), whatever the caller
    asks for, so a crafted checkpoint cannot run code.
    """

    def load_checkpoint(self, path: Any, map_location: Any = _keep_location, weights_only: bool | None = None) -> dict:
        """Load with `weights_only=True` always.

        Raises:
            ValueError: If a caller turns `weights_only` off (an unrestricted unpickler).
        """
        if weights_only is False:
            raise ValueError("checkpoints are loaded with torch's weights-only unpickler only; turning weights_only "
                             "off would let a checkpoint run code while it loads")
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        directory = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # make the rename itself durable
        finally:
            os.close(directory)


def resolve_last_checkpoint(ckpt_path: str | None, experiment_dir: Path | None) -> str | None:
    """Turn `--ckpt_path last` into the newest `last.ckpt` of this experiment, in any of its run folders
    (`<strategy>-<P>x<K>-<device>/version_*/checkpoints/`, or `version_*/checkpoints/` directly).

    Lightning's own "last" looks only in the new run's (empty) checkpoint folder, so a resume would silently
    start from scratch.

    Raises:
        FileNotFoundError: "last" with no last.ckpt under the experiment folder.
    """
    if ckpt_path != "last" or experiment_dir is None:
        return ckpt_path
    root = Path(experiment_dir)
    found = [*root.glob("version_*/checkpoints/last.ckpt"), *root.glob("*/version_*/checkpoints/last.ckpt")]
    found.sort(key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"--ckpt_path last: no last.ckpt under {experiment_dir}/*/version_*/checkpoints/; "
                                "nothing to resume (drop --ckpt_path to start a new run, or give the path)")
    return str(found[-1])


def newest_complete_checkpoint(experiment_dir: Path, run_folder: str) -> Path | None:
    """The newest checkpoint (by modification time) of one run, for `--ckpt_path auto`.

    The run is the folder `run_folder` (a logger version, e.g. "elastic-JOB") under any run name of the
    experiment (`<experiment_dir>/<strategy>-<P>x<K>-<device>/<run_folder>/checkpoints/*.ckpt`, or
    `<experiment_dir>/<run_folder>/checkpoints/`), so a restart on another number of processes finds the
    checkpoints of the first start. Temporary files of an interrupted save (`.<name>.tmp-<pid>`) are not
    `*.ckpt`; a file whose zip directory is unreadable (truncated, e.g. written by another tool without a rename),
    or a member of which fails its CRC-32 (`damaged_member`), is passed over with a line saying so, and kept.

    Returns:
        The file, or None when the run has no complete checkpoint yet.
    """
    root = Path(experiment_dir)
    found = [*root.glob(f"{run_folder}/checkpoints/*.ckpt"), *root.glob(f"*/{run_folder}/checkpoints/*.ckpt")]
    for path in sorted(found, key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            with zipfile.ZipFile(path):
                pass
        except (zipfile.BadZipFile, OSError) as err:
            rank_zero_warn(f"--ckpt_path auto: passing over {path}, which is incomplete ({err})")
            continue
        # a restart goes on from an earlier checkpoint rather than stop at a damaged one
        damage = damaged_member(path)
        if damage is None:
            return path
        rank_zero_warn(f"--ckpt_path auto: passing over {path}, which is damaged ({damage})")
    return None


class UnsafeCheckpointError(ValueError):
    """Raised for a checkpoint whose unpickling would need objects other than tensors and plain data."""


_WHERE_CHECKPOINTS_ARE = ("give a .ckpt file that a fit run wrote, e.g. logs/<model>/<run>/version_N/checkpoints/"
                          "last.ckpt, or --ckpt_path last for the newest one of the configured model")


def check_checkpoint_file(path: str | Path) -> None:
    """Say what `path` is when it cannot be a checkpoint, before torch tries to unpickle it.

    torch saves checkpoints as zip archives holding `<name>/data.pkl` (torch >= 1.6; the older format is a pickle,
    left to torch). Read as a pickle, any other file fails with a message about unsafe globals or bad opcodes,
    which says nothing about what the file is.

    Raises:
        IsADirectoryError: A folder (the message lists up to 3 of the checkpoints inside it).
        ValueError: A file that is not a checkpoint (the message says what it is), a truncated zip archive, a
            zip archive that torch did not write, or one with a member whose CRC-32 fails (`damaged_member`).
    """
    path = Path(path)
    if path.is_dir():
        inside = sorted(path.glob("**/*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)[:3]
        which = f": give one of the checkpoints inside it, e.g. {', '.join(map(str, inside))}" if inside else \
            f", and holds no .ckpt file; {_WHERE_CHECKPOINTS_ARE}"
        raise IsADirectoryError(f"--ckpt_path {path} is a folder, not a checkpoint file{which}")
    kind = what_is(path)
    if kind == "a pickle":
        return  # torch's legacy format: torch.load reads it, or says why not
    if kind != "a zip archive":
        raise ValueError(f"--ckpt_path {path} is not a checkpoint: it is {kind}; {_WHERE_CHECKPOINTS_ARE}")
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError) as err:
        raise ValueError(f"--ckpt_path {path} is a truncated or damaged checkpoint ({path.stat().st_size:,} bytes; "
                         f"zip: {err}): it was cut short while being copied or written. Copy it again, or use an "
                         "earlier checkpoint of the run (e.g. --ckpt_path last)") from None
    if not any(n.endswith("/data.pkl") or n == "data.pkl" for n in names):
        raise ValueError(f"--ckpt_path {path} is a zip archive but not a torch checkpoint (no data.pkl among its "
                         f"{len(names)} entries); {_WHERE_CHECKPOINTS_ARE}")
    damage = damaged_member(path)
    if damage:
        raise ValueError(f"--ckpt_path {path} is a damaged checkpoint: {damage}, so its contents are not what was "
                         "saved. Copy it again, or use an earlier checkpoint of the run (e.g. --ckpt_path last)")


def damaged_member(path: str | Path) -> str | None:
    """The first member of the zip archive `path` whose bytes do not match the CRC-32 its zip entry records.

    torch reads a checkpoint's members without checking their CRC-32, so bytes changed inside a tensor load
    silently as other numbers. torch stores the members uncompressed and records each one's CRC-32; reading
    a member to its end through `zipfile` compares the two (for a ResNet-18 checkpoint of 89 MB, 35 ms against
    torch.load's 65 ms, both from the page cache).

    Returns:
        e.g. "member archive/data/4 fails its CRC-32 check", or None when every member reads back as written.
    """
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            try:
                with archive.open(info) as member:
                    while member.read(1 << 20):
                        pass
            except (zipfile.BadZipFile, EOFError, OSError, zlib.error) as err:
                if "CRC-32" in str(err):
                    return f"member {info.filename} fails its CRC-32 check"
                return f"member {info.filename} is unreadable ({err})"
    return None


def load_checkpoint_safely(path: str | Path) -> dict:
    """Load a checkpoint file with torch's weights-only unpickler, onto the CPU.

    The weights-only unpickler rebuilds tensors, containers and plain values only, so a crafted file cannot
    run code while it is read; weights_only=True is passed explicitly because torch then ignores the
    environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD.

    Returns:
        The checkpoint dict (tensors on the CPU).

    Raises:
        UnsafeCheckpointError: The file needs arbitrary objects to unpickle; it was not loaded.
        IsADirectoryError: A folder.
        ValueError: The file is unreadable: truncated, or not a checkpoint (`check_checkpoint_file`).
    """
    check_checkpoint_file(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "weights only load failed" not in str(err).lower():
            raise ValueError(f"--ckpt_path {path} cannot be read as a Lightning checkpoint (UnpicklingError: {err}); "
                             "it may be truncated or not a checkpoint") from err
        found = re.search(r"(?:unsupported GLOBAL|Unsupported global: GLOBAL) ([\w.]+)", str(err))
        what = f" (it asks for {found.group(1)})" if found else ""
        raise UnsafeCheckpointError(
            f"--ckpt_path {path} was not loaded: it holds objects other than tensors and plain data{what}, and "
            "unpickling those could run code. Use a checkpoint saved by this tool, or load a trusted file's "
            "state_dict yourself and save that") from None
    except Exception as err:  # truncated zip, a file that is not a checkpoint
        raise ValueError(f"--ckpt_path {path} cannot be read as a Lightning checkpoint ({type(err).__name__}: "
                         f"{err}); it may be truncated or not a checkpoint") from err


def check_checkpoint(ckpt_path: str | None, model: torch.nn.Module) -> dict | None:
    """A checkpoint given with --ckpt_path must be a local file, load safely, and fit the configured model.

    Returns:
        The checkpoint dict (tensors on the CPU), or None for no file (None, "best", "last", "hpc", "registry").

    Raises:
        ValueError: A URL (remote checkpoints are refused: Lightning would unpickle them unrestricted), an
            unreadable file, or one saved from a different network (the message names the first parameter
            whose shape differs, or the missing and unexpected ones).
        UnsafeCheckpointError: A file that needs unrestricted unpickling.
        FileNotFoundError: No such file.
    """
    if ckpt_path in (None, "best", "last", "hpc", "registry"):
        return None
    if "://" in str(ckpt_path):
        raise ValueError(f"--ckpt_path {ckpt_path}: checkpoints are loaded from local files only; download it first "
                         "and give the file's path")
    path = Path(ckpt_path)
    if not path.exists():
        raise FileNotFoundError(f"--ckpt_path {ckpt_path}: no such file; {_WHERE_CHECKPOINTS_ARE}")
    checkpoint = load_checkpoint_safely(path)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(f"--ckpt_path {ckpt_path} cannot be read as a Lightning checkpoint (it has no state_dict); "
                         "it may be truncated or not a checkpoint")
    state = checkpoint["state_dict"]
    expected = model.state_dict()
    for name, t in expected.items():
        if name in state and tuple(state[name].shape) != tuple(t.shape):
            raise ValueError(f"--ckpt_path {ckpt_path} does not fit {type(model).__name__}: '{name}' has shape "
                             f"{tuple(state[name].shape)} in the checkpoint but {tuple(t.shape)} in the model; it "
                             "was saved from another network (use the config.yaml of the run that saved it)")
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"--ckpt_path {ckpt_path} does not fit {type(model).__name__}: {len(missing)} of the model's tensors "
            f"are not in it (e.g. {', '.join(missing[:2]) or '-'}) and {len(unexpected)} of its tensors are not in "
            f"the model (e.g. {', '.join(unexpected[:2]) or '-'}); it was saved from another network (use the "
            "config.yaml of the run that saved it)")
    return checkpoint


def keep_saved_folders(callbacks: list, checkpoint: dict) -> None:
    """Give each `ModelCheckpoint` without a folder of its own the folder it had when `checkpoint` was saved.

    For a run that reads a checkpoint but trains nothing (validate, test, predict): the callbacks save nothing
    there, and their saved state (best score, top-k paths) loads as it was, without Lightning's warning that the
    folder changed from the training run's to this run's.
    """
    states = checkpoint.get("callbacks") or {}
    for callback in callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
            saved = (states.get(callback.state_key) or {}).get("dirpath")
            if saved:
                callback.dirpath = saved


def optimizer_state_by_position(saved: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed as one device's: each parameter's state under its position in the groups'
    parameter lists taken in turn, as `torch.optim.Optimizer.state_dict` numbers them.

    `Optimizer.load_state_dict` pairs the saved numbers with the parameters through those lists, whatever the numbers
    are; a strategy that loads the state by number must see one device's. Checkpoints of Lightning's FSDP number them
    by `model.parameters()` order instead (its `rekey_optim_state_dict` is given the model only), with the lists
    sorted: LeNet's groups [0, 2, 4, ...] (weights) and [1, 3, 5, ...] (biases) where one device has [0, 1, 2, 3]
    and [4, ...]. A state dict in one device's order is returned as it is.
    """
    order = [i for group in saved["param_groups"] for i in group["params"]]
    position = {i: n for n, i in enumerate(order)}
    if all(position[i] == i for i in order):
        return saved
    groups, start = [], 0
    for group in saved["param_groups"]:
        groups.append({**group, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    return {**saved, "state": {position[i]: s for i, s in saved["state"].items()}, "param_groups": groups}
