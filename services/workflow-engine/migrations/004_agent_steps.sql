-- Agent step bookkeeping (docs/workflow-engine.md "Agent steps: retries and ask_user resume"),
-- one row per agent action that needed it:
--   retries      retryable failures retried so far (UPSQUAD_WF_AGENT_RETRIES bounds them);
--   resumes      attempts that resumed a person's answer;
--                neither counts as an acceptance redo (max_redos);
--   tool_call_id the pending ask_user call of the open ask (InputRequired.tool_call_id);
--   checkpoint   the frozen turn (InputRequired.checkpoint), handed back verbatim in
--                AskUserResume.checkpoint; this row is the durable activity boundary the spec's
--                Temporal history was, and it is cleared when the step ends;
--   answer       AskUserResume.answer_tool_result of the resumed attempts ({tool_call_id, result}).
CREATE TABLE agent_steps (
    action_id    uuid PRIMARY KEY,
    org_id       uuid NOT NULL,
    run_id       uuid NOT NULL,
    retries      integer NOT NULL DEFAULT 0,
    resumes      integer NOT NULL DEFAULT 0,
    tool_call_id text NOT NULL DEFAULT '',
    checkpoint   bytea,
    answer       text
);

ALTER TABLE agent_steps ENABLE ROW LEVEL SECURITY;
ALTER TABLE agent_steps FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant ON agent_steps USING (org_id = tenant()) WITH CHECK (org_id = tenant());
REVOKE ALL ON agent_steps FROM PUBLIC;
