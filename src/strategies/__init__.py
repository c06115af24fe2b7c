"""Data-parallel strategies: the Lightning glue (this package) and pure communication (`src.strategies.comm`).

`SplitAllreduceStrategy` and `CompressedDDPStrategy` are loaded on first use, so that importing
`src.strategies.comm` does not load Lightning; their modules register their short names with Lightning when they
are imported (`split_allreduce`; `ddp_bf16`, `ddp_powersgd`). Their option groups, `CompressionSpec` (both) and
`ProcessStart` (ours), are loaded the same way.
"""

__all__ = ["CompressedDDPStrategy", "CompressionSpec", "PipelineStrategy", "ProcessStart", "SplitAllreduceStrategy",
           "TensorParallelStrategy"]


def __getattr__(name: str):
    if name == "SplitAllreduceStrategy":  # the class_path `src.strategies.SplitAllreduceStrategy` of every config
        from src.strategies.split_allreduce import SplitAllreduceStrategy

        return SplitAllreduceStrategy
    if name == "CompressedDDPStrategy":  # configs/strategy/ddp_cpu_bf16.yaml, ddp_cpu_powersgd.yaml
        from src.strategies.ddp_compression import CompressedDDPStrategy

        return CompressedDDPStrategy
    if name == "PipelineStrategy":  # configs/strategy/pipeline_cpu.yaml
        from src.strategies.pipeline import PipelineStrategy

        return PipelineStrategy
    if name == "TensorParallelStrategy":  # configs/strategy/tensor_parallel_cpu.yaml
        from src.strategies.tensor_parallel import TensorParallelStrategy

        return TensorParallelStrategy
    if name == "CompressionSpec":  # `compression: {kind: ..., rank: ...}` of both
        from src.strategies.comm.compression import CompressionSpec

        return CompressionSpec
    if name == "ProcessStart":  # ours' `processes: {backend: ..., timeout: ..., start_method: ...}`
        from src.strategies.processes import ProcessStart

        return ProcessStart
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
