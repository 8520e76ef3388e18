-- What relay/store/db.py runs as it opens a session, for the daemon, the CLI or a migration,
-- before anything else. Python asks for any statement of relay/sql/ as QUERIES.<name>.
-- Parameters are named, %(name)s; nothing here is built by string concatenation.

-- name: set_session_timeouts
-- Bound every statement, lock wait and idle transaction of a relay session, so a stuck
-- relay can never hold a lock on the lease row or the outbox for long.
SELECT set_config('statement_timeout', %(statement_timeout)s, false),
       set_config('lock_timeout', %(lock_timeout)s, false),
       set_config('idle_in_transaction_session_timeout', %(idle_timeout)s, false),
       set_config('application_name', %(application_name)s, false);

-- name: set_synchronous_commit
-- RELAY_DATABASE_SYNCHRONOUS_COMMIT, for the daemon's sessions: with asynchronous
-- replication a failover can lose acknowledged lease writes and marks; `remote_apply`
-- (or `on` with synchronous standbys) makes them wait for a standby.
SELECT set_config('synchronous_commit', %(synchronous_commit)s, false);

------------------------------------------------------------------------------------
-- Bring your own outbox table (RELAY_OUTBOX_TABLE; own_table.sql has the migration)
------------------------------------------------------------------------------------

-- name: own_table_session
-- A daemon session with RELAY_OUTBOX_TABLE: read the table's view first (then
-- own_table_view_check).
SELECT set_config('search_path',
                  quote_ident(%(schema)s) || ', ' || current_setting('search_path'),
                  false);

-- name: own_table_view_check
-- Whether the view exists, and whether it reads this table (`relay_a_b.c` and `relay_a.b_c`
-- would share a view schema). The relay refuses to start otherwise: it would find the
-- relay's own outbox further down the search_path, or another table's rows. `layout`:
-- the view's comment, which says which release's layout it is.
SELECT to_regclass(quote_ident(%(schema)s) || '.outbox') IS NOT NULL AS view_exists,
       EXISTS (SELECT 1
               FROM pg_rewrite AS r
               JOIN pg_depend AS d ON d.classid = 'pg_rewrite'::regclass AND d.objid = r.oid
               WHERE r.ev_class = to_regclass(quote_ident(%(schema)s) || '.outbox')
                 AND d.refclassid = 'pg_class'::regclass
                 AND d.refobjid = (SELECT c.oid  -- by name: no rights on its schema needed
                                   FROM pg_class AS c
                                   JOIN pg_namespace AS n ON n.oid = c.relnamespace
                                   WHERE n.nspname = split_part(%(table)s, '.', 1)
                                     AND c.relname = split_part(%(table)s, '.', 2)))
           AS view_reads_table,
       obj_description(to_regclass(quote_ident(%(schema)s) || '.outbox'), 'pg_class')
           AS layout,
       -- Where this release reads the table's dead letters and scheduled rows
       -- (own_table.sql): the views it finds before the relay's own tables.
       to_regclass(quote_ident(%(schema)s) || '.outbox_dead_letters') IS NOT NULL
       AND to_regclass(quote_ident(%(schema)s) || '.outbox_dead') IS NOT NULL
       AND to_regclass(quote_ident(%(schema)s) || '.outbox_scheduled') IS NOT NULL
           AS dead_letter_views,
       coalesce(has_table_privilege(
                    to_regclass(quote_ident(%(schema)s) || '.outbox_dead_letters'), 'SELECT')
                AND has_table_privilege(
                    to_regclass(quote_ident(%(schema)s) || '.outbox_dead'), 'SELECT')
                AND has_table_privilege(
                    to_regclass(quote_ident(%(schema)s) || '.outbox_scheduled'), 'SELECT'),
                false)
           AS dead_letter_views_readable;
