"""`python -m src.lab up|run ...`: a cluster in a box (see `src.lab` and docs/lab.md)."""

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from src.lab import privileges
from src.lab.job import CUT_GRACE, RDZV_CONF, Job, run_job
from src.lab.namespaces import Lab, LabError
from src.lab.spec import (assign_cores, parse_fault, parse_rate, parse_straggler, survivors_note,
                          tcp_give_up_seconds)

EXAMPLE = """example:
  python -m src.lab run --machines 2 --link 100mbit -- -m src.cli fit --config configs/lenet.yaml \\
      --config configs/strategy/split_allreduce_processes.yaml --trainer.devices 1 --ckpt_path auto"""


class Stopped(Exception):
    """SIGTERM or SIGHUP arrived: the lab is torn down as for Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def build_parser() -> argparse.ArgumentParser:
    """The command line of `up` and `run` (the job's command follows `--` and is split off before parsing)."""
    parser = argparse.ArgumentParser(prog="python -m src.lab", description=__doc__, epilog=EXAMPLE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="bring the lab up and hold it until Ctrl-C or SIGTERM, then tear it down")
    run = sub.add_parser("run", help="bring the lab up, run `-- COMMAND` under torchrun on every machine, tear "
                                     "the lab down, and exit with the job's status", epilog=EXAMPLE,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    for p in (up, run):
        p.add_argument("--machines", type=int, default=2, help="emulated machines (default 2)")
        p.add_argument("--cores-per-machine", type=int, default=1, help="cores of each machine (default 1)")
        p.add_argument("--oversubscribe", action="store_true",
                       help="allow more cores in total than this process may use (machines then share cores)")
        p.add_argument("--link", default="1gbit",
                       help="each machine's link rate, both ways, in tc's notation (100mbit, 1gbit) or none "
                            "(default 1gbit)")
        p.add_argument("--straggler", action="append", default=[], metavar="MACHINE=RATE",
                       help="give one machine another link rate, e.g. 1=100mbit (repeatable)")
        p.add_argument("--tcp-retries2", type=int, metavar="N",
                       help="every machine's net.ipv4.tcp_retries2: TCP gives up on unanswered data after N "
                            "retransmissions, e.g. 6: 25 s (default Linux's 15: about 15 minutes)")
    run.add_argument("--procs-per-machine", type=int, default=1, help="torchrun's --nproc-per-node (default 1)")
    run.add_argument("--min-machines", type=int, help="the fewest machines the job goes on with after a loss "
                                                      "(torchrun's --nnodes MIN:N; default: all of them)")
    run.add_argument("--max-restarts", type=int, default=3, help="torchrun's --max-restarts (default 3)")
    run.add_argument("--job", help="torchrun's --rdzv-id: the run folder elastic-JOB of --ckpt_path auto "
                                   "(default: the lab's name, new every time)")
    run.add_argument("--rdzv-conf", default=RDZV_CONF, help=f"torchrun's --rdzv-conf (default {RDZV_CONF}); "
                                                            "machine 0 also gets is_host=true")
    run.add_argument("--cut", action="append", default=[], metavar="MACHINE@WHEN",
                     help="partition a machine: its link goes down, its processes keep running; WHEN is seconds "
                          "after the start (30s) or a step (step6); machines 1 .. N-1 (repeatable)")
    run.add_argument("--cut-grace", type=float, default=CUT_GRACE, metavar="S",
                     help="once the other machines have ended, wait until S seconds after its cut for a cut-off "
                          f"machine to exit by itself, then kill it (default {CUT_GRACE:g}; 0 kills it as soon as the "
                          "others have ended)")
    run.add_argument("--kill", action="append", default=[], metavar="MACHINE@WHEN",
                     help="SIGKILL every process of a machine, WHEN as for --cut (repeatable)")
    run.add_argument("--timeout", type=float, help="stop the job after this many seconds (exit status 124)")
    run.add_argument("--out", type=Path, help="run folder for machineI.txt and lab.txt (default logs/lab/LAB)")
    run.add_argument("--quiet", action="store_true", help="do not copy machine 0's output to the terminal")
    return parser


def _refuse(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None, available: list[int] | None = None) -> int:
    """Parse the command line, check it and the privileges, then bring a lab up, use it and tear it down.

    Args:
        argv: The arguments (default: sys.argv[1:]); the job's command follows `--`.
        available: The cores the lab may use (default: this process's CPU affinity).

    Returns:
        The exit status: the job's for `run`; 0 for `up` ended by Ctrl-C or SIGTERM; 2 for bad input, 1 when
        privileges are missing or the lab cannot be built or torn down, 130 (128 + signal) when `run` is stopped.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    try:
        if args.action == "run" and not command:
            raise ValueError("run needs the job's command after --, e.g. -- -m src.cli fit --config ...")
        if args.action == "up" and command:
            raise ValueError("up takes no command: use run ... -- COMMAND")
        cores, oversubscribed = assign_cores(args.machines, args.cores_per_machine,
                                             sorted(os.sched_getaffinity(0)) if available is None else available,
                                             args.oversubscribe)
        if args.tcp_retries2 is not None:
            tcp_give_up_seconds(args.tcp_retries2)  # refuses a count below 1
        rates = [parse_rate(args.link)] * args.machines
        for text in args.straggler:
            machine, rate = parse_straggler(text, args.machines)
            rates[machine] = rate
        faults = []
        if args.action == "run":
            faults = [parse_fault("cut", t, args.machines) for t in args.cut]
            faults += [parse_fault("kill", t, args.machines) for t in args.kill]
            if args.procs_per_machine < 1 or args.max_restarts < 0:
                raise ValueError("--procs-per-machine must be at least 1 and --max-restarts at least 0")
            if args.cut_grace < 0:
                raise ValueError(f"--cut-grace {args.cut_grace:g} is negative: give seconds, 0 or more")
            if args.min_machines is not None and not 1 <= args.min_machines <= args.machines:
                raise ValueError(f"--min-machines {args.min_machines} is not one of 1 .. {args.machines}")
    except ValueError as e:
        return _refuse(str(e))
    lacking = privileges.missing()
    if lacking:
        return _refuse(lacking, 1)
    return _with_lab(args, command, cores, rates, faults, oversubscribed)


def _with_lab(args, command, cores, rates, faults, oversubscribed) -> int:
    """Bring the lab up, hold it (`up`) or run the job on it (`run`), and tear it down whatever happens."""
    def stop(signum, frame):
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    # Ctrl-C tears the lab down even when the lab was started with SIGINT ignored, as a shell does for a command it
    # starts in the background (Python then installs no handler of its own)
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    lab, log, code = None, None, 1
    try:
        lab = Lab(cores, rates, tcp_retries2=args.tcp_retries2)
        out = (args.out or Path("logs") / "lab" / lab.name) if args.action == "run" else None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            log = open(out / "lab.txt", "a")  # noqa: SIM115  closed below

        def say(text: str) -> None:
            print(f"lab: {text}", flush=True)
            if log is not None:
                log.write(text + "\n")
                log.flush()

        lab.up()
        _describe(lab, args.tcp_retries2, oversubscribed, say)
        if args.action == "up":
            say(f"{lab.name} is up: run a command on machine I with `ip netns exec {lab.name}-mI taskset -c CORES "
                "COMMAND` (its cores as above); Ctrl-C or SIGTERM tears the lab down")
            while True:
                signal.pause()
        code = _run(lab, args, command, faults, out, say)
    except KeyboardInterrupt:
        code = 0 if args.action == "up" else 130
    except Stopped as e:
        code = 0 if args.action == "up" else 128 + e.signum
    except LabError as e:
        code = _refuse(str(e), 1)
    finally:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second Ctrl-C must not cut the teardown short
            signal.signal(s, signal.SIG_IGN)
        if lab is not None:
            problems = lab.teardown()
            for p in problems:
                print(f"error: teardown: {p}", file=sys.stderr)
            print(f"lab: {lab.name} torn down" + (" with problems" if problems else ""), flush=True)
            code = code or (1 if problems else 0)
        if log is not None:
            log.close()
        for s, h in previous.items():
            if h is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(s, h)
    return code


def _describe(lab: Lab, tcp_retries2: int | None, oversubscribed: str, say: Callable[[str], None]) -> None:
    """The lab's lines once it is up: its machines, TCP's give-up time if set, a warning of shared cores."""
    say(f"{lab.name}: {len(lab.machines)} machines on a bridge (namespace {lab.switch})")
    for m in lab.machines:
        say(f"  {m.describe()}")
    if tcp_retries2 is not None:
        say(f"  TCP gives up on unanswered data after {tcp_give_up_seconds(tcp_retries2):g} s "
            f"(net.ipv4.tcp_retries2 = {tcp_retries2} on every machine)")
    if oversubscribed:
        say(oversubscribed)


def _run(lab: Lab, args, command: list[str], faults: list, out: Path, say: Callable[[str], None]) -> int:
    """Run the job on the lab that is up; its exit status."""
    note = survivors_note(faults, len(lab.machines), args.min_machines)
    if note:
        say(note)
    job = Job(command, out, args.procs_per_machine, args.min_machines, args.max_restarts, args.job or lab.name,
              args.rdzv_conf, faults, args.timeout, echo=not args.quiet, cut_grace=args.cut_grace)
    code = run_job(lab, job, say)
    say(f"job ended with exit status {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
