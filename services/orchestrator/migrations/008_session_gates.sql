-- orchestrator: a chat session parked on a human (docs/orchestrator.md, "Approvals and prompts
-- on the chat path").
--
-- One row per approval (a gated tool call: interrupt_required) or prompt (ask_user:
-- input_required) a chat turn opened through the workflow engine's ApprovalService, keyed by
-- the approval id the engine gave it. The approval itself (who may decide, the decision, its
-- audit, expiry) lives in the engine; this row holds what the orchestrator needs to resume the
-- turn from the decision alone, on any replica:
--   message_turn  the user turn the gated turn ran (the resume runs the same message);
--   frozen        a prompt's InputRequired.checkpoint, handed back on AskUserResume (kept only
--                 while the park lasts: cleared when the resume takes it);
--   stream_holder the replica whose SendMessage stream waits on the park (it resumes the turn
--                 on that stream when the decision comes; anyone else leaves it a moment);
--   decision      the ApprovalDecided as it arrived (first write wins);
--   taken_at      set by the one resume that re-enters the turn (exactly once: a
--                 compare-and-set on this row and the session's park, in one transaction).
CREATE TABLE session_gates (
    approval_id   uuid PRIMARY KEY,
    session_id    uuid NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    org_id        uuid NOT NULL,
    kind          text NOT NULL CHECK (kind IN ('approval_gate', 'user_prompt')),
    tool          text NOT NULL,
    tool_call_id  text NOT NULL,
    message_turn  integer NOT NULL CHECK (message_turn >= 1),
    frozen        bytea,
    clearance     integer NOT NULL CHECK (clearance BETWEEN 1 AND 5),
    stream_holder text,
    decision      jsonb,
    taken_at      timestamptz,
    created_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX session_gates_session ON session_gates (session_id);

ALTER TABLE session_gates ENABLE ROW LEVEL SECURITY;
ALTER TABLE session_gates FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant ON session_gates USING (org_id = current_org())
    WITH CHECK (org_id = current_org());
