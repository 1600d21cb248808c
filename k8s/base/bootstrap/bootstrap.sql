-- Roles and schemas of the Upsquad database, run by the Job upsquad-db-bootstrap as a role
-- with CREATEROLE and CREATE on the database (managed Postgres: its admin user). Idempotent:
-- every run sets the passwords again (key rotation is a Secret change and a re-run). The same
-- roles and grants as scripts/runtime.sh makes for `make run` (docs/security.md).
--
-- Per service schema S: role S owns the schema and everything in it and runs the migrations
-- (the Job <service>-migrate, Secret <service>-pg-owner); role S_app is what the service logs
-- in as (Secret <service>-pg): it owns nothing, so row-level security always applies to it and
-- it cannot switch it off, and it gets only the rights below. Neither is a superuser or
-- BYPASSRLS. A database made before the split (role S owning everything, services logging in
-- as S) converges: S keeps what it owns, S_app is added. Passwords come from the environment
-- (psql \getenv: PG_PASSWORD_<S> for S_app, PG_PASSWORD_<S>_OWNER for S), never from this
-- file; an empty or unset variable leaves that role's password as it is.
\set ON_ERROR_STOP on
SET client_min_messages = warning;

SELECT format('CREATE ROLE %I LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS', r)
  FROM unnest(ARRAY['orchestrator', 'workflow_engine', 'model_registry', 'stream_hub',
                    'orchestrator_app', 'workflow_engine_app', 'model_registry_app',
                    'stream_hub_app']) AS r
 WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) \gexec

-- each variable is reset first: \getenv leaves it as it was when the environment lacks it
\set pw_orchestrator ''
\getenv pw_orchestrator PG_PASSWORD_ORCHESTRATOR
\set pw_orchestrator_owner ''
\getenv pw_orchestrator_owner PG_PASSWORD_ORCHESTRATOR_OWNER
\set pw_workflow_engine ''
\getenv pw_workflow_engine PG_PASSWORD_WORKFLOW_ENGINE
\set pw_workflow_engine_owner ''
\getenv pw_workflow_engine_owner PG_PASSWORD_WORKFLOW_ENGINE_OWNER
\set pw_model_registry ''
\getenv pw_model_registry PG_PASSWORD_MODEL_REGISTRY
\set pw_model_registry_owner ''
\getenv pw_model_registry_owner PG_PASSWORD_MODEL_REGISTRY_OWNER
\set pw_stream_hub ''
\getenv pw_stream_hub PG_PASSWORD_STREAM_HUB
\set pw_stream_hub_owner ''
\getenv pw_stream_hub_owner PG_PASSWORD_STREAM_HUB_OWNER
SELECT format('ALTER ROLE %I PASSWORD %L', role, pw)
  FROM (VALUES ('orchestrator_app', :'pw_orchestrator'),
               ('orchestrator', :'pw_orchestrator_owner'),
               ('workflow_engine_app', :'pw_workflow_engine'),
               ('workflow_engine', :'pw_workflow_engine_owner'),
               ('model_registry_app', :'pw_model_registry'),
               ('model_registry', :'pw_model_registry_owner'),
               ('stream_hub_app', :'pw_stream_hub'),
               ('stream_hub', :'pw_stream_hub_owner')) AS p (role, pw)
 WHERE pw <> '' \gexec

-- The admin role must be a member of each owner to create a schema owned by it (Postgres 16+
-- no longer implies this for CREATEROLE holders).
SELECT format('GRANT %I TO CURRENT_USER', s)
  FROM unnest(ARRAY['orchestrator', 'workflow_engine', 'model_registry', 'stream_hub']) AS s
 WHERE NOT pg_has_role(current_user, s, 'MEMBER') \gexec

SELECT format('ALTER ROLE %I NOSUPERUSER NOBYPASSRLS', s),
       format('ALTER ROLE %I NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS NOINHERIT',
              s || '_app'),
       format('CREATE SCHEMA IF NOT EXISTS %I AUTHORIZATION %I', s, s),
       format('GRANT USAGE ON SCHEMA %I TO %I', s, s || '_app'),
       format('ALTER DEFAULT PRIVILEGES FOR ROLE %I IN SCHEMA %I '
              'GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO %I', s, s, s || '_app'),
       format('ALTER DEFAULT PRIVILEGES FOR ROLE %I IN SCHEMA %I '
              'GRANT USAGE, SELECT ON SEQUENCES TO %I', s, s, s || '_app'),
       format('GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA %I TO %I', s,
              s || '_app'),
       format('GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA %I TO %I', s, s || '_app'),
       format('ALTER ROLE %I IN DATABASE %I SET search_path = %I', s, current_database(), s),
       format('ALTER ROLE %I IN DATABASE %I SET search_path = %I', s || '_app',
              current_database(), s)
  FROM unnest(ARRAY['orchestrator', 'workflow_engine', 'model_registry', 'stream_hub']) AS s \gexec

-- The migration ledger is the owner's alone (the grant on all tables above included it; the
-- migration runner takes it back too).
SELECT format('REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON %I.schema_migrations FROM %I', s,
              s || '_app')
  FROM unnest(ARRAY['orchestrator', 'workflow_engine', 'model_registry', 'stream_hub']) AS s
 WHERE to_regclass(format('%I.schema_migrations', s)) IS NOT NULL \gexec
