"""Gradient compression for the exchange between processes: send fewer bits (bf16) or a low-rank approximation
with error feedback (PowerSGD).

Where it applies: to each bucket's exchange between processes, after the process's own replicas have summed it
on replica 0 (`src.strategies.comm.gradient_exchange.allreduce_bucket_`). Replicas in one process share a host's memory
or a GPU box's links, where bytes are cheap and every approximation would cost accuracy for nothing, so the
exchange among them stays exact.

The exchange sums (the loss is weighted by n_k / N before backward, so the sum of the gradients is the global
batch's mean gradient); every formula below is written for sums.

PowerSGD (Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019, https://arxiv.org/abs/1905.13727, Algorithm 1 with error feedback), per gradient
of a parameter with at least two dimensions, viewed as a matrix M of shape (n, m) = (shape[0], prod(shape[1:]))
(a conv weight (out, in, kh, kw) is (out, in·kh·kw)), at rank r:

1. M += e, this process's error memory from the last step (error feedback);
2. P = M Q, (n, r), with Q (m, r) the last step's summed Q (warm start) or a fresh Gaussian one, the same on
   every process;
3. allreduce P (sum), together with the bucket's tensors that are sent as they are;
4. orthogonalise P's columns (Gram-Schmidt);
5. Q = Mᵀ P, (m, r); allreduce Q (sum);
6. the approximation of the sum is P Qᵀ (n, m) = P Pᵀ Σ_i M_i, the sum projected on P's columns;
7. e = M - P Qᵀ / W for W processes, so that the errors of all processes add up to exactly what the
   approximation left out of the sum.

Every step after 1 is linear in Σ_i M_i, so the result depends on the processes' errors only through their sum:
a resume on another number of processes may put that sum on one process (`CompressionState`). The sums of P and
Q are bitwise the same on every process (`src.strategies.comm.process_allreduce`), so is everything computed
from them, and every replica keeps identical weights. Tensors that are not matrices (biases, BatchNorm weights)
and matrices that would shrink by less than `min_compression_rate` are sent as they are, as torch's
`powerSGD_hook` does (https://pytorch.org/docs/stable/ddp_comm_hooks.html).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from src.strategies.comm.hierarchical import BetweenProcesses
from src.strategies.comm.exchange_names import COMPRESSIONS, check_choice, compression_tag
from src.strategies.comm.powersgd_sizes import compressed_rank, matrix_shape, powersgd_problems
from src.timeline.labels import phase, recording


def orthogonalize_(p: Tensor) -> None:
    """Gram-Schmidt on the columns of p (n, r), in place: orthonormal columns spanning the same space.

    A column that is zero (or becomes zero: p of rank below r) stays zero instead of turning into NaN.
    """
    tiny = torch.finfo(p.dtype).tiny
    for i in range(p.shape[1]):
        col = p[:, i:i + 1]
        col /= torch.linalg.vector_norm(col).clamp_min(tiny)
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1:]
            rest -= col * (col.T @ rest)


class _Compression:
    """What both compressions share: the optimizer step count and the bytes of the current step.

    Args:
        wire_bytes: Bytes this process sends to allreduce a buffer of (numel, element size in bytes) between the
            processes uncompressed (0 when the implementation does not say, as with `dist.all_reduce`).
    """

    name = "none"

    def __init__(self, wire_bytes: Callable[[int, int], int]) -> None:
        self.wire_bytes = wire_bytes
        self.steps = 0  # optimizer steps begun, this one included
        self.bytes_sent = 0  # this process, this step, between processes
        self.bytes_uncompressed = 0  # what the same buckets would have sent uncompressed

    def begin_step(self) -> None:
        """Count the optimizer step whose gradients the next exchanges carry; its byte counts start at 0."""
        self.steps += 1
        self.bytes_sent = self.bytes_uncompressed = 0

    def allreduce_(self, flat: Tensor, param_ids: Sequence[int], shapes: Sequence[torch.Size],
                   between: BetweenProcesses) -> int:
        """Replace `flat` (N,), the concatenated gradients of the parameters `param_ids` (indices into replica 0's
        parameter list) with `shapes`, by the (approximate) sum over the processes, in place.

        Returns:
            Bytes this process sent (0 when `between` does not say); also added to `bytes_sent`.
        """
        raw = self.wire_bytes(flat.numel(), flat.element_size())
        # the span's name is worked out only while a step timeline records (`phase` ignores it otherwise)
        label = f"allreduce {self.name}: {self._planned_bytes(flat, shapes):,} of {raw:,} bytes" if recording() else ""
        with phase(label):
            sent = self._allreduce_(flat, param_ids, shapes, between)
        self.bytes_sent += sent
        self.bytes_uncompressed += raw
        return sent

    def _planned_bytes(self, flat: Tensor, shapes: Sequence[torch.Size]) -> int:
        raise NotImplementedError

    def _allreduce_(self, flat: Tensor, param_ids: Sequence[int], shapes: Sequence[torch.Size],
                    between: BetweenProcesses) -> int:
        raise NotImplementedError


class Bf16Compression(_Compression):
    """Send every bucket in bfloat16 and sum it there, then cast back: half the bytes of float32, a quarter of
    float64 (Horovod's `Compression.fp16`, torch's `bf16_compress_hook`, in bfloat16 for its float32 range).

    Args:
        wire_bytes: See `_Compression`.
    """

    name = "bf16"

    def _planned_bytes(self, flat: Tensor, shapes: Sequence[torch.Size]) -> int:
        return self.wire_bytes(flat.numel(), 2)

    def _allreduce_(self, flat: Tensor, param_ids: Sequence[int], shapes: Sequence[torch.Size],
                    between: BetweenProcesses) -> int:
        low = flat.to(torch.bfloat16)
        sent = between(low) or 0
        flat.copy_(low)
        return sent

    def state_dict(self) -> dict:
        """The method and the step count (bf16 keeps nothing else)."""
        return {"method": self.name, "steps": self.steps}

    def load_state_dict(self, state: dict, errors: dict[int, Tensor] | None) -> None:
        """Take the step count of `state`."""
        self.steps = int(state["steps"])


class PowerSGDCompression(_Compression):
    """PowerSGD at rank `rank` with error feedback and warm start (the module's docstring gives the steps).

    Args:
        rank: r, the rank of each approximation (>= 1).
        warmup_steps: Optimizer steps exchanged exactly before compression starts (the error memory starts then).
        error_feedback: Keep what the approximation left out and add it to the next step's gradient.
        warm_start: Start each step's power iteration from the last step's Q instead of a fresh random one.
        min_compression_rate: Compress a matrix only if it shrinks by more than this factor.
        world_size: W, the number of processes exchanging.
        wire_bytes: See `_Compression`.
        seed: Seeds the random Q (the same on every process, through a generator of its own: the global random
            state is left alone).

    The settings are checked once, by the `CompressionSpec` that makes it.
    """

    name = "powersgd"

    def __init__(self, rank: int, warmup_steps: int, error_feedback: bool, warm_start: bool,
                 min_compression_rate: float, world_size: int, wire_bytes: Callable[[int, int], int],
                 seed: int = 0) -> None:
        super().__init__(wire_bytes)
        self.rank, self.warmup_steps, self.seed = rank, warmup_steps, seed
        self.error_feedback, self.warm_start = error_feedback, warm_start
        self.min_compression_rate, self.world_size = min_compression_rate, world_size
        self.q: dict[int, Tensor] = {}  # per parameter index: the last summed Q (m, r)
        self.errors: dict[int, Tensor] = {}  # per parameter index: this process's error memory (n, m)

    @property
    def compressing(self) -> bool:
        """Whether the current step compresses (warm-up over)."""
        return self.steps > self.warmup_steps

    def _planned_bytes(self, flat: Tensor, shapes: Sequence[torch.Size]) -> int:
        if not self.compressing:
            return self.wire_bytes(flat.numel(), flat.element_size())
        first = second = 0
        for s in shapes:
            r = compressed_rank(s, self.rank, self.min_compression_rate)
            n, m = matrix_shape(s) if r else (s.numel(), 0)
            first += n * (r or 1)
            second += m * r
        return sum(self.wire_bytes(x, flat.element_size()) for x in (first, second) if x)

    def _allreduce_(self, flat: Tensor, param_ids: Sequence[int], shapes: Sequence[torch.Size],
                    between: BetweenProcesses) -> int:
        if not self.compressing:
            return between(flat) or 0
        grads = [g.view(s) for g, s in zip(flat.split([s.numel() for s in shapes]), shapes)]
        ranks = [compressed_rank(s, self.rank, self.min_compression_rate) for s in shapes]
        plain = [g for g, r in zip(grads, ranks) if not r]
        compressed, matrices, ps, qs = [], [], [], []  # (parameter index, its gradient), M, P, Q per matrix
        for i, g, r in zip(param_ids, grads, ranks):
            if not r:
                continue
            m = g.reshape(g.shape[0], -1)
            if self.error_feedback and i in self.errors:
                m = m + self.errors[i]
            q = self._start_q(i, m.shape[1], r, m)
            compressed.append((i, g))
            matrices.append(m)
            ps.append(m @ q)
            qs.append(q)
        first = torch.cat([t.reshape(-1) for t in plain + ps]) if plain or ps else flat.new_zeros(0)
        sent = (between(first) or 0) if first.numel() else 0
        offset = 0
        for t in plain + ps:  # the plain gradients back into the bucket, the P's summed
            t.copy_(first[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        for k, (p, m) in enumerate(zip(ps, matrices)):
            orthogonalize_(p)
            qs[k] = m.T @ p
        if qs:
            second = torch.cat([q.reshape(-1) for q in qs])
            sent += between(second) or 0
            offset = 0
            for k, q in enumerate(qs):
                qs[k] = second[offset:offset + q.numel()].view_as(q).clone()
                offset += q.numel()
        for (i, g), m, p, q in zip(compressed, matrices, ps, qs):
            approx = p @ q.T
            if self.error_feedback:
                self.errors[i] = m - approx / self.world_size
            g.copy_(approx.view_as(g))
            if self.warm_start:
                self.q[i] = q
        return sent

    def _start_q(self, i: int, m: int, r: int, like: Tensor) -> Tensor:
        """Q (m, r) to start parameter i's power iteration from: the last summed one (warm start), else Gaussian
        from a generator seeded by (seed, parameter, step), so every process draws the same."""
        if self.warm_start and i in self.q:
            return self.q[i]
        step = 0 if self.warm_start else self.steps
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + i) * 1_000_033 + step)
        q = torch.randn(m, r, generator=generator, dtype=like.dtype).to(like.device)
        orthogonalize_(q)
        return q

    def state_dict(self) -> dict:
        """What a resume needs besides the error memory (which differs per process): method, rank, steps, Q's."""
        return {"method": self.name, "rank": self.rank, "steps": self.steps, "q": dict(self.q)}

    def load_state_dict(self, state: dict, errors: dict[int, Tensor] | None) -> None:
        """Take the step count and Q's of `state` and this process's error memory `errors` (None: zeros)."""
        self.steps = int(state["steps"])
        self.q = {int(i): q for i, q in state.get("q", {}).items()}
        self.errors = {int(i): e for i, e in (errors or {}).items()}


Compression = Bf16Compression | PowerSGDCompression


@dataclass(frozen=True)
class CompressionSpec:
    """How gradients travel between processes: one option group, `compression: {kind: powersgd, rank: 2}` in YAML,
    the same for ours and for the DDP overlay (`CompressedDDPStrategy`). Checked once when it is made; `make`
    builds the compression at setup, when the world size and the exchange between processes are known.

    Args:
        kind: "none" (exactly), "bf16" (sent and summed in bfloat16) or "powersgd" (a rank-`rank` approximation
            with error feedback; Vogels et al., NeurIPS 2019, https://arxiv.org/abs/1905.13727).
        rank: PowerSGD's rank r: a gradient matrix (n, m) travels as n·r + m·r numbers.
        warmup_steps: Optimizer steps exchanged exactly before PowerSGD starts.
        error_feedback: PowerSGD keeps what each approximation left out and adds it to the next gradient.
        warm_start: PowerSGD starts each step's power iteration from the last step's Q.
        min_compression_rate: PowerSGD compresses a matrix only if it shrinks by more than this factor (biases and
            other vectors always travel as they are); any number > 0, as torch's hook takes.

    Raises:
        ValueError: An unknown kind, or bad PowerSGD settings with "powersgd".
    """

    kind: Literal[COMPRESSIONS] = "none"
    rank: int = 2
    warmup_steps: int = 1000
    error_feedback: bool = True
    warm_start: bool = True
    min_compression_rate: float = 2.0

    def __post_init__(self) -> None:
        check_choice("compression.kind", self.kind, COMPRESSIONS)
        if self.kind == "powersgd":
            problems = powersgd_problems(self.rank, self.warmup_steps, self.min_compression_rate)
            if problems:
                raise ValueError("; ".join(problems))

    @property
    def tag(self) -> str:
        """How run names and HPARAMS name it: "none", "bf16", "powersgd-r<rank>"."""
        return compression_tag(self.kind, self.rank)

    def make(self, world_size: int, wire_bytes: Callable[[int, int], int], seed: int = 0) -> Compression | None:
        """The compression for `world_size` processes whose uncompressed exchange sends `wire_bytes(numel,
        element_size)` bytes ("none": None)."""
        if self.kind == "bf16":
            return Bf16Compression(wire_bytes)
        if self.kind == "powersgd":
            return PowerSGDCompression(self.rank, self.warmup_steps, self.error_feedback, self.warm_start,
                                       self.min_compression_rate, world_size, wire_bytes, seed)
        return None
