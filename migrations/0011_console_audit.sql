-- The operators' console (`relay console`): what it changed, and who changed it.
--
-- Every requeue and discard the console makes writes one row here, in the same
-- transaction as the change itself: who (the login: "token", or the user an
-- authenticating proxy named), when (database clock), what (the row ids chosen, or the
-- filter matched), and how many rows it changed. The console reads it back on its
-- Audit page. Neither the relay nor its CLI writes here; `relay dead-letter requeue`
-- is an operator's shell, which keeps its own trail.
--
-- A new table: no lock on the outbox, nothing for a running relay to notice.
CREATE TABLE IF NOT EXISTS console_audit (
    id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at         timestamptz NOT NULL DEFAULT now(),
    actor      text        NOT NULL,
    action     text        NOT NULL CHECK (action IN ('requeue', 'discard')),
    target     jsonb       NOT NULL,  -- {"ids": [...]} or {"filter": {...}}
    row_count  integer     NOT NULL CHECK (row_count >= 0),
    first_id   bigint,                -- the lowest and highest id it changed
    last_id    bigint,
    note       text                   -- e.g. the per-key order warning shown
);

COMMENT ON TABLE console_audit IS
    'Requeues and discards made from the operators'' console: who, when, what, how many rows.';
