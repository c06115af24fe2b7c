"""The commands of README.md and docs/*.md, read from their fenced code blocks, and a way to run them quickly.

`extract` reads every ```bash / ```sh / ``` block: each logical line (`\\` continuations joined, a `for ... done`
loop kept whole, `# comments` dropped) of a shell block is a command; in a block without a language, only lines
that start like a command (`python `, `bash `, `tensorboard `, ...) are, since such blocks mostly show output.
A `# ...` line right after a command in a shell block is kept as that command's example output.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELL_LANGS = {"bash", "sh", "shell", "console", ""}
COMMAND_START = re.compile(r"^(sudo |python |python3 |bash |tensorboard |torchrun |srun |ip |[A-Z_]+=\S* )")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


@dataclass
class Command:
    """One documented command.

    Args:
        doc: the file it is in, relative to the repository root.
        line: its first line in that file (1-based).
        text: the command as one line, continuations joined and comments dropped.
        example_output: `# ...` lines that follow it in its block, without the `# `.
    """

    doc: str
    line: int
    text: str
    example_output: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def _logical_lines(body: str, first_line: int) -> list[tuple[int, str, bool]]:
    """(line number, text, is_comment) of each logical line: `\\` continuations joined."""
    out, buf, start = [], "", None
    for i, raw in enumerate(body.splitlines()):
        if start is None:
            start = first_line + i
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1].strip() + " "
            continue
        buf += raw.strip()
        stripped = buf.strip()
        if stripped:
            out.append((start, stripped, stripped.startswith("#")))
        buf, start = "", None
    return out


def _strip_comment(text: str) -> str:
    """The command without a trailing `# comment` (a `#` that starts a word, outside quotes)."""
    in_single = in_double = False
    for i, ch in enumerate(text):
        if ch == "'" and not in_double:
            in_single = not in_single
        elif ch == '"' and not in_single:
            in_double = not in_double
        elif ch == "#" and not in_single and not in_double and (i == 0 or text[i - 1].isspace()):
            return text[:i].strip()
    return text.strip()


def extract(paths: list[Path] | None = None) -> list[Command]:
    """Every command of README.md and docs/*.md (or of `paths`), in file order."""
    if paths is None:
        paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    commands: list[Command] = []
    for path in paths:
        text = path.read_text()
        for fence in FENCE.finditer(text):
            lang = fence.group(1).lower()
            if lang not in SHELL_LANGS:
                continue
            first_line = text.count("\n", 0, fence.start(2)) + 1
            loop: Command | None = None
            last: Command | None = None
            for line, logical, is_comment in _logical_lines(fence.group(2), first_line):
                if is_comment:
                    if last is not None and lang:
                        last.example_output.append(logical.lstrip("#").strip())
                    continue
                command = _strip_comment(logical)
                if loop is not None:
                    loop.text += "; " + command
                    if command == "done":
                        commands.append(loop)
                        last, loop = loop, None
                    continue
                if not lang and not COMMAND_START.match(command):
                    last = None
                    continue
                if command.startswith("for ") and command.endswith("; do"):
                    loop = Command(str(path.relative_to(ROOT)), line, command)
                    continue
                last = Command(str(path.relative_to(ROOT)), line, command)
                commands.append(last)
    return commands


def expand_loop(text: str) -> list[str]:
    """`for v in a b; do CMD $v; done` as the commands it runs, in order; any other command as itself."""
    match = re.fullmatch(r"for (\w+) in ([^;]+); do; (.+); done", text)
    if match is None:
        return [text]
    var, values, body = match.groups()
    return [body.replace(f"${var}", value).replace("${" + var + "}", value) for value in values.split()]


class ForkServer:
    """A client of `tests/helpers/forkserver.py`: runs `python -m MODULE ARGS` in a forked child of it."""

    def __init__(self, preload: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.forkserver", *preload], cwd=ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def run(self, module: str, args: list[str], cwd: Path, env: dict[str, str], stdout: Path, stderr: Path,
            timeout: float) -> int:
        """Run `python -m module args` in `cwd` with `env`, its output to the two files; its exit status.

        Raises:
            TimeoutError: it ran longer than `timeout` seconds (it and every process it started are killed).
        """
        request = dict(module=module, args=args, cwd=str(cwd), env=env, stdout=str(stdout), stderr=str(stderr))
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = json.loads(self.proc.stdout.readline())["pid"]
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            try:
                os.killpg(pid, 9)
            except ProcessLookupError:
                pass
            self.proc.stdout.readline()
            raise TimeoutError(f"python -m {module} {shlex.join(args)} ran over {timeout} s")
        return json.loads(self.proc.stdout.readline())["rc"]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
