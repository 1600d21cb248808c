"""workflow-engine's run and outbox metrics on /metrics, over real gRPC, Postgres and NATS:
runs ended by final status (completed, failed, cancelled) with their duration histogram, and
the outbox lag gauge, raised by a row that cannot be published and back to 0 once it is gone.
A fresh engine process (its counters start at 0) in a fresh org; stopped by pid."""
import os
import secrets
import sys
import time
import unittest
import urllib.parse
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
import upsquad_testlib as T  # noqa: E402
from upsquad_testlib import psql, with_database  # noqa: E402

DSN = os.environ.get("UPSQUAD_PG_DSN_WORKFLOW_ENGINE")
ADMIN_DSN = os.environ.get("UPSQUAD_PG_ADMIN_DSN")
NATS = os.environ.get("UPSQUAD_NATS_URL")
if not DSN or not NATS or not ADMIN_DSN:
    print("SKIP: UPSQUAD_PG_DSN_WORKFLOW_ENGINE, UPSQUAD_PG_ADMIN_DSN and UPSQUAD_NATS_URL are required")
    sys.exit(0)

from upsquad.workflow.v1 import workflow_pb2 as W  # noqa: E402

SECRET = secrets.token_hex(16)
DONE = {"type": "condition", "if": {"op": "eq", "path": "/run/id", "value": "never"}, "then": "never"}
GATE = {"type": "approval_gate", "required_clearance": 1, "summary": "ok?"}


class EngineMetrics(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = T.Server("workflow-engine", env=T.engine_env(DSN, NATS, SECRET))
        cls.org, cls.team = str(uuid.uuid4()), str(uuid.uuid4())
        cls.c = T.WorkflowClient(cls.srv.addr, T.mint(SECRET, sub=str(uuid.uuid4()), org=cls.org,
                                                      clearance=5, teams=[cls.team]))
        db = urllib.parse.urlsplit(DSN).path.lstrip("/")
        cls.admin = with_database(ADMIN_DSN, db)

    @classmethod
    def tearDownClass(cls):
        cls.c.close()
        cls.srv.stop()

    def m(self, name, labels=""):
        return self.srv.metric(name, labels)

    def start(self, steps, start):
        if any(v is DONE for v in steps.values()):  # its arm names a step that must exist
            steps = dict(steps, never=GATE)
        d = {"version": 1, "start": start, "steps": steps}
        wf = self.c("CreateWorkflow", W.CreateWorkflowRequest(name="metrics", definition=T.struct(d),
                                                               team_id=self.team)).workflow
        return self.c("TriggerWorkflow", W.TriggerWorkflowRequest(workflow_id=wf.id)).run.id

    def wait(self, pred, what, timeout=15):
        end = time.time() + timeout
        while time.time() < end:
            if pred():
                return
            time.sleep(0.05)
        self.fail("timed out waiting for " + what)

    def status(self, run):
        return self.c("GetWorkflowStatus", W.GetWorkflowStatusRequest(run_id=run))

    def test_runs_ended_by_status_with_durations(self):
        before = {s: self.m("workflow_engine_runs_ended_total", 'status="%s"' % s)
                  for s in ("completed", "failed", "cancelled")}
        ok = self.start({"c": DONE}, "c")
        rejected = self.start({"g": GATE}, "g")   # a reject with no on_reject fails the run
        parked = self.start({"g": GATE}, "g")
        self.wait(lambda: self.status(ok).run.status == "completed", "the completed run")
        for run in (rejected, parked):
            self.wait(lambda: any(a.status == "awaiting_approval" for a in self.status(run).actions), "the gate")
        time.sleep(1.1)  # the failed run's duration is at least this
        gate = [a for a in self.status(rejected).actions if a.status == "awaiting_approval"][0]
        self.c("RejectAction", W.RejectActionRequest(action_id=gate.id))
        self.wait(lambda: self.status(rejected).run.status == "failed", "the failed run")
        self.c("CancelRun", W.CancelRunRequest(run_id=parked, reason="test"))
        self.c("CancelRun", W.CancelRunRequest(run_id=parked, reason="again"))  # a no-op: not counted
        self.wait(lambda: self.m("workflow_engine_runs_ended_total", 'status="failed"') > before["failed"],
                  "the failed run counted")
        for s in ("completed", "failed", "cancelled"):
            self.assertEqual(self.m("workflow_engine_runs_ended_total", 'status="%s"' % s), before[s] + 1, s)
            self.assertEqual(self.m("workflow_engine_run_duration_seconds_count", 'status="%s"' % s),
                             before[s] + 1, s)
        # the failed run waited over a second at its gate: its duration says so; the completed
        # one-step run took well under that
        self.assertGreaterEqual(self.m("workflow_engine_run_duration_seconds_sum", 'status="failed"'), 1.0)
        self.assertEqual(self.m("workflow_engine_run_duration_seconds_bucket", 'status="failed",le="0.5"'), 0)
        self.assertGreaterEqual(
            self.m("workflow_engine_run_duration_seconds_bucket", 'status="completed",le="5"'), 1)
        self.assertEqual(self.m("workflow_engine_runs_finished_total"),
                         before["completed"] + before["failed"] + 2)  # the interpreter's own ends

    def test_outbox_lag_is_the_oldest_unpublished_row(self):
        self.wait(lambda: self.m("workflow_engine_outbox_lag_seconds") == 0, "an idle relay")
        # a row two minutes old on a subject no JetStream stream binds: it cannot be published,
        # so it stays at the head of the outbox
        subject = "upsquad.test.nostream.%s" % uuid.uuid4().hex
        psql(self.admin, "INSERT INTO workflow_engine.outbox (org_id, subject, msg_id, payload, created_at) "
                         "VALUES ('%s', '%s', '%s', '\\x00', now() - interval '120 seconds')"
             % (self.org, subject, uuid.uuid4()))
        try:
            self.wait(lambda: self.m("workflow_engine_outbox_lag_seconds") >= 120, "the lag of the stuck row")
            self.assertLess(self.m("workflow_engine_outbox_lag_seconds"), 180)
        finally:
            psql(self.admin, "DELETE FROM workflow_engine.outbox WHERE subject = '%s'" % subject)
        self.wait(lambda: self.m("workflow_engine_outbox_lag_seconds") == 0, "the lag back to 0")


    def test_pending_approvals_count_every_org_and_age(self):
        # a service-wide count (the gates of every org): relative to what other tests left
        gauge = "workflow_engine_pending_approvals"
        n0 = int(psql(self.admin, "SELECT count(*) FROM workflow_engine.governance WHERE status = 'pending'"))
        self.wait(lambda: self.m(gauge) == n0, "the gauge at the database's count (%d)" % n0)
        runs = [self.start({"g": GATE}, "g") for _ in range(3)]
        for run in runs:
            self.wait(lambda: any(a.status == "awaiting_approval" for a in self.status(run).actions), "the gate")
        self.wait(lambda: self.m(gauge) == n0 + 3, "3 more pending approvals (%s)" % self.m(gauge))
        self.assertGreaterEqual(self.m("workflow_engine_oldest_pending_approval_seconds"), 0)
        gate = [a for a in self.status(runs[0]).actions if a.status == "awaiting_approval"][0]
        self.c("ApproveAction", W.ApproveActionRequest(action_id=gate.id))
        self.wait(lambda: self.m(gauge) == n0 + 2, "one decided")
        for run in runs[1:]:
            self.c("CancelRun", W.CancelRunRequest(run_id=run))
        self.wait(lambda: self.m(gauge) == n0, "the cancelled runs' gates closed")


if __name__ == "__main__":
    unittest.main(verbosity=2)
