"""The Spin checks of tests/test_model.py, started as soon as the suite is collected.

Each takes a core for a minute or so and needs no server: run in a thread beside the
suite's first tests (which mostly wait on servers), they are done by the time their
tests ask, instead of adding their minutes to the suite's. One after the other, so they
never take both cores.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Each test that checks the model, and the arguments of its `python -m model` run.
RUNS = {
    "test_the_model_checks": (),
    "test_every_mutant_is_caught_with_a_trail": ("--mutants",),
}
_done: dict[str, subprocess.CompletedProcess[str]] = {}
_finished: dict[str, threading.Event] = {}


def run(args: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "model", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def start(selected: Iterable[str]) -> None:
    """Begin the runs of the selected tests, in a background thread."""
    wanted = [name for name in RUNS if name in set(selected) and name not in _finished]
    for name in wanted:
        _finished[name] = threading.Event()

    def work() -> None:
        for name in wanted:
            try:
                _done[name] = run(RUNS[name])
            finally:
                _finished[name].set()

    if wanted:
        threading.Thread(target=work, name="model-runs", daemon=True).start()


def result(name: str) -> subprocess.CompletedProcess[str]:
    """The test's run: the early one's when started, else one now."""
    finished = _finished.get(name)
    if finished is None:
        return run(RUNS[name])
    if not finished.wait(timeout=900):
        raise TimeoutError(f"{name}: the model run took over 15 minutes")
    if name not in _done:
        raise RuntimeError(f"{name}: the early model run failed to start")
    return _done[name]
