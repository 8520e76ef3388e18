-- Outbox and lease tables for the relay.
--
-- Applications INSERT (topic, key, payload, headers) inside their own transaction;
-- id, message_id and created_at have defaults. The remaining columns are the relay's
-- bookkeeping and are written only by the relay and its CLI.

CREATE TABLE outbox (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id          uuid        NOT NULL DEFAULT gen_random_uuid(),
    topic               text        NOT NULL,
    key                 text,
    payload             bytea,
    headers             jsonb,
    created_at          timestamptz NOT NULL DEFAULT now(),
    -- relay bookkeeping
    sent_at             timestamptz,
    attempts            integer     NOT NULL DEFAULT 0,
    next_attempt_at     timestamptz,
    last_error          text,
    dead_lettered_at    timestamptz,
    dead_letter_reason  text
);

COMMENT ON TABLE outbox IS
    'Transactional outbox: rows written by the application, published by the relay.';
COMMENT ON COLUMN outbox.message_id IS
    'Stable id sent as the message-id header; consumers deduplicate on it.';
COMMENT ON COLUMN outbox.next_attempt_at IS
    'Set after a failed publish; NULL means eligible now.';

-- The drain query walks this index in id order. It holds only unsent, live rows,
-- so its size follows the backlog, not the history of sent rows.
CREATE INDEX outbox_unsent_idx ON outbox (id)
    WHERE sent_at IS NULL AND dead_lettered_at IS NULL;

-- Rows waiting out a retry backoff block later rows of their key. There are few of
-- them, so the per-row "is my key blocked?" probe hits a tiny index.
CREATE INDEX outbox_backoff_idx ON outbox (key, id)
    WHERE sent_at IS NULL AND dead_lettered_at IS NULL AND next_attempt_at IS NOT NULL;

-- Listing and requeueing dead letters.
CREATE INDEX outbox_dead_letter_idx ON outbox (id)
    WHERE dead_lettered_at IS NOT NULL;

CREATE TABLE leases (
    name         text        PRIMARY KEY,
    holder       text,
    epoch        bigint      NOT NULL DEFAULT 0,
    expires_at   timestamptz NOT NULL DEFAULT now(),  -- born expired
    acquired_at  timestamptz,
    renewed_at   timestamptz,
    released_at  timestamptz,
    updated_at   timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE leases IS
    'One row per drained outbox: who may publish, until when, and the fencing epoch.';
COMMENT ON COLUMN leases.epoch IS
    'Fencing token: incremented on every acquisition; marks are conditioned on it.';
