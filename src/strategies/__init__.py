"""Data-parallel strategies: the Lightning glue (this package) and pure communication (`src.strategies.comm`).

`SplitAllreduceStrategy` is loaded on first use, so that importing `src.strategies.comm` does not load
Lightning; its module registers the short name `split_allreduce` with Lightning when it is imported.
"""

__all__ = ["SplitAllreduceStrategy"]


def __getattr__(name: str):
    if name == "SplitAllreduceStrategy":  # the class_path `src.strategies.SplitAllreduceStrategy` of every config
        from src.strategies.split_allreduce import SplitAllreduceStrategy

        return SplitAllreduceStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
