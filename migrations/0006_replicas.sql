-- Every running replica, as it last reported itself: alive, and able to reach the sink.
--
-- A leader cut off from the broker (or the endpoint) but not from PostgreSQL would
-- otherwise renew its lease forever while a standby that can deliver waits. Each replica
-- writes its row every RELAY_HEARTBEAT_SECONDS; a standby says whether its own probe of
-- the sink succeeded. A leader that has delivered nothing for RELAY_GIVE_WAY_SECONDS
-- while rows wait hands the lease over only if some live replica here says it can
-- reach the sink. Rows of replicas gone for an hour are removed by the others.
--
-- Tiny (one row per replica) and written only by the relay.
CREATE TABLE IF NOT EXISTS replicas (
    lease_name  text        NOT NULL,
    replica_id  text        NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    seen_at     timestamptz NOT NULL DEFAULT now(),  -- database clock
    sink_ok     boolean     NOT NULL,
    sink_error  text,
    PRIMARY KEY (lease_name, replica_id)
);

COMMENT ON TABLE replicas IS
    'Relay replicas per lease: last heartbeat (database clock) and whether each reaches the sink.';
