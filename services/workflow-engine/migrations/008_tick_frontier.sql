-- A tick reads only what it needs (docs/workflow-engine.md "Run model"): the latest lap of each
-- step of the run's definition, one probe of actions_latest per step, instead of every action
-- of the run; and the run's action count (the run budget, UPSQUAD_WF_RUN_MAX_ACTIONS) kept on
-- the run row by the statement that inserts an action, instead of counted from the actions.
CREATE INDEX actions_latest ON actions (run_id, step_name, created_at DESC, id DESC);

ALTER TABLE runs ADD COLUMN actions_count integer NOT NULL DEFAULT 0;

-- Runs in flight during the upgrade keep their budget: count what they have. The tenant policy
-- hides every row from a session without an org, so the owner lifts FORCE for this one
-- statement, inside the migration's transaction.
ALTER TABLE runs NO FORCE ROW LEVEL SECURITY;
ALTER TABLE actions NO FORCE ROW LEVEL SECURITY;
UPDATE runs r SET actions_count = (SELECT count(*) FROM actions a WHERE a.run_id = r.id)
 WHERE r.status IN ('pending', 'running', 'paused');
ALTER TABLE runs FORCE ROW LEVEL SECURITY;
ALTER TABLE actions FORCE ROW LEVEL SECURITY;
