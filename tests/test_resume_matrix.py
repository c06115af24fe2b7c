"""Every checkpoint resumes under every strategy (docs/troubleshooting.md, "Resuming"): a 2-step run's last.ckpt of
each strategy is the same checkpoint but for what it holds of its own run (its folder, its number of processes),
and one of each number of processes, resumed for 2 more steps under each strategy, resumes right. What a resume
does with a checkpoint depends on its keys, its tensors' dtypes and shapes and its other values, not on the
numbers in its tensors, so a checkpoint alike in all of those resumes alike.

A resume must start from the checkpoint's weights and optimizer state, each state at its own parameter (as the
target strategy would save them again at the start of training, `StateAtStart`: the whole model, the state numbered
by position in the optimizer's groups), then take 2 steps. The resumes run once for all targets, in one process for
the targets of one process and in two for those of two (`tests.helpers.resume_matrix`), so a process start is paid
per number of processes, not per target; one test per target reads its results.
"""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from tests.helpers.ports import free_port

ROOT = Path(__file__).resolve().parent.parent

# name -> (overlay on configs/lenet.yaml, processes)
STRATEGIES = {
    "single": ("none", 1),
    "ours-1x2": ("split_allreduce", 1),
    "ours-2x1": ("split_allreduce_processes", 2),
    "ours-zero1": ("split_allreduce_zero1", 1),
    "ours-zero2": ("split_allreduce_zero2", 1),
    "ddp": ("ddp_cpu", 2),
    "fsdp-full-shard": ("fsdp_cpu_full_shard", 2),
    "fsdp-shard-grad-op": ("fsdp_cpu_shard_grad_op", 2),
    "pipeline": ("pipeline_cpu", 2),
    "tensor": ("tensor_parallel_cpu", 2),
}
TIMEOUT = 600  # seconds for one driver: six strategies' resumes in turn
#: what the tests below wait for: a pytest-xdist worker whose test did not start them waits on the others' files
PROCESSES = "each strategy's 2-step run and the resumes, in the session's fixtures `sources` and `resumed`"
#: the checkpoints resumed under every strategy: one of a run of one process, one of two (the others are alike)
RESUMED = ("single", "fsdp-full-shard")


def _driver(args: list[str], processes: int) -> list[subprocess.Popen]:
    """`tests.helpers.resume_matrix` in `processes` processes, each told its rank as Lightning's launcher tells the
    processes it starts (one process: as is)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    ranks = [{}] if processes == 1 else [
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "0", "LOCAL_RANK": str(rank),
         "WORLD_SIZE": str(processes)} for port in [free_port()] for rank in range(processes)]
    return [subprocess.Popen([sys.executable, "-m", "tests.helpers.resume_matrix", *args], cwd=ROOT,
                             env={**env, **rank}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for rank in ranks]


def _wait(started: list[subprocess.Popen], what: str) -> None:
    try:
        outputs = [p.communicate(timeout=TIMEOUT)[0] for p in started]
    except subprocess.TimeoutExpired:  # a rank left waiting for one that failed: end them all
        for p in started:
            p.kill()
        outputs = [p.communicate()[0] for p in started]
        pytest.fail(f"{what}: not done in {TIMEOUT} s\n" + "\n".join(out[-3000:] for out in outputs))
    failed = [(p.returncode, out) for p, out in zip(started, outputs) if p.returncode]
    assert not failed, f"{what}: exit status {failed[0][0]}\n{failed[0][1][-4000:]}"


def _make_sources(root: Path, data_dir: Path) -> dict[str, Path]:
    """Each strategy's 2-step run: those of one process in one, those of two in two, both sets at once."""
    started = [_driver(["make", str(data_dir), str(root), *(f"{overlay}={name}" for name, (overlay, p) in
                                                            STRATEGIES.items() if p == processes)], processes)
               for processes in (1, 2)]
    for processes in started:
        _wait(processes, "the runs that make the checkpoints")
    found = {name: list((root / name).glob("*/*/*/checkpoints/last.ckpt")) for name in STRATEGIES}
    assert all(len(f) == 1 for f in found.values()), found
    return {name: f[0] for name, f in found.items()}


def _shared(tmp_path_factory) -> Path:
    """The folder of this pytest session that its pytest-xdist workers share."""
    base = tmp_path_factory.getbasetemp()  # a pytest-xdist worker's: in the session's, shared by the workers
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "resume-matrix"
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture(scope="session")
def sources(tmp_path_factory) -> dict[str, Path]:
    """name -> the last.ckpt of a 2-step run under that strategy (and "data" -> the tiny data set's folder); made
    once for all pytest-xdist workers."""
    shared = _shared(tmp_path_factory) / "sources"
    with FileLock(str(shared) + ".lock"):
        done = shared / "done"
        if not done.is_file():
            data_dir = shared / "data"
            data_dir.mkdir(parents=True, exist_ok=True)
            from tests.helpers.idx import write_fashion_mnist
            write_fashion_mnist(data_dir / "FashionMNIST" / "raw")
            made = _make_sources(shared, data_dir)
            made["data"] = data_dir
            done.write_text("\n".join(f"{name}={path}" for name, path in made.items()))
        return {name: Path(path) for name, path in (line.split("=", 1) for line in done.read_text().splitlines())}


@pytest.fixture(scope="session")
def resumed(sources, tmp_path_factory) -> Path:
    """The folder of each target's resumes of `RESUMED` (`<overlay>/<name>.pt`): the targets of one process in one
    process and those of two in two, both at once; made once for all pytest-xdist workers."""
    out = _shared(tmp_path_factory) / "resumed"
    with FileLock(str(out) + ".lock"):
        if not (out / "done").is_file():
            started = [_driver([",".join(o for o, p in STRATEGIES.values() if p == processes), str(sources["data"]),
                                str(out), *(f"{name}={sources[name]}" for name in RESUMED)], processes)
                       for processes in (1, 2)]
            for processes in started:
                _wait(processes, "the resumes")
            (out / "done").touch()
    return out


def _by_position(optimizer_state: dict) -> list[dict]:
    """Each parameter's state in the order of the groups' parameter lists (how `Optimizer.load_state_dict` pairs
    the saved numbers with the parameters)."""
    return [optimizer_state["state"].get(i, {}) for g in optimizer_state["param_groups"] for i in g["params"]]


# LeNet's 4 weights, then its 4 biases (LeNetClassifier.configure_optimizers), numbered in turn
ONE_DEVICE_NUMBERS = ([[0, 1, 2, 3], [4, 5, 6, 7]], list(range(8)))


def _numbering(optimizer_states: list[dict]) -> list[tuple[list, list]]:
    """Each optimizer's parameter numbers per group and the numbers its state is kept under."""
    return [([g["params"] for g in o["param_groups"]], sorted(o["state"])) for o in optimizer_states]


def _differences(saved: dict, result: dict) -> list[str]:
    """What went wrong: a checkpoint whose optimizer state is not numbered as one device's (each parameter's state
    under its position in the optimizer's groups, as `torch.optim.Optimizer.state_dict` numbers them), the resume's
    exit, its steps, a weight or an optimizer state unlike the checkpoint's."""
    numbers = _numbering(saved["optimizer_states"])
    wrong = [] if numbers == [ONE_DEVICE_NUMBERS] else [f"the checkpoint's optimizer state numbered {numbers}"]
    if result["code"] != 0:
        return [*wrong, f"exit {result['code']}: {result['error']}"]
    if result.get("global_step") != result["saved_step"] + 2:
        wrong.append(f"global step {result.get('global_step')}, not {result['saved_step']} + 2")
    model = result["model"]
    wrong += [f"weight {k}" for k, v in saved["state_dict"].items() if not torch.equal(model[k], v)]
    for o, (mine, theirs) in enumerate(zip(saved["optimizer_states"], result["optimizers"])):
        expected, got = _by_position(mine), _by_position(theirs)
        if len(expected) != len(got):
            wrong.append(f"optimizer {o}: {len(got)} parameters' states, the checkpoint's {len(expected)}")
            continue
        wrong += [f"optimizer {o}: the state at position {n}" for n, (a, b) in enumerate(zip(expected, got))
                  if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k]))]
        wrong += [f"optimizer {o}: group {g}'s lr" for g, (a, b) in
                  enumerate(zip(mine["param_groups"], theirs["param_groups"])) if a["lr"] != b["lr"]]
    return wrong


def _outline(value, run: str) -> object:
    """`value` (a checkpoint, or a part of it) with each tensor as its dtype and shape and `run` (the run's folder)
    as "RUN" in every string and key: what a resume can tell apart in two checkpoints but the tensors' numbers."""
    if isinstance(value, dict):
        return {_outline(k, run): _outline(v, run) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_outline(v, run) for v in value]
    if torch.is_tensor(value):
        return ("tensor", value.dtype, tuple(value.shape))
    return value.replace(run, "RUN") if isinstance(value, str) else value


@pytest.mark.slow(compute=PROCESSES)
def test_every_strategy_saves_the_same_checkpoint(sources):
    """Each strategy's checkpoint is one device's in outline (`_outline`): the same keys at every level, each
    tensor's dtype and shape, and every other value, the optimizer state numbered as one device's; it differs only
    in its run's folder and, for a run of two processes, in the two values that record them."""
    outlines = {name: _outline(torch.load(path, weights_only=True), str(path.parents[2]))
                for name, path in sources.items() if name != "data"}
    one_device = outlines["single"]
    assert _numbering(one_device["optimizer_states"]) == [ONE_DEVICE_NUMBERS]
    two = copy.deepcopy(one_device)
    two["callbacks"]["RestartReport"]["processes"] = two["intra_op_threads"]["processes_per_node"] = 2
    unlike = [name for name, outline in outlines.items()
              if outline != (one_device if STRATEGIES[name][1] == 1 else two)]
    assert not unlike, f"unlike one device's checkpoint: {unlike}"


@pytest.mark.slow(compute=PROCESSES)
@pytest.mark.parametrize("target", list(STRATEGIES))
def test_every_checkpoint_resumes_under(target, sources, resumed):
    """The checkpoint of a run of one process and of two (`RESUMED`; every other is alike in outline,
    test_every_strategy_saves_the_same_checkpoint) resumed under `target`: the checkpoint's weights and each
    parameter's optimizer state at the start of training, then 2 steps (no pair is refused)."""
    overlay = STRATEGIES[target][0]
    wrong = {}
    for name in RESUMED:
        found = _differences(torch.load(sources[name], weights_only=True),
                             torch.load(resumed / overlay / f"{name}.pt", weights_only=True))
        if found:
            wrong[name] = found
    assert not wrong, f"resumed under {target}:\n" + "\n".join(f"  from {k}: {v}" for k, v in wrong.items())


def test_an_older_fsdp_checkpoints_optimizer_state_is_read_by_position():
    """A checkpoint of Lightning's FSDP numbers the states in `model.parameters()` order with sorted group lists
    (weights [0, 2, 4, 6], biases [1, 3, 5, 7]); the strategies that load by number (tensor parallelism, ours with
    `zero_stage`) read it as one device's, each state at the parameter that `Optimizer.load_state_dict` gives it."""
    from src.models.classifier import LeNetClassifier
    from src.run.checkpoints import optimizer_state_by_position

    net = LeNetClassifier().net
    params = list(net.parameters())
    weights, biases = params[0::2], params[1::2]
    optimizer = torch.optim.SGD([{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    one_device = optimizer.state_dict()
    position = {id(p): i for i, p in enumerate(params)}
    model_order = {n: position[id(p)] for n, p in enumerate(weights + biases)}  # one device's number -> FSDP's
    fsdp = {"state": {model_order[n]: s for n, s in one_device["state"].items()},
            "param_groups": [{**g, "params": sorted(model_order[n] for n in g["params"])}
                             for g in one_device["param_groups"]]}
    assert fsdp["param_groups"][0]["params"] == [0, 2, 4, 6]
    read = optimizer_state_by_position(fsdp)
    assert read["param_groups"] == one_device["param_groups"]
    assert read["state"].keys() == one_device["state"].keys()
    assert all(read["state"][n]["momentum_buffer"] is s["momentum_buffer"] for n, s in one_device["state"].items())
    assert optimizer_state_by_position(one_device) is one_device
