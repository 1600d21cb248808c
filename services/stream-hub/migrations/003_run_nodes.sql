-- The (node_id, iteration) keys of each run with the newest seq of each, kept by the projector
-- in the transaction that inserts a node event. The StreamRunStatus snapshot (one update per
-- key) reads them and fetches each key's event by primary key, instead of walking run_events:
-- the plan of such a walk depends on statistics, and a run that grew fast since the last
-- ANALYZE was read with a plan that scanned every event of the run (tens of ms per snapshot
-- at 40,000 events).
CREATE TABLE run_nodes (
    org_id    uuid NOT NULL,
    run_id    uuid NOT NULL,
    node_id   text NOT NULL,
    iteration integer NOT NULL,
    last_seq  bigint NOT NULL,
    PRIMARY KEY (run_id, node_id, iteration)
);
CREATE POLICY tenant ON run_nodes
    USING (org_id = nullif(current_setting('app.org_id', true), '')::uuid)
    WITH CHECK (org_id = nullif(current_setting('app.org_id', true), '')::uuid);
ALTER TABLE run_nodes ENABLE ROW LEVEL SECURITY;

-- Runs projected before this table: their keys, once, across orgs (the owner, which runs the
-- migrations, is exempt from row-level security while it is not forced), then forced again.
ALTER TABLE run_events NO FORCE ROW LEVEL SECURITY;
INSERT INTO run_nodes (org_id, run_id, node_id, iteration, last_seq)
    SELECT org_id, run_id, node_id, iteration, max(seq) FROM run_events WHERE kind = 'n'
    GROUP BY org_id, run_id, node_id, iteration;
ALTER TABLE run_events FORCE ROW LEVEL SECURITY;
ALTER TABLE run_nodes FORCE ROW LEVEL SECURITY;
