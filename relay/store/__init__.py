"""What the drain asks of the database, and who answers it.

`port` is the interface the drain loop's parts talk to, with no database driver behind
it; `postgres` answers it with the statements of relay/sql/drain.sql; `memory` answers it
from a list, for the fast tests of the loop. `lease` holds the lease protocol's SQL
steps, which the elector runs.
"""
