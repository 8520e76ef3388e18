-- Runs once, when the compose PostgreSQL volume is created (docker-entrypoint-initdb.d).
-- The relay's least-privilege runtime role; the `grants` service gives it exactly
-- migrations/grants.sql after `relay migrate` has created the tables. Local use only.
CREATE ROLE relay LOGIN PASSWORD 'relay-dev-only';
