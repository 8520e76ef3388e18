"""Runs Spin on model/lease.pml: each check is compiled and run in a directory of its own
(never the source tree), and what it found is read back from pan's report."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from model.fingerprints import MODEL

Defines = Mapping[str, int | None]  # -DNAME=value, or -DNAME for None

# The bounds of each check; the model's own defaults are in lease.pml. Each run is
# exhaustive within its bounds (no bit-state hashing); together they cover the faults.
LEASES: Defines = {"CRASHES": 1, "LET_GOS": 1, "SINK_FAULTS": 0, "RECOUNTS": 0, "EMAX": 2}
SINK: Defines = {"ONE_COUNT": None, "CRASHES": 0, "LET_GOS": 0, "SINK_FAULTS": 1, "EMAX": 2}
LIVE: Defines = {
    "LIVENESS": None,
    "CRASHES": 1,
    "LET_GOS": 0,
    "SINK_FAULTS": 1,
    "EMAX": 3,
    "PAUSE_TICKS": 2,
}


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    what: str
    defines: Defines
    liveness: bool = False


@dataclass(frozen=True, slots=True)
class Mutant:
    name: str  # the model's -DMUTANT_<name>
    what: str
    defines: Defines
    expect: str  # the property whose violation catches it


CHECKS = (
    Check(
        "safety/leases",
        "counts 1,2,2 (a change of shard count), crash, give-way, pauses",
        LEASES,
    ),
    Check("safety/sink", "counts 2,2,2, a sink failure or straggler, pauses", SINK),
    Check(
        "liveness",
        "weak fairness: every row settled or dead-lettered once faults stop",
        LIVE,
        liveness=True,
    ),
)

MUTANTS = (
    Mutant("NO_FENCE", "the settle writes without its fence", LEASES, "fenced settle"),
    Mutant(
        "NO_EPOCH_CHECK",
        "the take is no compare-and-swap (no epoch check, no snapshot)",
        LEASES,
        "one holder per row",
    ),
    Mutant(
        "LATE_DEADLINE",
        "the local deadline from a clock read after the acquisition",
        LEASES,
        "one holder per row",
    ),
    Mutant(
        "EARLY_RELEASE",
        "the give-way releases before its last settle lands",
        LEASES,
        "clean hand-over",
    ),
    Mutant(
        "NO_KEY_HOLD",
        "the drain does not hold back a straggler's key",
        SINK,
        "per-key order",
    ),
    Mutant(
        "NO_COUNT_CHECK",
        "the shard-count claim ignores live leases of the other count",
        LEASES,
        "one holder per row",
    ),
)

_NUMBER = r"([0-9.e+]+)"


@dataclass(slots=True)
class Outcome:
    """What one pan run reported."""

    output: str
    seconds: float
    errors: int = -1
    stored: float = 0
    transitions: float = 0
    depth: int = 0
    vector: int = 0
    memory_mb: float = 0
    complete: bool = False  # pan searched the whole state space (no depth cut)
    violated: str = ""  # the property a trail violates
    trail_steps: int = 0
    trail: str = ""  # the replayed trail (spin -t -p), when there is one
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"states stored {self.stored:,.0f}, transitions {self.transitions:,.0f}, "
            f"depth {self.depth}, vector {self.vector} B, memory {self.memory_mb:.0f} MB, "
            f"{self.seconds:.1f} s, errors {self.errors}"
        )


def spin_missing() -> str | None:
    """Why the model cannot be checked here, or None."""
    for tool in ("spin", "gcc"):
        if shutil.which(tool) is None:
            return f"{tool} not found: `./dev model` installs it (Debian packages spin, gcc)"
    return None


def _flags(defines: Defines) -> list[str]:
    return [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in defines.items()]


def _run(argv: list[str], cwd: Path) -> str:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0 and argv[0] != "./pan":
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout + done.stderr


def _read(outcome: Outcome) -> None:
    text = outcome.output

    def number(pattern: str) -> float:
        found = re.search(pattern, text)
        return float(found.group(1)) if found else 0.0

    outcome.errors = int(number(r"errors: (\d+)"))
    outcome.stored = number(_NUMBER + r" states, stored")
    outcome.transitions = number(_NUMBER + r" transitions")
    outcome.depth = int(number(r"depth reached (\d+)"))
    outcome.vector = int(number(r"State-vector (\d+) byte"))
    outcome.memory_mb = number(_NUMBER + r"\s+total actual memory usage")
    outcome.complete = "max search depth too small" not in text and outcome.stored > 0


# A failed assertion's text, as Spin prints it, names its property by what it reads.
_PROPERTIES = (
    ("gcnt==", "fenced settle"),
    ("torel", "clean hand-over"),
    ("landed[j]", "nothing lost"),
    ("st[j]==", "settled once"),
    ("disorder", "per-key order"),
    ("tok[0]!=0", "one holder per row"),
)


def _property(trail: str) -> str:
    """The property the trail violates (model/lease.pml marks each `property:`)."""
    found = re.search(r"text of failed assertion: (.*)", trail)
    if found is None:
        return "eventually done (acceptance cycle)" if "START OF CYCLE" in trail else "?"
    return next((name for text, name in _PROPERTIES if text in found.group(1)), found.group(1))


def check(defines: Defines, *, liveness: bool, keep: Path | None = None) -> Outcome:
    """Compile the model with `defines` and search it: for assertions and the safety
    monitors, or (`liveness`) for a fair cycle that never gets every row done."""
    with tempfile.TemporaryDirectory(prefix="relay-model-") as tmp:
        work = Path(tmp)
        shutil.copy(MODEL, work / "lease.pml")
        flags = _flags(defines)
        _run(["spin", *flags, "-a", "lease.pml"], work)
        cflags = ["-O2", "-w", "-DCOLLAPSE", "-DVECTORSZ=512", "-DMEMLIM=4096"]
        cflags += ["-DNFAIR=3"] if liveness else ["-DSAFETY"]
        _run(["gcc", *cflags, "-o", "pan", "pan.c"], work)
        started = time.monotonic()
        argv = ["./pan", "-m1000000"] + (["-a", "-f"] if liveness else [])
        outcome = Outcome(_run(argv, work), time.monotonic() - started)
        _read(outcome)
        if (work / "lease.pml.trail").exists():
            outcome.trail = _run(["spin", *flags, "-t", "-p", "-g", "lease.pml"], work)
            outcome.trail_steps = len(re.findall(r"^\s*\d+:\s+proc", outcome.trail, re.M))
            outcome.violated = _property(outcome.trail)
            if keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
                stem = "-".join(f[2:].replace("=", "") for f in flags if "MUTANT" in f)
                stem = stem or "trail"
                shutil.copy(work / "lease.pml.trail", keep / f"{stem}.trail")
                (keep / f"{stem}.txt").write_text(outcome.trail, "utf-8")
        return outcome
