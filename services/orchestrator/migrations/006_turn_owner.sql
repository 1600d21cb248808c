-- orchestrator: the owner of each chat turn in flight (docs/orchestrator.md, "Dead turns").
--
-- A chat turn counts in flight on its session row (turns_running, migration 003) from
-- SendMessage's start to its end. The replica relaying it may die before the end: kill -9, an
-- OOM kill, a node lost. So each turn in flight also has a lease row here, written in the
-- transaction that begins the turn and deleted by the one that ends it: the replica that runs
-- it (owner, the replica's host:pid) renews renewed_at while the relay lives, and any replica
-- reclaims a lease not renewed for UPSQUAD_TURN_LEASE_TTL, ending the turn as its end would
-- (the count drops, a pending pause commits, the turn_reclaimed audit row).
--
-- Like session_directory, this table has no tenant policy: the reclaim sweep reads the stale
-- leases of every org before it can scope a transaction to one, and a row holds ids, the
-- owner's name and times, no tenant data. The reclaim itself runs scoped to the lease's org.
CREATE TABLE turn_leases (
    -- the turn's message_received audit row: the id the relay already carries to its end
    action_id  uuid PRIMARY KEY,
    session_id uuid NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    org_id     uuid NOT NULL,
    owner      text NOT NULL CHECK (length(owner) <= 160),
    began_at   timestamptz NOT NULL DEFAULT now(),
    renewed_at timestamptz NOT NULL DEFAULT now()
);
-- the sweep: the stalest leases first
CREATE INDEX turn_leases_renewed ON turn_leases (renewed_at);
-- the cascade from a deleted session
CREATE INDEX turn_leases_session ON turn_leases (session_id);
