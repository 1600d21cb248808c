-- orchestrator: PauseSession / ResumeSession and the cross-session provenance anchor
-- (docs/orchestrator.md, "Pause, resume and provenance").
--
-- A pause commits only at a message boundary (spec: never mid-tool or mid-LLM), so a session
-- knows whether a turn is in flight: turns_running counts the chat turns begun and not yet
-- ended, turn_deadline bounds them (a turn never outlives UPSQUAD_STEP_TIMEOUT; a count left
-- behind by a replica that died mid-turn stops counting once its deadline passed). A pause
-- asked for while a turn runs is recorded (pause_pending, with its reason, source and
-- correlation id) and committed by that turn's end, in the same transaction.
ALTER TABLE sessions
    ADD COLUMN turns_running        integer NOT NULL DEFAULT 0 CHECK (turns_running >= 0),
    ADD COLUMN turn_deadline        timestamptz,
    ADD COLUMN pause_pending        boolean NOT NULL DEFAULT false,
    ADD COLUMN pause_reason         text NOT NULL DEFAULT '' CHECK (length(pause_reason) <= 1024),
    -- PauseSource number (UNSPECIFIED is recorded as OPERATOR)
    ADD COLUMN pause_source         integer NOT NULL DEFAULT 0 CHECK (pause_source BETWEEN 0 AND 5),
    ADD COLUMN pause_correlation_id text NOT NULL DEFAULT ''
                                    CHECK (length(pause_correlation_id) <= 256),
    -- "<session_id>:<loop_iteration>" of the newest checkpoint when the pause committed; ''
    -- when the session had none
    ADD COLUMN pause_checkpoint_key text NOT NULL DEFAULT '',
    ADD COLUMN paused_at            timestamptz,
    -- the AgentStatus the session had when it was paused, given back on resume
    ADD COLUMN pre_pause_status     integer NOT NULL DEFAULT 0,
    -- A child session's anchor in its parent's audit chain: the parent's action that spawned
    -- it and that row's hash when it did (GetProvenanceChain with cross_session verifies the
    -- row still carries it). NULL: the anchor is the parent's newest audit row at or before
    -- the child's start.
    ADD COLUMN spawn_action_id      uuid,
    ADD COLUMN spawn_anchor_hash    text CHECK (spawn_anchor_hash ~ '^[0-9a-f]{64}$');

-- GetProvenanceChain reads a session's rows by seq (the hash chain) and by action id
CREATE INDEX audit_log_session_created ON audit_log (session_id, created_at);
