"""The guard of tests/helpers/process_guard.py: a test that starts a process without the `slow` marker fails,
naming itself and the fix; one with the marker, and one that starts nothing, pass."""

import subprocess
import sys

import pytest

from tests.helpers.process_guard import recorded_process_starts, unmarked_start_message

pytest_plugins = "pytester"

INNER = '''
import multiprocessing
import subprocess
import sys

import pytest


def test_popen_unmarked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_child_unmarked():
    child = multiprocessing.get_context("spawn").Process(target=print)
    child.start()
    child.join()


@pytest.mark.slow
def test_popen_marked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_nothing_started():
    assert True


@pytest.fixture(scope="module")
def server():
    return subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_module_fixture_unmarked(server):
    assert server.returncode == 0


def test_module_fixture_again(server):  # the fixture's process started for the test before
    assert server.returncode == 0
'''


@pytest.mark.slow  # starts processes: a python for each inner Popen test and a spawned multiprocessing child
def test_an_unmarked_test_that_starts_a_process_fails_naming_itself_and_the_fix(pytester):
    pytester.makeini("[pytest]\nmarkers =\n    slow: starts processes\n")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_inprocess("-p", "tests.helpers.process_guard", "-p", "no:randomly", "-p", "no:xdist")
    result.assert_outcomes(passed=6, errors=3)  # each failing test passes its call and fails at teardown
    out = result.stdout.str()
    for name in ("test_popen_unmarked", "test_child_unmarked", "test_module_fixture_unmarked"):
        assert f"test_inner.py::{name} starts 1 process(es) but is not marked slow" in out, out
    assert "Add @pytest.mark.slow" in out
    for name in ("test_popen_marked", "test_nothing_started", "test_module_fixture_again"):
        assert f"{name} starts" not in out, out


@pytest.mark.slow  # starts a process
def test_recorded_starts_name_the_program():
    with recorded_process_starts() as starts:
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with recorded_process_starts() as nothing:
        pass
    assert len(starts) == 1 and sys.executable in starts[0]
    assert nothing == []
    assert unmarked_start_message("t.py::test_x", slow=True, starts=starts) is None
    assert unmarked_start_message("t.py::test_x", slow=False, starts=[]) is None
    assert "t.py::test_x starts 1 process(es)" in unmarked_start_message("t.py::test_x", slow=False, starts=starts)
