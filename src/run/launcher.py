"""Which launcher started this process, read from the environment it set: torchrun (elastic) or SLURM.

Plain readers of environment variables with no other import of this package, so that both the run logger and the
restart logic (`src.run.elastic`, which builds on the logger) can ask without importing each other.
"""

import os
from collections.abc import Mapping


def elastic_launch(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether torchrun started this process (it sets TORCHELASTIC_RUN_ID, WORLD_SIZE and LOCAL_WORLD_SIZE)."""
    return all(key in environ for key in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_WORLD_SIZE"))


def restart_count(environ: Mapping[str, str] = os.environ) -> int:
    """How many times the launcher restarted this job: torchrun's TORCHELASTIC_RESTART_COUNT, SLURM's
    SLURM_RESTART_COUNT (requeues), else 0."""
    for key in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        value = environ.get(key, "")
        if value.isdigit():
            return int(value)
    return 0


def run_id(environ: Mapping[str, str] = os.environ) -> str | None:
    """The launcher's name for this job, the same in every process and after every restart: "elastic-<id>" for
    torchrun's `--rdzv-id` (TORCHELASTIC_RUN_ID; torchrun's default "none" does not count), "slurm-<id>" for
    SLURM_JOB_ID (a requeued job keeps its id), else None."""
    elastic = environ.get("TORCHELASTIC_RUN_ID", "")
    if elastic and elastic != "none":
        return f"elastic-{elastic}"
    if environ.get("SLURM_JOB_ID"):
        return f"slurm-{environ['SLURM_JOB_ID']}"
    return None
