"""Runs `python -m MODULE ARGS` commands in forked children of one process that has already imported the libraries.

Importing torch, Lightning and TensorBoard takes several seconds per process on a 2-core CPU, longer than most
shortened runs themselves. This server imports them once; each command then runs in a child forked from it, as
`python -m MODULE ARGS` would run it: in its own process (and session), with `sys.argv`, the working folder,
the environment and stdout/stderr (files) of its own, `__main__` set by `runpy` as `-m` sets it (so Lightning's
launchers start their other processes with `python -m MODULE ARGS`), and its exit status. The server never
computes anything itself before forking, so no thread pool of torch is running when a child is forked.

Protocol (one JSON object a line): the client writes {"module", "args", "cwd", "env", "stdout", "stderr"}; the
server answers {"pid": ...} at once and {"rc": ...} when the child has ended. Started by
`tests/helpers/doc_commands.py`; run as `python -m tests.helpers.forkserver MODULE [MODULE ...]`, each MODULE a
library to import beforehand.
"""

import importlib
import json
import os
import runpy
import sys
import traceback


def _child(request: dict) -> None:
    """In the forked child: become the command, run it, and leave with its exit status (never returns)."""
    code = 1
    try:
        os.setsid()  # its own process group: a timeout kills it together with every process it started
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.argv = [request["module"], *request["args"]]
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as stop:  # what the interpreter would do with it at exit
            if stop.code is None:
                code = 0
            elif isinstance(stop.code, int):
                code = stop.code
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed stream: nothing left to write
                pass
        os._exit(code)


def main(preload: list[str]) -> None:
    """Import `preload`, then serve requests from stdin until it closes."""
    for name in preload:
        importlib.import_module(name)
    # an entry module imported here would be run a second time by runpy, which warns about it on stderr
    for name in ("src.cli", "src.forecast", "src.scaling.__main__", "src.lab.__main__"):
        sys.modules.pop(name, None)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
