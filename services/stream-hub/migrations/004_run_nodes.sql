-- The newest projected transition of every node (workflow_action, per loop lap) of a run.
--
-- A StreamVisibleRuns snapshot row describes the whole run (spec VisibleRunEvent): nodes_total
-- (its action count), nodes_done (actions in a terminal status), open_prompt_count (the open
-- human-answerable gates), the FRESHEST open gate (prompt_kind, prompt_id, needs_input,
-- needs_approval, asked_by_role, co-derived from one row) and is_waiting (at least one node
-- parked on a wait). The run row's status group only mirrors the newest event, which is about
-- ONE action: a run whose gate is open while a parallel branch moves on, or whose counters were
-- last published when it started, would be described wrongly. This table keeps each node's
-- newest state (a row is only replaced by a newer seq, so replicas projecting out of order and
-- redeliveries change nothing) and the snapshot reads the roll-ups from it: a handful of rows
-- per run, one index range per run.
CREATE TABLE run_nodes (
    org_id         uuid NOT NULL,
    run_id         uuid NOT NULL,
    node_id        text NOT NULL,
    iteration      integer NOT NULL DEFAULT 0,
    seq            bigint NOT NULL,
    status         text NOT NULL DEFAULT '',   -- the five-colour fold of the action status
    needs_input    boolean NOT NULL DEFAULT false,
    needs_approval boolean NOT NULL DEFAULT false,
    prompt_kind    integer NOT NULL DEFAULT 0,
    prompt_id      text NOT NULL DEFAULT '',
    asked_by_role  text NOT NULL DEFAULT '',
    is_waiting     boolean NOT NULL DEFAULT false,
    PRIMARY KEY (run_id, node_id, iteration)
);

ALTER TABLE run_nodes ENABLE ROW LEVEL SECURITY;
ALTER TABLE run_nodes FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant ON run_nodes
    USING (org_id = nullif(current_setting('app.org_id', true), '')::uuid)
    WITH CHECK (org_id = nullif(current_setting('app.org_id', true), '')::uuid);

-- The StreamRunStatus snapshot folds a run's nodes from this table too: one row per
-- (node_id, iteration) key, its newest event fetched by primary key, instead of a walk over
-- run_events whose plan depends on statistics (a run that grew fast since the last ANALYZE
-- was read with a plan that scanned every event of the run: tens of ms per snapshot at 40,000
-- events).
--
-- Runs projected before this table: their keys and newest seqs, once, across orgs (the owner,
-- which runs the migrations, is exempt from row-level security while it is not forced), so
-- their status snapshots fold every node. Their state is unknown (status ''), so a
-- visible-run snapshot row of such a run keeps the run row's columns, as before this table.
ALTER TABLE run_events NO FORCE ROW LEVEL SECURITY;
ALTER TABLE run_nodes NO FORCE ROW LEVEL SECURITY;
INSERT INTO run_nodes (org_id, run_id, node_id, iteration, seq)
    SELECT org_id, run_id, node_id, iteration, max(seq) FROM run_events
    WHERE kind = 'n' AND node_id <> ''
    GROUP BY org_id, run_id, node_id, iteration;
ALTER TABLE run_events FORCE ROW LEVEL SECURITY;
ALTER TABLE run_nodes FORCE ROW LEVEL SECURITY;
