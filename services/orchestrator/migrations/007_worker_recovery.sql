-- orchestrator: worker liveness and crash recovery (docs/orchestrator.md, "Crash recovery").
--
-- worker_liveness: the last heartbeat of each worker (RuntimeService.Heartbeat with a worker
-- token), one row per worker_id, shared by every replica. A worker that never heartbeats has
-- no row and is never declared dead (its death is only seen by the calls that fail on it).
--
-- session_placement: which worker holds each live session, mirrored from sessions by a
-- trigger, plus the recovery lease. It holds no tenant data beyond session_directory's (ids and
-- a worker address), so like session_directory it has no row-level security: the sweeper finds
-- the sessions of a dead worker across every org, then scopes each recovery's transactions to
-- the session's org as every other path does.
--
-- The lease (lease_owner, lease_until) is how exactly one replica acts on a session: a
-- replica claims a session with an UPDATE ... FOR UPDATE SKIP LOCKED whose condition is "no
-- lease, or an expired one"; the claim commits before the worker is called (no connection or
-- row lock is held across the RPC), and a replica that dies while acting leaves a lease that
-- expires, after which another replica claims the session again.

CREATE TABLE worker_liveness (
    worker_id       text PRIMARY KEY CHECK (length(worker_id) BETWEEN 1 AND 128),
    last_seen       timestamptz NOT NULL DEFAULT now(),
    active_sessions integer NOT NULL DEFAULT 0
);

CREATE TABLE session_placement (
    session_id  uuid PRIMARY KEY REFERENCES sessions (session_id) ON DELETE CASCADE,
    org_id      uuid NOT NULL,
    worker      text NOT NULL DEFAULT '',
    live        boolean NOT NULL,
    lease_owner text,
    lease_until timestamptz
);
-- the sweeper: live sessions of one worker
CREATE INDEX session_placement_worker ON session_placement (worker) WHERE live AND worker <> '';

-- live: a session a worker may hold state for (suspended sessions are rehydrated by
-- ResumeSession, terminal ones are over)
CREATE FUNCTION session_placement_sync() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO session_placement (session_id, org_id, worker, live)
    VALUES (NEW.session_id, NEW.org_id, NEW.worker, NEW.state IN ('initializing', 'active'))
    ON CONFLICT (session_id) DO UPDATE
        SET worker = EXCLUDED.worker, live = EXCLUDED.live;
    RETURN NULL;
END
$$;

CREATE TRIGGER sessions_placement AFTER INSERT OR UPDATE OF worker, state ON sessions
    FOR EACH ROW EXECUTE FUNCTION session_placement_sync();
