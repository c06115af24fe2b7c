"""The docs are executed: every command in the code blocks of README.md and docs/*.md runs, shortened, or is skipped
for a stated reason; what the text says about its output (stdout or stderr, files, TensorBoard tags, the epoch
line, TensorBoard's SCALARS, IMAGES and HPARAMS) is checked against what it printed and wrote.

The commands are read from the docs (tests/helpers/doc_commands.py), never copied here. A command none of
SKIPPED's patterns names is run: one that cannot be run fails. Each runs in a folder of its own whose `configs`
links to the repository's and whose `logs` starts as a copy of three short runs (one device, ours 1 x 2, DDP
2 x 1), so commands that read a run (`test`, `validate`, `predict`, `--ckpt_path last`, `tensorboard`) find one
where the docs put it. `python -m` commands run in children forked from a process that has already imported
the libraries (tests/helpers/forkserver.py), which saves each command several seconds of imports.
"""

import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from lightning.pytorch.strategies import FSDPStrategy

from tests.helpers.cli_args import process_option
from tests.helpers.doc_commands import FENCE, ROOT, Command, ForkServer, expand_loop, extract
from tests.helpers.idx import write_fashion_mnist
from tests.helpers.ports import free_port


GPU = "needs an NVIDIA GPU with CUDA; tests/test_gpu.py (marked gpu) and scripts/gpu_check.sh run the GPU paths"
# (pattern searched in the command, reason): a command that matches none is run
SKIPPED = [
    (r"^bash scripts/main_job\.sh", "installs the venv (scripts/setup_env.sh) and downloads Fashion-MNIST "
                                    "(scripts/get_data.sh); the training it runs is `python -m src.cli fit --config "
                                    "configs/lenet.yaml`, run here from docs/data-and-configs.md"),
    (r"^bash scripts/test\.sh|^python -m pytest", "the test suite, which cannot run inside itself"),
    (r"_gpu\.yaml|accelerator gpu|gpu_check|benchmarks\.gpu_speed", GPU),
    (r"^sudo python -m src\.lab run .*-m src\.cli fit .*split_allreduce_processes\.yaml --trainer\.devices 1 "
     r"--ckpt_path auto$", "the lab's own tests run it: tests/test_lab_jobs.py" if os.geteuid() == 0 else
     "the lab needs root (network namespaces, tc); tests/test_lab_jobs.py runs it as root"),
    (r"^sudo python -m src\.lab run .*configs/profile\.yaml", "a lab job with the step timeline: the lab's jobs "
     "run in tests/test_lab_jobs.py and the timeline's command (docs/timeline.md) runs here; the two together "
     "take minutes of shaped 100 Mbit/s traffic"),
    (r"^sudo python -m (benchmarks\.lab_table|src\.lab run .* benchmarks/(lab_|allreduce_speed\.py lab))",
     "a lab benchmark: minutes of measurement on shaped links, its figures in benchmarks/README.md"),
    (r"^ip netns exec", "a template of the line the lab runs on each machine (MIN, N, K, CORES, COMMAND are "
                        "placeholders); tests/test_lab_jobs.py runs the lab that writes it"),
    (r"torchrun --nnodes 2:3", "needs 2 to 3 machines and a shared folder; tests/test_elastic.py runs the same "
                               "elastic job as three torchrun agents on loopback"),
    (r"TCPStore\(|^TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun \.\.\.", "a store host for several machines "
     "(STOREHOST and `...` are placeholders for the command above)"),
    (r"^#SBATCH|^srun ", "needs a SLURM cluster"),
    (r"configs/strategy/fsdp_cpu_full_shard\.yaml$", "tests/test_fsdp.py runs this command on the tiny data and "
     "checks its epoch line, run folder, test after fit and one-device checkpoint"),
    (r"^python -m src\.scaling --config configs/lenet\.yaml$", "tests/test_scaling.py::test_scaling_report_on_cpu "
     "runs this command (2 epochs of the tiny data) and checks its report: rows, accuracies, table, picture"),
    (r"^torchrun --nnodes N ", "placeholders N, K, i and HOST for several machines; tests/test_launchers.py runs "
                               "DDP and ours under two torchrun nodes on loopback"),
    (r"^python -m src\.forecast --calibrate$", "re-measures this machine for minutes and rewrites the shipped "
                                               "src/scaling/calibration/cpu-2core.json"),
    (r"--calibrate_configs .*my_net\.yaml", "configs/my_net.yaml stands for a config of your own network"),
    (r"^bash scripts/timelines\.sh", "installs the venv (scripts/setup_env.sh) and downloads Fashion-MNIST "
                                     "(scripts/get_data.sh); each of its runs is docs/timeline.md's command "
                                     "under another overlay, run here"),
]
# placeholders a reader fills in, filled in with what the folder holds
FILLED_IN = {"<name>": "single", "version_3": "version_0"}
TRAIN_BATCHES, EVAL_BATCHES = 4, 2
COMMANDS = extract()
README = (ROOT / "README.md").read_text()


def _reason(command: Command) -> str | None:
    for pattern, reason in SKIPPED:
        if re.search(pattern, command.text):
            return reason
    return None


def _number_pattern(text: str) -> str:
    """A regex of `text` with each number free, a word after a number free to be singular or plural, and an epoch
    line's count of the batches of a cut epoch free to be there."""
    out, pos = [], 0
    for match in re.finditer(r"\d[\d,]*(?:\.\d+)?(?: (\w+))?", text):
        out.append(re.escape(text[pos:match.start()]))
        out.append(r"[\d,]+(?:\.\d+)?")
        word = match.group(1)
        if word:
            if word.endswith("ses"):  # processes
                word = word[:-2]
            elif word.endswith("s") and not word.endswith("ss"):  # threads, images
                word = word[:-1]
            out.append(" " + re.escape(word) + r"(?:es|s)?")
        pos = match.end()
    out.append(re.escape(text[pos:]))
    # the commands run here cut every epoch short (`--trainer.limit_train_batches`), which an epoch line says as
    # "sec/epoch (4 of 8 batches)"; an example of a whole epoch matches that line too
    cut = r"/epoch(?: \([\d,]+ of [\d,]+ batches\))?,"
    return "".join(out).replace(re.escape("..."), ".*?").replace("/epoch,", cut)


def _readme_examples() -> list[str]:
    """The lines of README's example output block (the first block without a language that starts `epoch `)."""
    for lang, body in FENCE.findall(README):
        if not lang and body.startswith("epoch "):
            return body.strip().splitlines()
    raise AssertionError("README.md has no example block of the epoch line")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RANK",
                                "PYTEST_", "PL_"))}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _linked_folder(work: Path) -> Path:
    """A new folder in which the repository's configs, benchmarks and scripts are where the docs' commands look."""
    work.mkdir()
    for linked in ("configs", "benchmarks", "scripts"):
        (work / linked).symlink_to(ROOT / linked)
    return work


def _several_processes(args: list[str]) -> bool:
    """Whether a command's strategy overlay starts several processes (`trainer.devices` > 1 in a strategy config of
    DDP or ours, or a `layout` of several processes). Such runs start their other processes by fork (`start_method`,
    which both strategies take, ours in its `processes` group) rather than by running the command line again: a new
    interpreter imports torch and Lightning for several seconds, and this is a test of what the docs say, not of how
    processes start (the command line run again: tests/test_hidden_messages.py and tests/test_dead_rank.py;
    torchrun: tests/test_launchers.py)."""
    import yaml

    overlays = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config" and "configs/strategy/" in args[i + 1]]
    for overlay in overlays:
        config = yaml.safe_load((ROOT / overlay).read_text()) or {}
        layout = config.get("layout") or {}
        if layout.get("data", 1) * layout.get("pipeline", 1) * layout.get("tensor", 1) > 1:  # ours, by its layout
            return True
        trainer = config.get("trainer", {})
        strategy = trainer.get("strategy")
        if isinstance(strategy, dict) and "class_path" in strategy and int(trainer.get("devices", 1)) > 1:
            module, _, name = strategy["class_path"].rpartition(".")
            # Lightning's FSDP strategy takes no start_method: it runs the command line again
            cls = getattr(importlib.import_module(module), name)
            return not issubclass(cls, FSDPStrategy)
    return False


class Runner:
    """Runs documented commands, shortened, each in a folder of its own."""

    def __init__(self, root: Path):
        self.root = root
        self.data = root / "data"
        write_fashion_mnist(self.data / "FashionMNIST" / "raw")
        self.server = ForkServer(["lightning.pytorch", "src.cli", "src.forecast", "src.scaling_report",
                                  "tensorboard.backend.event_processing.event_accumulator"], _env())
        self.count = 0

    def workdir(self, name: str, logs_from: Path | None = None) -> Path:
        work = _linked_folder(self.root / name)
        if logs_from is not None:
            shutil.copytree(logs_from / "logs", work / "logs", symlinks=True)
        return work

    def shorten(self, args: list[str]) -> list[str]:
        """`src.cli` arguments with the overrides that make the run a few batches of the tiny data."""
        sub = args[0]
        short = ["--data.data_dir", str(self.data), "--data.download", "false"]
        if sub == "predict":
            return args + short
        short += ["--data.val_size", "100", "--trainer.limit_val_batches", str(EVAL_BATCHES),
                  "--trainer.limit_test_batches", str(EVAL_BATCHES)]
        if sub == "fit":
            short += ["--trainer.log_every_n_steps", "2"]
            if "--trainer.max_steps" not in args:  # one epoch, or one more for a run that resumes one
                epochs = "2" if "--ckpt_path" in args else "1"
                short += ["--trainer.max_epochs", epochs, "--trainer.limit_train_batches", str(TRAIN_BATCHES)]
        if "configs/resnet18.yaml" in args:  # a ResNet-18 step on the CPU takes seconds at batch 256
            short += ["--data.batch_size", "4"]
            if "--trainer.max_steps" not in args:  # else its steps in one epoch of the tiny data, one validation
                short += ["--trainer.limit_train_batches", "2"]
        if "--print_config" in args:  # it prints what was parsed before it and stops
            return args
        if _several_processes(args):  # forked from this process, which has imported the libraries already
            short += [process_option(args, "start_method"), "fork"]
        return args + short

    def python_m(self, module: str, args: list[str], work: Path, timeout: float = 240) -> dict:
        self.count += 1
        out, err = work / f"stdout-{self.count}.txt", work / f"stderr-{self.count}.txt"
        rc = self.server.run(module, args, work, _env(), out, err, timeout)
        return {"rc": rc, "stdout": out.read_text(), "stderr": err.read_text(), "argv": [module, *args]}

    def close(self) -> None:
        self.server.close()


@pytest.fixture(scope="module")
def runner(tmp_path_factory, testrun_uid):
    runner = Runner(tmp_path_factory.mktemp("docs"))
    # one folder for the whole session, beside the xdist workers' own temporary folders
    runner.base = _shared_base(runner, tmp_path_factory.getbasetemp().parent / f"docs-base-{testrun_uid}")
    yield runner
    runner.close()


def _shared_base(runner: Runner, base: Path) -> Path:
    """The three short runs that every command's folder starts from (one device, ours 1 x 2, DDP 2 x 1), made once
    per test session: the first xdist worker to get here makes them, the others wait for it and copy them."""
    from filelock import FileLock

    with FileLock(f"{base}.lock"):
        if (base / "complete").is_file():
            return base
        if base.exists():  # left half-made by a worker whose runs failed: made again
            shutil.rmtree(base)
        _linked_folder(base)
        for overlay in ([], ["--config", "configs/strategy/split_allreduce.yaml"],
                        ["--config", "configs/strategy/ddp_cpu.yaml"]):
            result = runner.python_m("src.cli", runner.shorten(["fit", "--config", "configs/lenet.yaml", *overlay]),
                                     base)
            assert result["rc"] == 0, result["stderr"][-3000:]
        (base / "complete").touch()
    return base


def test_the_docs_hold_commands_and_every_skip_names_a_command():
    assert len(COMMANDS) > 40, [c.text for c in COMMANDS]
    for pattern, reason in SKIPPED:
        assert reason and any(re.search(pattern, c.text) for c in COMMANDS), f"no documented command is {pattern}"


def _fill_in(text: str, previous: str | None) -> str:
    for placeholder, value in FILLED_IN.items():
        text = text.replace(placeholder, value)
    if " ... " in f"{text} " and previous is not None:  # `python -m src.forecast ... --flag`: the command above
        head, _, tail = text.partition(" ...")
        text = previous + tail
    return text


def _previous_full(command: Command) -> str | None:
    before = [c for c in COMMANDS if c.doc == command.doc and c.line < command.line and "..." not in c.text]
    return before[-1].text if before else None


@pytest.mark.slow  # starts processes of its own
@pytest.mark.parametrize("command", COMMANDS, ids=[c.id for c in COMMANDS])
def test_documented_command(command: Command, runner, tmp_path):
    reason = _reason(command)
    if reason is not None:
        pytest.skip(f"{command.text[:60]}...: {reason}")
    work = runner.workdir(command.id.replace("/", "_").replace(":", "_"), runner.base)
    problems = []
    for text in expand_loop(_fill_in(command.text, _previous_full(command))):  # a loop's runs: each checked
        argv = shlex.split(text)
        try:
            if argv[0] == "tensorboard":
                _check_tensorboard(argv, work)
            elif argv[:2] == ["python", "-m"]:
                _run_python_m(command, argv[2], argv[3:], work, runner)
            else:
                pytest.fail(f"{command.id}: no way to run `{text}`: run it here, or add it to SKIPPED with the reason")
        except AssertionError as failed:
            problems.append(f"`{text}`: {failed}")
    assert not problems, "\n\n".join(problems)


def _run_python_m(command: Command, module: str, args: list[str], work: Path, runner: Runner) -> None:
    if module == "src.cli":
        args = runner.shorten(args)
    elif module == "src.scaling":
        args += ["--max_steps", "2", "--max_epochs", "1", "--out", str(work / "scaling"), "--extra",
                 json.dumps(runner.shorten(["validate"])[1:])]
    if module == "src.cli" and args[0] == "predict":
        _write_photos(work / "my_photos")
    before = set((work / "logs").rglob("*")) if (work / "logs").exists() else set()
    result = runner.python_m(module, args, work)
    shown = f"`python -m {module} {shlex.join(args)}`\nstdout:\n{result['stdout'][-3000:]}\nstderr:\n" \
            f"{result['stderr'][-4000:]}"
    assert result["rc"] == 0, shown
    if module == "src.cli" and args[0] == "fit" and "--print_config" not in args:
        _check_fit(command, args, result, work, before, shown)
    elif module == "src.cli" and args[0] == "predict":
        _check_predict(result, work, before, shown)
    elif module == "src.cli" and args[0] in ("validate", "test"):
        _check_stage_folder(args[0], work, before, shown)
    elif module == "src.cli" and args[0] == "fit":
        assert "trainer:" in result["stdout"] and "model:" in result["stdout"], shown
    elif module != "src.cli":
        _check_other_module(module, args, result, work, shown)


def _check_other_module(module: str, args: list[str], result: dict, work: Path, shown: str) -> None:
    """A command other than the CLI's raised nothing and said something, or wrote what its `--out` names; a
    forecast names the files it wrote (the docs' `logs/forecast/<model>/version_N/forecast.md, ...`), and they are
    there."""
    assert "Traceback (most recent call last)" not in result["stderr"], shown
    if "--out" in args:
        assert (work / args[args.index("--out") + 1]).exists(), shown
    else:
        assert result["stdout"].strip() or result["stderr"].strip(), shown
    written = re.findall(r"^predicted \(not measured\): (\S+?),", result["stdout"] + result["stderr"], re.M)
    if module == "src.forecast" and written:
        assert (work / written[-1]).is_file(), shown


def _write_photos(folder: Path) -> None:
    from PIL import Image

    folder.mkdir(exist_ok=True)
    for i, colour in enumerate([(250, 250, 250), (30, 30, 30), (200, 40, 40)]):
        image = Image.new("RGB", (40, 30), colour)
        image.paste((0, 0, 0) if i != 1 else (255, 255, 255), (10, 5, 30, 25))
        image.save(folder / f"photo{i}.png")


def _run_folder(result: dict, work: Path) -> Path:
    found = re.findall(r"run in (\S+)", result["stderr"] + result["stdout"])
    assert found, "fit did not say where its run went"
    return work / found[-1]


def _check_fit(command: Command, args: list[str], result: dict, work: Path, before: set, shown: str) -> None:
    """Every claim of the docs about a fit's output, each checked even when another fails (all are reported)."""
    run = _run_folder(result, work)
    assert run.is_dir() and run not in before, shown
    single = not any("strategy/" in a or a in ("configs/profile.yaml", "--ckpt_path") for a in args)
    checks = [lambda: _check_stdout_stderr_split(result), lambda: _check_run_folder_sketch(run)]
    if single:  # README's example lines are a fresh one-device run (a resumed one adds its restart)
        checks.append(lambda: _check_readme_example_lines(result))
    examples = [line for line in command.example_output if line.startswith("epoch ")]
    if examples:  # each shows another epoch: the short run has the shape of one of them
        checks.append(lambda: _check_example_epoch_line(command, examples, result))
    if "configs/profile.yaml" in args:
        checks.append(lambda: _check_timeline(result, run))
    problems = []
    for check in checks:
        try:
            check()
        except AssertionError as failed:
            problems.append(str(failed))
    assert not problems, "\n\n".join(problems) + "\n\n" + shown


def _check_example_epoch_line(command: Command, examples: list[str], result: dict) -> None:
    patterns = [re.compile(_number_pattern(example)) for example in examples]
    assert any(p.fullmatch(line) for p in patterns for line in result["stdout"].splitlines()), \
        f"{command.id} shows {examples}; no stdout line has the shape of one ({[p.pattern for p in patterns]})"


def _check_stdout_stderr_split(result: dict) -> None:
    """README: stdout holds the run's report (the kinds of line its sentence lists) and nothing else; the test
    accuracy line goes to stderr."""
    flowing = re.sub(r"\s+", " ", README)  # the sentence as read, wherever its lines break
    sentence = ("stdout holds the run's report: the epoch lines, those progress lines, a resumed run's `restart …` "
                "and `finished …` lines, a profiled run's `step timeline …` line and Lightning's `Test metric` "
                "table.") in flowing
    assert sentence, "README no longer says what stdout holds: update this check with it"
    epoch = re.compile(_number_pattern(_readme_examples()[0].split(":")[0] + ":"))
    assert re.search(r"^test acc ", result["stderr"], re.M) and not re.search(r"^test acc ", result["stdout"], re.M), \
        "README: the test accuracy line goes to stderr"
    assert any(epoch.match(line) for line in result["stdout"].splitlines()), "README: the epoch lines go to stdout"
    report = re.compile(r"(?:restart \d+: |finished at step |step timeline of |training: [\d,]+ batches an epoch|"
                        r"epoch \d+: batch [\d,]+ of )")
    # Lightning's table: its rules, its header and one row per metric (test/...), drawn in plain text, or with rich's
    # box characters where the `rich` package is installed (a dev dependency, so in this suite)
    bar = r"[\s│┃]*"
    table = re.compile(rf"[─━┏┓┡┩└┘┳╇┴]+|{bar}Test metric{bar}DataLoader 0{bar}|{bar}test/\S+{bar}\S+{bar}")
    others = [line for line in result["stdout"].splitlines()
              if line.strip() and not (epoch.match(line) or report.match(line) or table.fullmatch(line))]
    assert not others, f"README lists what stdout holds; stdout also holds: {others[:6]}"


def _check_readme_example_lines(result: dict) -> None:
    for example in _readme_examples():
        pattern = _number_pattern(example)
        # the example's run folder is the default logs/...; any version
        pattern = pattern.replace(re.escape("logs/lenet/"), r"(?:\S*/)?logs/lenet/")
        lines = (result["stdout"] + result["stderr"]).splitlines()
        assert any(re.fullmatch(pattern, line) for line in lines), \
            f"README shows `{example}`; no line of the run has that shape ({pattern})"


def _sketch() -> tuple[list[str], list[tuple[str, str | None]]]:
    """docs/data-and-configs.md's run-folder sketch: (file name patterns, TensorBoard tags in its comments).

    Each tag comes with the strategy it is listed under (`under split_allreduce …`), or None for every run; a tag
    the sketch says appears only sometimes (`(when any image is)`) is left out.
    """
    text = (ROOT / "docs" / "data-and-configs.md").read_text()
    body = next(b for lang, b in FENCE.findall(text) if not lang and "events.out.tfevents" in b)
    files, comments = [], ""
    for line in body.splitlines()[1:]:
        name = re.search(r"[├└]── (\S+)", line)
        if name and not name.group(1).endswith("/"):
            files.append(name.group(1))
        if "#" in line:
            comments += " " + line.split("#", 1)[1]
    after_tb = comments.split("TensorBoard scalars:", 1)[1].split("checkpoints", 1)[0]
    tags = []
    for segment in after_tb.split(";"):
        strategy = re.search(r"under (\w+)", segment)
        for tag in re.finditer(r"([\w-]+/[\w*<>/-]*[\w*>])(\s*\(when any image is\))?", segment):
            if not tag.group(2):
                tags.append((tag.group(1), strategy.group(1) if strategy else None))
    assert len(tags) >= 10, f"read only {tags} from docs/data-and-configs.md's sketch: update _sketch with the text"
    return files, tags


def _check_run_folder_sketch(run: Path) -> None:
    files, tags = _sketch()
    present = [str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()]
    for name in files:
        pattern = re.sub(r"\\\*", ".*", _number_pattern(name))
        assert any(re.fullmatch(r"(?:checkpoints/)?" + pattern, p) for p in present), \
            f"docs/data-and-configs.md's sketch lists {name}; the run folder holds {sorted(present)}"
    found = _event_tags(run)
    for tag, strategy in tags:
        if strategy is not None and not run.parent.name.startswith(strategy + "-"):
            continue
        prefix = tag.split("<", 1)[0].rstrip("*")
        ok = any(t.startswith(prefix) for t in found) if prefix != tag else tag in found
        assert ok, f"docs/data-and-configs.md's sketch lists the tag {tag}; the run wrote {sorted(found)}"


def _event_tags(run: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for events in run.glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0, "images": 1, "tensors": 0})
        acc.Reload()
        found = acc.Tags()
        tags |= set(found["scalars"]) | set(found["images"]) | set(found["tensors"])
    return tags


def _check_timeline(result: dict, run: Path) -> None:
    text = (ROOT / "docs" / "timeline.md").read_text()
    example = re.search(r"^(step timeline of .*)$", text, re.M).group(1)
    pattern = _number_pattern(example).replace(re.escape("logs/lenet/ddp-2x1-cpu/version_"), r"\S*logs/lenet/"
                                                                                            r"ddp-2x1-cpu/version_")
    lines = (result["stdout"] + result["stderr"]).splitlines()
    assert any(re.fullmatch(pattern, line) for line in lines), f"docs/timeline.md shows `{example}`; none printed"
    files = [f for f in re.findall(r"^\| `([^`]+)`", text, re.M) if re.fullmatch(r"[\w<>*-]+\.\w+(`, `.*)?", f)]
    written = [p.name for p in (run / "timeline").iterdir()]
    for name in files:
        for one in re.split(r"`, `", name):
            pattern = re.sub(r"<\w+>", r"\\d+", re.escape(one).replace(r"<r>", "<r>"))
            assert any(re.fullmatch(pattern, w) for w in written), f"docs/timeline.md lists {one}; written: {written}"
    found = _event_tags(run)
    assert "timeline/steps" in found, sorted(found)
    assert any(re.fullmatch(r"timeline/rank\d+/\w+_ms", t) for t in found), sorted(found)


def _check_stage_folder(stage: str, work: Path, before: set, shown: str) -> None:
    """docs/compare-runs.md: `validate` and `test` write their runs under `logs/lenet/<stage>/<layout>/`."""
    text = " ".join((ROOT / "docs" / "compare-runs.md").read_text().split())
    example = re.search(r"write their runs under a stage folder, `(logs/lenet/test/[^`]+)`", text).group(1)
    pattern = re.sub(r"<\w+>", r"\\w+", re.escape(example.replace("/test/", f"/{stage}/"))) + ".+"
    new = [str(p.relative_to(work)) for p in (work / "logs").rglob("*") if p.is_file() and p not in before]
    assert any(re.fullmatch(pattern, p) for p in new), f"docs/compare-runs.md: `{stage}` writes its run under " \
        f"{example.replace('/test/', f'/{stage}/')}; new files: {new}\n{shown}"


def _check_predict(result: dict, work: Path, before: set, shown: str) -> None:
    text = (ROOT / "docs" / "predict.md").read_text()
    example = re.search(r"`(predictions: [^`]+)`", text).group(1)
    csv = work / "logs" / "lenet" / "predict" / "predictions_0.csv"
    assert csv.is_file(), f"docs/predict.md and README say the CSV is logs/lenet/predict/predictions_0.csv\n{shown}"
    new = [p for p in (work / "logs").rglob("*") if p.is_file() and p not in before]
    assert new == [csv], f"docs/predict.md: a predict run adds nothing but its CSV; it wrote {new}"
    assert len(csv.read_text().splitlines()) == 1 + 3, csv.read_text()
    pattern = _number_pattern(example).replace(re.escape("/home/me/fmnist/"), re.escape(str(work.resolve())) + "/")
    lines = (result["stdout"] + result["stderr"]).splitlines()
    assert any(re.fullmatch(pattern, line) for line in lines), f"docs/predict.md shows `{example}`\n{shown}"


def _get(base: str, path: str, data: bytes | None = None):
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"} if data
                                     else {})
    with urllib.request.urlopen(request, timeout=30) as response:
        body = response.read()
    return json.loads(body) if response.headers.get_content_type() == "application/json" else body


def _compare_runs_promises() -> dict[str, list[str]]:
    """What docs/compare-runs.md says SCALARS, IMAGES and HPARAMS show, read from its text."""
    text = (ROOT / "docs" / "compare-runs.md").read_text()
    section = text.split("## 2. TensorBoard", 1)[1].split("### Compressed", 1)[0]
    scalars_bullet = section.split("- **SCALARS**", 1)[1].split("- **HPARAMS**", 1)[0]
    hparams_bullet = section.split("- **HPARAMS**", 1)[1].split("- **Per class**", 1)[0]
    per_class = section.split("- **Per class**", 1)[1]
    ticked = re.search(r"\*\*The five columns shown\*\*(.*?)- \*\*One tick", hparams_bullet, re.S).group(1)
    away = re.search(r"\*\*One tick away\*\*(.*?)Switches show", hparams_bullet, re.S).group(1)
    left_out = re.search(r"Settings that only locate.*?\((.*?)\)", hparams_bullet, re.S).group(1)
    return {
        "scalars": re.findall(r"`(\w+/[\w/]+)`", scalars_bullet.split("Under `split_allreduce`")[0]),
        "ours_scalars": re.findall(r"`(comm/\w+)`", scalars_bullet),
        "columns": [c for c in re.findall(r"`(run/\w+)`", ticked)],
        "more_columns": [c for c in re.findall(r"`([a-z_/]+)`", away) if c not in
                         ("none", "ring", "reduce_broadcast", "hierarchical", "torch", "bf16", "powersgd")],
        "left_out": re.findall(r"`(\w+)`", left_out),
        "row_name": re.search(r"e\.g\.\s+`(v\d+ [^`]+)`", hparams_bullet).group(1),
        "length": re.search(r"what the run actually trained, e\.g\.\s+`([^`]+)`", hparams_bullet).group(1),
        "metrics": re.findall(r"^\s*\| `(hp/\w+)` \|", hparams_bullet, re.M),
        "per_class": [t.replace("<class>", "T-shirt_top") for t in re.findall(r"`(\w+/acc_per_class/<class>)`",
                                                                                per_class)],
        "images": re.findall(r"`((?:val|test)/(?:confusion_matrix|misclassified))`", per_class),
    }


def _check_tensorboard(argv: list[str], work: Path) -> None:
    """Start `tensorboard --logdir ...` on a loopback port and read what its pages read, through its HTTP API."""
    logdir = argv[argv.index("--logdir") + 1]
    program = Path(sys.executable).parent / "tensorboard"
    port = free_port()
    server = subprocess.Popen([str(program), *argv[1:], "--host", "127.0.0.1", "--port", str(port)], cwd=work,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env(), start_new_session=True)
    base = f"http://127.0.0.1:{port}/data"
    try:
        runs, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline and len(runs) < 3:
            try:
                runs = [r for r in _get(base, "/runs") if "version_" in r]
            except OSError:
                pass
            time.sleep(0.5)
        assert len(runs) >= 3, f"TensorBoard on {logdir} lists {runs}"
        _check_served(base, runs, logdir)
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()


def _check_served(base: str, runs: list[str], logdir: str) -> None:
    promised = _compare_runs_promises()
    assert {"scalars", "images", "hparams"} <= set(_get(base, "/plugins_listing"))
    layouts = {"single-1x1-cpu": None, "split_allreduce-1x2-cpu": None, "ddp-2x1-cpu": None}
    for layout in layouts:
        layouts[layout] = next(r for r in runs if f"{layout}/version_" in r)
    deadline = time.monotonic() + 60
    while True:  # TensorBoard loads runs in the background: wait until every run has its scalars
        scalar_tags = _get(base, "/plugin/scalars/tags")
        if all(set(promised["scalars"]) <= set(scalar_tags.get(run, {})) for run in layouts.values()) \
                or time.monotonic() > deadline:
            break
        time.sleep(1)
    image_tags = _get(base, "/plugin/images/tags")
    for layout, run in layouts.items():
        missing = set(promised["scalars"] + promised["per_class"]) - set(scalar_tags.get(run, {}))
        assert not missing, f"docs/compare-runs.md promises {sorted(missing)} in SCALARS; {run} has none"
        for tag in promised["scalars"]:
            points = _get(base, "/plugin/scalars/scalars?" + urllib.parse.urlencode({"run": run, "tag": tag}))
            assert points and all(len(p) == 3 for p in points), (run, tag, points)
        if layout.startswith("split_allreduce"):
            missing = set(promised["ours_scalars"]) - set(scalar_tags.get(run, {}))
            assert not missing, f"docs/compare-runs.md promises {sorted(missing)} under split_allreduce ({run})"
        missing = set(promised["images"]) - set(image_tags.get(run, {}))
        assert not missing, f"docs/compare-runs.md promises {sorted(missing)} in IMAGES; {run} has none"
        meta = _get(base, "/plugin/images/images?" + urllib.parse.urlencode(
            {"run": run, "tag": "test/confusion_matrix", "sample": 0}))
        png = _get(base, "/plugin/images/individualImage?" + meta[-1]["query"])
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 500, "not 500 px wide"
    experiment = _get(base, "/plugin/hparams/experiment", json.dumps({"experimentName": ""}).encode())
    names = [h["name"] for h in experiment["hparamInfos"]]
    metrics = [m["name"]["tag"] for m in experiment["metricInfos"]]
    assert set(promised["columns"]) <= set(names), (promised["columns"], names)
    assert set(promised["more_columns"]) <= set(names), set(promised["more_columns"]) - set(names)
    assert not set(promised["left_out"]) & set(names), set(promised["left_out"]) & set(names)
    assert [m for m in metrics if m in promised["metrics"]] == promised["metrics"] and "hp_metric" not in metrics, \
        metrics
    groups = _get(base, "/plugin/hparams/session_groups", json.dumps(
        {"experimentName": "", "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE",
                                                   "STATUS_RUNNING"],
         "colParams": [{"hparam": n} for n in names] + [{"metric": {"tag": m}} for m in metrics],
         "startIndex": 0, "sliceSize": 100}).encode())
    rows = {g["name"]: g for g in groups["sessionGroups"]}
    for layout in layouts:
        name, row = next(((name, g) for name, g in rows.items() if f"/{layout} " in name), (None, None))
        assert row is not None, f"HPARAMS has no row for {layout}: {list(rows)}"
        example = promised["row_name"]  # e.g. `v0 lenet/ddp-2x1-cpu (/home/me/logs)`
        shape = _number_pattern(example.split(" (")[0].replace("ddp-2x1-cpu", layout))
        assert re.fullmatch(shape + r" \(.+\)", name), f"docs/compare-runs.md: a row is named like `{example}`: {name}"
        length = row["hparams"]["run/length"]
        assert re.fullmatch(_number_pattern(promised["length"]), length), (promised["length"], length)
        strategy = layout.split("-")[0]
        assert row["hparams"]["run/strategy"] == strategy, row["hparams"]
        assert {m["name"]["tag"] for m in row["metricValues"]} >= set(promised["metrics"]), row["metricValues"]
