"""`python -m model`: check the lease model (safety runs, then liveness) and print what
each explored. `--mutants`: check each mutant; exit 0 only if every one is caught.
`--fingerprints`: print the current fingerprint of every statement the model names.
`--trails DIR`: keep each counterexample there (the trail and its replay)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from model import checker, fingerprints


def _bounds(defines: checker.Defines) -> str:
    return " ".join(k if v is None else f"{k}={v}" for k, v in defines.items())


def _main_check(trails: Path | None) -> int:
    failed = 0
    began = time.monotonic()
    for item in checker.CHECKS:
        print(f"{item.name}: {item.what}", flush=True)
        print(f"  bounds: {_bounds(item.defines)}", flush=True)
        outcome = checker.check(item.defines, liveness=item.liveness, keep=trails)
        print(f"  {outcome.summary()}", flush=True)
        if outcome.errors != 0 or not outcome.complete:
            failed += 1
            why = outcome.violated or "the search was cut short (depth bound)"
            print(f"  FAILED: {why} (trail of {outcome.trail_steps} steps)")
            print(outcome.trail[-4000:] or outcome.output[-4000:])
    verdict = "no violation" if not failed else f"{failed} check(s) failed"
    print(f"model: {verdict}, {time.monotonic() - began:.1f} s", flush=True)
    return 1 if failed else 0


def _mutants(trails: Path | None) -> int:
    survivors = 0
    for mutant in checker.MUTANTS:
        defines = {**mutant.defines, f"MUTANT_{mutant.name}": None}
        outcome = checker.check(defines, liveness=False, keep=trails)
        caught = outcome.errors > 0 and outcome.trail_steps > 0
        survivors += not caught
        verdict = (
            f"caught: {outcome.violated} violated, trail of {outcome.trail_steps} steps"
            if caught
            else "SURVIVED"
        )
        print(
            f"mutant {mutant.name} ({mutant.what}): {verdict}; "
            f"{outcome.stored:,.0f} states, {outcome.seconds:.1f} s",
            flush=True,
        )
        if caught and outcome.violated != mutant.expect:
            print(f"  note: expected {mutant.expect!r} to be the one violated")
    print(f"mutants: {len(checker.MUTANTS) - survivors}/{len(checker.MUTANTS)} caught")
    return 1 if survivors else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model", description=__doc__)
    parser.add_argument("--mutants", action="store_true", help="every mutant must fail")
    parser.add_argument("--fingerprints", action="store_true", help="print fingerprints")
    parser.add_argument("--trails", type=Path, help="keep counterexamples in this directory")
    args = parser.parse_args(argv)
    if args.fingerprints:
        for record in fingerprints.recorded():
            current = fingerprints.fingerprint(record.name)
            mark = "" if current == record.digest else f"  (model records {record.digest})"
            print(f"sql: {record.file} {record.name} sha256:{current}{mark}")
        return 0
    if (missing := checker.spin_missing()) is not None:
        print(f"model: {missing}", file=sys.stderr)
        return 2
    return _mutants(args.trails) if args.mutants else _main_check(args.trails)


if __name__ == "__main__":
    sys.exit(main())
