-- Admission of new runs: idempotency keys and the per-org active-run count.
--
-- Idempotent triggers (docs/workflow-engine.md "Idempotent triggers"): one row per
-- x-upsquad-idempotency-key a TriggerWorkflow carried, naming the run it created. The primary
-- key makes concurrent duplicates race-safe: the second insert waits for the first's
-- transaction and then finds its row. A row older than the window (24 hours) is replaced by
-- the next trigger with that key.
CREATE TABLE trigger_keys (
    org_id     uuid NOT NULL,
    idem_key   text NOT NULL,
    run_id     uuid NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, idem_key)
);

ALTER TABLE trigger_keys ENABLE ROW LEVEL SECURITY;
ALTER TABLE trigger_keys FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant ON trigger_keys USING (org_id = tenant()) WITH CHECK (org_id = tenant());
REVOKE ALL ON trigger_keys FROM PUBLIC;

-- Per-org admission (docs/workflow-engine.md "Per-org admission and fairness") counts an org's
-- pending and running runs on every trigger.
CREATE INDEX runs_active ON runs (org_id) WHERE status IN ('pending', 'running');
