-- What relay/store/db.py runs as it opens a session, for the daemon, the CLI or a migration,
-- before anything else. Python asks for any statement of relay/sql/ as QUERIES.<name>.
-- Parameters are named, %(name)s; nothing here is built by string concatenation.

-- name: session_backend
-- The backend that runs this session's statements: not the one the connection announced
-- when a pooler stands between (relay/store/db.py, behind_pooler).
SELECT pg_backend_pid() AS pid;

-- name: apply_settings
-- What a relay session runs with (relay/store/db.py names each setting and says why):
-- its timeouts, which bound every statement, lock wait and idle transaction so a stuck
-- relay never holds a lock on the lease row or the outbox for long; synchronous_commit;
-- the drain's planner settings. On a direct session for the session (`local` false);
-- through a transaction pooler first in each transaction (`local` true), since there a
-- session is one server connection only for one transaction.
SELECT set_config(s.name, s.value, %(local)s)
FROM unnest(%(names)s::text[], %(values)s::text[]) AS s (name, value);

------------------------------------------------------------------------------------
-- Bring your own outbox table (RELAY_OUTBOX_TABLE; own_table.sql has the migration)
------------------------------------------------------------------------------------

-- name: own_table_search_path
-- A daemon session with RELAY_OUTBOX_TABLE reads the table's view first (after
-- own_table_view_check): the search_path it keeps.
SELECT quote_ident(%(schema)s) || ', ' || current_setting('search_path') AS search_path;

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
       -- Where this release reads the table's dead letters, scheduled rows and paused
       -- topics' rows (own_table.sql): the views it finds before the relay's own tables.
       to_regclass(quote_ident(%(schema)s) || '.outbox_dead_letters') IS NOT NULL
       AND to_regclass(quote_ident(%(schema)s) || '.outbox_dead') IS NOT NULL
       AND to_regclass(quote_ident(%(schema)s) || '.outbox_scheduled') IS NOT NULL
       AND to_regclass(quote_ident(%(schema)s) || '.outbox_paused') IS NOT NULL
           AS dead_letter_views,
       coalesce(has_table_privilege(
                    to_regclass(quote_ident(%(schema)s) || '.outbox_dead_letters'), 'SELECT')
                AND has_table_privilege(
                    to_regclass(quote_ident(%(schema)s) || '.outbox_dead'), 'SELECT')
                AND has_table_privilege(
                    to_regclass(quote_ident(%(schema)s) || '.outbox_scheduled'), 'SELECT')
                AND has_table_privilege(
                    to_regclass(quote_ident(%(schema)s) || '.outbox_paused'), 'SELECT'),
                false)
           AS dead_letter_views_readable;
