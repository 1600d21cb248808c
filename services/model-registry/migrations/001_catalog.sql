-- model_registry: the model catalogue.
--
-- The catalogue is global reference data, the same for every org: no row belongs to a tenant,
-- so these tables carry no org_id and need no row-level security (there is nothing to confine;
-- a policy would only hide rows from every reader). Isolation here is about who may write:
--   * only the owning login role (model_registry) writes, and only through the data-file load;
--   * PUBLIC gets nothing;
--   * an optional read-only role, model_registry_readonly, gets SELECT when the deployment
--     created it (reporting, audits); nothing else is granted to anyone;
--   * history is append-only, enforced by triggers so that even the owner cannot rewrite it:
--     price rows are never deleted (a price that leaves the data file is marked withdrawn),
--     models are never deleted (they are unlisted), the change log is never updated or deleted.

CREATE TABLE models (
    model_id           text PRIMARY KEY CHECK (model_id ~ '^[a-z0-9][a-z0-9._-]{0,94}$'),
    provider           text NOT NULL CHECK (provider ~ '^[a-z0-9][a-z0-9-]{0,31}$'),
    display_name       text NOT NULL CHECK (length(display_name) BETWEEN 1 AND 128),
    released_on        date,
    max_context_tokens integer NOT NULL CHECK (max_context_tokens > 0),
    supports_streaming boolean NOT NULL,
    supports_tool_use  boolean NOT NULL,
    tool_use_quality   double precision NOT NULL CHECK (tool_use_quality BETWEEN 0 AND 1),
    reasoning          double precision NOT NULL CHECK (reasoning BETWEEN 0 AND 1),
    code_generation    double precision NOT NULL CHECK (code_generation BETWEEN 0 AND 1),
    structured_ops     double precision NOT NULL CHECK (structured_ops BETWEEN 0 AND 1),
    long_context       double precision NOT NULL CHECK (long_context BETWEEN 0 AND 1),
    evidence           text NOT NULL CHECK (evidence IN ('benchmarks', 'family-position')),
    score_basis        text NOT NULL,
    status             text NOT NULL CHECK (status IN ('active', 'deprecated', 'retired')),
    deprecated_on      date,
    shutdown_on        date,
    successor          text,
    -- false once the model left the data file; kept for history and never served
    listed             boolean NOT NULL DEFAULT true,
    first_loaded_at    timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    CHECK (supports_tool_use OR tool_use_quality = 0)
);

CREATE TABLE model_prices (
    model_id           text NOT NULL REFERENCES models (model_id),
    effective_from     date NOT NULL,
    input_per_million  numeric(14, 6) NOT NULL CHECK (input_per_million BETWEEN 0 AND 10000),
    output_per_million numeric(14, 6) NOT NULL CHECK (output_per_million BETWEEN 0 AND 10000),
    source_url         text NOT NULL CHECK (source_url LIKE 'https://%'),
    verified_on        date NOT NULL,
    note               text NOT NULL DEFAULT '',
    recorded_at        timestamptz NOT NULL DEFAULT now(),
    -- set when the row left the data file (an announcement withdrawn, a mistaken row removed)
    withdrawn_at       timestamptz,
    PRIMARY KEY (model_id, effective_from)
);

-- One row per load of the data file that changed something.
CREATE TABLE catalog_loads (
    load_id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    loaded_at       timestamptz NOT NULL DEFAULT now(),
    catalog_version text NOT NULL,
    file_sha256     text NOT NULL CHECK (file_sha256 ~ '^[0-9a-f]{64}$'),
    source          text NOT NULL,
    loaded_by       text NOT NULL,
    changes         integer NOT NULL DEFAULT 0
);

-- Every change a load made, with the row before and after: the catalogue's history.
CREATE TABLE catalog_changes (
    change_id  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    load_id    bigint NOT NULL REFERENCES catalog_loads (load_id),
    model_id   text NOT NULL,
    kind       text NOT NULL CHECK (kind IN ('model.added', 'model.updated', 'model.unlisted',
                                             'model.relisted', 'price.added', 'price.corrected',
                                             'price.reverified', 'price.withdrawn',
                                             'price.restored')),
    before     jsonb,
    after      jsonb,
    changed_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX catalog_changes_model ON catalog_changes (model_id, change_id);

CREATE FUNCTION refuse_history_rewrite() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'model_registry.%: % is not allowed, the catalogue keeps its history',
        TG_TABLE_NAME, TG_OP USING ERRCODE = 'insufficient_privilege';
END $$;

CREATE TRIGGER models_no_delete BEFORE DELETE ON models
    FOR EACH ROW EXECUTE FUNCTION refuse_history_rewrite();
CREATE TRIGGER model_prices_no_delete BEFORE DELETE ON model_prices
    FOR EACH ROW EXECUTE FUNCTION refuse_history_rewrite();
CREATE TRIGGER catalog_changes_append_only BEFORE UPDATE OR DELETE ON catalog_changes
    FOR EACH ROW EXECUTE FUNCTION refuse_history_rewrite();
CREATE TRIGGER no_truncate_models BEFORE TRUNCATE ON models
    FOR EACH STATEMENT EXECUTE FUNCTION refuse_history_rewrite();
CREATE TRIGGER no_truncate_prices BEFORE TRUNCATE ON model_prices
    FOR EACH STATEMENT EXECUTE FUNCTION refuse_history_rewrite();
CREATE TRIGGER no_truncate_changes BEFORE TRUNCATE ON catalog_changes
    FOR EACH STATEMENT EXECUTE FUNCTION refuse_history_rewrite();

REVOKE ALL ON models, model_prices, catalog_loads, catalog_changes FROM PUBLIC;
REVOKE ALL ON FUNCTION refuse_history_rewrite() FROM PUBLIC;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'model_registry_readonly') THEN
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO model_registry_readonly', current_schema());
        GRANT SELECT ON models, model_prices, catalog_loads, catalog_changes
            TO model_registry_readonly;
    END IF;
END $$;
