"""A workflow agent step's in-step approval over the real system: workflow-engine, orchestrator
and devworker processes with the runtime's Postgres, Redis and NATS (docs/workflow-engine.md
"Agent steps: in-step approvals", docs/orchestrator.md "Workflow agent steps: in-step
approvals", docs/devworker.md "Resuming after an approved interrupt").

The agent's step is a devworker `#!script` whose gated call (`interrupt`) parks the step on an
approval gate. The gate's clearance comes from the agent definition's tool policy; approving it
re-enters the frozen turn (the gated call runs once, the script goes on after the interrupt,
no fresh attempt); rejecting it gives the call the denial and the turn goes on; a gate whose
window (the step's timeout_minutes) closes fails the step; a second decision changes nothing.
Each run of this file uses a fresh org; processes are stopped by pid."""
import json
import os
import queue
import secrets
import subprocess
import sys
import time
import unittest
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
import upsquad_testlib as T  # noqa: E402

WF_DSN, ORCH_DSN, REDIS, NATS = T.require(
    ["UPSQUAD_PG_DSN_WORKFLOW_ENGINE", "UPSQUAD_PG_DSN_ORCHESTRATOR", "UPSQUAD_REDIS_URL", "UPSQUAD_NATS_URL"],
    bins=("workflow-engine", "orchestrator", "devworker", "upsquad-agents"))

import grpc  # noqa: E402
from google.protobuf import json_format  # noqa: E402
from upsquad.workflow.v1 import workflow_pb2 as W  # noqa: E402
from upsquad.approval.v1 import approval_pb2 as AP  # noqa: E402
from upsquad.internal.v1 import agent_step_pb2 as AS  # noqa: E402
from upsquad.internal.v1 import node_io_pb2 as NIO  # noqa: E402
import nats_mini  # noqa: E402

SECRET = secrets.token_hex(32)
KEK = "k1:" + secrets.token_hex(32)
ROLE = "gated"
C = grpc.StatusCode
st = T.struct
GATED = "github.merge"  # its policy: clearance 3
OTHER = "deploy.prod"   # no policy of its own: the agent's approval_clearance, 2


def js(s):
    return json_format.MessageToDict(s)


def script(*directives):
    return "#!script\n" + json.dumps(list(directives))


def gated_step(tool=GATED, after="merged after approval", **kw):
    s = {"type": "agent_action", "agent_role": ROLE, "prompt": script(
        {"tokens": "merging now"},
        {"interrupt": {"tool_name": tool, "pending_tool_intent": {"pr": 42}}},
        {"complete": after})}
    s.update(kw)
    return {"version": 1, "start": "a", "steps": {"a": s}}


def apply_agent(org):
    T.apply_agent(org, {"role": ROLE, "display_name": "Gated", "model": "claude-sonnet-4-6",
                        "tool_policies": {GATED: {"requires_approval": True, "required_clearance": 3}},
                        "approval_clearance": 2}, ORCH_DSN, KEK)


Client = T.WorkflowClient


class AgentStepApprovals(unittest.TestCase):
    procs = []

    @classmethod
    def setUpClass(cls):
        cls.worker = T.drain(T.Server("devworker", env={"UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_LOG_LEVEL": "info",
                                                      "UPSQUAD_ORCHESTRATOR_ADDR": ""}))
        cls.procs.append(cls.worker)
        cls.orch = T.drain(T.Server("orchestrator", env={
            "UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_PG_DSN": ORCH_DSN, "UPSQUAD_REDIS_URL": REDIS,
            "UPSQUAD_NATS_URL": NATS, "UPSQUAD_KEK": KEK, "UPSQUAD_WORKER_PROBE": "200ms",
            "UPSQUAD_MIGRATIONS_DIR": os.path.join(T.ROOT, "services/orchestrator/migrations"),
            "UPSQUAD_WORKER_TARGETS": cls.worker.addr, "UPSQUAD_LOG_LEVEL": "info"}))
        cls.procs.append(cls.orch)
        cls.engine = T.drain(T.Server("workflow-engine", env=T.engine_env(
            WF_DSN, NATS, SECRET, UPSQUAD_WF_LEASE="2s", UPSQUAD_LOG_LEVEL="info")))
        cls.procs.append(cls.engine)
        cls.org = str(uuid.uuid4())
        cls.team = str(uuid.uuid4())
        cls.user, cls.m2, cls.m3 = (str(uuid.uuid4()) for _ in range(3))
        apply_agent(cls.org)
        tok = lambda sub, c: T.mint(SECRET, sub=sub, org=cls.org, clearance=c, teams=[cls.team])
        cls.A = Client(cls.engine.addr, tok(cls.user, 5))   # starts the runs
        cls.two = Client(cls.engine.addr, tok(cls.m2, 2))   # below the policy's 3
        cls.three = Client(cls.engine.addr, tok(cls.m3, 3))  # at it
        cls.nc = nats_mini.Nats(NATS)
        cls.results, cls.frames = queue.Queue(), queue.Queue()
        cls.seen, cls.seen_frames = [], []
        cls.nc.subscribe("agent.step.result.%s.>" % cls.org, q=cls.results)
        cls.nc.subscribe("wfio.%s.>" % cls.org, q=cls.frames)
        cls.nc.flush()

    @classmethod
    def tearDownClass(cls):
        for c in (cls.A, cls.two, cls.three):
            c.close()
        cls.nc.close()
        for p in reversed(cls.procs):
            p.stop()

    # ---- helpers ----
    def start(self, d):
        w = self.A("CreateWorkflow", W.CreateWorkflowRequest(name="agent-gates", definition=st(d),
                                                             team_id=self.team)).workflow
        return self.A("TriggerWorkflow", W.TriggerWorkflowRequest(workflow_id=w.id)).run.id

    def status(self, run):
        return self.A("GetWorkflowStatus", W.GetWorkflowStatusRequest(run_id=run))

    def wait_for(self, run, pred, timeout=30):
        return T.wait_run(self, self.A, run, pred, timeout, logs=[o.log for o in (self.orch, self.engine, self.worker)])

    def parked(self, run):
        s = self.wait_for(run, lambda s: any(a.status == "awaiting_approval" for a in s.actions))
        return s.actions[0]

    def done(self, run, timeout=30):
        return self.wait_for(run, lambda s: s.run.status in ("completed", "failed", "cancelled"), timeout)

    def results_of(self, run, n, timeout=20):
        end = time.time() + timeout
        while time.time() < end:
            mine = [r for r in self.seen if r.run_id == run]
            if len(mine) >= n:
                return mine[:n]
            try:
                _, _, _, data = self.results.get(timeout=0.2)
                self.seen.append(AS.AgentStepResult.FromString(data))
            except queue.Empty:
                pass
        return [r for r in self.seen if r.run_id == run]

    def frames_of(self, run, settle=0.5):
        """The live node I/O frames of run seen so far (after settle seconds of quiet)."""
        end = time.time() + settle
        while time.time() < end:
            try:
                _, _, _, data = self.frames.get(timeout=0.1)
                self.seen_frames.append(NIO.NodeIOEvent.FromString(data))
                end = time.time() + settle
            except queue.Empty:
                pass
        return [f.frame for f in self.seen_frames if f.run_id == run and f.HasField("frame")]

    def psql(self, sql):
        out = subprocess.run(["psql", WF_DSN, "-X", "-Atq", "-v", "ON_ERROR_STOP=1", "-c",
                              "SELECT set_config('app.org_id', '%s', false)" % self.org, "-c", sql],
                             capture_output=True, text=True, timeout=30)
        self.assertEqual(out.returncode, 0, out.stderr)
        return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""

    def frozen(self, run):
        """(rows holding a frozen checkpoint, of which gated) for run's agent steps."""
        r = self.psql("SELECT count(*) || ',' || count(*) FILTER (WHERE gated) FROM workflow_engine.agent_steps "
                      "WHERE run_id = '%s' AND checkpoint IS NOT NULL" % run)
        return tuple(int(x) for x in r.split(","))

    def approval(self, client, aid):
        return client("GetApproval", AP.GetApprovalRequest(approval_id=aid)).approval

    def pending_ids(self, client):
        return [p.action.id for p in client("ListPendingApprovals", W.ListPendingApprovalsRequest(limit=100)).approvals]

    def gated_results(self, frames, call):
        return [f.tool_result for f in frames if f.WhichOneof("event") == "tool_result"
                and f.tool_result.tool_call_id == call]

    # ---- 1. the gate's clearance is the tool policy's ----
    def test_1_clearance_from_the_tool_policy(self):
        run = self.start(gated_step())
        a = self.parked(run)
        first = self.results_of(run, 1)[0]
        self.assertEqual(first.WhichOneof("outcome"), "interrupt_required")
        self.assertEqual(first.interrupt_gate.required_clearance, 3)
        self.assertTrue(first.interrupt_gate.checkpoint)  # the frozen state travels with the result
        self.assertEqual(self.frozen(run), (1, 1))         # kept durably while the gate waits
        ap = self.approval(self.three, a.approval_id)
        self.assertEqual((ap.required_clearance, ap.status), (3, "pending"))
        # below the floor: hidden and refused on every door; nothing changes
        self.assertNotIn(a.id, self.pending_ids(self.two))
        self.assertIn(a.id, self.pending_ids(self.three))
        T.rpc_error(self, C.PERMISSION_DENIED, self.two, "ApproveAction", W.ApproveActionRequest(action_id=a.id),
                    contains="clearance 3")
        T.rpc_error(self, C.PERMISSION_DENIED, self.two, "RejectAction", W.RejectActionRequest(action_id=a.id))
        T.rpc_error(self, C.PERMISSION_DENIED, self.two, "RecordDecision", AP.RecordDecisionRequest(
            approval_id=a.approval_id, decision=AP.DECISION_APPROVED), contains="clearance 3")
        self.assertEqual(self.approval(self.three, a.approval_id).status, "pending")
        self.assertEqual(self.status(run).actions[0].status, "awaiting_approval")
        # a tool the policies do not name: the agent's approval_clearance
        run2 = self.start(gated_step(tool=OTHER))
        b = self.parked(run2)
        self.assertEqual(self.approval(self.two, b.approval_id).required_clearance, 2)
        for r in (run, run2):
            self.A("CancelRun", W.CancelRunRequest(run_id=r))
        self.assertEqual(self.frozen(run), (0, 0))

    # ---- 2. approval re-enters the gated call ----
    def test_2_approve_reenters_the_gated_call_once(self):
        run = self.start(gated_step())
        a = self.parked(run)
        first = self.results_of(run, 1)[0]
        call = first.interrupt_required.tool_call_id
        r = self.three("ApproveAction", W.ApproveActionRequest(action_id=a.id, comment="ship it"))
        self.assertEqual(r.action.status, "in_progress")
        s = self.done(run)
        self.assertEqual(s.run.status, "completed", js(s.actions[0].output))
        # the script went on after the interrupt: not a fresh attempt (that would park again)
        self.assertEqual(js(s.actions[0].output), {"text": "merged after approval"})
        res = self.results_of(run, 2)
        self.assertEqual([x.WhichOneof("outcome") for x in res], ["interrupt_required", "completed"])
        self.assertEqual(res[1].attempt, first.attempt + 1)
        # the gated call ran exactly once, approved, in the resumed turn
        frames = self.frames_of(run)
        got = self.gated_results(frames, call)
        self.assertEqual(len(got), 1, [js(f) for f in frames])
        self.assertEqual((json.loads(got[0].summary), got[0].is_error), ({"approved": True}, False))
        self.assertEqual(sum(1 for f in frames if f.WhichOneof("event") == "token_text"
                             and "merging" in f.token_text), 1)  # the turn's start ran once
        self.assertTrue(any('"step.resumed"' in l and "approved" in l and res[1].session_id in l
                            for l in self.worker.log), "the worker did not restore the frozen turn")
        self.assertEqual(self.frozen(run), (0, 0))  # dropped when the step ended
        # a second decision changes nothing: first write wins
        d = self.three("RecordDecision", AP.RecordDecisionRequest(approval_id=a.approval_id,
                                                                    decision=AP.DECISION_REJECTED))
        self.assertEqual((d.recorded, d.already_decided, d.approval.status), (False, True, "approved"))
        T.rpc_error(self, C.FAILED_PRECONDITION, self.three, "ApproveAction", W.ApproveActionRequest(action_id=a.id))
        time.sleep(0.5)
        self.assertEqual(len(self.results_of(run, 3, timeout=1)), 2)  # nothing dispatched again
        self.assertEqual(self.status(run).run.status, "completed")

    # ---- 3. rejection: the denial is the call's result, the turn goes on ----
    def test_3_reject_gives_the_call_the_denial(self):
        run = self.start(gated_step(after="stopped: {{answer}}"))
        a = self.parked(run)
        call = self.results_of(run, 1)[0].interrupt_required.tool_call_id
        d = self.three("RecordDecision", AP.RecordDecisionRequest(approval_id=a.approval_id,
                                                                    decision=AP.DECISION_REJECTED,
                                                                    comment="not on a Friday"))
        self.assertEqual((d.recorded, d.already_decided), (True, False))
        s = self.done(run)
        self.assertEqual(s.run.status, "completed")
        text = js(s.actions[0].output)["text"]
        self.assertTrue(text.startswith("stopped: "), text)
        denial = json.loads(text[len("stopped: "):])
        self.assertEqual(denial, {"denied": True, "approval_id": a.approval_id, "status": "rejected", "decided_by": self.m3,
                                  "comment": "not on a Friday"})
        got = self.gated_results(self.frames_of(run), call)
        self.assertEqual(len(got), 1)
        self.assertTrue(got[0].is_error)
        self.assertEqual(json.loads(got[0].summary)["denied"], True)
        # a later approval is already decided and runs nothing
        d = self.three("RecordDecision", AP.RecordDecisionRequest(approval_id=a.approval_id,
                                                                    decision=AP.DECISION_APPROVED))
        self.assertEqual((d.recorded, d.already_decided, d.approval.status), (False, True, "rejected"))
        time.sleep(0.5)
        self.assertEqual(len(self.results_of(run, 3, timeout=1)), 2)

    # ---- 4. the gate's window is the step's timeout_minutes ----
    def test_4_timeout_fails_the_step(self):
        run = self.start(gated_step(timeout_minutes=1))
        a = self.parked(run)
        # the gate's window is the step's: one minute from the park
        left = float(self.psql("SELECT extract(epoch FROM deadline_at - now()) FROM workflow_engine.actions "
                               "WHERE id = '%s'" % a.id))
        self.assertTrue(30 < left <= 60, left)
        self.psql("UPDATE workflow_engine.actions SET deadline_at = now() - interval '1 second' "
                  "WHERE run_id = '%s' AND status = 'awaiting_approval'; "
                  "UPDATE workflow_engine.run_queue SET wake_at = now(), wake_gen = wake_gen + 1 "
                  "WHERE run_id = '%s'" % (run, run))
        s = self.done(run)
        self.assertEqual(s.run.status, "failed")
        self.assertEqual(s.actions[0].status, "failed")
        self.assertEqual(js(s.actions[0].output).get("error"), "timeout")
        self.assertEqual(self.approval(self.three, a.approval_id).status, "expired")
        self.assertEqual(self.frozen(run), (0, 0))
        d = self.three("RecordDecision", AP.RecordDecisionRequest(approval_id=a.approval_id,
                                                                    decision=AP.DECISION_APPROVED))
        self.assertEqual((d.recorded, d.already_decided), (False, True))
        time.sleep(0.5)
        self.assertEqual(len(self.results_of(run, 2, timeout=1)), 1)  # the gated call never ran
        self.assertEqual(self.status(run).run.status, "failed")


if __name__ == "__main__":
    unittest.main(verbosity=2)
