"""upsq, the CLI, run as a program against real services (model-registry, workflow-engine,
stream-hub on Postgres and NATS) it starts on free loopback ports in throw-away databases or
fresh orgs, stopped by pid: output, -o json, --metadata, errors by gRPC status name and the
documented exit codes (docs/upsq.md); `runs watch` across a stream-hub restart, `runs logs`,
the gates, and `workflows validate`."""
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
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

    def upsq(self, *args, stdin=None):
        e = {k: v for k, v in os.environ.items() if not k.startswith("UPSQUAD_")}
        e.update({"UPSQUAD_WORKFLOW_ENGINE_ADDR": self.srv.addr, "UPSQUAD_TOKEN": self.token, "NO_COLOR": "1"})
        p = subprocess.run([UPSQ] + list(args), env=e, capture_output=True, text=True, timeout=30, input=stdin)
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


    def test_gates_list_approve_and_answer_a_prompt(self):
        d = {"version": 1, "start": "g", "steps": {
            "g": {"type": "approval_gate", "required_clearance": 1, "summary": "ship it?", "on_approve": "ask"},
            "ask": {"type": "user_input", "question": "which region?",
                    "options": [{"value": "eu"}, {"value": "us"}]}}}
        wf = self.ok_json("workflows", "create", json.dumps(d), "--name", "upsq-gates", "--team", self.team)
        run = self.ok_json("runs", "trigger", wf["workflow"]["id"])["run"]["id"]
        gate = self.parked(run, "g")
        pending = self.ok_json("gates", "list", "--limit", "100")
        self.assertIn(gate["id"], [p["action"]["id"] for p in pending["approvals"]])
        rc, out, err = self.upsq("runs", "describe", run)  # text: the step table with the gate
        self.assertEqual(rc, 0, err)
        self.assertRegex(out, r"(?m)^  g\s+awaiting_approval\s+\S+\s+%s" % gate["id"])
        # one id: the gate's blocked_by (its approval id) works where the action id does
        self.assertNotEqual(gate["blocked_by"], gate["id"])
        rc, out, err = self.upsq("-o", "json", "gates", "approve", gate["blocked_by"], "--comment", "lgtm")
        self.assertEqual(rc, 0, err)
        self.assertEqual(json.loads(out)["action"]["id"], gate["id"])
        rc, _, err = self.upsq("gates", "approve", gate["id"])
        self.assertEqual(rc, 1)
        self.assertTrue(err.startswith("upsq: FAILED_PRECONDITION: "), err)
        rc, _, err = self.upsq("gates", "reject", str(uuid.uuid4()))  # neither: the first answer
        self.assertEqual(rc, 1)
        self.assertTrue(err.startswith("upsq: NOT_FOUND: "), err)
        ask = self.parked(run, "ask")
        self.assertEqual(ask["blocked_by"], ask["approval_id"])
        prompt = self.ok_json("gates", "prompt", ask["blocked_by"])
        self.assertEqual(prompt["question"], "which region?")
        rc, _, err = self.upsq("gates", "answer", ask["blocked_by"])
        self.assertEqual(rc, 2)
        self.assertIn("--choice or --text", err)
        rc, _, err = self.upsq("gates", "answer", ask["blocked_by"], "--choice", "mars")
        self.assertEqual(rc, 1)
        self.assertTrue(err.startswith("upsq: INVALID_ARGUMENT: "), err)
        self.ok_json("gates", "answer", ask["blocked_by"], "--choice", "eu")
        self.wait_run(run, "completed")

    def test_validate_is_the_engines_validator_offline(self):
        good = os.path.join(T.ROOT, "examples", "workflows", "ci-gated-merge.json")
        rc, out, err = self.upsq("workflows", "validate", good)
        self.assertEqual((rc, out.strip()), (0, good + ": valid"), err)
        bad = {"version": 1, "start": "x", "steps": {"x": {"type": "approval_gate", "required_clearance": 9}}}
        rc, out, err = self.upsq("-o", "json", "workflows", "validate", good, "-", stdin=json.dumps(bad))
        self.assertEqual(rc, 5, err)
        doc = json.loads(out)
        self.assertEqual([r["valid"] for r in doc], [True, False])
        self.assertIn("/steps/x/required_clearance", [v["instance_location"] for v in doc[1]["violations"]])
        # the engine refuses the same definition with the same pointer
        rc, _, err = self.upsq("workflows", "create", json.dumps(bad), "--name", "bad", "--team", self.team)
        self.assertEqual(rc, 1)
        self.assertIn("INVALID_ARGUMENT", err)
        self.assertIn("required_clearance", err)
        rc, _, err = self.upsq("workflows", "validate", "/nonexistent.json")
        self.assertEqual(rc, 2)
        self.assertIn("/nonexistent.json", err)

    def describe(self, run):
        return self.ok_json("runs", "describe", run)

    def parked(self, run, step, timeout=15):
        end = time.time() + timeout
        while time.time() < end:
            for x in self.describe(run).get("actions", []):
                if x.get("step_name") == step and x.get("status") == "awaiting_approval":
                    return x
            time.sleep(0.1)
        self.fail("step %s of run %s never parked" % (step, run))

    def wait_run(self, run, status, timeout=15):
        end = time.time() + timeout
        while time.time() < end:
            got = self.describe(run)["run"]["status"]
            if got == status:
                return
            time.sleep(0.1)
        self.fail("run %s is %s, not %s" % (run, got, status))


HUB_DSN = os.environ.get("UPSQUAD_PG_DSN_STREAM_HUB")
TAG = "%d%s" % (os.getpid(), secrets.token_hex(3))


@unittest.skipUnless(HUB_DSN, "UPSQUAD_PG_DSN_STREAM_HUB is required")
class UpsqStreamTest(unittest.TestCase):
    """`runs watch` and `runs logs` on a real stream-hub fed by build/bin/hub-publisher (events
    on the bus exactly as the engine publishes them), in a throw-away database."""

    @classmethod
    def setUpClass(cls):
        cls.db = "upsq_hub_%s" % TAG
        psql(ADMIN_DSN, "CREATE DATABASE %s" % cls.db)
        psql(with_database(ADMIN_DSN, cls.db), "CREATE SCHEMA stream_hub AUTHORIZATION stream_hub")
        cls.secret = secrets.token_hex(16)
        cls.hub = cls.start_hub()
        cls.pub = subprocess.Popen([os.path.join(T.BUILD, "bin", "hub-publisher"), NATS], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    @classmethod
    def start_hub(cls, addr="127.0.0.1:0"):
        return T.Server("stream-hub", env={
            "UPSQUAD_JWT_SECRET": cls.secret, "UPSQUAD_PG_DSN": with_database(HUB_DSN, cls.db),
            "UPSQUAD_NATS_URL": NATS, "UPSQUAD_GRPC_ADDR": addr,
            "UPSQUAD_MIGRATIONS_DIR": os.path.join(T.ROOT, "services", "stream-hub", "migrations"),
            "UPSQUAD_HUB_PROJECTION_DURABLE": "upsq-it-%s-events" % TAG,
            "UPSQUAD_HUB_TRANSCRIPT_DURABLE": "upsq-it-%s-io" % TAG,
            "UPSQUAD_HUB_PROJECTION_FROM": "new", "UPSQUAD_SHUTDOWN_GRACE": "1s",
            "UPSQUAD_HUB_NEW_RUN_GRACE": "1s"})

    @classmethod
    def tearDownClass(cls):
        cls.pub.stdin.close()
        cls.pub.wait(timeout=10)
        cls.pub.stdout.close()
        cls.hub.stop()
        psql(ADMIN_DSN, "DROP DATABASE IF EXISTS %s WITH (FORCE)" % cls.db)

    def publish(self, op, **kw):
        kw["op"] = op
        self.pub.stdin.write(json.dumps(kw) + "\n")
        self.pub.stdin.flush()
        line = self.pub.stdout.readline().strip()
        self.assertTrue(line.startswith("ok"), line)

    def projected(self, run, seq, timeout=15):
        admin = with_database(ADMIN_DSN, self.db)
        end = time.time() + timeout
        while time.time() < end:
            if psql(admin, "SELECT count(*) FROM stream_hub.run_events WHERE run_id = '%s' AND seq = %d"
                    % (run, seq)) == "1":
                return
            time.sleep(0.03)
        self.fail("seq %d of run %s never projected" % (seq, run))

    def spawn(self, *args):
        e = {k: v for k, v in os.environ.items() if not k.startswith("UPSQUAD_")}
        e.update({"UPSQUAD_STREAM_HUB_ADDR": self.hub.addr, "NO_COLOR": "1",
                  "UPSQUAD_TOKEN": T.mint(self.secret, sub=str(uuid.uuid4()), org=self.org, clearance=5)})
        return subprocess.Popen([UPSQ] + list(args), env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    def lines(self, proc, n, timeout=15):
        """The first n stdout lines of a running upsq, read on a thread (a hang fails, not blocks)."""
        out = []

        def read():
            while len(out) < n:
                line = proc.stdout.readline()
                if not line:
                    return
                out.append(line.rstrip("\n"))
        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout)
        self.assertEqual(len(out), n, "upsq printed %r" % out)
        return out

    def setUp(self):
        self.org, self.run = str(uuid.uuid4()), str(uuid.uuid4())
        self.publish("run", org=self.org, run=self.run, seq=1, status="running", workflow_name="wf",
                     workflow_id=str(uuid.uuid4()), nodes_total=3)

    def node(self, seq, node, status, run_status="running"):
        self.publish("node", org=self.org, run=self.run, seq=seq, node_id=node, status=status,
                     run_status=run_status, cost_usd=seq)

    def test_watch_resumes_after_a_hub_restart_without_a_frame_twice(self):
        for seq, n in ((2, "build"), (3, "test")):
            self.node(seq, n, "running")
        self.projected(self.run, 3)
        w = self.spawn("-o", "json", "runs", "watch", self.run, "--retries", "40")
        try:
            first = [json.loads(x) for x in self.lines(w, 2)]
            self.assertEqual([f["run_seq"] for f in first], ["2", "3"])
            # the hub dies without an orderly end; events go on meanwhile; a new hub on the
            # same address serves the rest
            port = self.hub.port
            self.hub.signal(signal.SIGKILL)
            self.hub.wait(10)
            self.hub.stop()
            self.node(4, "build", "completed")
            self.node(5, "test", "failed")
            self.__class__.hub = self.start_hub("127.0.0.1:%d" % port)
            self.projected(self.run, 5)
            self.publish("run", org=self.org, run=self.run, seq=6, status="failed", nodes_total=3)
            rest = [json.loads(x) for x in self.lines(w, 2, timeout=30)]
            rc = w.wait(timeout=15)
        finally:
            if w.poll() is None:
                w.kill()
            err = w.stderr.read()
            w.stdout.close()
            w.stderr.close()
        self.assertEqual([f["run_seq"] for f in rest], ["4", "5"], err)
        self.assertEqual([(f["update"]["node_id"], f["update"]["status"]) for f in rest],
                         [("build", "completed"), ("test", "failed")])
        self.assertIn("resuming after run_seq 3", err)
        self.assertEqual(rc, 4, err)  # the run failed

    def test_watch_dag_view_redraws_one_line_per_node_and_exits_0(self):
        self.node(2, "plan", "running")
        self.node(3, "plan", "completed")
        self.node(4, "ship", "running")
        self.projected(self.run, 4)
        w = self.spawn("runs", "watch", self.run, "--view", "dag")
        self.node(5, "ship", "completed", run_status="completed")
        self.publish("run", org=self.org, run=self.run, seq=6, status="completed", nodes_total=2, nodes_done=2)
        out, err = w.communicate(timeout=20)
        self.assertEqual(w.returncode, 0, err)
        last = out.split("\033[J")[-1].splitlines()  # the final drawing
        # no engine address here: the end is told by the stream, the outcome by the nodes
        self.assertRegex(last[0], r"^run %s  ended" % self.run)
        self.assertRegex(last[2], r"^  plan\s+completed")
        self.assertRegex(last[3], r"^  ship\s+completed")
        self.assertEqual(len(last), 4, out)
        self.assertGreaterEqual(out.count("run %s" % self.run), 3, out)  # frames and the end
        self.assertIn("\033[", out)  # redrawn in place, not appended

    def test_logs_follow_then_tail_from_a_sequence(self):
        for s in range(2, 6):
            self.publish("log", org=self.org, run=self.run, seq=s, message="line %d" % s)
        self.projected(self.run, 5)
        lg = self.spawn("runs", "logs", self.run)
        try:
            got = self.lines(lg, 4)
            self.publish("log", org=self.org, run=self.run, seq=6, message="live 6")
            got += self.lines(lg, 1)
        finally:
            lg.kill()
            lg.communicate()
        self.assertEqual([x.split(": ", 1)[1] for x in got], ["line %d" % s for s in range(2, 6)] + ["live 6"])
        self.assertTrue(all(" (run): " in x for x in got), got)
        lg = self.spawn("-o", "json", "--metadata", "x-upsquad-resume-seq=4", "runs", "logs", self.run)
        try:
            got = [json.loads(x) for x in self.lines(lg, 2)]
        finally:
            lg.kill()
            lg.communicate()
        self.assertEqual([g["line"]["message"] for g in got], ["line 5", "live 6"])

    def test_watch_of_a_foreign_run_is_not_found(self):
        w = self.spawn("runs", "watch", str(uuid.uuid4()))
        _, err = w.communicate(timeout=20)
        self.assertEqual(w.returncode, 1)
        self.assertTrue(err.startswith("upsq: NOT_FOUND: "), err)


ORCH_DSN = os.environ.get("UPSQUAD_PG_DSN_ORCHESTRATOR")
REDIS = os.environ.get("UPSQUAD_REDIS_URL")


@unittest.skipUnless(ORCH_DSN and REDIS and os.path.exists(os.path.join(T.BUILD, "bin", "devworker")),
                     "UPSQUAD_PG_DSN_ORCHESTRATOR, UPSQUAD_REDIS_URL and build/bin/devworker are required")
class UpsqChatTest(unittest.TestCase):
    """`agents chat` through a real orchestrator to a devworker (which echoes), with an agent
    applied by upsquad-agents in a fresh org: replica A takes the worker's heartbeats, replica B
    (the one upsq calls) runs the turn on it, as in the orchestrator's own tests."""

    @classmethod
    def setUpClass(cls):
        cls.secret, kek = secrets.token_hex(32), "k1:" + secrets.token_hex(32)
        base = {"UPSQUAD_JWT_SECRET": cls.secret, "UPSQUAD_PG_DSN": ORCH_DSN, "UPSQUAD_REDIS_URL": REDIS,
                "UPSQUAD_NATS_URL": NATS, "UPSQUAD_KEK": kek, "UPSQUAD_WORKER_PROBE": "200ms",
                "UPSQUAD_MIGRATIONS_DIR": os.path.join(T.ROOT, "services", "orchestrator", "migrations")}
        cls.procs = []
        a = cls.start("orchestrator", dict(base, UPSQUAD_WORKER_TARGETS="127.0.0.1:1"))
        w = cls.start("devworker", {"UPSQUAD_JWT_SECRET": cls.secret, "UPSQUAD_ORCHESTRATOR_ADDR": a.addr,
                                    "UPSQUAD_DEVWORKER_HEARTBEAT_INTERVAL": "200ms"})
        cls.b = cls.start("orchestrator", dict(base, UPSQUAD_WORKER_TARGETS=w.addr))
        cls.org, cls.user = str(uuid.uuid4()), str(uuid.uuid4())
        path = os.path.join(T.BUILD, "upsq-agent-%s.json" % uuid.uuid4().hex)
        with open(path, "w") as f:
            json.dump({"role": "assistant", "display_name": "upsq", "model": "claude-sonnet-4-6"}, f)
        try:
            p = subprocess.run([os.path.join(T.BUILD, "bin", "upsquad-agents"), "--org", cls.org, "apply", path],
                               env=dict(os.environ, UPSQUAD_PG_DSN=ORCH_DSN, UPSQUAD_KEK=kek,
                                        UPSQUAD_LOG_LEVEL="warn"), capture_output=True, text=True, timeout=30)
        finally:
            os.unlink(path)
        if p.returncode != 0:
            raise RuntimeError(p.stderr)
        cls.agent = p.stdout.split()[0]

    @classmethod
    def start(cls, binary, env):
        srv = T.Server(binary, env=env)
        cls.procs.append(srv)
        return srv

    @classmethod
    def tearDownClass(cls):
        for p in reversed(cls.procs):
            p.stop()

    def upsq(self, *args):
        e = {k: v for k, v in os.environ.items() if not k.startswith("UPSQUAD_")}
        e.update({"UPSQUAD_ORCHESTRATOR_ADDR": self.b.addr,
                  "UPSQUAD_TOKEN": T.mint(self.secret, sub=self.user, org=self.org, clearance=5)})
        p = subprocess.run([UPSQ] + list(args), env=e, capture_output=True, text=True, timeout=60)
        return p.returncode, p.stdout, p.stderr

    def test_chat_streams_the_reply_then_sessions_and_trees(self):
        msg = "hello " + uuid.uuid4().hex
        end = time.time() + 20
        while True:  # until the worker's first heartbeat has made it live
            rc, out, err = self.upsq("agents", "chat", self.agent, msg)
            if rc == 0 or time.time() > end:
                break
            time.sleep(0.3)
        self.assertEqual((rc, out), (0, "echo: " + msg + "\n"), err)
        rc, out, err = self.upsq("-o", "json", "agents", "chat", self.agent, msg)
        self.assertEqual(rc, 0, err)
        frames = [json.loads(x) for x in out.splitlines()]
        self.assertEqual("".join(f["token"]["text"] for f in frames if "token" in f), "echo: " + msg)
        self.assertEqual(len([f for f in frames if "completion" in f]), 1)
        rc, _, err = self.upsq("agents", "chat", str(uuid.uuid4()), "hi")
        self.assertEqual(rc, 1)
        self.assertRegex(err, r"^upsq: (NOT_FOUND|INVALID_ARGUMENT): ")
        # the sessions those turns made: listed by agent, read one by one, their trees
        listed = json.loads(self.upsq("-o", "json", "agents", "sessions", "--agent", self.agent)[1])
        self.assertGreaterEqual(len(listed["sessions"]), 2, listed)  # a retry above may add one
        self.assertEqual({x["agent_id"] for x in listed["sessions"]}, {self.agent})
        sid = listed["sessions"][0]["session_id"]
        rc, out, err = self.upsq("-o", "json", "agents", "session", sid)
        self.assertEqual((rc, json.loads(out)["session_id"]), (0, sid), err)
        rc, out, err = self.upsq("-o", "json", "agents", "tree", sid)
        self.assertEqual(rc, 0, err)
        self.assertIn(sid, out)
        rc, _, err = self.upsq("agents", "session", str(uuid.uuid4()))
        self.assertEqual(rc, 1)
        self.assertTrue(err.startswith("upsq: NOT_FOUND: "), err)


if __name__ == "__main__":
    unittest.main(verbosity=2)
