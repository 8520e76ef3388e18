"""`relay run`, the daemon: `app` wires settings into threads and servers and shuts them
down cleanly; `lanes` runs one drain per shard with its elector and shares shards out
between replicas; `runtime` tunes the interpreter for a process that moves rows all day.
"""
