"""Database roles: row-level security that the service's own login cannot switch off.

Each service schema has two roles (scripts/runtime.sh, docs/security.md): the owner, which
applies the migrations (UPSQUAD_PG_MIGRATE_DSN), and <schema>_app, the login the service runs
as, which owns nothing. This test applies every service's migrations as the owner (`--migrate`
with the split DSNs), runs the workflow-engine end to end as its login role, and then tries,
as each login role, every way of reading past the tenant policy that an owner would have:
ALTER TABLE ... NO FORCE / DISABLE ROW LEVEL SECURITY (the hostile-client run's finding, tried
on workflow_engine.runs and orchestrator.provider_keys), row_security off, a policy dropped,
replaced or added, the table given away, the owner's role taken, a grant to itself, a table or
a SECURITY DEFINER function of its own. Every one is refused, and nothing changed.

Needs the runtime's env (scripts/runtime.sh up; sourced): UPSQUAD_PG_DSN_<SCHEMA> (owner),
UPSQUAD_PG_APP_DSN_<SCHEMA> (login), UPSQUAD_PG_ADMIN_DSN, UPSQUAD_NATS_URL.
"""
import os
import secrets
import subprocess
import sys
import unittest
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import upsquad_testlib as T  # noqa: E402

SERVICES = {  # schema -> (executable, a table holding tenant rows)
    "orchestrator": ("orchestrator", "provider_keys"),
    "workflow_engine": ("workflow-engine", "runs"),
    "model_registry": ("model-registry", None),
    "stream_hub": ("stream-hub", None),
}
ADMIN = os.environ.get("UPSQUAD_PG_ADMIN_DSN")
NATS = os.environ.get("UPSQUAD_NATS_URL")


def dsns(schema):
    env = schema.upper()
    return os.environ.get("UPSQUAD_PG_DSN_" + env), os.environ.get("UPSQUAD_PG_APP_DSN_" + env)


if not ADMIN or not NATS or not all(dsns(s)[0] for s in SERVICES):
    print("SKIP: the runtime's env (UPSQUAD_PG_DSN_*, UPSQUAD_PG_ADMIN_DSN, UPSQUAD_NATS_URL) is "
          "required")
    sys.exit(0)
if not all(dsns(s)[1] for s in SERVICES):  # a runtime whose services log in as the owner
    print("FAIL: the runtime exports no UPSQUAD_PG_APP_DSN_<SCHEMA>: its services log in as the "
          "role that owns their tables")
    sys.exit(1)

import grpc  # noqa: E402
from upsquad.workflow.v1 import workflow_pb2 as W  # noqa: E402


def refused(dsn, sql):
    """psql's error text when sql fails as dsn's role; raises when it succeeds."""
    out = subprocess.run(["psql", dsn, "-X", "-Atq", "-v", "ON_ERROR_STOP=1", "-c", sql],
                         capture_output=True, text=True, timeout=60)
    if out.returncode == 0:
        raise AssertionError("accepted: %s" % sql)
    return out.stderr


class Roles(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # the migrations, applied as each schema's owner while the service's DSN is its login
        for schema, (exe, _) in SERVICES.items():
            owner, app = dsns(schema)
            env = dict(os.environ, UPSQUAD_PG_DSN=app, UPSQUAD_PG_MIGRATE_DSN=owner,
                       UPSQUAD_MIGRATIONS_DIR=os.path.join(T.ROOT, "services", exe, "migrations"),
                       UPSQUAD_LOG_LEVEL="warn")
            out = subprocess.run([os.path.join(T.BUILD, "bin", exe), "--migrate"], env=env,
                                 capture_output=True, text=True, timeout=120, cwd=T.ROOT)
            assert out.returncode == 0, "%s --migrate: %s" % (exe, out.stderr[-2000:])

    def test_the_login_roles_are_not_the_owners(self):
        for schema in SERVICES:
            owner, app = dsns(schema)
            row = T.psql(ADMIN, "SELECT r.rolsuper, r.rolbypassrls, r.rolcreaterole, r.rolcreatedb,"
                                " (SELECT count(*) FROM pg_class c JOIN pg_namespace n"
                                "   ON n.oid = c.relnamespace WHERE c.relowner = r.oid),"
                                " (SELECT count(*) FROM pg_auth_members m WHERE m.member = r.oid)"
                                " FROM pg_roles r WHERE r.rolname = '%s_app'" % schema)
            # not a superuser, no BYPASSRLS, cannot create roles or databases, owns no relation,
            # is a member of no role
            self.assertEqual(row, "f|f|f|f|0|0", schema)
            tables = T.psql(ADMIN, "SELECT count(*) FROM pg_tables WHERE schemaname = '%s'"
                                   " AND tableowner = '%s'" % (schema, schema))
            self.assertGreater(int(tables), 0, "%s: the owner owns its tables" % schema)

    def test_the_login_role_cannot_switch_rls_off(self):
        for schema, (_, table) in SERVICES.items():
            owner, app = dsns(schema)
            def tables_where(cond):
                return T.psql(ADMIN, "SELECT string_agg(c.relname, ' ' ORDER BY c.relname) FROM"
                                     " pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                                     " WHERE n.nspname = '%s' AND c.relkind = 'r' AND %s"
                                     % (schema, cond)).split()
            # the tenant tables (model_registry holds none: its catalogue is global; its tables
            # are tried for ownership all the same)
            rls = tables_where("c.relrowsecurity")
            self.assertTrue(rls or schema == "model_registry", schema)
            for t in ([table] if table else []) + (rls[:3] or tables_where("true")[:2]):
                q = "%s.%s" % (schema, t)
                for sql in ("BEGIN; ALTER TABLE %s NO FORCE ROW LEVEL SECURITY; COMMIT" % q,
                            "BEGIN; ALTER TABLE %s DISABLE ROW LEVEL SECURITY; COMMIT" % q,
                            "ALTER TABLE %s OWNER TO %s_app" % (q, schema),
                            "CREATE POLICY everything ON %s USING (true)" % q,
                            "ALTER TABLE %s ADD COLUMN x int" % q,
                            "DROP TABLE %s" % q):
                    err = refused(app, sql)
                    self.assertRegex(err, "must be owner|permission denied", sql)
                if t not in rls:
                    continue
                for pol in T.psql(ADMIN, "SELECT policyname FROM pg_policies WHERE schemaname ="
                                         " '%s' AND tablename = '%s'" % (schema, t)).split():
                    for sql in ("DROP POLICY %s ON %s" % (pol, q),
                                "ALTER POLICY %s ON %s USING (true)" % (pol, q)):
                        self.assertIn("must be owner", refused(app, sql), sql)
                # row_security off errors out instead of reading past the policy
                err = refused(app, "SET row_security = off; SELECT count(*) FROM %s" % q)
                self.assertIn("row-level security", err)
                forced = T.psql(ADMIN, "SELECT relrowsecurity AND relforcerowsecurity FROM pg_class"
                                       " WHERE oid = '%s'::regclass" % q)
                self.assertEqual(forced, "t", q)
            for sql in ("SET ROLE %s" % schema,
                        "GRANT %s TO %s_app" % (schema, schema),
                        "CREATE TABLE %s.mine (x int)" % schema,
                        "CREATE FUNCTION %s.f() RETURNS int LANGUAGE sql SECURITY DEFINER"
                        " AS 'SELECT 1'" % schema,
                        "ALTER ROLE %s_app BYPASSRLS" % schema):
                err = refused(app, sql)
                self.assertRegex(err, "permission denied|must be|must have|not have permission", sql)

    def test_the_engine_runs_as_its_login_role(self):
        owner, app = dsns("workflow_engine")
        secret = secrets.token_hex(16)
        env = T.engine_env(app, NATS, secret, UPSQUAD_PG_MIGRATE_DSN=owner)
        srv = T.Server("workflow-engine", env=env)
        try:
            org = str(uuid.uuid4())
            c = T.WorkflowClient(srv.addr, T.mint(secret, sub=str(uuid.uuid4()), org=org,
                                                  clearance=5))
            d = T.struct({"version": 1, "start": "w", "steps": {
                "w": {"type": "wait", "mode": "signal", "event_key": "k"}}})
            w = c("CreateWorkflow", W.CreateWorkflowRequest(name="roles", definition=d)).workflow
            run = c("TriggerWorkflow", W.TriggerWorkflowRequest(workflow_id=w.id)).run
            got = c("GetWorkflowStatus", W.GetWorkflowStatusRequest(run_id=run.id)).run
            self.assertEqual(got.id, run.id)
            c("CancelRun", W.CancelRunRequest(run_id=run.id))
            # the connections it holds are the login role's
            users = T.psql(ADMIN, "SELECT DISTINCT usename FROM pg_stat_activity"
                                  " WHERE application_name = 'workflow-engine'")
            self.assertIn("workflow_engine_app", users.split())
            c.close()
        finally:
            srv.stop()

    def test_the_login_role_cannot_touch_the_migration_ledger(self):
        # the schema's default privileges give its login role DML on every table; the ledger
        # of applied migrations is taken back from it (db_migrate), or the role could forge or
        # erase the record of what ran
        for schema in SERVICES:
            owner, app = dsns(schema)
            q = "%s.schema_migrations" % schema
            for sql in ("INSERT INTO %s VALUES (9999, 'x', 'x')" % q,
                        "UPDATE %s SET checksum = 'x'" % q,
                        "DELETE FROM %s" % q,
                        "TRUNCATE %s" % q):
                self.assertIn("permission denied", refused(app, sql), sql)
            self.assertGreater(int(T.psql(owner, "SELECT count(*) FROM %s" % q)), 0, schema)

    def test_a_pending_migration_cannot_be_applied_by_the_login_role(self):
        # without the owner's DSN the service's login cannot create what a migration creates
        owner, app = dsns("stream_hub")
        err = refused(app, "CREATE TABLE stream_hub.later (x int)")
        self.assertIn("permission denied", err)


if __name__ == "__main__":
    unittest.main(verbosity=2)
