"""Data-parallel strategies; importing this package registers their short names with Lightning."""

from lightning.pytorch.strategies import StrategyRegistry

from src.strategies.split_allreduce import SplitAllreduceStrategy

SplitAllreduceStrategy.register_strategies(StrategyRegistry)

__all__ = ["SplitAllreduceStrategy"]
