"""Which devices hold the replicas, and whether this process was started as one of several."""

import os

import torch


def parse_devices(devices: list[str]) -> list[torch.device]:
    """Turn names like "cpu", "cuda:1" into devices, checking that each exists on this machine.

    Args:
        devices: One name per replica; "cuda" means "cuda:0".

    Returns:
        One `torch.device` per replica, in order.

    Raises:
        ValueError: For an empty list, an unparsable name, a type other than cpu/cuda, or a CUDA device
            that this machine does not have.
    """
    if not devices:
        raise ValueError("split_allreduce needs at least one device, e.g. devices: [cpu, cpu]")
    parsed = []
    for name in devices:
        try:
            dev = torch.device(name)
        except RuntimeError:
            raise ValueError(f"{name!r} is not a device name; use e.g. 'cpu', 'cuda:0'") from None
        if dev.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0:
                raise ValueError(f"device {name!r} asked for, but this machine has no CUDA GPU; use 'cpu' replicas")
            dev = torch.device("cuda", dev.index if dev.index is not None else 0)
            if dev.index >= count:
                raise ValueError(f"device {name!r} does not exist: this machine has {count} CUDA device(s), "
                                 f"cuda:0 to cuda:{count - 1}")
        elif dev.type != "cpu":
            raise ValueError(f"device {name!r}: split_allreduce runs on 'cpu' and 'cuda' devices only")
        parsed.append(dev)
    return parsed


def multi_process_launcher() -> str | None:
    """Name the launcher if this process is one of several started by torchrun, SLURM or MPI, else None."""
    if torch.distributed.is_torchelastic_launched():
        return f"torchrun (WORLD_SIZE={os.environ.get('WORLD_SIZE')})"
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return f"SLURM (SLURM_NTASKS={os.environ['SLURM_NTASKS']})"
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return f"MPI (OMPI_COMM_WORLD_SIZE={os.environ['OMPI_COMM_WORLD_SIZE']})"
    return None
