"""Lightning's DDP with one of torch's gradient-compression communication hooks, chosen by plain config values.

Lightning's `DDPStrategy(ddp_comm_hook=...)` registers a hook only when the root device is CUDA
(`DDPStrategy._register_ddp_hooks`), so on the CPU it would silently train with DDP's uncompressed allreduce.
`CompressedDDPStrategy` registers the hook on every device through torch's public
`DistributedDataParallel.register_comm_hook`, the call Lightning makes on CUDA, and counts what each hook call
hands to allreduce.

Sources: torch's DDP communication hooks, https://pytorch.org/docs/stable/ddp_comm_hooks.html; PowerSGD: Vogels,
Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization",
NeurIPS 2019, https://arxiv.org/abs/1905.13727.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from src.layout import SENT, UNCOMPRESSED, ParallelLayout, StepCounters, default_backend
from src.run.lightning_compat import tolerate_cpu_in_cuda_synchronize
from src.strategies.comm.compression import CompressionSpec

# DDPStrategy arguments that choose a hook by hand; here `compression` chooses it
_HOOK_ARGS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
_BF16_BYTES = torch.finfo(torch.bfloat16).bits // 8


def check_compression_options(compression: CompressionSpec, ddp_kwargs: dict[str, Any]) -> None:
    """Refuse what torch would refuse later (in every training process) or would silently misread; the settings
    themselves were checked when `compression` was made (`CompressionSpec`).

    Raises:
        ValueError: One message listing every bad value and what to set instead.
    """
    problems = []
    if compression.kind == "powersgd" and (compression.error_feedback or compression.warm_start) \
            and compression.warmup_steps < 2:  # DDP's own rule
        problems.append(f"compression.warmup_steps={compression.warmup_steps}: torch's PowerSGD needs at least 2 "
                        "uncompressed steps while error_feedback or warm_start is on (DDP rebuilds its gradient "
                        "buckets after the first step); set compression.warmup_steps >= 2, or "
                        "compression.error_feedback: false and compression.warm_start: false")
    given = [name for name in _HOOK_ARGS if ddp_kwargs.get(name) is not None]
    if given:
        problems.append(f"{', '.join(given)}: this strategy registers its hook from `compression`; use "
                        "lightning.pytorch.strategies.DDPStrategy for a hook of your own")
    if problems:
        raise ValueError("CompressedDDPStrategy: " + "; ".join(problems))


def _bucket_buffer(bucket: Any) -> torch.Tensor:
    """The flat gradient buffer of a DDP bucket (a `GradBucket`, or the (grad, param) pair of DDP's Python
    reducer, which torch's default hooks accept too)."""
    return bucket[0] if isinstance(bucket, tuple) else bucket.buffer()


class CompressedDDPStrategy(DDPStrategy):
    """Lightning's DDP whose gradient allreduce goes through one of torch's communication hooks, on the CPU too.

    - "none": torch's `allreduce_hook` (the average DDP computes by itself: divide by the world size, allreduce
      the flat bucket), counted like the other two, as the uncompressed baseline.
    - "bf16": torch's `bf16_compress_hook`: each bucket is cast to bfloat16 (2 bytes an element), divided by the
      world size, allreduced and cast back; 2x fewer bytes than float32 gradients, 4x fewer than float64.
    - "powersgd": torch's `powerSGD_hook` (Vogels, Karimireddy and Jaggi, NeurIPS 2019,
      https://arxiv.org/abs/1905.13727): for its first `compression.warmup_steps` steps a plain allreduce; then
      every gradient matrix n x m (a conv kernel is viewed as out x in*k*k) that shrinks by at least
      `compression.min_compression_rate` is sent as two rank-r factors P (n x r) and Q (m x r), allreduced one after the
      other, and every other tensor (biases) is allreduced as it is.

    Lightning registers `ddp_comm_hook` only on CUDA; this class registers in `configure_ddp` with torch's
    `DistributedDataParallel.register_comm_hook` on every device (on CUDA the same call Lightning makes). torch
    refuses its own `bf16_compress_hook` by name without CUDA and NCCL; the counting wrapper registered here has
    another name, and gloo allreduces bfloat16 tensors on the CPU.

    What the hook does is counted in every training process, per optimizer step (the hook calls since the
    previous optimizer step ended, which under gradient accumulation are those of the step's last micro-batch,
    as DDP synchronises no other). The counts are taken synchronously at each hook call, before its allreduces
    run: "none" and "bf16" hand allreduce one tensor of the bucket's elements, in the bucket's dtype or in
    bfloat16 (`torch.distributed.algorithms.ddp_comm_hooks.default_hooks`); a PowerSGD warm-up step hands the
    whole bucket; a compressed PowerSGD step hands the uncompressed tensors (one concatenated tensor), then P,
    then Q, whose elements torch's own `PowerSGDState.total_numel_after_compression` adds up in the same call
    ((n + m) * r per compressed matrix, n * m per tensor sent as it is), so the bytes sent are that increase
    times the bucket's element size. These are the sizes of the tensors reduced, not bytes on the wire: a ring
    allreduce moves about 2(P-1)/P times that in and out of each of P processes. With `start_method: spawn`
    the counts live in the training processes, not in the one that called `fit`.

    Resuming: Lightning saves no communication-hook state in checkpoints (neither `DDPStrategy` nor the
    checkpoint connector reads `ddp_comm_state`), and `configure_ddp` makes a new `PowerSGDState` at every fit.
    A resumed run therefore starts PowerSGD anew: `compression.warmup_steps` uncompressed steps again, zero
    error-feedback memory, and fresh random Q factors drawn from the same seed as at the first start.

    Args:
        compression: `kind` "none" (torch's `allreduce_hook`: DDP's own average, counted), "bf16"
            (`bf16_compress_hook`: buckets allreduced in bfloat16) or "powersgd" (`powerSGD_hook`: rank-r factors
            after the warm-up), and PowerSGD's settings, the same group as ours
            (`src.strategies.comm.compression.CompressionSpec`): `rank` is torch's `matrix_approximation_rank`,
            `warmup_steps` its `start_powerSGD_iter` (at least 2 while `error_feedback` or `warm_start` is on;
            torch suggests about 10% of the run and no fewer than the lr warm-up's steps), `error_feedback` its
            `use_error_feedback` (one gradient-sized buffer), `warm_start` its `warm_start`, and
            `min_compression_rate` its own.
        **kwargs: Every argument of `lightning.pytorch.strategies.DDPStrategy` (`process_group_backend`,
            `timeout`, `start_method`, and DDP's own such as `bucket_cap_mb`), except the four that choose a hook
            by hand: `ddp_comm_state`, `ddp_comm_hook`, `ddp_comm_wrapper`, `model_averaging_period`.

    Attributes:
        hook_calls: Hook calls in this process since this fit began (one per gradient bucket per synchronised
            backward).
        hook_calls_last_step: Hook calls of the last optimizer step.
        bytes_sent_last_step: Bytes of the tensors this process handed to allreduce in the last optimizer step.
        bytes_uncompressed_last_step: Bytes of the gradient buckets of that step: what DDP's own allreduce would
            have handed over (the buckets' elements in the gradients' dtype).
        bytes_sent_total, bytes_uncompressed_total: The same, summed over the optimizer steps of this fit.
        powersgd_state: torch's `PowerSGDState` of this fit ("powersgd" only, else None; made at setup).

    Raises:
        ValueError: At construction, for `compression.warmup_steps` < 2 with error feedback or warm start, or one
            of the hook arguments above; one message lists every bad value and what to set. `CompressionSpec`
            refuses the other bad settings when it is made.
    """

    def __init__(self, compression: CompressionSpec = CompressionSpec("bf16"), **kwargs: Any) -> None:
        check_compression_options(compression, kwargs)
        super().__init__(**kwargs)  # as it is: jsonargparse reads DDPStrategy's arguments through this call
        self.compression = compression
        self.powersgd_state: powerSGD_hook.PowerSGDState | None = None
        self._reset_counts()

    def _reset_counts(self) -> None:
        self.hook_calls = self.hook_calls_last_step = 0
        self.bytes_sent_last_step = self.bytes_uncompressed_last_step = 0
        self.bytes_sent_total = self.bytes_uncompressed_total = 0
        self._pending = [0, 0, 0]  # hook calls, bytes sent, bytes uncompressed since the last optimizer step

    def parallel_layout(self) -> ParallelLayout:
        """DDP's layout (`src.layout.parallel_layout`) with its compression ("bf16", "powersgd-r<rank>"), so that
        run names (`ddp-2x1-cpu-bf16`) and the HPARAMS table (`run/compression`) tell the compressions apart."""
        p = self.world_size
        backend = self.process_group_backend or default_backend(self.root_device)
        return ParallelLayout("ddp", p, 1, (self.root_device,), tuple(self.parallel_devices or [self.root_device]),
                              "torch" if p > 1 else "none", backend if p > 1 else None,
                              compression=self.compression.tag)

    def step_counters(self) -> StepCounters:
        """The bytes its hook counted in the last optimizer step, for the callbacks (`src.layout.StepCounters`)."""
        return _HookCounts(self)

    @override
    def configure_ddp(self) -> None:
        """Wrap the model in DDP as Lightning does, then register the chosen hook on any device."""
        super().configure_ddp()  # registers nothing: no ddp_comm_hook was given to DDPStrategy
        assert isinstance(self.model, DistributedDataParallel)
        self._reset_counts()
        state, hook = self._make_hook()
        self.model.register_comm_hook(state=state, hook=hook)

    def _make_hook(self) -> tuple[object, Callable]:
        """A fresh hook state (a new `PowerSGDState` each fit) and the counting hook around torch's."""
        spec = self.compression
        if spec.kind == "powersgd":
            if self.root_device.type == "cpu" and torch.cuda.is_available():
                tolerate_cpu_in_cuda_synchronize()
            self.powersgd_state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=spec.rank, start_powerSGD_iter=spec.warmup_steps,
                min_compression_rate=spec.min_compression_rate, use_error_feedback=spec.error_feedback,
                warm_start=spec.warm_start)
            return self.powersgd_state, self._counted_powersgd
        return None, (self._counted_bf16 if spec.kind == "bf16" else self._counted_allreduce)

    def _count(self, sent: int, uncompressed: int) -> None:
        self.hook_calls += 1
        self._pending[0] += 1
        self._pending[1] += sent
        self._pending[2] += uncompressed

    def _counted_allreduce(self, process_group, bucket):
        buffer = _bucket_buffer(bucket)
        self._count(buffer.numel() * buffer.element_size(), buffer.numel() * buffer.element_size())
        return default_hooks.allreduce_hook(process_group, bucket)

    def _counted_bf16(self, process_group, bucket):
        buffer = _bucket_buffer(bucket)
        self._count(buffer.numel() * _BF16_BYTES, buffer.numel() * buffer.element_size())
        return default_hooks.bf16_compress_hook(process_group, bucket)

    def _counted_powersgd(self, state: powerSGD_hook.PowerSGDState, bucket: dist.GradBucket):
        buffer = bucket.buffer()
        numel, size = buffer.numel(), buffer.element_size()
        warming_up = state.iter < state.start_powerSGD_iter  # the test powerSGD_hook makes first
        before = state.total_numel_after_compression
        future = powerSGD_hook.powerSGD_hook(state, bucket)  # adds this bucket's elements before any allreduce
        sent = numel if warming_up else state.total_numel_after_compression - before
        self._count(sent * size, numel * size)
        return future

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        """Take the step, then publish the hook's counts since the previous step as `*_last_step`."""
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        calls, sent, uncompressed = self._pending
        self.hook_calls_last_step, self.bytes_sent_last_step, self.bytes_uncompressed_last_step = \
            calls, sent, uncompressed
        self.bytes_sent_total += sent
        self.bytes_uncompressed_total += uncompressed
        self._pending = [0, 0, 0]
        return out


class _HookCounts(StepCounters):
    """`CompressedDDPStrategy`'s counters: under a compression, the bytes its hook handed to allreduce in the last
    optimizer step and the bytes of the buckets, as the two `comm/bytes_*` scalars and for the epoch line."""

    def per_step_tags(self) -> list[str]:
        return [SENT, UNCOMPRESSED] if self.strategy.compression.kind != "none" else []

    def scalars(self) -> dict[str, float]:
        found = self.compression_bytes()
        return {SENT: float(found[1]), UNCOMPRESSED: float(found[2])} if found is not None else {}

    def compression_bytes(self) -> tuple[str, int, int] | None:
        strategy, spec = self.strategy, self.strategy.compression
        if spec.kind == "none" or not strategy.bytes_uncompressed_last_step:
            return None
        words = f"PowerSGD rank {spec.rank}" if spec.kind == "powersgd" else "bf16"
        return words, strategy.bytes_sent_last_step, strategy.bytes_uncompressed_last_step


# `trainer.strategy: ddp_bf16` / `ddp_powersgd` (DDP's defaults otherwise) work once this module is imported
StrategyRegistry.register("ddp_bf16", CompressedDDPStrategy, description="DDP with torch's bf16_compress_hook, "
                          "registered on the CPU too", compression=CompressionSpec("bf16"))
StrategyRegistry.register("ddp_powersgd", CompressedDDPStrategy, description="DDP with torch's powerSGD_hook, "
                          "registered on the CPU too", compression=CompressionSpec("powersgd"))
