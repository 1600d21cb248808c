-- workflow_engine: workflows, runs, actions, governance rows, event deliveries, schedules,
-- run logs, the audit log, the run queue and the outbox.
--
-- Tenancy: every table carries org_id and row-level security keyed on the transaction-local
-- setting app.org_id (SET LOCAL through set_config(..., true), libcommon/db.c). FORCE makes the
-- policies bind the owning login role too, so the service's own role cannot read across
-- tenants by accident. Three service tables (run_queue, outbox, schedules) hold no tenant
-- content beyond ids and timers; their policy also admits a transaction that set
-- app.service = 'on', which is how the interpreter claims runs, the relay publishes events and
-- the scheduler finds due firings across orgs. Everything a run reads or writes after the
-- claim goes through a transaction scoped to the run's org.

CREATE FUNCTION tenant() RETURNS uuid LANGUAGE sql STABLE AS
    $$ SELECT nullif(current_setting('app.org_id', true), '')::uuid $$;
CREATE FUNCTION service_scope() RETURNS boolean LANGUAGE sql STABLE AS
    $$ SELECT coalesce(current_setting('app.service', true), '') = 'on' $$;

CREATE TABLE workflows (
    id                  uuid PRIMARY KEY,
    org_id              uuid NOT NULL,
    team_id             uuid,
    name                text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    description         text NOT NULL DEFAULT '' CHECK (length(description) <= 2000),
    definition          jsonb NOT NULL,
    created_by          uuid NOT NULL,
    status              text NOT NULL DEFAULT 'draft'
                        CHECK (status IN ('draft', 'active', 'archived')),
    visibility          text NOT NULL DEFAULT 'team' CHECK (visibility IN ('team', 'private')),
    data_classification text NOT NULL DEFAULT 'internal'
                        CHECK (data_classification IN ('public', 'internal', 'confidential',
                                                       'restricted')),
    trigger_type        text NOT NULL DEFAULT 'manual'
                        CHECK (trigger_type IN ('manual', 'schedule')),
    trigger_config      jsonb,
    enabled             boolean NOT NULL DEFAULT false,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    deleted_at          timestamptz
);
CREATE INDEX workflows_list ON workflows (org_id, created_at DESC, id DESC)
    WHERE deleted_at IS NULL;

-- updated_at is stamped on every UPDATE (definition edits, status, enable toggles, delete).
CREATE FUNCTION touch_updated_at() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.updated_at := clock_timestamp();
    RETURN NEW;
END $$;
CREATE TRIGGER workflows_touch BEFORE UPDATE ON workflows
    FOR EACH ROW EXECUTE FUNCTION touch_updated_at();

-- A run keeps the definition it started with (run immunity): edits never reach it.
CREATE TABLE runs (
    id            uuid PRIMARY KEY,
    org_id        uuid NOT NULL,
    workflow_id   uuid NOT NULL REFERENCES workflows (id),
    triggered_by  uuid,
    status        text NOT NULL DEFAULT 'pending'
                  CHECK (status IN ('pending', 'running', 'paused', 'completed', 'failed',
                                    'cancelled')),
    context       jsonb NOT NULL DEFAULT '{}',
    definition    jsonb NOT NULL,
    display_name  text NOT NULL DEFAULT '',
    reason        text NOT NULL DEFAULT '',
    cost_usd      double precision NOT NULL DEFAULT 0,
    event_seq     bigint NOT NULL DEFAULT 0,
    created_at    timestamptz NOT NULL DEFAULT now(),
    started_at    timestamptz NOT NULL DEFAULT now(),
    completed_at  timestamptz,
    paused_at     timestamptz,
    cancelled_at  timestamptz
);
CREATE INDEX runs_by_workflow ON runs (org_id, workflow_id, started_at DESC, id DESC);
CREATE INDEX runs_by_org ON runs (org_id, started_at DESC, id DESC);

-- One row per (step, lap) of a run. lap_key is the path of enclosing loop laps ("" outside
-- loops, "2" in lap 2, "2/1" in lap 1 of an inner loop in lap 2); iteration is the innermost
-- lap (0 outside loops), as on the wire.
CREATE TABLE actions (
    id              uuid PRIMARY KEY,
    org_id          uuid NOT NULL,
    run_id          uuid NOT NULL REFERENCES runs (id),
    step_name       text NOT NULL,
    step_type       text NOT NULL,
    lap_key         text NOT NULL DEFAULT '',
    iteration       integer NOT NULL DEFAULT 0,
    status          text NOT NULL
                    CHECK (status IN ('pending', 'in_progress', 'awaiting_approval', 'waiting',
                                      'escalated', 'approved', 'completed', 'skipped',
                                      'rejected', 'failed')),
    attempt         integer NOT NULL DEFAULT 0,
    idempotency_key text,
    input           jsonb,
    output          jsonb,
    -- the raw outcome received for the current attempt, applied by the interpreter
    result          jsonb,
    feedback        text NOT NULL DEFAULT '',
    agent_id        text NOT NULL DEFAULT '',
    approval_id     uuid,
    blocked_by      text NOT NULL DEFAULT '',
    cost_usd        double precision NOT NULL DEFAULT 0,
    input_tokens    bigint NOT NULL DEFAULT 0,
    output_tokens   bigint NOT NULL DEFAULT 0,
    polls           integer NOT NULL DEFAULT 0,
    deadline_at     timestamptz,
    next_poll_at    timestamptz,
    decided_by      uuid,
    decided_at      timestamptz,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    started_at      timestamptz,
    finished_at     timestamptz,
    UNIQUE (run_id, step_name, lap_key)
);
CREATE INDEX actions_by_run ON actions (run_id, created_at, iteration, id);

-- Human gates (approval gates, prompts, questions): the next issue answers them.
CREATE TABLE governance (
    id                 uuid PRIMARY KEY,
    org_id             uuid NOT NULL,
    run_id             uuid NOT NULL REFERENCES runs (id),
    action_id          uuid NOT NULL REFERENCES actions (id),
    kind               text NOT NULL
                       CHECK (kind IN ('approval_gate', 'user_prompt', 'question_gate')),
    status             text NOT NULL DEFAULT 'pending',
    required_clearance integer NOT NULL DEFAULT 0,
    spec               jsonb NOT NULL DEFAULT '{}',
    created_at         timestamptz NOT NULL DEFAULT now(),
    expires_at         timestamptz
);
CREATE INDEX governance_by_run ON governance (run_id, status);

-- External events, burned per (org, run, event_key, delivery_id) before anything is signalled;
-- consumed_by is the wait action that took it (NULL: buffered for a later wait).
CREATE TABLE event_deliveries (
    org_id      uuid NOT NULL,
    run_id      uuid NOT NULL REFERENCES runs (id),
    event_key   text NOT NULL,
    delivery_id text NOT NULL,
    payload     jsonb NOT NULL DEFAULT '{}',
    received_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    consumed_by uuid,
    PRIMARY KEY (org_id, run_id, event_key, delivery_id)
);
CREATE INDEX event_deliveries_pending ON event_deliveries (run_id, event_key, received_at)
    WHERE consumed_by IS NULL;

CREATE TABLE run_logs (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    org_id    uuid NOT NULL,
    run_id    uuid NOT NULL,
    action_id uuid,
    level     text NOT NULL,
    message   text NOT NULL,
    at        timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX run_logs_by_run ON run_logs (run_id, id);

-- Append-only audit of run control and definition changes.
CREATE TABLE audit_log (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    org_id      uuid NOT NULL,
    member_id   uuid,
    subject_id  uuid NOT NULL,
    action      text NOT NULL,
    reason      text NOT NULL DEFAULT '',
    detail      jsonb NOT NULL DEFAULT '{}',
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Runs with work to do. wake_at NULL: nothing until a result, event or control wakes it;
-- wake_gen counts wake-ups so a release never loses one that arrived during the lease.
CREATE TABLE run_queue (
    run_id      uuid PRIMARY KEY REFERENCES runs (id),
    org_id      uuid NOT NULL,
    wake_at     timestamptz,
    wake_gen    bigint NOT NULL DEFAULT 0,
    lease_owner text,
    lease_until timestamptz
);
CREATE INDEX run_queue_due ON run_queue (wake_at) WHERE wake_at IS NOT NULL;

-- Events and dispatches written in the transaction that made the change; the relay publishes
-- them to JetStream (msg_id de-duplicates a republish after a crash) and deletes them.
CREATE TABLE outbox (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    org_id     uuid NOT NULL,
    subject    text NOT NULL,
    msg_id     text NOT NULL,
    payload    bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE schedules (
    workflow_id  uuid PRIMARY KEY REFERENCES workflows (id),
    org_id       uuid NOT NULL,
    spec         jsonb NOT NULL,
    next_fire_at timestamptz NOT NULL
);
CREATE INDEX schedules_due ON schedules (next_fire_at);

-- One row per firing: the primary key makes a slot start exactly one run across replicas.
CREATE TABLE schedule_firings (
    org_id      uuid NOT NULL,
    workflow_id uuid NOT NULL,
    slot        timestamptz NOT NULL,
    run_id      uuid NOT NULL,
    fired_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workflow_id, slot)
);

DO $$
DECLARE t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['workflows', 'runs', 'actions', 'governance', 'event_deliveries',
                             'run_logs', 'audit_log', 'schedule_firings'] LOOP
        EXECUTE format('ALTER TABLE %I ENABLE ROW LEVEL SECURITY', t);
        EXECUTE format('ALTER TABLE %I FORCE ROW LEVEL SECURITY', t);
        EXECUTE format('CREATE POLICY tenant ON %I USING (org_id = tenant()) '
                       'WITH CHECK (org_id = tenant())', t);
    END LOOP;
    FOREACH t IN ARRAY ARRAY['run_queue', 'outbox', 'schedules'] LOOP
        EXECUTE format('ALTER TABLE %I ENABLE ROW LEVEL SECURITY', t);
        EXECUTE format('ALTER TABLE %I FORCE ROW LEVEL SECURITY', t);
        EXECUTE format('CREATE POLICY tenant_or_service ON %I '
                       'USING (org_id = tenant() OR service_scope()) '
                       'WITH CHECK (org_id = tenant() OR service_scope())', t);
    END LOOP;
END $$;

-- The audit log is append-only, even for the owner.
CREATE FUNCTION refuse_audit_rewrite() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'workflow_engine.audit_log is append-only' USING ERRCODE = 'insufficient_privilege';
END $$;
CREATE TRIGGER audit_log_append_only BEFORE UPDATE OR DELETE ON audit_log
    FOR EACH ROW EXECUTE FUNCTION refuse_audit_rewrite();

REVOKE ALL ON workflows, runs, actions, governance, event_deliveries, run_logs, audit_log,
    run_queue, outbox, schedules, schedule_firings FROM PUBLIC;
