"""Host work of a training step on the CPU: the application and ours against the loops they stand on.

    python -m benchmarks.host_work                          # batches 2 and 8, 5 alternated rounds
    python -m benchmarks.host_work --batches 2 --rounds 3 --timed 50

At a tiny batch LeNet's arithmetic is small, so a step's time is mostly what the host does around it: Lightning's
loop, the application's metrics, callbacks and checks, ours' split, copies and exchange. Host work does not depend
on the device, so what shows here shows on a GPU too. Five rows, each ms per optimizer step over the steps
[warmup, warmup + timed), one intra-op thread, LeNet with the shipped recipe (configs/lenet.yaml), batches made once:

- bare: forward, loss, backward and SGD step in a Python loop, one replica;
- plain Lightning: the same network, loss and optimizer in a bare LightningModule with no logging, metrics, checks
  or callbacks, run by Lightning's Trainer (`plain_step`: what Lightning's loop costs by itself, its closure, hook
  dispatch and precision plugin);
- the app: `python -m src.cli fit --config configs/lenet.yaml` in this process, on synthetic IDX files;
- the seed loop: the d2l.ai "Training on Multiple GPUs" `train_batch` written plainly on 2 replicas: split the batch,
  forward each replica on its shard, one backward of the shards' weighted losses, add replica 1's gradients into
  replica 0's, step replica 0, copy its parameters to replica 1;
- ours 1 x 2: the app with `configs/strategy/split_allreduce.yaml`;
- the app, no step saves: the app with the recipe's mid-epoch saves of last.ckpt turned off (LastCheckpoint's
  `every_n_train_steps: 0`, a copy of configs/lenet.yaml), to show what those saves (every 50 steps) cost a step.

Every round runs every row once per batch, in an order that rotates from round to round, and the table gives each
row's median over the rounds, with two ratios: the app / plain Lightning, and what a second replica adds under
ours ((ours 1 x 2 - the app) / (the seed loop - bare)). Machines here are shared: compare the ratios of one run.
`benchmarks.gpu_speed` and `benchmarks.lenet_epoch` use the loops' shared parts: `recipe_sgd` (the optimizer of a
config's recipe), `resident_batches` (random batches made once on the device) and `plain_step` (also on a GPU).
"""

import argparse
import contextlib
import copy
import importlib
import io
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import torch
import yaml
from torch import nn

from src.models import LeNet, init_weights

WARMUP, TIMED = 30, 100  # steps before the timed window, steps in it


def recipe_sgd(net: nn.Module, recipe: dict, lr: float) -> torch.optim.SGD:
    """SGD as `ImageClassifier.configure_optimizers` builds it: weight decay on weights, none on biases and
    BatchNorm's affine parameters (ndim <= 1), the recipe's momentum and Nesterov flag, and torch's fused
    implementation where the recipe sets `fused_optimizer` (so the loops compared with the app run its optimizer).

    Args:
        net: The network whose parameters are trained.
        recipe: A config's model init_args (weight_decay, momentum, nesterov).
        lr: The learning rate (constant: a schedule costs the loops nothing).
    """
    decay = [p for p in net.parameters() if p.ndim > 1]
    no_decay = [p for p in net.parameters() if p.ndim <= 1]
    return torch.optim.SGD([{"params": decay, "weight_decay": recipe["weight_decay"]},
                            {"params": no_decay, "weight_decay": 0.0}], lr=lr, momentum=recipe["momentum"],
                           nesterov=recipe["nesterov"], fused=True if recipe.get("fused_optimizer") else None)


def resident_batches(batch: int, device: torch.device | str, count: int = 8) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`count` random batches already on `device`: images x (batch, 1, 28, 28) float32 channels_last, and labels
    (count, batch) int64 in [0, 10)."""
    xs = [torch.randn(batch, 1, 28, 28, device=device).contiguous(memory_format=torch.channels_last)
          for _ in range(count)]
    return xs, torch.randint(0, 10, (count, batch), device=device)


class _Plain(pl.LightningModule):
    def __init__(self, net: nn.Module, recipe: dict, run: nn.Module) -> None:
        super().__init__()
        self.net, self.recipe, self.run = net, recipe, run
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=recipe["label_smoothing"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_fn(self.run(x), y)

    def configure_optimizers(self):
        return recipe_sgd(self.net, self.recipe, lr=0.01)


class _Batches:
    """The batches as one iterable (Lightning reads a list as several dataloaders)."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class _PlainWindow(pl.Callback):
    """Seconds of steps [warmup, warmup + timed), the device drained at the two ends only."""

    def __init__(self, device: torch.device, warmup: int, timed: int) -> None:
        self.device, self.warmup, self.timed, self.seconds, self._t0 = device, warmup, timed, float("nan"), 0.0

    def _drain(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup:
            self._drain()
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup + self.timed:
            self._drain()
            self.seconds = time.perf_counter() - self._t0
            trainer.should_stop = True


def plain_step(net: nn.Module, recipe: dict, batch: int, precision: str, compile_mode: str | None = None,
               device: str = "cuda", warmup: int = WARMUP, timed: int = TIMED) -> float:
    """ms per step of `net` trained by Lightning's Trainer with nothing but the loss and the optimizer, over steps
    [warmup, warmup + timed).

    Args:
        net: The network, x (B, 1, 28, 28) -> logits (B, 10); moved to `device` and to channels_last.
        recipe: The config's model init_args (momentum, nesterov, weight_decay, label_smoothing).
        batch: Images per step; the batches are random, made once, already on the device.
        precision: Lightning's precision ("32-true", "bf16-mixed", ...).
        compile_mode: None for eager, else the `torch.compile` mode of the network, as the application's.
        device: "cuda" or "cpu".
    """
    torch.manual_seed(0)
    dev = torch.device(device)
    net = net.to(dev).to(memory_format=torch.channels_last)
    run = net if compile_mode is None else torch.compile(net, mode=compile_mode, dynamic=False)
    xs, ys = resident_batches(batch, dev)
    steps = warmup + timed + 1
    batches = [(xs[i % 8], ys[i % 8]) for i in range(steps)]
    window = _PlainWindow(dev, warmup, timed)
    trainer = pl.Trainer(accelerator="gpu" if dev.type == "cuda" else "cpu", devices=1, precision=precision,
                         max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[window], num_sanity_val_steps=0)
    trainer.fit(_Plain(net, recipe, run), train_dataloaders=_Batches(batches))
    return window.seconds / timed * 1e3


ROWS = ("bare", "plain Lightning", "the app", "seed loop, 2 replicas", "ours 1 x 2", "the app, no step saves")


class Window(pl.Callback):
    """Seconds of the training steps [WARMUP, WARMUP + TIMED) of a CLI fit; stops the fit at the window's end.

    The CLI builds it by class path, so its settings are class attributes (set by `app_step`)."""

    WARMUP, TIMED = WARMUP, TIMED
    seconds = float("nan")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == type(self).WARMUP:
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == type(self).WARMUP + type(self).TIMED:  # counts this batch's step already
            type(self).seconds = time.perf_counter() - self._t0
            trainer.should_stop = True


def _recipe() -> dict:
    return yaml.safe_load(open("configs/lenet.yaml"))["model"]["init_args"]


def _lenet(recipe: dict) -> nn.Module:
    torch.manual_seed(0)
    net = LeNet()
    init_weights(net, recipe["init"])
    return net.to(memory_format=torch.channels_last)


def _timed_loop(step: Callable[[int], None], warmup: int, timed: int) -> float:
    """ms per call of `step(i)` over calls [warmup, warmup + timed)."""
    for i in range(warmup):
        step(i)
    t0 = time.perf_counter()
    for i in range(warmup, warmup + timed):
        step(i)
    return (time.perf_counter() - t0) / timed * 1e3


def bare_step(batch: int, warmup: int, timed: int) -> float:
    """ms per step of the bare loop: one replica's forward, loss, backward and SGD step on resident batches."""
    recipe = _recipe()
    net = _lenet(recipe)
    opt = recipe_sgd(net, recipe, lr=0.01)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=recipe["label_smoothing"])
    xs, ys = resident_batches(batch, "cpu")

    def step(i: int) -> None:
        loss = loss_fn(net(xs[i % 8]), ys[i % 8])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return _timed_loop(step, warmup, timed)


def seed_loop_step(batch: int, warmup: int, timed: int) -> float:
    """ms per step of the d2l.ai 2-replica `train_batch` written plainly (see the module's docstring): the shards'
    losses, each a mean over its shard, weighted by shard size so that their sum is the global batch's mean."""
    recipe = _recipe()
    replicas = [_lenet(recipe)]
    replicas.append(copy.deepcopy(replicas[0]))
    opt = recipe_sgd(replicas[0], recipe, lr=0.01)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=recipe["label_smoothing"])
    xs, ys = resident_batches(batch, "cpu")
    params = [list(r.parameters()) for r in replicas]

    def step(i: int) -> None:
        x, y = xs[i % 8], ys[i % 8]
        shards = list(zip(x.chunk(2), y.chunk(2)))
        loss = sum(loss_fn(net(xk), yk) * (len(yk) / len(y)) for net, (xk, yk) in zip(replicas, shards))
        opt.zero_grad(set_to_none=True)
        for p in params[1]:
            p.grad = None
        loss.backward()
        with torch.no_grad():
            torch._foreach_add_([p.grad for p in params[0]], [p.grad for p in params[1]])
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(params[1], params[0])

    return _timed_loop(step, warmup, timed)


def app_step(batch: int, warmup: int, timed: int, root: str, overlay: list[str],
             config: str = "configs/lenet.yaml") -> float:
    """ms per step of a real CLI fit of `config` (plus `overlay`) at global batch `batch`, one thread, no validation,
    its output silenced."""
    from src.cli import main as cli_main

    # the class as the CLI imports it by its path: under `python -m` this file is also `__main__`, whose Window is
    # another class object
    window = importlib.import_module("benchmarks.host_work").Window
    window.WARMUP, window.TIMED, window.seconds = warmup, timed, float("nan")
    with tempfile.TemporaryDirectory(prefix="host-work-logs-") as logs, \
            contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        cli_main(["fit", "--config", config, *overlay, "--threads", "1",
                  "--data.data_dir", root, "--data.download", "false", "--data.batch_size", str(batch),
                  "--trainer.max_steps", str(warmup + timed + 1), "--trainer.limit_val_batches", "0",
                  "--trainer.enable_progress_bar", "false", "--test_after_fit", "false",
                  "--trainer.logger.init_args.save_dir", logs, "--trainer.callbacks+=benchmarks.host_work.Window"])
    return window.seconds / timed * 1e3


def _last_checkpoint(config: dict) -> dict:
    """The init_args of a config's LastCheckpoint (the recipe's saves of last.ckpt), as a part of `config`."""
    return next(c["init_args"] for c in config["trainer"]["callbacks+"]
                if c["class_path"] == "src.callbacks.LastCheckpoint")


def _no_step_saves(folder: str) -> str:
    """A copy of configs/lenet.yaml in `folder` whose LastCheckpoint saves at epoch ends only; its path."""
    config = yaml.safe_load(open("configs/lenet.yaml"))
    _last_checkpoint(config)["every_n_train_steps"] = 0
    path = Path(folder) / "lenet-no-step-saves.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def measure(batches: list[int], rounds: int, warmup: int, timed: int, root: str) -> dict[int, dict[str, list[float]]]:
    """ms per step of every row at every batch, `rounds` times, the rows' order rotated each round."""
    recipe = _recipe()
    no_step_saves = _no_step_saves(root)
    rows: dict[str, Callable[[int], float]] = {
        "bare": lambda b: bare_step(b, warmup, timed),
        "plain Lightning": lambda b: _plain(recipe, b, warmup, timed),
        "the app": lambda b: app_step(b, warmup, timed, root, []),
        "seed loop, 2 replicas": lambda b: seed_loop_step(b, warmup, timed),
        "ours 1 x 2": lambda b: app_step(b, warmup, timed, root,
                                         ["--config", "configs/strategy/split_allreduce.yaml"]),
        "the app, no step saves": lambda b: app_step(b, warmup, timed, root, [], config=no_step_saves),
    }
    times: dict[int, dict[str, list[float]]] = {b: {name: [] for name in ROWS} for b in batches}
    for r in range(rounds):
        order = ROWS[r % len(ROWS):] + ROWS[:r % len(ROWS)]
        for b in batches:
            for name in order:
                torch.set_num_threads(1)  # the app sets its own (--threads 1); the loops take it from here
                times[b][name].append(rows[name](b))
    return times


def _plain(recipe: dict, batch: int, warmup: int, timed: int) -> float:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return plain_step(_lenet(recipe), recipe, batch, "32-true", device="cpu", warmup=warmup, timed=timed)


#: the per-step hooks Lightning calls on every callback of a training step, with their arguments after (trainer, module)
_STEP_HOOKS = {"on_train_batch_start": (None, 0), "on_before_backward": (None,), "on_after_backward": (),
               "on_before_optimizer_step": (None,), "on_before_zero_grad": (None,),
               "on_train_batch_end": (None, None, 0)}


def _us_per_call(fn: Callable[[], object], calls: int = 2000, repeats: int = 5) -> float:
    """Microseconds per call of `fn`: the fastest of `repeats` timings of `calls` calls (noise only adds time)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def _dispatch_us(extra: int, profiler: pl.profilers.Profiler | None = None) -> float:
    """µs per step that Lightning's callback dispatch spends on `extra` callbacks with no per-step hook of their own
    (each of the six per-step hooks is called on each, as Lightning calls every hook on every callback), under
    `profiler` (default: the app's, `NoProfiler`; Lightning's own default is `PassThroughProfiler()`)."""
    from lightning.pytorch.trainer import call

    from src.run.lightning_compat import NoProfiler

    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, profiler=profiler or NoProfiler())
    module = pl.LightningModule()
    trainer.strategy._lightning_module, module.trainer = module, trainer  # a module to dispatch to, as in a fit

    def step(callbacks: list) -> Callable[[], None]:
        def run() -> None:
            trainer.callbacks = callbacks
            for hook, args in _STEP_HOOKS.items():
                call._call_callback_hooks(trainer, hook, *args)
        return run

    return _us_per_call(step([pl.Callback() for _ in range(extra + 1)])) - _us_per_call(step([pl.Callback()]))


def parts(batch: int) -> list[tuple[str, float]]:
    """(part, µs per step) of what the app's step does beyond plain Lightning's, each timed alone on the CPU, one
    thread: the dispatch of a callback with no per-step work, the training metrics' updates, the non-finite watch,
    one batch of the app's loader and its normalisation, the lr schedule's step, and last.ckpt's save (once every
    `configs/lenet.yaml`'s 50 steps) spread over the steps."""
    from src.data.fashion_mnist import MEAN, STD
    from src.data.loader import GlobalBatchSampler, TensorBatchLoader
    from src.models.classifier import LeNetClassifier, _warmup_then
    from src.run.checkpoints import AtomicCheckpointIO

    torch.manual_seed(0)
    module = LeNetClassifier(**_recipe())
    logits, y, loss = torch.randn(batch, 10), torch.randint(0, 10, (batch,)), torch.tensor(2.3)
    images, labels = torch.randint(0, 256, (4096, 28, 28), dtype=torch.uint8), torch.randint(0, 10, (4096,))
    loader = TensorBatchLoader(images, labels, GlobalBatchSampler(len(labels), batch, shuffle=True, drop_last=True))
    batches = iter(())

    def one_batch() -> None:
        nonlocal batches
        try:
            x, _ = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, _ = next(batches)
        x.unsqueeze(1).float().div_(255.0).sub_(MEAN).div_(STD)

    opt = recipe_sgd(module.net, _recipe(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_then(1000, 10**6, cosine=True))  # the recipe's shape
    module.loss_fn(module.net(torch.randn(2, 1, 28, 28)), torch.zeros(2, dtype=torch.long)).backward()
    opt.step()
    checkpoint = {"state_dict": module.state_dict(), "optimizer_states": [opt.state_dict()],
                  "lr_schedulers": [sched.state_dict()], "hyper_parameters": dict(module.hparams)}
    every = _last_checkpoint(yaml.safe_load(open("configs/lenet.yaml")))["every_n_train_steps"]
    with tempfile.TemporaryDirectory(prefix="host-work-ckpt-") as folder:
        io_ = AtomicCheckpointIO()
        save_ms = _us_per_call(lambda: io_.save_checkpoint(checkpoint, Path(folder) / "last.ckpt"), calls=10) / 1e3

    return [("Lightning's dispatch of 1 callback that has no per-step hook", _dispatch_us(6) / 6),
            ("the training metrics' update (train/acc, train/loss_epoch)",
             _us_per_call(lambda: module.train_totals.update(logits, y, loss))),
            ("the non-finite watch of the loss", _us_per_call(lambda: module._nonfinite.watch(loss, 0, 0, 0))),
            ("a batch of the app's loader, normalised", _us_per_call(one_batch)),
            ("the lr schedule's step", _us_per_call(sched.step)),
            (f"writing last.ckpt ({save_ms:.1f} ms) once every {every} steps", save_ms * 1e3 / every)]


def table(times: dict[int, dict[str, list[float]]]) -> list[str]:
    """The markdown table: each row's median ms per step at each batch, then the two ratios."""
    batches = list(times)
    med = {b: {name: statistics.median(v) for name, v in times[b].items()} for b in batches}
    lines = ["| ms/step | " + " | ".join(f"batch {b}" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]
    lines += [f"| {name} | " + " | ".join(f"{med[b][name]:.2f}" for b in batches) + " |" for name in ROWS]
    lines.append("| **the app / plain Lightning** | " + " | ".join(
        f"**{med[b]['the app'] / med[b]['plain Lightning']:.2f}**" for b in batches) + " |")
    lines.append("| the app, no step saves / plain Lightning | " + " | ".join(
        f"{med[b]['the app, no step saves'] / med[b]['plain Lightning']:.2f}" for b in batches) + " |")
    added = {b: (med[b]["ours 1 x 2"] - med[b]["the app"], med[b]["seed loop, 2 replicas"] - med[b]["bare"])
             for b in batches}
    lines.append("| **a second replica: ours / the seed loop** | " + " | ".join(
        f"**{ours / seed:.2f}** ({ours:.2f} / {seed:.2f} ms)" for ours, seed in (added[b] for b in batches)) + " |")
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    """Measure and print the table (see the module's docstring); returns its lines."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="2,8", help="global batches, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=30, help="steps before the timed window")
    parser.add_argument("--timed", type=int, default=100, help="steps in the timed window")
    parser.add_argument("--parts", action="store_true", help="instead: time each part of the app's step that plain "
                        "Lightning's lacks, alone (`parts`)")
    args = parser.parse_args(argv)
    if args.parts:
        torch.set_num_threads(1)
        lines = ["| part of the app's step | " + " | ".join(f"µs/step, batch {b}" for b in args.batches.split(","))
                 + " |", "|---|" + "---|" * len(args.batches.split(","))]
        measured = [parts(int(b)) for b in args.batches.split(",")]
        lines += [f"| {name} | " + " | ".join(f"{m[i][1]:.1f}" for m in measured) + " |"
                  for i, (name, _) in enumerate(measured[0])]
        print("\n".join(lines))
        return lines
    from src.data.synthetic import write_fashion_mnist

    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory(prefix="host-work-data-") as root:
        # enough images that no window crosses an epoch's end (and its validation and checkpoint)
        write_fashion_mnist(Path(root) / "FashionMNIST" / "raw",
                            n_train=max(batches) * (args.warmup + args.timed + 2) + 1000, n_test=200)
        times = measure(batches, args.rounds, args.warmup, args.timed, root)
    lines = table(times)
    print(f"LeNet, 1 thread, steps [{args.warmup}, {args.warmup + args.timed}), medians of {args.rounds} rounds, "
          f"torch {torch.__version__}")
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
