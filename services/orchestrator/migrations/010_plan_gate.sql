-- orchestrator: the gate an autonomous cycle parked on (docs/orchestrator.md, "The autonomous
-- loop", "Durability").
--
-- A gated tool call or an ask_user inside a cycle parks the session on an approval (or prompt)
-- and stops the loop with reason 'gate'; gate_id names that approval, so its decision re-enters
-- the cycle itself (the resume carries the cycle's step_goal) rather than running the turn as a
-- chat turn. NULL whenever the plan is not waiting on a gate of its own.
ALTER TABLE session_plans ADD COLUMN gate_id uuid;
