"""upsq, the CLI, run as a program against a real model-registry (Postgres, NATS) it starts on
a free loopback port in a throw-away database, stopped by pid: output, -o json, --metadata,
errors by gRPC status name and the documented exit codes (docs/upsq.md)."""
import json
import os
import secrets
import subprocess
import sys
import unittest
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
import upsquad_testlib as T  # noqa: E402
from upsquad_testlib import psql, with_database  # noqa: E402

DSN = os.environ.get("UPSQUAD_PG_DSN_MODEL_REGISTRY")
ADMIN_DSN = os.environ.get("UPSQUAD_PG_ADMIN_DSN")
NATS = os.environ.get("UPSQUAD_NATS_URL")
if not DSN or not NATS or not ADMIN_DSN:
    print("SKIP: UPSQUAD_PG_DSN_MODEL_REGISTRY, UPSQUAD_PG_ADMIN_DSN and UPSQUAD_NATS_URL are required")
    sys.exit(0)

UPSQ = os.path.join(T.BUILD, "bin", "upsq")
SHIPPED = os.path.join(T.ROOT, "services", "model-registry", "catalog", "models.json")
MIGRATIONS = os.path.join(T.ROOT, "services", "model-registry", "migrations")


class UpsqTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.db = "upsq_it_%d_%s" % (os.getpid(), secrets.token_hex(4))
        psql(ADMIN_DSN, "CREATE DATABASE %s" % cls.db)
        psql(with_database(ADMIN_DSN, cls.db), "CREATE SCHEMA model_registry AUTHORIZATION model_registry")
        cls.srv = T.Server("model-registry", env={
            "UPSQUAD_PG_DSN": with_database(DSN, cls.db), "UPSQUAD_NATS_URL": NATS,
            "UPSQUAD_MIGRATIONS_DIR": MIGRATIONS, "UPSQUAD_MODEL_CATALOG_FILE": SHIPPED})
        with open(SHIPPED) as f:
            cls.catalog = json.load(f)

    @classmethod
    def tearDownClass(cls):
        cls.srv.stop()
        psql(ADMIN_DSN, "DROP DATABASE IF EXISTS %s WITH (FORCE)" % cls.db)

    def upsq(self, *args, token=True, env=None):
        e = {k: v for k, v in os.environ.items() if not k.startswith("UPSQUAD_")}
        e.update({"UPSQUAD_MODEL_REGISTRY_ADDR": self.srv.addr, "UPSQUAD_RUN_DIR": "/nonexistent"})
        if token:
            e["UPSQUAD_TOKEN"] = self.srv.token()
        e.update(env or {})
        p = subprocess.run([UPSQ] + list(args), env=e, capture_output=True, text=True, timeout=30)
        return p.returncode, p.stdout, p.stderr

    def catalog_ids(self):
        models = self.catalog["models"] if isinstance(self.catalog, dict) else self.catalog
        return {m.get("id") or m.get("model_id") for m in models}

    def test_models_list_json_is_the_catalog(self):
        rc, out, err = self.upsq("-o", "json", "models", "list")
        self.assertEqual(rc, 0, err)
        doc = json.loads(out)
        got = {m["model_id"] for m in doc["models"]}
        self.assertEqual(got, self.catalog_ids())

    def test_models_compare_and_recommend(self):
        ids = sorted(self.catalog_ids())[:2]
        rc, out, err = self.upsq("-o", "json", "models", "compare", *ids)
        self.assertEqual(rc, 0, err)
        for i in ids:
            self.assertIn('"%s"' % i, out)
        rc, out, err = self.upsq("-o", "json", "models", "recommend", "architect")
        self.assertEqual(rc, 0, err)
        self.assertIn(json.loads(out)["recommended"]["model_id"], self.catalog_ids())
        rc, _, err = self.upsq("models", "compare")
        self.assertEqual(rc, 2)
        self.assertIn("model_ids", err)

    def test_models_list_text_is_readable_not_json(self):
        rc, out, err = self.upsq("models", "list")
        self.assertEqual(rc, 0, err)
        self.assertNotIn("{", out.splitlines()[0])
        for mid in self.catalog_ids():
            self.assertIn("model_id: %s" % mid, out)

    def test_bad_token_is_status_name_and_exit_1(self):
        rc, out, err = self.upsq("models", "list", env={"UPSQUAD_TOKEN": "not-a-jwt"})
        self.assertEqual(rc, 1)
        self.assertTrue(err.startswith("upsq: UNAUTHENTICATED: "), err)
        self.assertNotIn("Traceback", err)
        self.assertEqual(out, "")

    def test_metadata_flag_reaches_the_server(self):
        # a malformed flag is usage; a well-formed one rides along with the token
        rc, _, err = self.upsq("--metadata", "novalue", "models", "list")
        self.assertEqual(rc, 2)
        self.assertIn("--metadata wants key=value", err)
        rc, _, err = self.upsq("--metadata", "x-upsquad-test=1", "models", "list")
        self.assertEqual(rc, 0, err)

    def test_misspelt_flag_names_it_with_usage_exit_2(self):
        rc, out, err = self.upsq("models", "list", "--provdier", "x")
        self.assertEqual(rc, 2)
        self.assertIn("--provdier", err)
        self.assertIn("usage:", err)
        self.assertNotIn("Traceback", err)

    def test_missing_token_and_address_are_config_exit_3(self):
        rc, _, err = self.upsq("models", "list", token=False)
        self.assertEqual(rc, 3)
        self.assertIn("no token", err)
        rc, _, err = self.upsq("runs", "list", env={"UPSQUAD_WORKFLOW_ENGINE_ADDR": ""})
        self.assertEqual(rc, 3)
        self.assertIn("UPSQUAD_WORKFLOW_ENGINE_ADDR", err)

    def test_bad_context_json_is_usage(self):
        rc, _, err = self.upsq("runs", "trigger", "wf", "--context", "{nope",
                               env={"UPSQUAD_WORKFLOW_ENGINE_ADDR": "127.0.0.1:1"})
        self.assertEqual(rc, 2)
        self.assertIn("context is not JSON", err)

    def test_unreachable_service_is_unavailable_exit_1(self):
        rc, _, err = self.upsq("--timeout", "2", "models", "list",
                               env={"UPSQUAD_MODEL_REGISTRY_ADDR": "127.0.0.1:1"})
        self.assertEqual(rc, 1)
        self.assertRegex(err, r"^upsq: (UNAVAILABLE|DEADLINE_EXCEEDED): ")


ENGINE_DSN = os.environ.get("UPSQUAD_PG_DSN_WORKFLOW_ENGINE")


@unittest.skipUnless(ENGINE_DSN, "UPSQUAD_PG_DSN_WORKFLOW_ENGINE is required")
class UpsqWorkflowTest(unittest.TestCase):
    """Workflows and runs through a real workflow-engine, in a fresh org of its own."""

    @classmethod
    def setUpClass(cls):
        secret = secrets.token_hex(16)
        cls.srv = T.Server("workflow-engine", env=T.engine_env(ENGINE_DSN, NATS, secret))
        cls.org, cls.team = str(uuid.uuid4()), str(uuid.uuid4())
        cls.token = T.mint(secret, sub=str(uuid.uuid4()), org=cls.org, clearance=5, teams=[cls.team])

    @classmethod
    def tearDownClass(cls):
        cls.srv.stop()

    def upsq(self, *args):
        e = {k: v for k, v in os.environ.items() if not k.startswith("UPSQUAD_")}
        e.update({"UPSQUAD_WORKFLOW_ENGINE_ADDR": self.srv.addr, "UPSQUAD_TOKEN": self.token})
        p = subprocess.run([UPSQ] + list(args), env=e, capture_output=True, text=True, timeout=30)
        return p.returncode, p.stdout, p.stderr

    def ok_json(self, *args):
        rc, out, err = self.upsq("-o", "json", *args)
        self.assertEqual(rc, 0, err)
        return json.loads(out)

    def test_create_list_trigger_describe_rerun_cancel(self):
        path = os.path.join(T.ROOT, "examples", "workflows", "ci-gated-merge.json")
        wf = self.ok_json("workflows", "create", "@" + path, "--name", "upsq-it", "--team", self.team)
        wid = wf["workflow"]["id"]
        listed = self.ok_json("workflows", "list")
        self.assertIn(wid, [w["id"] for w in listed["workflows"]])
        run = self.ok_json("runs", "trigger", wid, "--context", '{"pull_request": 42}')["run"]
        desc = self.ok_json("runs", "describe", run["id"])
        self.assertEqual(desc["run"]["context"], {"pull_request": 42})
        again = self.ok_json("runs", "rerun", run["id"])["run"]
        self.assertNotEqual(again["id"], run["id"])
        self.assertEqual(self.ok_json("runs", "describe", again["id"])["run"]["context"], {"pull_request": 42})
        runs = self.ok_json("runs", "list", "--workflow", wid)
        self.assertEqual({r["id"] for r in runs["runs"]}, {run["id"], again["id"]})
        rc, out, err = self.upsq("runs", "cancel", run["id"], "--reason", "test")
        self.assertEqual(rc, 0, err)
        rc, _, err = self.upsq("runs", "describe", str(uuid.uuid4()))
        self.assertEqual(rc, 1)
        self.assertTrue(err.startswith("upsq: NOT_FOUND: "), err)
        rc, _, err = self.upsq("runs", "describe", "not-a-uuid")
        self.assertEqual(rc, 1)
        self.assertTrue(err.startswith("upsq: INVALID_ARGUMENT: "), err)


if __name__ == "__main__":
    unittest.main(verbosity=2)
