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
    for name in RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.prefix == LITLOGGER_TIP for f in logger.filters):
            logger.addFilter(_DropMessage(LITLOGGER_TIP))


apply()
