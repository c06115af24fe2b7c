"""The third-party messages that a normal run hides, all in one place (listed in docs/troubleshooting.md).

`src.cli` imports this module before Lightning builds anything, so every process that runs the CLI gets the
same filters: the launching process, DDP's and our strategy's children (which re-run `python -m src.cli`) and
spawned children (multiprocessing imports the parent's main module, `src.cli`, in each). Each filter matches
one message from one module, so any other warning from the same libraries still shows.
"""

import logging
import warnings

# Lightning 2.6 logs this advertisement at info level whenever no LitLogger is configured, i.e. on every run
# (lightning/pytorch/trainer/connectors/logger_connector/logger_connector.py). It says nothing about the run.
LITLOGGER_TIP = "💡 Tip: For seamless cloud logging and experiment tracking"

# torch 2.14 deprecated `LeafSpec`; Lightning 2.6 still builds one in its own pytree helper
# (lightning/pytorch/utilities/_pytree.py), so torch warns at every fit, test and predict. Nothing in this
# project uses LeafSpec, and nothing the user can change avoids it.
PYTREE_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
PYTREE_MODULE = r"lightning\.pytorch\.utilities\._pytree"

# torch 2.14 deprecated `torch.distributed.nn.functional.all_gather`; Lightning 2.6's `all_gather` for several
# processes still calls it (lightning/fabric/utilities/distributed.py), so a predict under DDP warned once per rank
# when the prediction writer gathered the ranks' rows. The gather itself works and is tested.
ALL_GATHER_DEPRECATION = r"torch\.distributed\.nn\.functional\.all_gather is deprecated"
ALL_GATHER_MODULE = r"lightning\.fabric\.utilities\.distributed"

# Lightning warns on every run that leaves a GPU unused (lightning/pytorch/trainer/setup.py, `_log_device_info`).
# A shipped config that runs on the CPU names that accelerator on purpose (configs/lenet.yaml stays on the CPU
# so the main job's figure is the CPU's, bitwise), and Lightning's own info line just before it ("GPU available:
# True (cuda), used: False") and the epoch line ("... on cpu") already say where the run is.
# `--trainer.accelerator gpu` moves it.
GPU_UNUSED = r"GPU available but not used"

# Lightning's model summary knows no size per parameter for mixed precision ("bf16-mixed", "16-mixed") and warns
# at every such fit that it counts 32 bits (lightning/pytorch/utilities/model_summary/model_summary.py). That is
# right: the weights of a mixed-precision run are float32; only the autocast regions compute in 16 bits.
SUMMARY_PRECISION = r"Precision .*-mixed is not supported by the model summary"

# torch warns at the first backward under Lightning's DDP on a GPU that an AccumulateGrad node's stream is not the
# stream of its incoming gradient (torch/csrc/autograd/input_buffer.cpp). Lightning wraps the model in
# DistributedDataParallel on a side stream (`DDPStrategy._setup_model`, after torch's CUDA stream semantics notes),
# and DDP keeps references to the AccumulateGrad nodes made there. In torch's words the mismatch "may incur
# unnecessary synchronization"; it is Lightning's choice, which a config cannot change.
DDP_STREAM_MISMATCH = r"The AccumulateGrad node's stream does not match"

# torch's DDP warns once per run on a GPU that a gradient's strides differ from those of its bucket view
# (torch/csrc/distributed/c10d/reducer.cpp). Measured on an H200: the first convolution of LeNet and of ResNet-18
# has one input channel, so its channels_last weight (strides (9, 1, 3, 1) for a 3x3 kernel) and the contiguous
# gradient cuDNN returns (strides (9, 9, 3, 1)) hold the same numbers in the same memory order; only the stride of
# the size-1 dimension differs. In torch's words it "is not an error", and the values allreduced are the same.
DDP_GRAD_STRIDES = r"Grad strides do not match bucket view strides"

# Lightning's tip to enable TF32 (lightning/fabric/accelerators/cuda.py, `_check_cuda_matmul_precision`). The CLI
# decides float32 matmul precision itself (src/run/matmul_precision.py): TF32 when every device of the run is a
# GPU, IEEE float32 when a CPU replica shares the run, so the tip would only repeat a choice already made.
TF32_TIP = "You are using a CUDA device"

# Lightning warns when an epoch has fewer batches than `log_every_n_steps` (lightning/pytorch/loops/fit_loop.py,
# `setup_data`). `EpochReport` says it instead, once, naming the per-step tags left out and the command-line option,
# and also when `max_steps` makes the whole run shorter than the interval, which Lightning does not check
# (src/run/log_steps.py).
LOGGING_INTERVAL = r"The number of training batches \(\d+\) is smaller than the logging interval"

# Lightning's ModelCheckpoint warns on every resume that "The dirpath has changed from ..." and that the top-k
# bookkeeping of the checkpoint's folder is not reloaded (lightning/pytorch/callbacks/model_checkpoint.py,
# `load_state_dict`), once per process. A run here never writes into another run's folder: `--ckpt_path` starts a
# run of its own, in a new version folder (src/run/logger.py; only a restarted job goes on in its own), so that the
# run it continues keeps every file it wrote. The new run keeps its top-k among its own checkpoints and never
# deletes the old run's; that is what the message reports, on every resume, as a change.
CKPT_DIRPATH = r"The dirpath has changed from .* won't be reloaded"

# The loggers that `rank_zero_info` writes through (Lightning points lightning_utilities' helper at the last
# of these that was imported)
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropMessage(logging.Filter):
    """Drops the log records whose message starts with `prefix`."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def apply() -> None:
    """Install the filters; calling it again adds nothing."""
    warnings.filterwarnings("ignore", message=PYTREE_DEPRECATION, category=FutureWarning, module=PYTREE_MODULE)
    warnings.filterwarnings("ignore", message=ALL_GATHER_DEPRECATION, category=FutureWarning,
                            module=ALL_GATHER_MODULE)
    for message in (GPU_UNUSED, SUMMARY_PRECISION, DDP_STREAM_MISMATCH, DDP_GRAD_STRIDES, LOGGING_INTERVAL,
                    CKPT_DIRPATH):
        # matched by message alone: Lightning's rank_zero_warn and torch's C++ warnings are attributed to the
        # caller's frame, which differs between call sites
        warnings.filterwarnings("ignore", message=message)
    for name in RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        for prefix in (LITLOGGER_TIP, TF32_TIP):
            if not any(isinstance(f, _DropMessage) and f.prefix == prefix for f in logger.filters):
                logger.addFilter(_DropMessage(prefix))


apply()
