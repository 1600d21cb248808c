-- stream_hub: the hub's own projection of the workflow-engine's run events and of the
-- orchestrator's captured transcript events (DESIGN.md "Live streams": snapshots come from the
-- hub's store, never from another service's tables).
--
-- Every row belongs to one org. Row-level security is FORCEd, so the owning login role
-- (stream_hub, which the service logs in as) sees only the rows of the org bound to the
-- transaction with set_config('app.org_id', ...) (libcommon db_tx_begin); a transaction
-- without an org sees nothing and can write nothing.
--
-- Writes are idempotent by sequence, so replicas that share the durable consumers, and
-- redeliveries after a crash, never duplicate or regress anything:
--   run_events      primary key (run_id, seq): the engine's per-run outbox sequence;
--   runs            each column group carries the seq that last wrote it and is only
--                   overwritten by a newer one;
--   session_events  primary key (run_id, session_id, seq): the publisher's capture order.

CREATE TABLE run_events (
    org_id    uuid NOT NULL,
    run_id    uuid NOT NULL,
    seq       bigint NOT NULL CHECK (seq > 0),
    kind      "char" NOT NULL CHECK (kind IN ('n', 'r', 'l')), -- node, run, log
    -- node events: the node (workflow_action id) and lap, for the per-node fold
    node_id   text NOT NULL DEFAULT '',
    iteration integer NOT NULL DEFAULT 0,
    at        timestamptz NOT NULL DEFAULT now(),
    -- the RunEvent exactly as published (upsquad.internal.v1.RunEvent)
    body      bytea NOT NULL,
    PRIMARY KEY (run_id, seq)
);
CREATE INDEX run_events_node ON run_events (run_id, node_id, iteration, seq) WHERE kind = 'n';

CREATE TABLE runs (
    org_id         uuid NOT NULL,
    run_id         uuid PRIMARY KEY,
    workflow_id    text NOT NULL DEFAULT '',
    workflow_name  text NOT NULL DEFAULT '',
    team_id        text NOT NULL DEFAULT '',
    visibility     text NOT NULL DEFAULT 'team',
    owner_id       text NOT NULL DEFAULT '',
    display_name   text NOT NULL DEFAULT '',
    -- public run status and the governance roll-up, from the newest event (run or node)
    status         text NOT NULL DEFAULT 'pending',
    needs_input    boolean NOT NULL DEFAULT false,
    needs_approval boolean NOT NULL DEFAULT false,
    prompt_kind    integer NOT NULL DEFAULT 0,
    prompt_id      text NOT NULL DEFAULT '',
    asked_by_role  text NOT NULL DEFAULT '',
    is_waiting     boolean NOT NULL DEFAULT false,
    status_seq     bigint NOT NULL DEFAULT 0,
    -- counters, from the newest run transition
    nodes_total    integer NOT NULL DEFAULT 0,
    nodes_done     integer NOT NULL DEFAULT 0,
    counters_seq   bigint NOT NULL DEFAULT 0,
    -- highest seq projected for the run (any kind)
    last_seq       bigint NOT NULL DEFAULT 0,
    started_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX runs_org_status ON runs (org_id, status, started_at DESC);

CREATE TABLE session_events (
    org_id     uuid NOT NULL,
    run_id     uuid NOT NULL,
    step_name  text NOT NULL,
    action_id  text NOT NULL DEFAULT '',
    iteration  integer NOT NULL DEFAULT 0,
    session_id text NOT NULL,
    seq        integer NOT NULL,
    -- the unredacted TranscriptEvent (upsquad.workflow.v1.TranscriptEvent); redacted on read
    body       bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, session_id, seq)
);
CREATE INDEX session_events_step ON session_events (run_id, step_name, session_id, seq);

ALTER TABLE run_events ENABLE ROW LEVEL SECURITY;
ALTER TABLE run_events FORCE ROW LEVEL SECURITY;
ALTER TABLE runs ENABLE ROW LEVEL SECURITY;
ALTER TABLE runs FORCE ROW LEVEL SECURITY;
ALTER TABLE session_events ENABLE ROW LEVEL SECURITY;
ALTER TABLE session_events FORCE ROW LEVEL SECURITY;

CREATE POLICY tenant ON run_events
    USING (org_id = nullif(current_setting('app.org_id', true), '')::uuid)
    WITH CHECK (org_id = nullif(current_setting('app.org_id', true), '')::uuid);
CREATE POLICY tenant ON runs
    USING (org_id = nullif(current_setting('app.org_id', true), '')::uuid)
    WITH CHECK (org_id = nullif(current_setting('app.org_id', true), '')::uuid);
CREATE POLICY tenant ON session_events
    USING (org_id = nullif(current_setting('app.org_id', true), '')::uuid)
    WITH CHECK (org_id = nullif(current_setting('app.org_id', true), '')::uuid);
