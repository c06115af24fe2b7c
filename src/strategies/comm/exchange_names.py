"""The names of the gradient allreduce: one vocabulary for the strategy's options, HPARAMS, the predictor and docs.

Pure Python (no torch), so the cost model can share it. Two options of `split_allreduce` choose the algorithm at
each level; `exchange_name` turns them and the layout (P processes x K replicas) into the name of the whole
job's exchange, the word HPARAMS shows as `run/allreduce` and the predictor takes in `--algorithms`.
"""

# split_allreduce's `allreduce`: among one process's K replicas
IN_PROCESS = ("ring", "reduce_broadcast")
# split_allreduce's `process_allreduce`: between the P processes
BETWEEN_PROCESSES = ("ring", "torch")
# `compression.kind` (ours' and CompressedDDPStrategy's) and the predictor's --compression, as Literal[COMPRESSIONS]
COMPRESSIONS = ("none", "bf16", "powersgd")

# The whole job's exchange, by name
EXCHANGES = {
    "none": "one replica in all: nothing to exchange",
    "ring": "one ring over all replicas: reduce-scatter, then all-gather; every device sends 2(n-1)/n of the "
            "gradient bytes (ours: allreduce: ring in one process, or process_allreduce: ring with one replica "
            "per process)",
    "reduce_broadcast": "sum on one device, then broadcast (d2l.ai's allreduce; ours: allreduce: reduce_broadcast, "
                        "with the processes' exchange between the sum and the broadcast)",
    "hierarchical": "a ring inside every process, a ring between processes over each device's chunk, then an "
                    "all-gather inside every process (Horovod's; ours: allreduce: ring with P > 1 processes of "
                    "K > 1 replicas)",
    "torch": "torch.distributed.all_reduce: the backend's own algorithm (DDP; ours: process_allreduce: torch "
             "with one replica per process)",
}


def compression_tag(compression: str, rank: int) -> str:
    """How run names and HPARAMS' `run/compression` name a compression: "none", "bf16", "powersgd-r<rank>"."""
    return f"powersgd-r{rank}" if compression == "powersgd" else compression


def check_choice(option: str, value: str, choices: tuple[str, ...]) -> None:
    """Raises ValueError naming `option`, the bad `value` and the `choices`."""
    if value not in choices:
        raise ValueError(f"unknown {option} {value!r}; choose one of {', '.join(choices)}")


def exchange_name(allreduce: str, process_allreduce: str, processes: int, replicas_per_process: int) -> str:
    """The name (a key of `EXCHANGES`) of the exchange that split_allreduce runs with these options and layout.

    Args:
        allreduce: Among a process's replicas, one of `IN_PROCESS`.
        process_allreduce: Between processes, one of `BETWEEN_PROCESSES`.
        processes: P, the world size.
        replicas_per_process: K.
    """
    if processes == 1:
        return allreduce if replicas_per_process > 1 else "none"
    if replicas_per_process == 1:
        return process_allreduce
    return "hierarchical" if allreduce == "ring" else "reduce_broadcast"
