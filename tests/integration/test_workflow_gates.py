"""Human gates of workflow-engine over real gRPC (grpcio), real Postgres and NATS, two engine
replicas: ApproveAction / RejectAction / EscalateAction / ListPendingApprovals /
GetRunPrompt / AnswerRunPrompt and upsquad.approval.v1.ApprovalService (RecordDecision,
GetApproval). Fresh org UUIDs per run, so it shares the runtime's database safely. No tool
provider or agent is needed: every definition here is gates, conditions and waits."""
import os
import secrets
import subprocess
import sys
import threading
import time
import unittest
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
import upsquad_testlib as T  # noqa: E402
import nats_mini  # noqa: E402

DSN = os.environ.get("UPSQUAD_PG_DSN_WORKFLOW_ENGINE")
NATS = os.environ.get("UPSQUAD_NATS_URL")
if not DSN or not NATS:
    print("SKIP: UPSQUAD_PG_DSN_WORKFLOW_ENGINE and UPSQUAD_NATS_URL are required")
    sys.exit(0)

import grpc  # noqa: E402
from google.protobuf import json_format  # noqa: E402
from upsquad.workflow.v1 import workflow_pb2 as W  # noqa: E402
from upsquad.approval.v1 import approval_pb2 as AP  # noqa: E402
from upsquad.internal.v1 import agent_step_pb2 as AS  # noqa: E402

SECRET = secrets.token_hex(16)
C = grpc.StatusCode
ENGINE_ENV = T.engine_env(DSN, NATS, SECRET)


st = T.struct


def js(s):
    return json_format.MessageToDict(s)


def defn(start, steps):
    if any(v is DONE for v in steps.values()):
        steps = dict(steps, never=gate(1))
    return {"version": 1, "start": start, "steps": steps}


def gate(clearance, **kw):
    d = {"type": "approval_gate", "required_clearance": clearance, "summary": "ship it?"}
    d.update(kw)
    return d


# a step that resolves at once with no side effect: a condition whose arm is never taken
DONE = {"type": "condition", "if": {"op": "eq", "path": "/run/id", "value": "never"}, "then": "never"}


Client = T.WorkflowClient


class GatesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.a = T.Server("workflow-engine", env=ENGINE_ENV)
        cls.b = T.Server("workflow-engine", env=ENGINE_ENV)
        cls.org, cls.org2 = str(uuid.uuid4()), str(uuid.uuid4())
        cls.user, cls.user2 = str(uuid.uuid4()), str(uuid.uuid4())
        cls.team = str(uuid.uuid4())
        tok = lambda sub, org, c: T.mint(SECRET, sub=sub, org=org, clearance=c, teams=[cls.team])
        cls.A = Client(cls.a.addr, tok(cls.user, cls.org, 3))       # the requester, clearance 3
        cls.B = Client(cls.b.addr, tok(cls.user, cls.org, 3))
        cls.low = Client(cls.b.addr, tok(cls.user2, cls.org, 2))    # another member, clearance 2
        cls.high = Client(cls.a.addr, tok(cls.user2, cls.org, 5))   # another member, clearance 5
        cls.foreign = Client(cls.b.addr, tok(cls.user, cls.org2, 5))
        cls.nc = nats_mini.Nats(NATS)
        cls.dec_sid, cls.dec_q = cls.nc.subscribe("approval.decided.%s" % cls.org)
        cls.nc.flush()

    @classmethod
    def tearDownClass(cls):
        for c in (cls.A, cls.B, cls.low, cls.high, cls.foreign):
            c.close()
        cls.a.stop()
        cls.b.stop()
        cls.nc.close()

    # ---- helpers ----
    def err(self, code, fn, *args, contains=None):
        return T.rpc_error(self, code, fn, *args, contains=contains)

    def start(self, d, client=None):
        c = client or self.A
        wf = c("CreateWorkflow", W.CreateWorkflowRequest(name="gates", definition=st(d), team_id=self.team)).workflow
        return c("TriggerWorkflow", W.TriggerWorkflowRequest(workflow_id=wf.id)).run.id

    def status(self, run):
        return self.B("GetWorkflowStatus", W.GetWorkflowStatusRequest(run_id=run))

    def wait_for(self, run, pred, timeout=15):
        end = time.time() + timeout
        while time.time() < end:
            s = self.status(run)
            if pred(s):
                return s
            time.sleep(0.05)
        self.fail("timed out; last: %s %s" % (s.run.status, [(a.step_name, a.status) for a in s.actions]))

    def parked(self, run, step):
        s = self.wait_for(run, lambda s: any(a.step_name == step and a.status == "awaiting_approval" for a in s.actions))
        return [a for a in s.actions if a.step_name == step][0]

    def psql(self, sql):
        psql = [os.path.join(os.environ.get("PGBIN", "/usr/lib/postgresql/15/bin"), "psql"), "-X", "-q",
                "-At", "-v", "ON_ERROR_STOP=1", DSN]
        sql = "BEGIN; SELECT set_config('app.org_id', '%s', true) \\g /dev/null\n%s; COMMIT;" % (self.org, sql)
        return subprocess.run(psql, input=sql, check=True, capture_output=True, text=True, timeout=20).stdout

    # ---- approval gates ----
    def test_01_approve_reject(self):
        d = defn("g", {"g": gate(3, on_approve="next", on_reject="fallback"),
                       "next": gate(1), "fallback": gate(1)})
        run = self.start(d)
        a = self.parked(run, "g")
        # below the floor: PERMISSION_DENIED, nothing changes; not in that member's list
        self.err(C.PERMISSION_DENIED, self.low, "ApproveAction", W.ApproveActionRequest(action_id=a.id), contains="clearance 3")
        self.err(C.PERMISSION_DENIED, self.low, "RejectAction", W.RejectActionRequest(action_id=a.id))
        self.assertNotIn(a.id, [p.action.id for p in self.low("ListPendingApprovals", W.ListPendingApprovalsRequest()).approvals])
        self.assertFalse(self.low("GetApproval", AP.GetApprovalRequest(approval_id=a.approval_id)).approval.can_decide)
        lp = self.A("ListPendingApprovals", W.ListPendingApprovalsRequest(limit=100))
        mine = [p for p in lp.approvals if p.action.id == a.id]
        self.assertEqual(len(mine), 1)
        self.assertEqual((mine[0].workflow_name, mine[0].action.status, mine[0].action.approval_id),
                         ("gates", "awaiting_approval", a.approval_id))
        self.assertGreaterEqual(lp.total_count, 1)
        # spec: "limit controls pagination (default: 50, max: 100)", worded as ListWorkflows':
        # the same clamp, a negative limit is the default (as ListWorkflows answers it)
        for limit in (-1, 0, 1000):
            for method, req in (("ListPendingApprovals", W.ListPendingApprovalsRequest(limit=limit)),
                                ("ListWorkflows", W.ListWorkflowsRequest(limit=limit))):
                self.assertGreaterEqual(self.A(method, req).total_count, 1, (method, limit))
        self.err(C.INVALID_ARGUMENT, self.A, "ListPendingApprovals", W.ListPendingApprovalsRequest(offset=-1), contains="offset")
        # bad input
        self.err(C.INVALID_ARGUMENT, self.A, "ApproveAction", W.ApproveActionRequest(), contains="action_id")
        self.err(C.INVALID_ARGUMENT, self.A, "ApproveAction", W.ApproveActionRequest(action_id="nope"), contains="action_id")
        self.err(C.INVALID_ARGUMENT, self.A, "ApproveAction", W.ApproveActionRequest(action_id=a.id, comment="x" * 1001), contains="comment")
        self.err(C.NOT_FOUND, self.A, "ApproveAction", W.ApproveActionRequest(action_id=str(uuid.uuid4())))
        self.err(C.INVALID_ARGUMENT, self.A, "ListPendingApprovals", W.ListPendingApprovalsRequest(offset=-1), contains="offset")
        # at the floor, on the other replica: approved, routed to on_approve
        r = self.B("ApproveAction", W.ApproveActionRequest(action_id=a.id, comment="lgtm"))
        self.assertEqual((r.action.status, r.action.decided_by), ("approved", self.user))
        self.assertTrue(r.action.HasField("decided_at"))
        self.assertEqual([(n.step_name, n.status) for n in r.next_actions], [("next", "awaiting_approval")])
        # elapsed_ms is time spent, never negative, even for the action this very call started
        self.assertGreaterEqual(r.next_actions[0].elapsed_ms, 0)
        self.assertEqual(r.action.blocked_by, "")
        ap = self.A("GetApproval", AP.GetApprovalRequest(approval_id=a.approval_id)).approval
        self.assertEqual((ap.status, ap.decided_by, ap.comment, ap.kind), ("approved", self.user, "lgtm", "approval_gate"))
        self.assertFalse(ap.can_decide)
        self.err(C.FAILED_PRECONDITION, self.A, "ApproveAction", W.ApproveActionRequest(action_id=a.id))
        self.err(C.FAILED_PRECONDITION, self.A, "RejectAction", W.RejectActionRequest(action_id=a.id))
        # an action that waits on no approval (the next gate's skipped sibling is not one)
        done = [n for n in self.status(run).actions if n.status == "approved"][0]
        self.assertEqual(done.id, a.id)
        cond = self.start(defn("c", {"c": DONE}))
        s = self.wait_for(cond, lambda s: s.run.status == "completed")
        self.err(C.FAILED_PRECONDITION, self.A, "ApproveAction", W.ApproveActionRequest(action_id=s.actions[0].id), contains="no approval")
        self.err(C.NOT_FOUND, self.foreign, "ApproveAction", W.ApproveActionRequest(action_id=s.actions[0].id))
        # the decision went out on approval.decided.<org>
        subj, _, _, data = self.dec_q.get(timeout=10)
        ev = AP.ApprovalDecided.FromString(data)
        self.assertEqual((subj, ev.approval_id, ev.status, ev.decided_by),
                         ("approval.decided." + self.org, a.approval_id, "approved", self.user))
        # reject routes to on_reject; the next gate resolves the run
        run2 = self.start(d)
        a2 = self.parked(run2, "g")
        r = self.A("RejectAction", W.RejectActionRequest(action_id=a2.id, comment="no"))
        self.assertEqual(r.action.status, "rejected")
        nxt = self.parked(run2, "fallback")
        self.high("ApproveAction", W.ApproveActionRequest(action_id=nxt.id))
        s = self.wait_for(run2, lambda s: s.run.status == "completed")
        got = [(x.step_name, x.status) for x in s.actions]
        self.assertIn(("g", "rejected"), got)
        self.assertIn(("fallback", "approved"), got)
        self.assertNotIn(("next", "awaiting_approval"), got)
        # reject without on_reject fails the run
        run3 = self.start(defn("g", {"g": gate(1)}))
        self.A("RejectAction", W.RejectActionRequest(action_id=self.parked(run3, "g").id))
        self.assertEqual(self.wait_for(run3, lambda s: s.run.status in ("failed", "completed")).run.status, "failed")

    def test_02_escalate(self):
        run = self.start(defn("g", {"g": gate(2, on_approve="end"), "end": DONE}))
        a = self.parked(run, "g")
        self.err(C.INVALID_ARGUMENT, self.A, "EscalateAction", W.EscalateActionRequest(), contains="action_id")
        r = self.low("EscalateAction", W.EscalateActionRequest(action_id=a.id, comment="needs a lead"))
        self.assertEqual((r.action.status, r.action.blocked_by), ("escalated", a.approval_id))
        ap = self.A("GetApproval", AP.GetApprovalRequest(approval_id=a.approval_id)).approval
        self.assertEqual((ap.status, ap.required_clearance, ap.escalations), ("pending", 3, 1))
        self.assertEqual(self.status(run).actions[0].status, "escalated")
        # the member who escalated (clearance 2) is now below the floor
        self.err(C.PERMISSION_DENIED, self.low, "ApproveAction", W.ApproveActionRequest(action_id=a.id))
        self.err(C.PERMISSION_DENIED, self.low, "EscalateAction", W.EscalateActionRequest(action_id=a.id))
        self.high("EscalateAction", W.EscalateActionRequest(action_id=a.id))
        self.high("EscalateAction", W.EscalateActionRequest(action_id=a.id))
        self.err(C.FAILED_PRECONDITION, self.high, "EscalateAction", W.EscalateActionRequest(action_id=a.id), contains="highest")
        self.err(C.PERMISSION_DENIED, self.A, "ApproveAction", W.ApproveActionRequest(action_id=a.id))
        r = self.high("ApproveAction", W.ApproveActionRequest(action_id=a.id))
        self.assertEqual(r.action.status, "approved")
        self.assertEqual([(n.step_name, n.status) for n in r.next_actions], [("end", "completed"), ("never", "skipped")])
        self.wait_for(run, lambda s: s.run.status == "completed")
        audit = self.psql("SELECT count(*) FROM workflow_engine.audit_log WHERE subject_id = '%s' AND action = 'gate.escalate'" % a.approval_id)
        self.assertEqual(audit.strip(), "3")

    def test_02b_escalated_gate_is_still_an_open_gate_on_the_bus(self):
        """An escalated gate is the same governance row, still open: its node event keeps
        needs_approval / prompt_kind / prompt_id (spec VisibleRunEvent: needs_approval is a row
        "open on the run", cleared by "gate resolved"), so stream-hub's snapshot, which rolls up
        node events, agrees with ListVisibleRuns; the decision clears them."""
        from upsquad.internal.v1 import run_events_pb2 as RE
        sid, q = self.nc.subscribe("wf.status.%s.>" % self.org)
        self.nc.flush()
        run = self.start(defn("g", {"g": gate(2, on_approve="end"), "end": DONE}))
        a = self.parked(run, "g")
        self.A("EscalateAction", W.EscalateActionRequest(action_id=a.id))
        self.wait_for(run, lambda s: s.actions[0].status == "escalated")
        row = [r for r in self.A("ListVisibleRuns", W.ListVisibleRunsRequest(status_filter=1)).runs
               if r.run.id == run][0]
        self.assertEqual((row.prompt_kind, row.open_prompt_count), (W.RUN_PROMPT_KIND_APPROVAL_GATE, 1))
        self.high("ApproveAction", W.ApproveActionRequest(action_id=a.id))
        self.wait_for(run, lambda s: s.run.status == "completed")
        end, nodes = time.time() + 10, {}
        while time.time() < end and not {"escalated", "approved"} <= set(nodes):
            try:
                subj, _, _, data = q.get(timeout=0.5)
            except Exception:
                continue
            for ev in T.run_events(data, RE):
                if subj.endswith(run) and ev.WhichOneof("event") == "node" and ev.node.step_name == "g":
                    nodes[ev.node.raw_status] = ev.node
        self.nc.unsubscribe(sid)
        esc = nodes["escalated"]
        self.assertEqual((esc.update.status, esc.update.blocked_by), ("blocked", a.approval_id))
        self.assertEqual((esc.needs_approval, esc.needs_input, esc.prompt_kind, esc.prompt_id),
                         (True, False, W.RUN_PROMPT_KIND_APPROVAL_GATE, a.approval_id))
        done = nodes["approved"]
        self.assertEqual((done.needs_approval, done.prompt_kind, done.prompt_id), (False, 0, ""))

    # ---- prompts ----
    def test_03_prompt(self):
        d = defn("ask", {"ask": {"type": "user_input", "question": "which region?",
                                 "options": [{"value": "eu", "label": "Europe", "next": "end"}, {"value": "us"}],
                                 "allow_text": True, "text_placeholder": "why?", "default_choice": "us",
                                 "timeout_minutes": 30, "on_timeout": "default", "answerable_by": "requester"},
                         "end": DONE})
        run = self.start(d)
        a = self.parked(run, "ask")
        pid = a.approval_id
        self.assertEqual(a.blocked_by, pid)
        p = self.A("GetRunPrompt", W.GetRunPromptRequest(prompt_id=pid))
        self.assertEqual((p.prompt_id, p.kind, p.question, p.allow_text, p.text_placeholder, p.default_choice,
                          p.status, p.answerable_by, p.required_clearance),
                         (pid, "user_prompt", "which region?", True, "why?", "us", "pending", "requester", 0))
        self.assertEqual([(o.value, o.label) for o in p.options], [("eu", "Europe"), ("us", "")])
        self.assertTrue(p.can_answer)
        # the window is the step's own 30 minutes; the row's expiry is the 24 h backstop
        self.assertAlmostEqual(p.expires_at.seconds - time.time(), 1800, delta=60)
        self.assertGreater(p.governance_expires_at.seconds, p.expires_at.seconds)
        # another member (even at clearance 5) may not answer a requester-scoped prompt
        self.assertFalse(self.high("GetRunPrompt", W.GetRunPromptRequest(prompt_id=pid)).can_answer)
        self.err(C.PERMISSION_DENIED, self.high, "AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=pid, choice="eu"), contains="requester")
        # validation names the field and changes nothing
        self.err(C.INVALID_ARGUMENT, self.A, "AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=pid, choice="mars"), contains="choice")
        self.err(C.INVALID_ARGUMENT, self.A, "AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=pid, text="only text"), contains="choice")
        self.err(C.INVALID_ARGUMENT, self.A, "AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=""), contains="prompt_id")
        self.err(C.NOT_FOUND, self.A, "GetRunPrompt", W.GetRunPromptRequest(prompt_id=str(uuid.uuid4())))
        self.assertEqual(self.A("GetRunPrompt", W.GetRunPromptRequest(prompt_id=pid)).status, "pending")
        # 50 concurrent answers over both replicas: exactly one recorded
        out, errs = [], []

        def answer(i):
            c = self.A if i % 2 else self.B
            try:
                out.append(c("AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=pid, choice="eu" if i % 3 else "us", text="t%d" % i), timeout=30))
            except grpc.RpcError as e:
                errs.append((e.code(), e.details()))
        ths = [threading.Thread(target=answer, args=(i,)) for i in range(50)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        self.assertEqual(errs, [])
        won = [r for r in out if r.recorded]
        self.assertEqual(len(won), 1)
        self.assertTrue(all(r.already_answered and not r.recorded for r in out if r is not won[0]))
        w = won[0].prompt
        self.assertEqual(w.expires_at, p.expires_at)  # the window does not move on answering
        self.assertEqual((w.status, w.answered_by, w.can_answer), ("answered", self.user, False))
        self.assertEqual({(r.prompt.answered_choice, r.prompt.answered_text) for r in out}, {(w.answered_choice, w.answered_text)})
        s = self.wait_for(run, lambda s: s.run.status == "completed")
        self.assertEqual(js(s.actions[0].output)["choice"], w.answered_choice)
        # "eu" routes to its option's next; "us" has none and falls through (no next: done)
        self.assertEqual("end" in [x.step_name for x in s.actions], w.answered_choice == "eu")

    def test_04_prompt_doors_and_rules(self):
        free = self.start(defn("ask", {"ask": {"type": "user_input", "question": "say", "allow_text": True}}))
        pid = self.parked(free, "ask").approval_id
        self.err(C.INVALID_ARGUMENT, self.A, "AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=pid), contains="text")
        self.err(C.INVALID_ARGUMENT, self.A, "AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=pid, choice="x"), contains="choice")
        r = self.low("AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=pid, text="hello"))  # anyone may answer
        self.assertEqual((r.recorded, r.prompt.answered_text, r.prompt.answered_by), (True, "hello", self.user2))
        notext = self.start(defn("ask", {"ask": {"type": "user_input", "question": "pick", "options": [{"value": "a"}]}}))
        pid = self.parked(notext, "ask").approval_id
        self.err(C.INVALID_ARGUMENT, self.A, "AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=pid, choice="a", text="x"), contains="text")
        self.err(C.INVALID_ARGUMENT, self.A, "ApproveAction",
                 W.ApproveActionRequest(action_id=self.parked(notext, "ask").id), contains="AnswerRunPrompt")
        # the approval door refuses a prompt and names the right one
        # ApprovalService decides prompts too: APPROVED with {choice, text}, checked the same way
        rd = lambda **kw: self.A("RecordDecision", AP.RecordDecisionRequest(approval_id=pid, **kw))
        self.err(C.INVALID_ARGUMENT, lambda: rd(decision=AP.DECISION_REJECTED), contains="DECISION_APPROVED")
        self.err(C.INVALID_ARGUMENT, lambda: rd(decision=AP.DECISION_APPROVED, response_payload=st({"choice": "zz"})), contains="choice")
        r = rd(decision=AP.DECISION_APPROVED, response_payload=st({"choice": "a"}))
        self.assertEqual((r.recorded, r.approval.status, r.approval.kind), (True, "answered", "user_prompt"))
        self.assertEqual(self.A("GetRunPrompt", W.GetRunPromptRequest(prompt_id=pid)).answered_choice, "a")
        self.wait_for(notext, lambda s: s.run.status == "completed")
        # an approval gate is not a prompt
        g = self.start(defn("g", {"g": gate(1)}))
        ga = self.parked(g, "g")
        self.err(C.INVALID_ARGUMENT, self.A, "GetRunPrompt", W.GetRunPromptRequest(prompt_id=ga.approval_id), contains="GetApproval")
        self.err(C.INVALID_ARGUMENT, self.A, "AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=ga.approval_id, choice="a"), contains="ApproveAction")

    # ---- questions through ApprovalService ----
    def test_05_question(self):
        d = defn("q", {"q": {"type": "question", "prompt": "risk?", "required_clearance": 3,
                             "options": [{"key": "low", "label": "Low", "next": "end"}, {"key": "high", "label": "High", "next": "hold"}],
                             "answer": {"score": {"type": "integer", "required": True}, "note": {"type": "string"}}},
                       "end": DONE, "hold": gate(1)})
        run = self.start(d)
        a = self.parked(run, "q")
        self.assertEqual(a.blocked_by, "awaiting-question")
        qid = a.approval_id
        # spec: blocked_by is the sub-kind token; the gate's id is approval_id, for a question as
        # for every gate, and every door takes it. The token given instead is told where it is.
        self.assertEqual(str(uuid.UUID(qid)), qid)
        for method, msg in (("GetRunPrompt", W.GetRunPromptRequest(prompt_id=a.blocked_by)),
                            ("AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=a.blocked_by, choice="low")),
                            ("GetApproval", AP.GetApprovalRequest(approval_id=a.blocked_by)),
                            ("RecordDecision", AP.RecordDecisionRequest(approval_id=a.blocked_by,
                                                                        decision=AP.DECISION_APPROVED))):
            e = self.err(C.INVALID_ARGUMENT, self.A, method, msg, contains="approval_id")
            self.assertIn("awaiting-question", e.details())
        self.assertEqual(self.A("GetApproval", AP.GetApprovalRequest(approval_id=qid)).approval.id, qid)
        p = self.A("GetRunPrompt", W.GetRunPromptRequest(prompt_id=qid))
        self.assertEqual((p.kind, p.question, p.allow_text, p.required_clearance), ("question_gate", "risk?", False, 3))
        self.assertEqual([o.value for o in p.options], ["low", "high"])
        self.assertEqual([(f.name, f.type, f.required) for f in p.answer_fields], [("note", "string", False), ("score", "integer", True)])
        self.assertFalse(self.low("GetRunPrompt", W.GetRunPromptRequest(prompt_id=qid)).can_answer)
        self.err(C.INVALID_ARGUMENT, self.A, "AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=qid, choice="low"),
                 contains="ApprovalService.RecordDecision")
        self.err(C.INVALID_ARGUMENT, self.A, "ApproveAction", W.ApproveActionRequest(action_id=a.id), contains="RecordDecision")
        def rd(c, decision=0, **kw):
            return c("RecordDecision", AP.RecordDecisionRequest(approval_id=qid, decision=decision, **kw))
        ok = st({"option_key": "high", "fields": {"score": 7, "note": "hm"}})
        APPROVED, REJECTED = AP.DECISION_APPROVED, AP.DECISION_REJECTED
        self.err(C.PERMISSION_DENIED, lambda: rd(self.low, APPROVED, response_payload=ok))
        self.err(C.INVALID_ARGUMENT, lambda: rd(self.A, response_payload=ok), contains="decision")
        self.err(C.INVALID_ARGUMENT, lambda: rd(self.A, REJECTED, response_payload=ok), contains="decision")
        e = self.err(C.INVALID_ARGUMENT, lambda: rd(self.A, APPROVED, response_payload=st(
            {"option_key": "mid", "fields": {"score": "7", "extra": 1}})))
        for frag in ("option_key", "fields.score must be of type integer", "fields.extra"):
            self.assertIn(frag, e.details())
        self.err(C.INVALID_ARGUMENT, lambda: rd(self.A, APPROVED, response_payload=st({"option_key": "low"})),
                 contains="fields.score is required")
        self.assertEqual(self.A("GetApproval", AP.GetApprovalRequest(approval_id=qid)).approval.status, "pending")
        r = rd(self.B, decision=AP.DECISION_APPROVED, comment="ok", response_payload=ok)
        self.assertEqual((r.recorded, r.already_decided, r.approval.status, r.approval.decided_by), (True, False, "approved", self.user))
        self.assertEqual(js(r.approval.response_payload)["option_key"], "high")
        r2 = rd(self.A, decision=AP.DECISION_APPROVED, response_payload=st({"option_key": "low", "fields": {"score": 1}}))
        self.assertEqual((r2.recorded, r2.already_decided), (False, True))
        self.assertEqual(js(r2.approval.response_payload)["option_key"], "high")
        hold = self.parked(run, "hold")  # routed by the option key
        p = self.A("GetRunPrompt", W.GetRunPromptRequest(prompt_id=qid))
        self.assertEqual((p.status, p.answered_choice, p.answered_by), ("answered", "high", self.user))
        self.assertIn('"score":7', p.answered_fields)
        self.assertTrue(hold.approval_id)

    # ---- N of M, no self-approval ----
    def test_05b_n_of_m_and_self_approval(self):
        self.err(C.INVALID_ARGUMENT, self.start, defn("g", {"g": gate(1, min_approvals=0)}), contains="min_approvals")
        run = self.start(defn("g", {"g": gate(1, min_approvals=2, allow_self_approval=False, on_approve="end"), "end": DONE}))
        a = self.parked(run, "g")
        self.err(C.PERMISSION_DENIED, self.A, "ApproveAction", W.ApproveActionRequest(action_id=a.id), contains="allow_self_approval")
        r = self.low("ApproveAction", W.ApproveActionRequest(action_id=a.id, comment="one"))
        self.assertEqual((r.action.status, len(r.next_actions)), ("awaiting_approval", 0))
        ap = self.A("GetApproval", AP.GetApprovalRequest(approval_id=a.approval_id)).approval
        self.assertEqual((ap.status, list(ap.approvers), ap.min_approvals), ("pending", [self.user2], 2))
        self.err(C.FAILED_PRECONDITION, self.low, "ApproveAction", W.ApproveActionRequest(action_id=a.id), contains="already approved")
        self.err(C.FAILED_PRECONDITION, self.high, "ApproveAction", W.ApproveActionRequest(action_id=a.id), contains="already approved")
        third = str(uuid.uuid4())
        c3 = Client(self.b.addr, T.mint(SECRET, sub=third, org=self.org, clearance=1, teams=[self.team]))
        try:
            r = c3("RecordDecision", AP.RecordDecisionRequest(approval_id=a.approval_id, decision=AP.DECISION_APPROVED))
        finally:
            c3.close()
        self.assertEqual((r.recorded, r.approval.status, list(r.approval.approvers)), (True, "approved", [self.user2, third]))
        self.assertEqual(self.wait_for(run, lambda s: s.run.status == "completed").run.status, "completed")

    # ---- an agent asks a person ----
    def dispatch_of(self, run, timeout=15):
        d = T.agent_dispatch(self.nc, run, timeout)
        if d is None:
            self.fail("no dispatch for run %s" % run)
        return d

    def reply(self, d, **outcome):
        r = AS.AgentStepResult(idempotency_key=d.idempotency_key, org_id=d.org_id, run_id=d.run_id,
                               action_id=d.action_id, step_name=d.step_name, iteration=d.iteration,
                               attempt=d.attempt, agent_id="agent-1")
        if outcome.get("ask"):
            r.input_required.SetInParent()
        else:
            r.completed.text = "done"
            r.completed.output.update({"ok": True})
        self.nc.publish("agent.step.result.%s.%s" % (d.org_id, d.run_id), r.SerializeToString())

    def test_05c_agent_asks_and_resumes(self):
        self.nc.js_consumer("AGENT_STEPS", "orchestrator-steps", "agent.step.dispatch")
        run = self.start(defn("a", {"a": {"type": "agent_action", "agent_role": "eng", "prompt": "deploy"}}))
        d = self.dispatch_of(run)
        self.reply(d, ask=True)
        a = self.parked(run, "a")
        p = self.A("GetRunPrompt", W.GetRunPromptRequest(prompt_id=a.approval_id))
        self.assertEqual((p.kind, p.allow_text, p.status, p.can_answer), ("user_prompt", True, "pending", True))
        r = self.low("AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=a.approval_id, text="staging please"))
        self.assertTrue(r.recorded)
        d2 = self.dispatch_of(run)  # the same step, a new attempt carrying the answer
        self.assertEqual((d2.action_id, d2.attempt), (a.id, d.attempt + 1))
        self.assertIn("staging please", d2.feedback)
        self.reply(d2)
        s = self.wait_for(run, lambda s: s.run.status == "completed")
        self.assertEqual(js(s.actions[0].output), {"ok": True})

    def test_05e_asked_by_attribution(self):
        """A gate without a declared asked_by is attributed to the last agent step the run
        completed: GetRunPrompt and the live NodeTransition carry its step and agent_role."""
        from upsquad.internal.v1 import run_events_pb2 as RE
        self.nc.js_consumer("AGENT_STEPS", "orchestrator-steps", "agent.step.dispatch")
        sid, q = self.nc.subscribe("wf.status.%s.>" % self.org)
        self.nc.flush()
        d = defn("a", {"a": {"type": "agent_action", "agent_role": "reviewer", "prompt": "review", "next": "ask"},
                       "ask": {"type": "user_input", "question": "merge?", "allow_text": True}})
        run = self.start(d)
        self.reply(self.dispatch_of(run))
        a = self.parked(run, "ask")
        p = self.A("GetRunPrompt", W.GetRunPromptRequest(prompt_id=a.approval_id))
        self.assertEqual((p.asked_by_step, p.asked_by_role), ("a", "reviewer"))
        end, seen = time.time() + 10, None
        while time.time() < end and seen is None:
            try:
                subj, _, _, data = q.get(timeout=0.5)
            except Exception:
                continue
            for ev in T.run_events(data, RE):
                if subj.endswith(run) and ev.WhichOneof("event") == "node" and ev.node.step_name == "ask" \
                        and ev.node.raw_status == "awaiting_approval":
                    seen = ev.node
        self.nc.unsubscribe(sid)
        self.assertIsNotNone(seen, "no parked transition for the prompt on wf.status")
        self.assertEqual((seen.asked_by_role, seen.prompt_id, seen.needs_input), ("reviewer", a.approval_id, True))
        # a gate reached before any agent turn is unattributed
        run2 = self.start(defn("ask", {"ask": {"type": "user_input", "question": "go?", "allow_text": True}}))
        a2 = self.parked(run2, "ask")
        p2 = self.A("GetRunPrompt", W.GetRunPromptRequest(prompt_id=a2.approval_id))
        self.assertEqual((p2.asked_by_step, p2.asked_by_role), ("", ""))

    # ---- timeouts meet the gate RPCs ----
    def expire(self, run):
        self.psql("UPDATE workflow_engine.actions SET deadline_at = now() - interval '1 second' "
                  "WHERE run_id = '%s' AND status IN ('awaiting_approval', 'escalated') "
                  "AND deadline_at IS NOT NULL; "
                  "UPDATE workflow_engine.run_queue SET wake_at = now(), wake_gen = wake_gen + 1 "
                  "WHERE run_id = '%s'" % (run, run))

    def test_05d_timeouts(self):
        run = self.start(defn("g", {"g": gate(1, timeout_minutes=1, on_timeout="reject", on_reject="end"), "end": DONE}))
        a = self.parked(run, "g")
        # a replica restarts while the gate waits: the timer is the run's, in the database
        cls = type(self)
        cls.a.stop()
        cls.a = T.Server("workflow-engine", env=ENGINE_ENV)
        cls.A.close()
        cls.A = Client(cls.a.addr, T.mint(SECRET, sub=self.user, org=self.org, clearance=3, teams=[self.team]))
        cls.high.close()  # the later tests still reach replica a through it
        cls.high = Client(cls.a.addr, T.mint(SECRET, sub=self.user2, org=self.org, clearance=5, teams=[self.team]))
        self.expire(run)
        self.wait_for(run, lambda s: s.run.status == "completed")
        time.sleep(0.3)
        n = self.psql("SELECT count(*) FROM workflow_engine.run_logs WHERE run_id = '%s' AND message LIKE '%%timed out%%'" % run)
        self.assertEqual(n.strip(), "1")  # applied once across both replicas
        self.err(C.FAILED_PRECONDITION, self.A, "ApproveAction", W.ApproveActionRequest(action_id=a.id))
        ap = self.A("GetApproval", AP.GetApprovalRequest(approval_id=a.approval_id)).approval
        self.assertEqual((ap.status, ap.can_decide), ("expired", False))
        self.assertNotIn(a.id, [p.action.id for p in self.A("ListPendingApprovals", W.ListPendingApprovalsRequest(limit=100)).approvals])
        # a prompt whose timer recorded the default reads as answered by "timeout"
        run = self.start(defn("ask", {"ask": {"type": "user_input", "question": "?", "options": [{"value": "a"}, {"value": "b"}],
                                              "default_choice": "b", "timeout_minutes": 1, "on_timeout": "default"}}))
        pid = self.parked(run, "ask").approval_id
        self.expire(run)
        self.wait_for(run, lambda s: s.run.status == "completed")
        p = self.A("GetRunPrompt", W.GetRunPromptRequest(prompt_id=pid))
        self.assertEqual((p.status, p.answered_by, p.answered_choice, p.can_answer), ("answered", "timeout", "b", False))
        r = self.A("AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=pid, choice="a"))
        self.assertEqual((r.recorded, r.already_answered, r.prompt.answered_choice), (False, True, "b"))
        # "A second answer to an already-answered prompt is a NO-OP ... rather than erroring":
        # whatever it carries (a choice the prompt never offered, text it does not allow)
        r = self.A("AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=pid, choice="zzz", text="free"))
        self.assertEqual((r.recorded, r.already_answered, r.prompt.answered_choice), (False, True, "b"))

    def test_05f_escalate_on_timeout(self):
        """on_timeout "escalate": "escalated = parked, escalated to a higher clearance" and such
        a park "WILL transition again" (spec): the row stays pending and decidable, one level
        up, and the spent window does not fire again."""
        run = self.start(defn("g", {"g": gate(2, timeout_minutes=1, on_timeout="escalate", on_approve="end"),
                                    "end": DONE}))
        a = self.parked(run, "g")
        self.expire(run)
        s = self.wait_for(run, lambda s: s.actions[0].status == "escalated")
        self.assertEqual((s.run.status, s.actions[0].blocked_by), ("running", a.approval_id))
        ap = self.high("GetApproval", AP.GetApprovalRequest(approval_id=a.approval_id)).approval
        self.assertEqual((ap.status, ap.required_clearance, ap.escalations, ap.can_decide), ("pending", 3, 1, True))
        self.assertIn(a.id, [p.action.id for p in self.high("ListPendingApprovals", W.ListPendingApprovalsRequest(limit=100)).approvals])
        audit = self.psql("SELECT count(*) FROM workflow_engine.audit_log WHERE subject_id = '%s' "
                          "AND action = 'gate.escalate' AND member_id IS NULL" % a.approval_id)
        self.assertEqual(audit.strip(), "1")
        # the window is spent: no timer is left, so nothing escalates again
        self.assertEqual(self.psql("SELECT deadline_at IS NULL FROM workflow_engine.actions WHERE id = '%s'" % a.id).strip(), "t")
        self.expire(run)
        self.psql("UPDATE workflow_engine.run_queue SET wake_at = now(), wake_gen = wake_gen + 1 WHERE run_id = '%s'" % run)
        time.sleep(0.5)
        ap = self.high("GetApproval", AP.GetApprovalRequest(approval_id=a.approval_id)).approval
        self.assertEqual((ap.status, ap.required_clearance, ap.escalations), ("pending", 3, 1))
        n = self.psql("SELECT count(*) FROM workflow_engine.run_logs WHERE run_id = '%s' AND message LIKE '%%timed out%%'" % run)
        self.assertEqual(n.strip(), "1")
        # the raised floor holds (clearance 2 is now below it); a member above it decides
        self.err(C.PERMISSION_DENIED, self.low, "ApproveAction", W.ApproveActionRequest(action_id=a.id))
        r = self.high("ApproveAction", W.ApproveActionRequest(action_id=a.id))
        self.assertEqual(r.action.status, "approved")
        self.wait_for(run, lambda s: s.run.status == "completed")
        # the same through ApprovalService.RecordDecision: a rejection is recorded, not "already decided"
        run = self.start(defn("g", {"g": gate(5, timeout_minutes=1, on_timeout="escalate", on_reject="end"), "end": DONE}))
        a = self.parked(run, "g")
        self.expire(run)
        self.wait_for(run, lambda s: s.actions[0].status == "escalated")
        ap = self.high("GetApproval", AP.GetApprovalRequest(approval_id=a.approval_id)).approval
        self.assertEqual((ap.status, ap.required_clearance, ap.escalations), ("pending", 5, 1))  # at the cap
        r = self.high("RecordDecision", AP.RecordDecisionRequest(approval_id=a.approval_id, decision=AP.DECISION_REJECTED))
        self.assertFalse(r.already_decided)
        s = self.wait_for(run, lambda s: s.run.status == "completed")
        self.assertEqual(s.actions[0].status, "rejected")

    def test_05g_escalated_gate_keeps_its_window(self):
        """EscalateAction does not stop the step's window: GetRunPrompt.expires_at is "the deadline
        the run's own timer will honour" (spec), and the timer honours it on the escalated gate."""
        run = self.start(defn("ask", {"ask": {"type": "user_input", "question": "?", "options": [{"value": "a"}, {"value": "b"}],
                                              "default_choice": "b", "timeout_minutes": 1, "on_timeout": "default"}}))
        a = self.parked(run, "ask")
        p0 = self.A("GetRunPrompt", W.GetRunPromptRequest(prompt_id=a.approval_id))
        self.assertEqual(self.A("EscalateAction", W.EscalateActionRequest(action_id=a.id)).action.status, "escalated")
        p = self.A("GetRunPrompt", W.GetRunPromptRequest(prompt_id=a.approval_id))
        self.assertEqual((p.status, p.expires_at), ("pending", p0.expires_at))
        self.assertLess(p.expires_at.ToSeconds(), p.governance_expires_at.ToSeconds())
        self.expire(run)
        s = self.wait_for(run, lambda s: s.run.status == "completed")
        self.assertEqual(js(s.actions[0].output)["choice"], "b")
        p = self.A("GetRunPrompt", W.GetRunPromptRequest(prompt_id=a.approval_id))
        self.assertEqual((p.status, p.answered_by, p.answered_choice), ("answered", "timeout", "b"))
        # an approval gate escalated by hand still applies its on_timeout "reject"
        run = self.start(defn("g", {"g": gate(2, timeout_minutes=1, on_timeout="reject", on_reject="end"), "end": DONE}))
        a = self.parked(run, "g")
        self.high("EscalateAction", W.EscalateActionRequest(action_id=a.id))
        self.expire(run)
        s = self.wait_for(run, lambda s: s.run.status == "completed")
        self.assertEqual((s.actions[0].status, js(s.actions[0].output)["decided_by"]), ("rejected", "timeout"))
        ap = self.high("GetApproval", AP.GetApprovalRequest(approval_id=a.approval_id)).approval
        self.assertEqual((ap.status, ap.can_decide), ("expired", False))

    # ---- replicas, tenancy ----
    def test_06_decided_while_other_replica_leases(self):
        run = self.start(defn("g", {"g": gate(1, on_approve="end"), "end": DONE}))
        a = self.parked(run, "g")
        # the run leased by another replica for 5 s: the decision still lands, now, on this one
        self.psql("UPDATE workflow_engine.run_queue SET lease_owner = 'replica-x', "
                  "lease_until = now() + interval '5 seconds' WHERE run_id = '%s'" % run)
        t0 = time.time()
        r = self.B("ApproveAction", W.ApproveActionRequest(action_id=a.id))
        self.assertLess(time.time() - t0, 4)
        self.assertIn("end", [n.step_name for n in r.next_actions])
        self.assertEqual(self.wait_for(run, lambda s: s.run.status == "completed", timeout=10).run.status, "completed")

    def test_06b_deleted_workflow(self):
        """Spec, DeleteWorkflow: the runs "become UNDISCOVERABLE through the workflow", but
        "any run row already known by id remains readable": the gate leaves the pending list and
        stays answerable by its id."""
        wf = self.A("CreateWorkflow", W.CreateWorkflowRequest(name="gone", definition=st(defn("g", {"g": gate(1)})),
                                                              team_id=self.team)).workflow
        run = self.A("TriggerWorkflow", W.TriggerWorkflowRequest(workflow_id=wf.id)).run.id
        a = self.parked(run, "g")
        pending = lambda: [p.action.id for p in self.A("ListPendingApprovals", W.ListPendingApprovalsRequest(limit=100)).approvals]
        self.assertIn(a.id, pending())
        self.A("DeleteWorkflow", W.DeleteWorkflowRequest(workflow_id=wf.id))
        self.assertNotIn(a.id, pending())
        self.assertTrue(self.A("GetApproval", AP.GetApprovalRequest(approval_id=a.approval_id)).approval.can_decide)
        self.B("ApproveAction", W.ApproveActionRequest(action_id=a.id))
        self.assertEqual(self.wait_for(run, lambda s: s.run.status == "completed").run.status, "completed")

    def test_07_cross_tenant(self):
        run = self.start(defn("g", {"g": gate(1)}))
        a = self.parked(run, "g")
        q = self.start(defn("ask", {"ask": {"type": "user_input", "question": "x", "allow_text": True}}))
        pid = self.parked(q, "ask").approval_id
        f = self.foreign
        self.err(C.NOT_FOUND, f, "ApproveAction", W.ApproveActionRequest(action_id=a.id))
        self.err(C.NOT_FOUND, f, "RejectAction", W.RejectActionRequest(action_id=a.id))
        self.err(C.NOT_FOUND, f, "EscalateAction", W.EscalateActionRequest(action_id=a.id))
        self.err(C.NOT_FOUND, f, "GetRunPrompt", W.GetRunPromptRequest(prompt_id=pid))
        self.err(C.NOT_FOUND, f, "AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=pid, text="x"))
        self.err(C.NOT_FOUND, f, "GetApproval", AP.GetApprovalRequest(approval_id=a.approval_id))
        self.err(C.NOT_FOUND, f, "RecordDecision", AP.RecordDecisionRequest(approval_id=a.approval_id, decision=AP.DECISION_APPROVED))
        self.assertEqual(len(f("ListPendingApprovals", W.ListPendingApprovalsRequest()).approvals), 0)
        self.assertEqual(self.status(run).actions[0].status, "awaiting_approval")
        self.assertEqual(self.A("GetRunPrompt", W.GetRunPromptRequest(prompt_id=pid)).status, "pending")


if __name__ == "__main__":
    unittest.main(verbosity=2)
