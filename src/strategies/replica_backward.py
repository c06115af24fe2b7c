"""Backward one replica at a time, so that each replica's backward is a span of its own in the step timeline.

d2l.ai, "Training on Multiple GPUs" (https://d2l.ai/chapter_computational-performance/multiple-gpus.html),
`train_batch`: `for l in ls: l.backward()`. The strategy's usual path is one backward through the gathered
loss sum_k (n_k / N) * loss_k; since the replicas' graphs share nothing, backpropagating each term on its own
gives every parameter bitwise the same gradient. It is taken only while a timeline records: one backward lets
autograd run the replicas of several GPUs on its per-device threads at once.
"""

from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from src.timeline.labels import replica_phase


def backward_per_replica(strategy: Any, terms: list[tuple[int, Tensor]], closure_loss: Tensor,
                         optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
    """What `Strategy.backward` does for `closure_loss`, with the backward itself run per replica.

    Args:
        strategy: The Lightning strategy (its precision plugin and hooks run as in `Strategy.backward`).
        terms: (k, (n_k / N) * loss_k) for every replica k that ran, from `gather_losses`.
        closure_loss: Lightning's loss, sum of the terms divided by `accumulate_grad_batches` (a () tensor).
        optimizer, args, kwargs: Passed on to the precision plugin's backward.

    Returns:
        The closure loss after the precision plugin's `post_backward`, as `Strategy.backward` returns it.
    """
    module, precision = strategy.lightning_module, strategy.precision_plugin
    strategy.pre_backward(closure_loss)
    closure_loss = precision.pre_backward(closure_loss, module)
    normalize = module.trainer.accumulate_grad_batches  # Lightning divides the step's loss by it, as here
    for k, term in terms:
        with replica_phase(k, "backward"):
            precision.backward(term / normalize, module, optimizer, *args, **kwargs)
    closure_loss = precision.post_backward(closure_loss, module)
    strategy.post_backward(closure_loss)
    return closure_loss
