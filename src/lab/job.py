"""One job on every machine of a lab: the same elastic torchrun line in each, faults at a time or a step, each
machine's output in a file of the run folder, and the job's exit status at the end."""

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from src.lab.namespaces import NIC, Lab
from src.lab.spec import Fault

RDZV_PORT = 29400  # every machine has its own port space, so a fixed port never collides with another lab's
# docs/fault_tolerance.md's settings: a lost node is dropped after 2 missed 1-second keep-alives
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"
# seconds after its cut that a cut-off machine gets to exit by itself once the others have ended: none, since with
# Linux's default TCP settings its agent waits about 15 minutes for its rendezvous store (docs/fault_tolerance.md)
CUT_GRACE = 0.0
# what a launcher outside the lab may have set, and would mislead the torchrun agents and workers inside it
_LAUNCHER_VARS = ("SLURM_", "TORCHELASTIC_", "MASTER_", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RANK",
                  "GROUP_RANK", "ROLE_RANK", "LOCAL_WORLD_SIZE")


@dataclass
class Job:
    """What to run on the lab's machines, and how.

    Attributes:
        command: What follows torchrun's options on every machine, e.g. `-m src.cli fit --config ...`.
        out: The run folder: `machineI.txt` (each machine's output) and `lab.txt` (what the lab did) go there.
        procs_per_machine: Processes per machine (torchrun's `--nproc-per-node`).
        min_machines: The fewest machines the job goes on with (torchrun's `--nnodes MIN:N`).
        max_restarts: torchrun's `--max-restarts` (failures, not membership changes).
        job_id: torchrun's `--rdzv-id`; the CLI's `--ckpt_path auto` keeps the run in `elastic-<job_id>`.
        rdzv_conf: torchrun's `--rdzv-conf`, without `is_host` (the lab gives it to machine 0 only).
        faults: Faults to apply.
        timeout: Seconds after which the whole job is stopped (None: no limit).
        echo: Copy machine 0's output to this process's stdout as it comes.
        cut_grace: Seconds after its cut that a cut-off machine is given to exit by itself once the other machines
            have ended; one still running then is killed (0: killed as soon as the others have ended).
    """

    command: list[str]
    out: Path
    procs_per_machine: int = 1
    min_machines: int | None = None
    max_restarts: int = 3
    job_id: str = "lab"
    rdzv_conf: str = RDZV_CONF
    faults: list[Fault] = field(default_factory=list)
    timeout: float | None = None
    echo: bool = True
    cut_grace: float = CUT_GRACE


def torchrun_line(lab: Lab, machine: int, job: Job) -> list[str]:
    """The command that starts `machine`'s torchrun agent, in its namespace and on its cores.

    Every machine gets `--local-addr` with its own address: the namespaces share one hostname, which would
    otherwise resolve to the same address for every machine and point the workers' MASTER_ADDR at the wrong
    one. Machine 0 gets `is_host=true`: it holds the rendezvous endpoint's address, but in a namespace that
    address is not the hostname's, so torchrun would not start the c10d store there by itself.
    """
    n = len(lab.machines)
    host = lab.machines[0].address
    return [*lab.exec_prefix(machine), sys.executable, "-m", "torch.distributed.run",
            "--nnodes", f"{job.min_machines or n}:{n}", "--nproc-per-node", str(job.procs_per_machine),
            "--max-restarts", str(job.max_restarts), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{host}:{RDZV_PORT}", "--rdzv-id", job.job_id,
            "--rdzv-conf", f"{job.rdzv_conf},is_host={'true' if machine == 0 else 'false'}",
            "--local-addr", lab.machines[machine].address, *job.command]


def machine_env(lab: Lab, machine: int, job: Job, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of `machine`'s agent: gloo on its NIC, its cores shared by its processes as intra-op
    threads, and a store of the workers' own in every rendezvous round (docs/fault_tolerance.md)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith(_LAUNCHER_VARS)}
    threads = max(len(lab.machines[machine].cores) // job.procs_per_machine, 1)
    return {**env, "GLOO_SOCKET_IFNAME": NIC, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LAB_MACHINE": str(machine)}


def _option(command: list[str], name: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` in `command` (the last one given), else None."""
    value = None
    for i, word in enumerate(command):
        if word == name and i + 1 < len(command):
            value = command[i + 1]
        elif word.startswith(name + "="):
            value = word.split("=", 1)[1]
    return value


class StepWatch:
    """The newest finished step of the job, from `last_step.txt`, which rank 0 rewrites after every step in the
    run's log folder, `<save_dir>/<model>/<layout>/elastic-<job_id>/`. The save_dir is read from the command
    (`--trainer.logger.init_args.save_dir`, else `--trainer.default_root_dir`, else `logs`); a file older than
    the job is passed over, so a previous run of the same job id does not count.

    The lab reads the file from outside, every 0.1 s, so a fault "after step N" hits at the first look that sees
    step N or later: with steps shorter than that it can be a step or two late (the lab says which step it saw).
    """

    def __init__(self, job: Job, cwd: Path, started: float) -> None:
        root = (_option(job.command, "--trainer.logger.init_args.save_dir")
                or _option(job.command, "--trainer.default_root_dir") or "logs")
        self.root, self.pattern, self.started = cwd / root, f"*/*/elastic-{job.job_id}/last_step.txt", started
        self.path: Path | None = None

    def step(self) -> int | None:
        """The newest finished global step, or None before the first one."""
        if self.path is None:
            fresh = [p for p in self.root.glob(self.pattern) if p.stat().st_mtime >= self.started]
            self.path = fresh[0] if fresh else None
        try:
            return int(self.path.read_text()) if self.path is not None else None
        except (OSError, ValueError):
            return None


def _follow(path: Path, stop: threading.Event) -> None:
    """Copy what is appended to `path` to stdout until `stop` is set (and then the rest)."""
    with open(path, "rb") as f:
        while True:
            chunk = f.read()
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
            elif stop.is_set():
                return
            else:
                time.sleep(0.2)


def exit_status(code: int) -> int:
    """A child's return code as a shell reports it: 128 + N for a process ended by signal N."""
    return 128 - code if code < 0 else code


def job_status(codes: list[int | None], hit: set[int], timed_out: bool = False) -> int:
    """The job's exit status from its machines' torchrun return codes.

    Args:
        codes: Each machine's return code (negative: ended by that signal; None: still running).
        hit: The machines a fault hit: their codes do not count.
        timed_out: The job ran past its timeout.

    Returns:
        124 when timed out, else the first non-zero exit status of a machine no fault hit (machine 0 first, a
        signal N as 128 + N), else 0.
    """
    if timed_out:
        return 124
    return next((exit_status(c) for i, c in enumerate(codes) if i not in hit and c), 0)


def machine_line(machine: int, code: int | None, fault: Fault | None = None, hit_at: float | None = None,
                 ended_at: float | None = None, now: float | None = None) -> str:
    """The lab's last line about one machine, e.g. `machine 2: exit status 1, by itself 41.3 s after the cut (hit
    by a fault: cut after step 6)`.

    Args:
        machine: Its index.
        code: Its torchrun's return code (negative: ended by that signal; None: still running).
        fault: The fault that hit it, if any.
        hit_at: When the fault hit, in seconds on the clock of `ended_at` and `now` (`time.monotonic()`).
        ended_at: When its torchrun was first seen to have exited, on the same clock.
        now: The time of the line, on the same clock (for a cut-off machine still running).

    Returns:
        The line, without the lab's time. A cut-off machine's line says how long after the cut it exited by
        itself, or how long after the cut it was still running (the teardown then kills it).
    """
    cut = fault is not None and fault.kind == "cut" and hit_at is not None
    if code is None:
        state = "still running"
        if cut and now is not None:
            state += f" {now - hit_at:.1f} s after the cut: killed"
    else:
        state = f"exit status {exit_status(code)}"
        if cut and ended_at is not None:
            state += (f", by itself {ended_at - hit_at:.1f} s after the cut" if ended_at >= hit_at
                      else ", ended before the cut")
    cause = f" (hit by a fault: {fault.kind} {fault.when()})" if fault is not None else ""
    return f"machine {machine}: {state}{cause}"


def run_job(lab: Lab, job: Job, say: Callable[[str], None], cwd: Path | None = None) -> int:
    """Start the job on every machine, apply its faults when due, and wait for it to end.

    The job ends when every machine that was neither cut off nor killed has exited. A cut-off machine is then
    given until `job.cut_grace` seconds after its cut to exit by itself (its agent does when its machine's TCP
    gives up on a request to the rendezvous store, docs/fault_tolerance.md); one still running after that, or at
    `job.timeout`, is named and left to the lab's teardown, which kills it. Each machine's last line
    (`machine_line`) says how it ended, a cut-off one's also when.

    Args:
        lab: A lab that is up.
        job: What to run.
        say: Reports what the lab does (a line, without the time, which it adds).
        cwd: Where the command runs (default: the current folder).

    Returns:
        The job's exit status (`job_status`): the cut-off and killed machines' own statuses do not count.
    """
    run = _JobRun(lab, job, say, Path.cwd() if cwd is None else cwd)
    try:
        run.start()
        timed_out = run.apply_faults()
        if not timed_out:
            run.wait_for_cut_off()
        return run.report(timed_out)
    finally:
        run.teardown()


class _JobRun:
    """One run of a job: its torchrun processes and output files, and when each machine's fault hit and when it
    was first seen to have exited (seconds on `time.monotonic()`'s clock)."""

    def __init__(self, lab: Lab, job: Job, say: Callable[[str], None], cwd: Path) -> None:
        self.lab, self.job, self.say, self.cwd = lab, job, say, cwd
        job.out.mkdir(parents=True, exist_ok=True)
        self.tic, self.wall = time.monotonic(), time.time()
        self.deadline = self.tic + job.timeout if job.timeout is not None else float("inf")
        self.procs: list[subprocess.Popen] = []
        self.files: list = []
        self.ended: dict[int, float] = {}  # machine -> when its torchrun was first seen to have exited
        self.hit_at: dict[int, float] = {}  # machine -> when its fault hit
        self.hit: dict[int, Fault] = {}  # machine -> the fault that hit it
        self.pending = sorted(job.faults, key=lambda f: (f.step is not None, f.seconds or 0, f.step or 0))
        self.stop = threading.Event()
        self.follower: threading.Thread | None = None

    def note(self, text: str) -> None:
        self.say(f"{time.monotonic() - self.tic:7.1f} s  {text}")

    def look(self) -> None:
        """Note the machines whose torchrun has exited since the last look (0.1 s apart)."""
        now = time.monotonic()
        for i, p in enumerate(self.procs):
            if i not in self.ended and p.poll() is not None:
                self.ended[i] = now

    def start(self) -> None:
        """torchrun on every machine, each writing to its own file; machine 0's output echoed if asked."""
        for m in self.lab.machines:
            self.files.append(open(self.job.out / f"machine{m.index}.txt", "wb"))  # noqa: SIM115  closed in teardown
            self.procs.append(subprocess.Popen(torchrun_line(self.lab, m.index, self.job), cwd=self.cwd,
                                               stdin=subprocess.DEVNULL, env=machine_env(self.lab, m.index, self.job),
                                               stdout=self.files[-1], stderr=subprocess.STDOUT,
                                               start_new_session=True))
        self.note(f"started torchrun on {len(self.procs)} machines; their output: {self.job.out}/machineI.txt")
        if self.job.echo:
            self.follower = threading.Thread(target=_follow, args=(self.job.out / "machine0.txt", self.stop),
                                             daemon=True)
            self.follower.start()

    def apply_faults(self) -> bool:
        """Until every machine no fault hit has exited: apply each fault when its time or step comes.

        Returns:
            Whether the job ran past its timeout.
        """
        steps = StepWatch(self.job, self.cwd, self.wall)
        while any(self.procs[i].poll() is None for i in range(len(self.procs)) if i not in self.hit):
            self.look()
            if time.monotonic() > self.deadline:
                self.note(f"the job ran past --timeout {self.job.timeout:g} s: stopped")
                return True
            elapsed = time.monotonic() - self.tic
            step = steps.step() if any(f.step is not None for f in self.pending) else None
            for fault in [f for f in self.pending if (f.seconds is not None and elapsed >= f.seconds)
                          or (f.step is not None and step is not None and step >= f.step)]:
                self._apply(fault, step)
            time.sleep(0.1)
        self.look()
        return False

    def _apply(self, fault: Fault, step: int | None) -> None:
        self.pending.remove(fault)
        self.hit[fault.machine] = fault
        if fault.kind == "cut":
            self.lab.cut(fault.machine)
            what = "cut off", "its link is down at the switch, its processes keep running"
        else:
            self.lab.kill(fault.machine)
            what = "killed", "all its processes SIGKILLed"
        self.hit_at[fault.machine] = time.monotonic()
        at_step = f" (step {step})" if step is not None else ""
        self.note(f"machine {fault.machine} {what[0]} {fault.when()}{at_step}: {what[1]}")

    def wait_for_cut_off(self) -> None:
        """A cut-off machine cannot be told that the job is over: give it until cut_grace after its cut to notice
        by itself (and not past --timeout), so that the lab shows whether and when it would have stopped."""
        cut = [i for i, f in self.hit.items() if f.kind == "cut" and self.procs[i].poll() is None]
        grace = self.job.cut_grace
        if any(time.monotonic() < self.hit_at[i] + grace for i in cut):
            which = f"machines {', '.join(map(str, cut))} to exit by themselves" if len(cut) > 1 else \
                f"machine {cut[0]} to exit by itself"
            self.note(f"the others have ended; waiting for cut-off {which}, up to {grace:g} s after the cut "
                      "(--cut-grace)")
        while any(self.procs[i].poll() is None and time.monotonic() < min(self.hit_at[i] + grace, self.deadline)
                  for i in cut):
            self.look()
            time.sleep(0.1)

    def report(self, timed_out: bool) -> int:
        """Each machine's last line, the faults that never came due; the job's exit status."""
        self.look()
        now = time.monotonic()
        codes = [p.poll() for p in self.procs]
        for i, code in enumerate(codes):  # one that exited since the last look ended about now
            self.note(machine_line(i, code, self.hit.get(i), self.hit_at.get(i), self.ended.get(i, now), now))
        for fault in self.pending:
            self.note(f"--{fault.kind} {fault.machine} {fault.when()} never came due")
        return job_status(codes, set(self.hit), timed_out)

    def teardown(self) -> None:
        """Kill what still runs (its machine's processes, then the torchrun itself), stop the echo, close files."""
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                self.lab.kill(i)
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
        self.stop.set()
        if self.follower is not None:
            self.follower.join(timeout=5)
        for f in self.files:
            f.close()
