-- An agent step's approval interrupt (docs/workflow-engine.md "Agent steps: in-step approvals"):
-- the frozen checkpoint an interrupt_required attempt left is kept in the same agent_steps row
-- an ask_user's frozen turn uses (tool_call_id = the gated call, checkpoint = the worker's state
-- at the interrupt, answer = the decision as {tool_call_id, result}); `gated` tells the two
-- apart, since they resume differently: an ask with AskUserResume alone, a gated call with
-- InitWorkerSession(resume_checkpoint) and, when it was rejected, the denial in AskUserResume.
ALTER TABLE agent_steps ADD COLUMN gated boolean NOT NULL DEFAULT false;
