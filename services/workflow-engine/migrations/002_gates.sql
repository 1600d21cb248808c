-- Human gates: the decision or answer a governance row records, who made it and when, and how
-- often the gate was escalated (docs/workflow-engine.md "Governance").
--
-- status moves exactly once out of 'pending' (first write wins, a conditional UPDATE under the
-- run's row lock): 'approved' / 'rejected' (an approval gate, or a question answered through
-- ApprovalService.RecordDecision), 'answered' (a prompt), 'expired' (the run's timer applied
-- on_timeout), 'closed' (the run ended). Escalation keeps the row pending with a higher floor.
ALTER TABLE governance
    ADD COLUMN decided_by  text,
    ADD COLUMN decided_at  timestamptz,
    ADD COLUMN answer      jsonb,
    ADD COLUMN comment     text NOT NULL DEFAULT '',
    ADD COLUMN escalations integer NOT NULL DEFAULT 0;

CREATE INDEX governance_pending ON governance (org_id, created_at, id) WHERE status = 'pending';
