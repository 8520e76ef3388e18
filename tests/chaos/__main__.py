"""`python -m tests.chaos [--long | --medium | --sharded] [--sink S] [--seed N]`: one chaos run, by hand."""

from __future__ import annotations

import argparse
import random
import sys

from tests.chaos.runner import PROFILES, cleanup, run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--long", action="store_true", help="≥100k messages, ≥50 faults")
    group.add_argument("--medium", action="store_true", help="20k messages, 25 faults")
    group.add_argument(
        "--sharded", action="store_true", help="the short profile with RELAY_SHARDS=8"
    )
    parser.add_argument(
        "--sink", choices=("kafka", "nats", "rabbitmq"), default="kafka", help="the sink under test"
    )
    parser.add_argument("--seed", type=int, default=None, help="replay a run")
    parser.add_argument("--keep", action="store_true", help="keep the logs even if it passed")
    args = parser.parse_args()
    name = "long" if args.long else "medium" if args.medium else "short"
    profile = PROFILES["sharded" if args.sharded else name]
    seed = args.seed if args.seed is not None else random.randrange(1, 1_000_000)
    outcome = run(profile, seed, args.sink)
    print(outcome.summary())
    if outcome.report.ok and not args.keep:
        cleanup(outcome)
    return 0 if outcome.report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
