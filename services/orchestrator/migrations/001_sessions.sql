-- orchestrator: agents, provider keys, sessions, turns, checkpoints, the audit log and the
-- outcomes of workflow agent steps.
--
-- Tenancy: every table holding tenant data carries org_id and is confined by row-level
-- security to current_setting('app.org_id', true), which libcommon's db_tx_begin() sets per
-- transaction. FORCE makes the policies bind the owning login role too, so a query that
-- forgets its WHERE clause still cannot read another org's rows. The one exception is
-- session_directory (session id -> org id, nothing else): workers heartbeat and checkpoint by
-- session id alone, and the orchestrator must learn which tenant to scope the transaction to.

CREATE FUNCTION current_org() RETURNS uuid LANGUAGE sql STABLE AS $$
    SELECT nullif(current_setting('app.org_id', true), '')::uuid
$$;

-- Agent definitions, provisioned by `upsquad-agents apply` (docs/orchestrator.md). The whole
-- validated document is kept in `definition`; the columns are what lookups need.
CREATE TABLE agents (
    agent_id     uuid PRIMARY KEY,
    org_id       uuid NOT NULL,
    role         text NOT NULL CHECK (role ~ '^[a-z][a-z0-9_-]{0,63}$'),
    display_name text NOT NULL CHECK (length(display_name) BETWEEN 1 AND 128),
    model        text NOT NULL,
    definition   jsonb NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    UNIQUE (org_id, role)
);

-- BYOK provider keys: AES-256-GCM ciphertext (tag appended) under the key-encryption key
-- named by kek_id; the clear key never reaches the database.
CREATE TABLE provider_keys (
    org_id     uuid NOT NULL,
    provider   text NOT NULL CHECK (provider ~ '^[a-z0-9][a-z0-9_-]{0,31}$'),
    kek_id     text NOT NULL,
    nonce      bytea NOT NULL CHECK (length(nonce) = 12),
    ciphertext bytea NOT NULL CHECK (length(ciphertext) > 16),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, provider)
);

CREATE TABLE sessions (
    session_id        uuid PRIMARY KEY,
    org_id            uuid NOT NULL,
    user_id           text NOT NULL,
    agent_id          uuid NOT NULL,
    -- lifecycle: initializing, active, suspended, terminated, error, crashed
    state             text NOT NULL CHECK (state IN ('initializing', 'active', 'suspended',
                                                      'terminated', 'error', 'crashed')),
    -- AgentStatus number last reported (GetSession.status)
    agent_status      integer NOT NULL DEFAULT 0,
    kind              text NOT NULL DEFAULT 'chat' CHECK (kind IN ('chat', 'step')),
    execution_mode    integer NOT NULL DEFAULT 0,
    model_id          text NOT NULL,
    snapshot          bytea NOT NULL,
    snapshot_hash     text NOT NULL CHECK (snapshot_hash ~ '^[0-9a-f]{64}$'),
    loop_count        integer NOT NULL DEFAULT 0,
    max_loops         integer NOT NULL DEFAULT 0,
    turns             integer NOT NULL DEFAULT 0,
    input_tokens      bigint NOT NULL DEFAULT 0,
    output_tokens     bigint NOT NULL DEFAULT 0,
    cost_usd          double precision NOT NULL DEFAULT 0,
    worker            text NOT NULL DEFAULT '',
    last_error        text NOT NULL DEFAULT '',
    parent_session_id uuid,
    root_session_id   uuid,
    delegation_depth  integer NOT NULL DEFAULT 0,
    started_at        timestamptz NOT NULL DEFAULT now(),
    last_heartbeat    timestamptz,
    ended_at          timestamptz
);
-- ListSessions: newest first, keyset on (started_at, session_id)
CREATE INDEX sessions_list ON sessions (org_id, started_at DESC, session_id DESC);
CREATE INDEX sessions_agent ON sessions (org_id, agent_id, started_at DESC, session_id DESC);

CREATE TABLE session_directory (
    session_id uuid PRIMARY KEY,
    org_id     uuid NOT NULL
);

-- Final user and assistant texts, the source of ExecuteStepRequest.prior_turns.
CREATE TABLE turns (
    session_id uuid NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    turn_no    integer NOT NULL,
    org_id     uuid NOT NULL,
    role       smallint NOT NULL CHECK (role IN (1, 2)),
    text       text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (session_id, turn_no)
);

CREATE TABLE checkpoints (
    session_id     uuid NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    loop_iteration integer NOT NULL CHECK (loop_iteration >= 0),
    org_id         uuid NOT NULL,
    schema_version bigint NOT NULL,
    state          bytea NOT NULL,
    sha256         text NOT NULL CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    created_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (session_id, loop_iteration)
);

-- Append-only, hash-chained per session: hash = sha256(prev_hash | seq | action_type |
-- parent_action_id | detail), docs/orchestrator.md.
CREATE TABLE audit_log (
    action_id        uuid PRIMARY KEY,
    session_id       uuid NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    seq              integer NOT NULL,
    org_id           uuid NOT NULL,
    action_type      text NOT NULL,
    agent_id         uuid,
    parent_action_id uuid,
    detail           jsonb NOT NULL DEFAULT '{}',
    prev_hash        text NOT NULL,
    hash             text NOT NULL CHECK (hash ~ '^[0-9a-f]{64}$'),
    created_at       timestamptz NOT NULL DEFAULT now(),
    UNIQUE (session_id, seq)
);

CREATE FUNCTION refuse_audit_rewrite() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit_log is append-only' USING ERRCODE = '42501';
END
$$;
CREATE TRIGGER audit_log_append_only BEFORE UPDATE OR DELETE ON audit_log
    FOR EACH ROW EXECUTE FUNCTION refuse_audit_rewrite();

-- Outcomes of workflow agent steps, keyed by the dispatch's idempotency key: a redelivered
-- dispatch is answered from here and never runs twice.
CREATE TABLE step_results (
    idempotency_key text PRIMARY KEY CHECK (idempotency_key ~ '^[0-9a-f]{64}$'),
    org_id          uuid NOT NULL,
    run_id          uuid NOT NULL,
    session_id      uuid,
    result          bytea,
    state           text NOT NULL CHECK (state IN ('running', 'done')),
    created_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz
);

DO $$
DECLARE t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['agents', 'provider_keys', 'sessions', 'turns', 'checkpoints',
                             'audit_log', 'step_results'] LOOP
        EXECUTE format('ALTER TABLE %I ENABLE ROW LEVEL SECURITY', t);
        EXECUTE format('ALTER TABLE %I FORCE ROW LEVEL SECURITY', t);
        EXECUTE format('CREATE POLICY tenant ON %I USING (org_id = current_org()) '
                       'WITH CHECK (org_id = current_org())', t);
    END LOOP;
END
$$;

