"""The guard of tests/helpers/process_guard.py: a test that starts a process without the `slow` marker fails,
naming itself and the fix, and so does one with the marker that starts nothing and trains no ResNet-18; one with
the marker that starts a process (itself or through a fixture), and one without it that starts nothing, pass."""

import subprocess
import sys

import pytest

from tests.helpers.process_guard import recorded_process_starts, unearned_slow_message, unmarked_start_message

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


@pytest.mark.slow
def test_slow_starting_nothing():
    assert True


@pytest.mark.slow
def test_slow_resnet18_starting_nothing():  # the marker's other reason: a ResNet-18 training on the CPU
    assert True


@pytest.mark.slow(compute="a long training")
def test_slow_for_its_compute():
    assert True


@pytest.mark.slow
def test_slow_that_skips_itself():
    pytest.skip("not here")


@pytest.fixture(scope="module")
def server():
    return subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_module_fixture_unmarked(server):
    assert server.returncode == 0


def test_module_fixture_again(server):  # the fixture's process started for the test before
    assert server.returncode == 0


@pytest.mark.slow
def test_module_fixture_slow(server):  # served by the process started for a test before: it earns its mark
    assert server.returncode == 0
'''


@pytest.mark.slow  # starts processes: a python for each inner Popen test and a spawned multiprocessing child
def test_an_unmarked_test_that_starts_a_process_fails_naming_itself_and_the_fix(pytester):
    pytester.makeini("[pytest]\nmarkers =\n    slow: starts processes\n")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_inprocess("-p", "tests.helpers.process_guard", "-p", "no:randomly", "-p", "no:xdist")
    # each failing test passes its call and fails at teardown
    result.assert_outcomes(passed=10, errors=4, skipped=1)
    out = result.stdout.str()
    for name in ("test_popen_unmarked", "test_child_unmarked", "test_module_fixture_unmarked"):
        assert f"test_inner.py::{name} starts 1 process(es) but is not marked slow" in out, out
    assert "Add @pytest.mark.slow" in out
    assert "test_inner.py::test_slow_starting_nothing is marked slow but starts no process" in out, out
    assert "Remove its @pytest.mark.slow" in out
    for name in ("test_popen_marked", "test_nothing_started", "test_module_fixture_again", "test_module_fixture_slow",
                 "test_slow_resnet18_starting_nothing", "test_slow_that_skips_itself", "test_slow_for_its_compute"):
        assert f"{name} starts" not in out and f"{name} is marked" not in out, out


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
    assert unearned_slow_message("t.py::test_x", slow=True, started=True) is None
    assert unearned_slow_message("t.py::test_ResNet18", slow=True, started=False) is None
    assert unearned_slow_message("t.py::test_x", slow=False, started=False) is None
    assert "t.py::test_x is marked slow" in unearned_slow_message("t.py::test_x", slow=True, started=False)
