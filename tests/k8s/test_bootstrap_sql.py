"""k8s/base/bootstrap/bootstrap.sql, as the bootstrap Job runs it (psql, passwords from the
environment), against the real Postgres in a throw-away database: run twice (idempotent), the
eight roles and four schemas it promises (the same split scripts/runtime.sh makes: S owns,
S_app logs in), every service's migrations applied as the OWNER role (`<service> --migrate`,
as the migration Jobs do), then a workflow-engine logged in as the non-owner login role serving
a run end to end (row-level security and the default privileges), and that login role refused
DDL.

Roles are cluster-wide and exist already (the runtime made them): their password variables are
left empty, which the script honours, so the runtime's credentials keep working."""
import os
import secrets
import subprocess
import sys
import time
import unittest
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
import upsquad_testlib as T  # noqa: E402
from upsquad_testlib import psql, with_database  # noqa: E402

ADMIN_DSN = os.environ.get("UPSQUAD_PG_ADMIN_DSN")
NATS = os.environ.get("UPSQUAD_NATS_URL")
SCHEMAS = {"orchestrator": "orchestrator", "workflow_engine": "workflow-engine",
           "model_registry": "model-registry", "stream_hub": "stream-hub"}
OWNER_DSNS = {s: os.environ.get("UPSQUAD_PG_DSN_" + s.upper()) for s in SCHEMAS}
APP_DSNS = {s: os.environ.get("UPSQUAD_PG_APP_DSN_" + s.upper()) for s in SCHEMAS}
if not ADMIN_DSN or not NATS or not all(OWNER_DSNS.values()) or not all(APP_DSNS.values()):
    print("SKIP: UPSQUAD_PG_ADMIN_DSN, UPSQUAD_NATS_URL, the four UPSQUAD_PG_DSN_* and "
          "UPSQUAD_PG_APP_DSN_* are required")
    sys.exit(0)
LOGINS = [s + "_app" for s in SCHEMAS]

from upsquad.workflow.v1 import workflow_pb2 as W  # noqa: E402

SQL = os.path.join(T.ROOT, "k8s", "base", "bootstrap", "bootstrap.sql")
PSQL = os.path.join(os.environ.get("PGBIN", "/usr/lib/postgresql/15/bin"), "psql")


class BootstrapSQL(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.db = "boot_it_%d_%s" % (os.getpid(), secrets.token_hex(3))
        psql(ADMIN_DSN, "CREATE DATABASE %s" % cls.db)
        cls.admin = with_database(ADMIN_DSN, cls.db)
        cls.env = dict(os.environ)
        for s in SCHEMAS:  # unchanged: the runtime's roles keep their passwords
            cls.env["PG_PASSWORD_" + s.upper()] = ""
            cls.env["PG_PASSWORD_" + s.upper() + "_OWNER"] = ""
        cls.procs = []

    @classmethod
    def tearDownClass(cls):
        for p in cls.procs:
            p.stop()
        psql(ADMIN_DSN, "DROP DATABASE IF EXISTS %s WITH (FORCE)" % cls.db)

    def bootstrap(self):
        return subprocess.run([PSQL, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-f", SQL, self.admin],
                              env=self.env, capture_output=True, text=True, timeout=60)

    def test_roles_schemas_migrations_and_a_run_as_the_login_role(self):
        for attempt in (1, 2):  # the Job may run again: same result
            p = self.bootstrap()
            self.assertEqual(p.returncode, 0, "run %d: %s" % (attempt, p.stderr))
        # an empty variable left the passwords alone: the runtime still logs in as both
        for s in SCHEMAS:
            self.assertEqual(psql(OWNER_DSNS[s], "SELECT current_user"), s)
            self.assertEqual(psql(APP_DSNS[s], "SELECT current_user"), s + "_app")
        rows = psql(self.admin, "SELECT rolname, rolcanlogin, rolsuper, rolbypassrls, rolcreaterole, rolcreatedb "
                                "FROM pg_roles WHERE rolname IN (%s) ORDER BY 1" %
                    ",".join("'%s'" % r for r in list(SCHEMAS) + LOGINS)).splitlines()
        self.assertEqual(len(rows), 8, rows)
        for r in rows:
            self.assertTrue(r.endswith("|t|f|f|f|f"), r)  # login; not super, bypassrls, createrole, createdb
        owners = psql(self.admin, "SELECT nspname || '=' || pg_get_userbyid(nspowner) FROM pg_namespace "
                                  "WHERE nspname IN (%s) ORDER BY 1" % ",".join("'%s'" % s for s in SCHEMAS))
        self.assertEqual(owners.splitlines(), sorted("%s=%s" % (s, s) for s in SCHEMAS))

        # the migration Jobs: each service migrates its schema as the owner
        for schema, svc in SCHEMAS.items():
            env = T.engine_env(with_database(OWNER_DSNS[schema], self.db), NATS, secrets.token_hex(16))
            env.update({"UPSQUAD_MIGRATIONS_DIR": os.path.join(T.ROOT, "services", svc, "migrations"),
                        "UPSQUAD_REDIS_URL": os.environ.get("UPSQUAD_REDIS_URL", ""),
                        "UPSQUAD_GRPC_ADDR": "127.0.0.1:0", "UPSQUAD_METRICS_ADDR": "127.0.0.1:0"})
            p = subprocess.run([os.path.join(T.BUILD, "bin", svc), "--migrate"], env=dict(os.environ, **env),
                               capture_output=True, text=True, timeout=120)
            self.assertEqual(p.returncode, 0, "%s --migrate: %s" % (svc, p.stderr[-2000:]))
            n = psql(self.admin, "SELECT count(*) FROM %s.schema_migrations" % schema)
            files = [f for f in os.listdir(os.path.join(T.ROOT, "services", svc, "migrations")) if f.endswith(".sql")]
            self.assertEqual(int(n), len(files), svc)
            tables = psql(self.admin, "SELECT count(*) FROM pg_tables WHERE schemaname = '%s' "
                                      "AND tableowner <> '%s'" % (schema, schema))
            self.assertEqual(tables, "0", "%s: tables not owned by the owner role" % schema)

        # the service as the login role: no migrations of its own, a run end to end
        login = with_database(APP_DSNS["workflow_engine"], self.db)  # the runtime's credentials
        secret = secrets.token_hex(16)
        srv = T.Server("workflow-engine", env=T.engine_env(login, NATS, secret, UPSQUAD_MIGRATIONS_DIR="none"))
        self.procs.append(srv)
        org, team = str(uuid.uuid4()), str(uuid.uuid4())
        c = T.WorkflowClient(srv.addr, T.mint(secret, sub=str(uuid.uuid4()), org=org, clearance=5, teams=[team]))
        try:
            d = {"version": 1, "start": "c", "steps": {
                "c": {"type": "condition", "if": {"op": "eq", "path": "/run/id", "value": "x"}, "then": "g"},
                "g": {"type": "approval_gate", "required_clearance": 1, "summary": "s"}}}
            wf = c("CreateWorkflow", W.CreateWorkflowRequest(name="boot", definition=T.struct(d), team_id=team)).workflow
            run = c("TriggerWorkflow", W.TriggerWorkflowRequest(workflow_id=wf.id)).run.id
            end = time.time() + 15
            while c("GetWorkflowStatus", W.GetWorkflowStatusRequest(run_id=run)).run.status != "completed":
                self.assertLess(time.time(), end, "the run did not complete")
                time.sleep(0.05)
        finally:
            c.close()
        # the login role owns nothing and may not change the schema
        with self.assertRaises(RuntimeError) as ctx:
            psql(login, "CREATE TABLE workflow_engine.intruder (i int)")
        self.assertIn("permission denied", str(ctx.exception))
        with self.assertRaises(RuntimeError):
            psql(login, "ALTER TABLE workflow_engine.runs DISABLE ROW LEVEL SECURITY")


if __name__ == "__main__":
    unittest.main(verbosity=2)
