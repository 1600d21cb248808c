-- orchestrator: the delegation bridge (docs/orchestrator.md, "Subagent trees").
--
-- A delegation tree lives on sessions (parent_session_id, root_session_id, delegation_depth);
-- each edge parent -> child also has one bridge row here, the invocation that created the
-- child: its symbolic role, and the result the parent is waiting on. SubagentLink (spec) is a
-- sessions row joined with the bridge row whose child_session_id is that session.
--
-- child_session_id is NULL while an invocation is pending and its child not yet started; once
-- set it names exactly one invocation (a session is created by at most one delegation).

CREATE TABLE subagent_invocations (
    id                uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    org_id            uuid NOT NULL,
    parent_session_id uuid NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    child_session_id  uuid UNIQUE REFERENCES sessions (session_id) ON DELETE CASCADE,
    subagent_role     text NOT NULL CHECK (length(subagent_role) <= 64),
    status            text NOT NULL DEFAULT 'pending'
                      CHECK (status IN ('pending', 'ok', 'error', 'timeout', 'cancelled')),
    error_code        text CHECK (length(error_code) <= 128),
    created_at        timestamptz NOT NULL DEFAULT now(),
    finished_at       timestamptz
);
-- the invocations a parent made (the cascade's pending rows); child_session_id is UNIQUE,
-- which indexes the join from a session to its bridge row
CREATE INDEX subagent_invocations_parent ON subagent_invocations (parent_session_id, status);

-- the walks: ListChildren and every tree step read a parent's children in (started_at,
-- session_id) order, the keyset of ListChildren's page tokens
CREATE INDEX sessions_children ON sessions (parent_session_id, started_at, session_id)
    WHERE parent_session_id IS NOT NULL;

ALTER TABLE subagent_invocations ENABLE ROW LEVEL SECURITY;
ALTER TABLE subagent_invocations FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant ON subagent_invocations USING (org_id = current_org())
    WITH CHECK (org_id = current_org());
