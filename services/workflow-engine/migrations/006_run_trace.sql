-- The trace id of the call that created a run (its W3C trace id, or the caller's x-request-id),
-- so the work the run does later, on the interpreter's threads and through the outbox, logs and
-- dispatches under it: the agent step dispatch carries it to the orchestrator, which sends it
-- on to the worker (docs/workflow-engine.md "Traces"). '' when the run was not made by a call.
ALTER TABLE runs ADD COLUMN trace_id text NOT NULL DEFAULT ''
    CHECK (length(trace_id) <= 64);
