"""Pure communication: allreduce algorithms, buckets, overlap and the per-step gradient exchange.

Nothing here imports Lightning or the strategy glue in `src.strategies`; every function works on tensors and
torch.distributed process groups alone, so it can be tested and benchmarked on its own.
"""
