"""Fails every test that starts a process of its own without the `slow` marker, so `-m "not slow"` starts none;
and every test with the marker that neither starts a process nor trains ResNet-18 (the marker's other reason), so
`-m "not slow"` leaves out no test that costs it nothing. A test too long for `-m "not slow"` for its compute alone
says so in the marker: `@pytest.mark.slow(compute="what it trains")`.

Loaded by tests/conftest.py (the fixture and hooks are imported there) and usable as a pytest plugin
(`-p tests.helpers.process_guard`). What counts as a start: `subprocess.Popen` (and so `subprocess.run`,
`check_output`, ...) and `multiprocessing`'s `Process.start` in any context (fork, spawn, forkserver; and so
`torch.multiprocessing.spawn`, Lightning's spawned DDP processes, process pools). pytest-xdist's own workers are
started by the controller before any test runs, outside every test, so they never count.

A start is recorded, not refused: the test runs exactly as it would without the guard (refusing could be caught
and turned into some other failure by the code under test), and fails at teardown with a message naming it. Two
hook wrappers record the test's setup (every fixture it requests, whatever their scope: a module-scoped fixture
that starts a process counts for the first test that sets it up) and its call; the autouse fixture checks both
at teardown. A fixture of any scope whose setup started a process counts for every test that uses it: a slow test
served by a module-scoped server started for the test before it still earns its mark. A test whose call raised
(failed, or skipped itself) is not judged on its mark.
"""

import multiprocessing.process
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def recorded_process_starts() -> Iterator[list[str]]:
    """Record every process started from any thread while the block runs.

    Yields:
        A list that grows by one description per start: the program (`Popen`'s first argument) or the
        multiprocessing child's name and target.
    """
    starts: list[str] = []
    lock = threading.Lock()
    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def recording_popen_init(self, args, *rest, **kwargs):
        with lock:
            starts.append(f"subprocess.Popen({args!r})"[:200])
        return popen_init(self, args, *rest, **kwargs)

    def recording_process_start(self):
        target = getattr(self, "_target", None)
        with lock:
            starts.append(f"multiprocessing {type(self).__name__} {self.name!r} (target {target!r})"[:200])
        return process_start(self)

    subprocess.Popen.__init__ = recording_popen_init
    multiprocessing.process.BaseProcess.start = recording_process_start
    try:
        yield starts
    finally:
        subprocess.Popen.__init__ = popen_init
        multiprocessing.process.BaseProcess.start = process_start


def unmarked_start_message(nodeid: str, slow: bool, starts: list[str]) -> str | None:
    """The failure message for a test that started processes without being marked slow; None if it may.

    Args:
        nodeid: The test's pytest id.
        slow: Whether the test carries the `slow` marker (itself, its class or its module).
        starts: What it started, from `recorded_process_starts`.
    """
    if slow or not starts:
        return None
    shown = "\n  ".join(starts[:5]) + (f"\n  ... and {len(starts) - 5} more" if len(starts) > 5 else "")
    return (f"{nodeid} starts {len(starts)} process(es) but is not marked slow, so `-m \"not slow\"` would run it:\n"
            f"  {shown}\nAdd @pytest.mark.slow to the test (or pytestmark = pytest.mark.slow to its module).")


def unearned_slow_message(nodeid: str, slow: bool, started: bool) -> str | None:
    """The failure message for a test marked slow that neither started a process nor trains ResNet-18; None if not.

    Args:
        nodeid: The test's pytest id ("resnet" in it, in any case, names a ResNet-18 training).
        slow: Whether the test carries the `slow` marker without a `compute` reason.
        started: Whether the test, or a fixture it uses, started a process.
    """
    if not slow or started or "resnet" in nodeid.lower():
        return None
    return (f"{nodeid} is marked slow but starts no process and trains no ResNet-18, so `-m \"not slow\"` leaves "
            "it out for nothing.\nRemove its @pytest.mark.slow (or its module's pytestmark), or name the compute that "
            "makes it long: @pytest.mark.slow(compute=\"...\").")


_STARTS = pytest.StashKey[dict[str, list[str]]]()
_CALL_RAISED = pytest.StashKey[bool]()
_STARTING_FIXTURES: set[str] = set()  # names of the fixtures whose setup started a process, in this session


def _record(item: pytest.Item, phase: str) -> Iterator[None]:
    with recorded_process_starts() as starts:
        outcome = yield
    item.stash.setdefault(_STARTS, {})[phase] = list(starts)
    if phase == "call":
        item.stash[_CALL_RAISED] = outcome.excinfo is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request) -> Iterator[None]:
    """Remember the fixtures whose setup started a process: a test using one earns its slow mark."""
    with recorded_process_starts() as starts:
        yield
    if starts:
        _STARTING_FIXTURES.add(fixturedef.argname)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """Record the processes started while the test's fixtures are set up."""
    yield from _record(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Record the processes started while the test runs."""
    yield from _record(item, "call")


@pytest.fixture(autouse=True)
def only_slow_tests_start_processes(request) -> Iterator[None]:
    """Autouse: fail the test at teardown if its setup or call started a process without the `slow` marker, or if
    it carries the marker and started none (itself or through a fixture), trains no ResNet-18 and names no compute."""
    yield
    item = request.node
    phases = item.stash.get(_STARTS, {})
    starts = [*phases.get("setup", []), *phases.get("call", [])]
    marker = item.get_closest_marker("slow")
    message = unmarked_start_message(item.nodeid, marker is not None, starts)
    if message is None and not item.stash.get(_CALL_RAISED, True):
        started = bool(starts) or any(name in _STARTING_FIXTURES for name in item.fixturenames)
        # `slow(compute="...")` names a training too long for `-m "not slow"` that needs no process of its own
        message = unearned_slow_message(item.nodeid, marker is not None and "compute" not in marker.kwargs, started)
    if message:
        pytest.fail(message, pytrace=False)
