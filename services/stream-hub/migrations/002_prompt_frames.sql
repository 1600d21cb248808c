-- stream_hub: the live user_prompt frames the workflow-engine publishes on wfio (one per
-- prompt it opens: a user_input step, an agent's ask_user), captured so that a StreamNodeIO
-- subscriber that comes after the prompt opened still gets the "answer needed" frame (spec:
-- NodeIOFrame.user_prompt is delivered at every clearance so the card can render). A frame is
-- replayed only while the prompt is open: the node's newest projected transition is parked on
-- it (fanout.c). Idempotent by the prompt id (a redelivery changes nothing).
CREATE TABLE prompt_frames (
    org_id     uuid NOT NULL,
    run_id     uuid NOT NULL,
    prompt_id  text NOT NULL,   -- the governance row id == the node's blocked_by
    step_name  text NOT NULL,
    action_id  text NOT NULL DEFAULT '',
    iteration  integer NOT NULL DEFAULT 0,
    -- the NodeIOFrame exactly as published (upsquad.workflow.v1.NodeIOFrame, user_prompt arm)
    body       bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, prompt_id)
);

ALTER TABLE prompt_frames ENABLE ROW LEVEL SECURITY;
ALTER TABLE prompt_frames FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant ON prompt_frames
    USING (org_id = nullif(current_setting('app.org_id', true), '')::uuid)
    WITH CHECK (org_id = nullif(current_setting('app.org_id', true), '')::uuid);
