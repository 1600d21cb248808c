-- Agent sessions' approvals and prompts (docs/workflow-engine.md "Agent sessions: OpenApproval"):
-- the orchestrator opens them with ApprovalService.OpenApproval when a worker's turn trips a
-- gated tool call (InterruptRequired) or asks the user (InputRequired). They are governance rows
-- like a run's gates, read, listed and decided through the same doors, but they belong to a
-- session instead of a run and an action: a row is one or the other, never both or neither.
ALTER TABLE governance
    ALTER COLUMN run_id DROP NOT NULL,
    ALTER COLUMN action_id DROP NOT NULL,
    ADD COLUMN session_id          uuid,
    ADD COLUMN agent_id            uuid,
    ADD COLUMN tool                text CHECK (length(tool) <= 200),
    ADD COLUMN tool_call_id        text CHECK (length(tool_call_id) <= 200),
    ADD COLUMN requested_by        uuid,
    ADD COLUMN correlation_key     text CHECK (length(correlation_key) BETWEEN 1 AND 200),
    -- opaque to the engine: handed back on approval.decided.<org>, never to a member
    ADD COLUMN pending_tool_intent bytea CHECK (octet_length(pending_tool_intent) <= 65536),
    ADD CONSTRAINT governance_owner CHECK (
        (run_id IS NOT NULL AND action_id IS NOT NULL AND session_id IS NULL)
        OR (run_id IS NULL AND action_id IS NULL AND session_id IS NOT NULL
            AND agent_id IS NOT NULL AND requested_by IS NOT NULL
            AND correlation_key IS NOT NULL AND tool IS NOT NULL));

-- The correlation key (the ask's idempotency key) opens one row per session: a re-driven turn
-- that asks again finds the row it opened.
CREATE UNIQUE INDEX governance_session_key ON governance (org_id, session_id, correlation_key)
    WHERE session_id IS NOT NULL;

-- ApproveAction / RejectAction / EscalateAction find a gate by its action id, or a session's row
-- by its own id (the id ListPendingApprovals lists it under): both arms by index.
CREATE INDEX governance_by_action ON governance (action_id) WHERE action_id IS NOT NULL;

-- A session row's expiry, fired by any replica (a service scan across orgs, like run_queue:
-- ids and a timer, no tenant content). Deleted when the row is decided or expires.
CREATE TABLE approval_timers (
    approval_id uuid PRIMARY KEY,
    org_id      uuid NOT NULL,
    due_at      timestamptz NOT NULL
);
CREATE INDEX approval_timers_due ON approval_timers (due_at);

ALTER TABLE approval_timers ENABLE ROW LEVEL SECURITY;
ALTER TABLE approval_timers FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_or_service ON approval_timers
    USING (org_id = tenant() OR service_scope())
    WITH CHECK (org_id = tenant() OR service_scope());
REVOKE ALL ON approval_timers FROM PUBLIC;
