"""`layout: {data, pipeline, tensor}` (src/mesh_layout.py): each combination of degrees runs the strategy of its
ways, the shipped presets build the strategies their class-path overlays built, a run's saved config.yaml (which
names both) reads again, and what a layout cannot mean is refused in one line before anything starts. The layout's
runs themselves are the CLI tests of the split models (tests/test_pipeline.py, test_pipeline_tensor.py,
test_model_split_exchange.py), which run the presets with `--layout.*`."""

from pathlib import Path

import pytest
import yaml
from jsonargparse import Namespace

from src import cli
from src.mesh_layout import MeshLayout, strategy_for_layout

PRESETS = Path("configs/strategy")
# the options every split-model overlay named before it was a layout (processes: gloo, a 10-minute timeout)
PROCESSES = ["--trainer.strategy.init_args.processes.backend", "gloo",
             "--trainer.strategy.init_args.processes.timeout", "0:10:00"]


class _Built(Exception):
    """Raised once the Trainer is built, before anything runs: carries the CLI."""


@pytest.fixture
def built(monkeypatch, fast_args):
    """`built(args)`: the CLI of `fit --config configs/lenet.yaml ARGS`, its Trainer built and nothing run."""
    def stop(self):
        raise _Built(self)

    monkeypatch.setattr(cli.CLI, "before_fit", stop)

    def build(args: list[str]) -> cli.CLI:
        with pytest.raises(_Built) as got:
            cli.main(["fit", "--config", "configs/lenet.yaml", *fast_args, *args])
        return got.value.args[0]
    return build


def _settings(built_cli: cli.CLI) -> dict:
    """What a strategy was built with, as its own attributes hold it, and the processes."""
    strategy = built_cli.trainer.strategy
    names = ("copies", "tensor", "cuts", "n_microbatches", "schedule", "overlap", "zero_stage", "_start_method",
             "_process_group_backend", "_timeout", "_replicas_per_process")
    found = {name: getattr(strategy, name) for name in names if hasattr(strategy, name)}
    compression = getattr(strategy, "_compression", None)
    return {"class": type(strategy).__name__, "processes": built_cli.trainer.num_devices, **found,
            "compression": getattr(compression, "spec", None)}


@pytest.mark.parametrize("degrees, strategy, data_arg", [
    ((1, 1, 1), None, None),
    ((2, 1, 1), "SplitAllreduceStrategy", ("replicas_per_process", 1)),  # ours, one replica in each process
    ((1, 2, 1), "PipelineStrategy", ("pipelines", 1)),
    ((1, 1, 2), "TensorParallelStrategy", ("replicas", 1)),
    ((2, 2, 1), "PipelineStrategy", ("pipelines", 2)),
    ((2, 1, 2), "TensorParallelStrategy", ("replicas", 2)),
    ((1, 2, 2), "PipelineStrategy", ("pipelines", 1)),
    ((2, 2, 2), "PipelineStrategy", ("pipelines", 2)),
])
def test_each_combination_of_degrees_names_the_strategy_of_its_ways(degrees, strategy, data_arg):
    data, pipeline, tensor = degrees
    processes, made = strategy_for_layout(Namespace(data=data, pipeline=pipeline, tensor=tensor))
    assert processes == data * pipeline * tensor
    if strategy is None:
        assert made == "auto"
        return
    assert made.class_path == f"src.strategies.{strategy}"
    assert made.init_args[data_arg[0]] == data_arg[1]
    assert made.init_args.get("tensor", tensor) == tensor


@pytest.mark.parametrize("degrees, folder", [((2, 1, 1), "split_allreduce-2x1-cpu"),
                                             ((2, 1, 2), "tensor_parallel-2x1x2-cpu"),
                                             ((2, 2, 2), "pipeline-2x2x2-cpu-gpipe-m4")])
def test_the_cli_builds_the_mesh_a_layout_names(built, degrees, folder):
    """Through the CLI, to the built Trainer: the processes, the mesh's degrees as the strategy reports them and the
    run folder that names them (ours' processes x replicas for the data dimension alone)."""
    from src.run.logger import run_tag

    data, pipeline, tensor = degrees
    made = built(["--trainer.accelerator", "cpu", "--layout.data", str(data), "--layout.pipeline", str(pipeline),
                  "--layout.tensor", str(tensor), *(["--layout.cuts", "[classifier]"] if pipeline > 1 else [])])
    layout = made.trainer.strategy.parallel_layout()
    assert made.trainer.num_devices == layout.processes == data * pipeline * tensor
    assert run_tag(made.trainer) == folder
    if pipeline == tensor == 1:  # the data dimension alone: ours, one replica in each process
        assert (layout.strategy, layout.words()) == \
            ("split_allreduce", "2 processes x 1 replica (2 data x 1 pipeline x 1 tensor) on cpu")
    else:
        assert layout.mesh == degrees


@pytest.mark.parametrize("preset, class_path", [
    ("pipeline_cpu", ["--trainer.strategy.class_path", "src.strategies.PipelineStrategy", "--trainer.devices", "2"]),
    ("tensor_parallel_cpu", ["--trainer.strategy.class_path", "src.strategies.TensorParallelStrategy",
                             "--trainer.devices", "2"]),
    ("three_ways_cpu", ["--trainer.strategy.class_path", "src.strategies.PipelineStrategy", "--trainer.devices", "8",
                        "--trainer.strategy.init_args.pipelines", "2", "--trainer.strategy.init_args.tensor", "2",
                        "--trainer.strategy.init_args.cuts", "[classifier]"]),
])
def test_the_presets_build_the_strategies_their_class_path_overlays_built(built, preset, class_path):
    """Each preset, a `layout`, against the overlay it replaced, spelled by class path (as scripts/same_state.py
    runs the pipeline and tensor parallelism at every commit): the same strategy, options and processes."""
    assert "layout" in yaml.safe_load((PRESETS / f"{preset}.yaml").read_text())
    layout = _settings(built(["--config", str(PRESETS / f"{preset}.yaml")]))
    assert layout == _settings(built(["--trainer.accelerator", "cpu", *class_path, *PROCESSES]))
    assert layout["processes"] > 1 and layout["_timeout"].total_seconds() == 600


def test_a_saved_config_names_the_layout_and_its_strategy_and_reads_again(built, tmp_path):
    """A run's config.yaml holds the layout and the strategy it made; read again, with a degree changed on the
    command line, the two disagree and the run is refused, saying how to give the degrees once."""
    from src.run.errors import describe

    made = built(["--config", str(PRESETS / "three_ways_cpu.yaml"), "--layout.schedule", "1f1b"])
    saved = tmp_path / "config.yaml"
    saved.write_text(made._parser("fit").dump(made.config["fit"], skip_none=False))  # as SaveConfigCallback does
    written = yaml.safe_load(saved.read_text())
    assert written["layout"]["data"] == 2 and written["trainer"]["devices"] == 8
    assert written["trainer"]["strategy"]["init_args"]["schedule"] == "1f1b"
    again = built(["--config", str(saved)])
    assert _settings(again) == _settings(made)
    with pytest.raises(ValueError) as refused:
        built(["--config", str(saved), "--layout.data", "1"])
    assert "trainer.strategy (src.strategies.PipelineStrategy, with its own degrees) and layout 1 data x 2 pipeline " \
           "x 2 tensor (4 processes) both say how the run is split" in describe(refused.value)
    resplit = built(["--config", str(saved), "--layout.data", "1", "--trainer.strategy", "auto", "--trainer.devices",
                     "auto"])
    assert resplit.trainer.strategy.parallel_layout().mesh == (1, 2, 2)


@pytest.mark.parametrize("given, message", [
    ({"pipeline": 0}, "layout.pipeline must be an integer of at least 1, got 0"),
    ({"data": 2, "schedule": "1f1b"},
     "layout.schedule is an option of the pipeline dimension, and this layout (2 data x 1 pipeline x 1 tensor) has "
     "none: set layout.pipeline to 2 or more, or leave schedule out"),
    ({"pipeline": 2, "compression": Namespace(kind="bf16")},
     "layout.compression is an option of the data dimension, and this layout (1 data x 2 pipeline x 1 tensor) has "
     "none: set layout.data to 2 or more, or leave compression out"),
    ({"data": 2, "pipeline": 2, "overlap": True},
     "layout.overlap exchanges buckets during backward, which the pipeline's schedule runs itself: set "
     "layout.pipeline to 1, or leave overlap out (2 data x 2 pipeline x 1 tensor)"),
], ids=["degree", "pipeline-option", "data-option", "overlap-pipeline"])
def test_what_a_layout_cannot_mean_is_refused_naming_the_option(given, message):
    with pytest.raises(ValueError) as refused:
        strategy_for_layout(Namespace(**{"data": 1, "pipeline": 1, "tensor": 1, **given}))
    assert str(refused.value) == message


def test_a_data_option_that_does_nothing_runs_with_one_copy():
    """A preset may write `compression: {kind: none}`, `zero_stage: 0`, `overlap: false` and still run with data 1."""
    _, made = strategy_for_layout(Namespace(data=1, pipeline=2, tensor=1, compression=Namespace(kind="none"),
                                            zero_stage=0))
    assert made.init_args.compression.kind == "none" and made.init_args.zero_stage == 0


@pytest.mark.parametrize("args, message", [
    (["--layout.tensor", "2", "--trainer.devices", "4"],
     "trainer.devices 4 and layout 1 data x 1 pipeline x 2 tensor (2 processes) disagree: leave trainer.devices out, "
     "the layout sets it (--trainer.devices auto when a config names it)"),
    (["--layout.tensor", "2", "--trainer.strategy", "ddp"],
     "trainer.strategy (ddp, with its own degrees) and layout 1 data x 1 pipeline x 2 tensor (2 processes) both say "
     "how the run is split, and they disagree"),
    (["--layout.tensor", "3", "--trainer.num_nodes", "2"],
     "layout 1 data x 1 pipeline x 3 tensor (3 processes) does not divide over trainer.num_nodes 2"),
    (["--layout.schedule", "1f1b"], "layout.schedule is an option of the pipeline dimension"),
], ids=["devices", "strategy", "nodes", "option"])
def test_the_cli_refuses_a_layout_in_one_line_before_anything_starts(args, message, fast_args, tmp_path, capsys):
    from tests.helpers.process_guard import recorded_process_starts

    with recorded_process_starts() as starts:
        assert cli.run(["fit", "--config", "configs/lenet.yaml", *fast_args, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}"), err
    assert starts == [] and not any((tmp_path / "logs").rglob("version_*"))


def test_the_layout_options_are_the_strategies_own():
    """Every option of `MeshLayout` but its degrees is an init arg, by the same name, of the strategies it runs,
    so a preset writes what a class-path overlay writes."""
    import inspect

    from src.strategies import PipelineStrategy, SplitAllreduceStrategy, TensorParallelStrategy

    names = set(MeshLayout.__dataclass_fields__) - {"data", "pipeline", "tensor"}
    accepted = set()
    for strategy in (PipelineStrategy, SplitAllreduceStrategy, TensorParallelStrategy):
        accepted |= set(inspect.signature(strategy.__init__).parameters)
    assert names <= accepted, names - accepted
