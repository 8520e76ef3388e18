"""The interpreter's garbage collector, tuned for a process that moves rows all day.

A batch allocates thousands of short-lived containers (rows, header lists, delivery
callbacks). With CPython's default thresholds that starts a young-generation collection
every 700 allocations, and every so often a full one that walks every object the
imports made (pydantic, prometheus-client, confluent-kafka...), none of which will ever
be garbage. Measured on a 100,000-row drain: about a quarter of the relay's CPU time per
message (docs/benchmarks.md).
"""

from __future__ import annotations

import gc

# Young-generation collections every this many net allocations, not 700: a batch's
# garbage is freed by reference counting anyway; this only finds cycles, a little later.
YOUNG_THRESHOLD = 10_000


def tune_garbage_collector() -> None:
    """Call once start-up is done: what exists now lives as long as the process, so it
    moves to the permanent generation and no collection walks it again."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
