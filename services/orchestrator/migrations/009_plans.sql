-- orchestrator: the autonomous loop's plan (docs/orchestrator.md, "The autonomous loop").
--
-- One row per session that ran in EXECUTION_MODE_AUTONOMOUS: the goal, the todos the PLAN step
-- produced (re-indexed todo-<n>, each with its done flag), the cursor on the active todo, the
-- cycles run, the stall counter and the last response_delta_hash the stall rule compares,
-- and, once the loop ended, its termination reason. Written after every cycle, so a worker
-- crash, an orchestrator restart or a pause between cycles resumes at the same todo.
CREATE TABLE session_plans (
    session_id uuid PRIMARY KEY REFERENCES sessions (session_id) ON DELETE CASCADE,
    org_id     uuid NOT NULL,
    goal       text NOT NULL,
    todos      jsonb NOT NULL,
    cursor     integer NOT NULL DEFAULT 0 CHECK (cursor >= 0),
    cycles     integer NOT NULL DEFAULT 0 CHECK (cycles >= 0),
    stall      integer NOT NULL DEFAULT 0 CHECK (stall >= 0),
    last_hash  text NOT NULL DEFAULT '',
    state      text NOT NULL CHECK (state IN ('running', 'ended')),
    reason     text NOT NULL DEFAULT '',
    updated_at timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE session_plans ENABLE ROW LEVEL SECURITY;
ALTER TABLE session_plans FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant ON session_plans USING (org_id = current_org())
    WITH CHECK (org_id = current_org());
