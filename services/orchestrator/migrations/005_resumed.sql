-- orchestrator: the resume transition's own values (docs/orchestrator.md, "Pause, resume and
-- provenance"). ResumeSession answers resumed_at and resumed_at_loop, and the SendMessage stream
-- that waited on the pause sends them again in its SessionResumedEvent (spec: "resumed_at is
-- the timestamp of the transition"): both read them from the row, whichever replica resumed.
ALTER TABLE sessions
    ADD COLUMN resumed_at      timestamptz,
    ADD COLUMN resumed_at_loop integer NOT NULL DEFAULT 0;
