"""Which devices hold a process's replicas."""

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
                raise ValueError(f"device {name!r} asked for, but this machine has no CUDA GPU; use 'cpu' replicas, "
                                 "e.g. --config configs/strategy/split_allreduce.yaml (devices: [cpu, cpu])")
            dev = torch.device("cuda", dev.index if dev.index is not None else 0)
            if dev.index >= count:
                raise ValueError(f"device {name!r} does not exist: this machine has {count} CUDA device(s), "
                                 f"cuda:0 to cuda:{count - 1}")
        elif dev.type != "cpu":
            raise ValueError(f"device {name!r}: split_allreduce runs on 'cpu' and 'cuda' devices only")
        parsed.append(dev)
    return parsed


def local_replica_devices(assigned: list[torch.device] | None, local_rank: int, k: int) -> list[torch.device]:
    """The K replica devices of local process `local_rank` when the strategy's `devices` is not given.

    CPU: K times "cpu". CUDA: local process p takes cuda:p*K .. cuda:p*K+K-1 (with K = 1, the GPU Lightning
    assigned it, as under DDP).

    Args:
        assigned: The devices Lightning assigned this node's processes, one each (`trainer.accelerator/devices`;
            None or empty: the CPU).
        local_rank: This process's rank on its node.
        k: Replicas per process.
    """
    assigned = assigned or [torch.device("cpu")]
    accelerator_device = assigned[min(local_rank, len(assigned) - 1)]
    if accelerator_device.type != "cuda":
        return [torch.device(accelerator_device.type)] * k
    if k == 1:
        return [accelerator_device]
    return [torch.device("cuda", local_rank * k + j) for j in range(k)]
