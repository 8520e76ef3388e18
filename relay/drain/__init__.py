"""The drain: while this replica holds the lease, read the next batch, publish it, settle
it. `loop` is the loop; `reader`, `pipeline` and `settler` its three sides; the rest are
the pure rules they share (batches, outcomes, stragglers, pace, progress, giving way).
It talks to the database only through `relay.store.port`, so it runs against the
in-memory store in the unit tests.
"""
