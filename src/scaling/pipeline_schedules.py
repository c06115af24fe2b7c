"""The shapes of the pipeline schedules the pipeline strategy runs (src/strategies/pipeline_net.py): their bubble
and how many micro-batches' activations each process holds at its peak. Pure Python.

Sources: GPipe (Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism",
NeurIPS 2019, arXiv:1811.06965, section 2.3); 1F1B (Narayanan et al., "PipeDream: Generalized Pipeline Parallelism
for DNN Training", SOSP 2019; its flush variant in Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN
Training", ICML 2021, arXiv:2006.09503); interleaved stages (Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC 2021, arXiv:2104.04473, section 2.2.2); the warm-up counts of
torch.distributed.pipelining.schedules (`Schedule1F1B`, `_get_warmup_ops`, torch 2.14.1).
"""

#: the pipeline schedules (the keys of src.strategies.pipeline_net.SCHEDULES) and their stages per process v
STAGES_PER_PROCESS = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "interleaved_zero_bubble": 2}
SCHEDULES = tuple(STAGES_PER_PROCESS)


def bubble_fraction(stages: int, microbatches: int, per_process: int = 1) -> float:
    """The idle share of a pipeline's schedule: (p - 1) / (v·m + p - 1).

    GPipe (Huang et al. 2019, section 2.3) and 1F1B (Narayanan et al. 2019) with v = 1; interleaved with v stages
    per process (Narayanan et al. 2021, section 2.2.2).

    Args:
        stages: p, processes in the pipeline, >= 1.
        microbatches: m, >= 1.
        per_process: v, stages per process, >= 1.

    Returns:
        The share, 0 for one process.

    Raises:
        ValueError: An argument below 1.
    """
    if min(stages, microbatches, per_process) < 1:
        raise ValueError(f"stages, micro-batches and stages per process must be >= 1, got {stages}, {microbatches}, "
                         f"{per_process}")
    return (stages - 1) / (per_process * microbatches + stages - 1)


def in_flight(schedule: str, rank: int, processes: int, microbatches: int) -> list[int]:
    """The local stage (0 .. v-1) of each micro-batch whose activations process `rank` holds at its peak.

    GPipe: all m forwards before any backward; 1F1B: torch's warm-up of min(m, p - rank) forwards, then one backward
    before each forward; interleaved: torch's `_get_warmup_ops` (factor 2 for 1F1B, 1 for zero bubble) plus one,
    capped at v·m, the forwards cycling through the local stages in rounds of m // max(1, m // p) micro-batches.

    Args:
        schedule: A key of `STAGES_PER_PROCESS`.
        rank: The process's rank in its pipeline, 0 .. p-1.
        processes: p, processes in the pipeline.
        microbatches: m.

    Returns:
        One entry per micro-batch held: the index of the process's stage it is on (0 with one stage per process).

    Raises:
        ValueError: An unknown schedule.
    """
    if schedule not in STAGES_PER_PROCESS:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    v, m = STAGES_PER_PROCESS[schedule], microbatches
    if schedule == "gpipe":
        return [0] * m
    if schedule == "1f1b":
        return [0] * min(m, processes - rank)
    per_round = m // max(1, m // processes)
    factor = 2 if schedule == "interleaved_1f1b" else 1
    held = min((v - 1) * per_round + factor * (processes - 1 - rank) + 1, m * v)
    return [(i // per_round) % v for i in range(held)]
