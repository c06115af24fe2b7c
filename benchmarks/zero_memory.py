"""Memory of ResNet-18 at `zero_stage` 0, 1 and 2, measured per process, beside ZeRO's forecast.

    python -m benchmarks.zero_memory --processes 2 --k 1      # 2 processes x 1 replica (forked, gloo)
    python -m benchmarks.zero_memory --processes 1 --k 2      # 1 process x 2 replicas
    python -m benchmarks.zero_memory --model lenet --steps 3  # a quick look

Every setting trains in float32 with SGD (momentum 0.9), global batch `--batch`, for `--steps` optimizer steps,
stage 0, 1 and 2 each without and with `overlap`, after one fit that is not reported (a process's first fit also
loads kernels). The measure is the kernel's count of each process's resident memory (proc(5): `VmRSS`, and the peak
`VmHWM`, restarted with `/proc/self/clear_refs`), with glibc told to map every block of 64 KiB or more on its own
(mallopt(3), `large_blocks_mapped`), so that the resident set rises and falls with every tensor torch's CPU
allocator hands out and frees, in every thread, the exchange's too (torch's profiler, `profile_memory=True`, sees
the training thread only). Figures are over the resident set at the strategy's setup (glibc's free memory handed
back first, malloc_trim(3)), plus the model's parameters and buffers made before it; per process and setting, at
the last step:

- held: in use at the end of the step (after the optimizer step, before the next forward), once glibc has handed
  back the pages of the blocks freed (malloc_trim(3));
- peak of the step: the most in use from the start of backward (`on_before_backward`) to the end of the step:
  gradients, the exchange's buffers, the update, the parameters' all-gather and the activations backward frees;
- peak of a save: the most in use while `trainer.save_checkpoint` runs, on the fullest rank and (in brackets) the
  others;
- counted: what the strategy counts itself (`model_state_bytes`): every local replica's parameters and optimizer
  state, the gradients still held (replica 0's whole gradient at stages 0 and 1) and the kept receive buffers.
- sent (several processes): the bytes this process's TCP sockets sent in the last step, each once
  (`benchmarks.three_ways.tcp_bytes_sent`), read after a barrier at both ends: every message of gloo.

Beside them, ZeRO's per-device model state (`src.scaling.memory.model_state_bytes`, N = P x K devices). One process
per device (P x 1) compares directly; K replicas in one process share its memory, which holds their sum.
"""

import argparse
import ctypes
import gc
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning.pytorch as pl
import torch

from src.data.fashion_mnist import FashionMNISTDataModule
from src.data.synthetic import write_fashion_mnist
from src.models.classifier import LeNetClassifier, ResNet18Classifier
from src.scaling.memory import bytes_per_element, model_state_bytes
from src.strategies import ProcessStart, SplitAllreduceStrategy
from src.strategies.comm.allreduce import nbytes
from benchmarks.three_ways import tcp_bytes_sent

MIB = 2**20
# glibc maps every block of this many bytes or more on its own and unmaps it when freed, so the resident set rises and
# falls with each tensor (malloc(3), M_MMAP_THRESHOLD; set, it no longer adapts)
MMAP_THRESHOLD = 65536
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt(3)'s parameter numbers (glibc's malloc.h)
LIBC = ctypes.CDLL("libc.so.6")


@contextmanager
def large_blocks_mapped() -> Iterator[None]:
    """While the block runs glibc maps every block of `MMAP_THRESHOLD` bytes or more on its own (mallopt(3)), in
    this process and in the processes it forks, and returns the free top of its heap above 128 KiB (its default,
    which its own adaptation may have raised in a process that ran before); afterwards the thresholds its adaptation
    reaches at most (blocks of 32 MiB or more mapped, the heap trimmed above 64 MiB free), so that later work does
    not pay a mapping and its page faults for every tensor."""
    if LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or LIBC.mallopt(M_TRIM_THRESHOLD, 128 * 1024) != 1:
        raise RuntimeError("glibc refused mallopt: the resident set would not follow the tensors")
    try:
        yield
    finally:
        LIBC.mallopt(M_MMAP_THRESHOLD, 32 * MIB)
        LIBC.mallopt(M_TRIM_THRESHOLD, 64 * MIB)


def rss_bytes(field: str) -> int:
    """This process's resident set (`VmRSS`) or its peak since the last reset (`VmHWM`), bytes (/proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (a Linux kernel is needed)")


def reset_peak() -> None:
    """Start the kernel's peak of the resident set (`VmHWM`) again from the current size (proc(5), clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


class MemoryProbe(pl.Callback):
    """Reads the process's resident set at setup, at the end of the last step, and its kernel-tracked peak from the
    start of that step's backward to its end and during one checkpoint save; writes this rank's figures as JSON.

    An observer: it reads /proc and resets the kernel's peak counter, which changes nothing in the process, and the
    save is the one Lightning's ModelCheckpoint makes (`trainer.save_checkpoint`, here into a temporary folder).

    Args:
        report: Folder for rank<r>.json and the checkpoint.
        save_at: The step (1-based) after which the checkpoint is saved.
    """

    def __init__(self, report: Path, save_at: int) -> None:
        self.report, self.save_at = report, save_at
        self.figures: dict[str, int] = {}

    def setup(self, trainer, pl_module, stage) -> None:
        gc.collect()  # what an earlier fit left in reference cycles would be freed during this one
        LIBC.malloc_trim(0)  # and what glibc keeps free would be handed out again (malloc_trim(3))
        # the model's parameters and buffers were made before: what setup's resident set holds besides them is the
        # interpreter, the libraries and the data, which no stage changes
        model = sum(nbytes(t) for t in [*pl_module.parameters(), *pl_module.buffers()])
        self.figures["base"] = rss_bytes("VmRSS") - model

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.world_size > 1 and trainer.global_step == self.save_at:  # the last step starts
            self.figures["sent"] = -_sent_so_far()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        reset_peak()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.figures["step_peak"] = rss_bytes("VmHWM")
        # glibc keeps the pages of small blocks freed during the step (in a heap with holes, from work before, many
        # MiB): handed back first, what is left resident is what the process holds
        LIBC.malloc_trim(0)
        self.figures["held"] = rss_bytes("VmRSS")
        if "sent" in self.figures and trainer.global_step == self.save_at + 1:
            self.figures["sent"] += _sent_so_far()
        if trainer.global_step == self.save_at:
            reset_peak()
            trainer.save_checkpoint(self.report / f"step{self.save_at}.ckpt")
            self.figures["save_peak"] = rss_bytes("VmHWM")
            (self.report / f"step{self.save_at}.ckpt").unlink(missing_ok=True)
        self.figures["counted"] = _counted(trainer.strategy)

    def on_train_end(self, trainer, pl_module) -> None:
        base = self.figures.pop("base")
        out = {key: value - base for key, value in self.figures.items() if key not in ("counted", "sent")}
        out.update({key: self.figures[key] for key in ("counted", "sent") if key in self.figures})
        (self.report / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


def _sent_so_far() -> int:
    """Bytes this process's TCP sockets have sent (`benchmarks.three_ways.tcp_bytes_sent`), read once every process
    has received all that was sent before: after a barrier, which a process enters only once its collectives are
    done. A send returns once its bytes are in the socket's buffer, so without it bytes sent before (a save's
    gathering to rank 0) would be counted when they leave."""
    torch.distributed.barrier()
    return tcp_bytes_sent(os.getpid())


def _counted(strategy: SplitAllreduceStrategy) -> int:
    """What this process holds between steps by the strategy's own count (`model_state_bytes`): every local replica's
    parameters and optimizer state, replica 0's whole gradient at stages 0 and 1 (kept until the next step's
    `zero_grad`; stage 2 drops its partition's after the update), and the receive buffers kept between processes."""
    held = strategy.model_state_bytes()
    grads = held[0]["gradients_at_update"] if strategy.zero_stage < 2 else 0
    return sum(r["parameters"] + r["optimizer_state"] + r["exchange_buffers"] for r in held) + grads


def measure(args: argparse.Namespace, root: str, stage: int, overlap: bool) -> dict[str, int]:
    """One fit at `stage`: the figures of the fullest process, and the save's peak on the ranks other than 0 (bytes)."""
    pl.seed_everything(0, verbose=False)
    with tempfile.TemporaryDirectory(prefix="zero-memory-") as report:  # the ranks' JSON, removed once read
        ranks = _fit(args, root, stage, overlap, Path(report))
    fullest = {key: max(r[key] for r in ranks) for key in ranks[0]}
    # a partitioned save builds the whole optimizer state on rank 0 only: the other ranks' peak, apart
    return {**fullest, "save_peak_others": max((r["save_peak"] for r in ranks[1:]), default=0)}


def _fit(args: argparse.Namespace, root: str, stage: int, overlap: bool, report: Path) -> list[dict[str, int]]:
    """The fit of `measure`, its probe writing each rank's figures to `report`: those figures, by rank."""
    probe = MemoryProbe(report, save_at=args.steps - 1)
    strategy = SplitAllreduceStrategy(devices=["cpu"] * args.k, zero_stage=stage, overlap=overlap,
                                      bucket_cap_mb=args.bucket_cap_mb,
                                      processes=ProcessStart("gloo", start_method="fork"))
    model = (ResNet18Classifier if args.model == "resnet18" else LeNetClassifier)(lr=0.01, momentum=0.9)
    trainer = pl.Trainer(accelerator="cpu", devices=args.processes, strategy=strategy, max_steps=args.steps,
                         limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[probe])
    trainer.fit(model, FashionMNISTDataModule(root, batch_size=args.batch, val_size=16, download=False))
    return [json.loads((report / f"rank{r}.json").read_text()) for r in range(args.processes)]


def measure_stages(args: argparse.Namespace, root: str, settings: list[tuple[int, bool]]) -> list[dict]:
    """One fit that is not reported (a process's first fit also loads kernels and starts threads), then one for each
    (zero_stage, overlap) of `settings`: their rows of figures (bytes), in that order. Call it under
    `large_blocks_mapped()`, so that the resident set follows the tensors."""
    measure(args, root, 0, False)
    return [{"stage": stage, "overlap": overlap, **measure(args, root, stage, overlap)} for stage, overlap in settings]


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2, help="P, processes (forked, gloo)")
    parser.add_argument("--k", type=int, default=1, help="K, replicas per process")
    parser.add_argument("--model", choices=["resnet18", "lenet"], default="resnet18")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per fit (the save follows the "
                                                              "second to last, the figures are the last's)")
    parser.add_argument("--batch", type=int, default=32, help="global batch")
    parser.add_argument("--bucket_cap_mb", type=float, default=25.0, help="bucket size (MiB), as the strategy's")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2], choices=[0, 1, 2],
                        help="zero_stage values, the first the baseline of the saved columns")
    parser.add_argument("--overlap", choices=["both", "off", "on"], default="both", help="overlap: false, true or both")
    parser.add_argument("--json", help="also write the rows (bytes) to this file")
    args = parser.parse_args()
    psi = sum(p.numel() for p in (ResNet18Classifier if args.model == "resnet18" else LeNetClassifier)().parameters())
    sizes, n = bytes_per_element("sgd_momentum", "fp32"), args.processes * args.k
    forecast = {s: model_state_bytes(psi, n, s, sizes) for s in (0, 1, 2)}
    print(f"{args.model}, {psi:,} parameters, float32, SGD momentum; {args.processes} x {args.k}, global batch "
          f"{args.batch}, {args.steps} steps; MiB per process (the fullest); forecast: ZeRO's per device, N = {n}; "
          f"saved: against stage {args.stages[0]}")
    print("| stage | overlap | held | peak of the step | peak of a save (other ranks) | counted | forecast "
          "| held saved | step peak saved | forecast saved | sent in the step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    settings = [(stage, overlap) for stage in args.stages
                for overlap in {"both": (False, True), "off": (False,), "on": (True,)}[args.overlap]]
    with tempfile.TemporaryDirectory(prefix="fmnist-zero-memory-") as root, large_blocks_mapped():
        write_fashion_mnist(Path(root) / "FashionMNIST" / "raw", n_train=args.batch * args.steps + 16, n_test=16)
        rows = measure_stages(args, root, settings)
    base = {}
    for row in rows:
        stage, overlap, m = row["stage"], row["overlap"], row
        b = base.setdefault(overlap, m)  # the first stage given is the baseline
        row["forecast"] = forecast[stage]
        print(f"| {stage} | {overlap} | {m['held'] / MIB:.1f} | {m['step_peak'] / MIB:.1f} | "
              f"{m['save_peak'] / MIB:.1f} ({m['save_peak_others'] / MIB:.1f}) | {m['counted'] / MIB:.1f} | "
              f"{forecast[stage] / MIB:.1f} | "
              f"{(b['held'] - m['held']) / MIB:.1f} | {(b['step_peak'] - m['step_peak']) / MIB:.1f} | "
              f"{(forecast[args.stages[0]] - forecast[stage]) / MIB:.1f} | {m.get('sent', 0) / MIB:.2f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
