"""The lease: which replica may publish, until when, under which fencing epoch.

`protocol` is the pure state and its rules, `elector` the thread that keeps this
replica's belief true, `metrics` its series. No database driver here: the SQL steps
are in `relay.store.lease`.
"""
