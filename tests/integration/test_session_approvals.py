"""Agent sessions' approvals and prompts in workflow-engine's ApprovalService over real gRPC
(grpcio), Postgres and NATS, two engine replicas: OpenApproval (service scope only, every field
checked, idempotent by correlation key), and the doors a run's gates have, on session rows:
GetApproval, RecordDecision (clearance floor, first write wins), ApproveAction / RejectAction /
EscalateAction by the listed action id, ListPendingApprovals, GetRunPrompt / AnswerRunPrompt,
expiry, tenancy, and ApprovalDecided on approval.decided.<org> carrying the session's fields and
the pending tool intent. Fresh org UUIDs per run, so it shares the runtime's database safely."""
import os
import secrets
import sys
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

SECRET = secrets.token_hex(16)
C = grpc.StatusCode
ENGINE_ENV = T.engine_env(DSN, NATS, SECRET, UPSQUAD_WF_SCHEDULE_POLL="100ms")
Client = T.WorkflowClient
INTENT = b"\x00\x01{\"tool\":\"deploy\",\"args\":{\"env\":\"prod\"}}\xff"


def js(s):
    return json_format.MessageToDict(s)


class SessionApprovalsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.a = T.Server("workflow-engine", env=ENGINE_ENV)
        cls.b = T.Server("workflow-engine", env=ENGINE_ENV)
        cls.org, cls.org2 = str(uuid.uuid4()), str(uuid.uuid4())
        cls.user, cls.user2 = str(uuid.uuid4()), str(uuid.uuid4())
        cls.agent = str(uuid.uuid4())
        tok = lambda sub, org, c, **kw: T.mint(SECRET, sub=sub, org=org, clearance=c, **kw)
        svc = {"scope": "approvals.open"}
        cls.svc = Client(cls.a.addr, tok("orchestrator", cls.org, 1, extra=svc))
        cls.svc_b = Client(cls.b.addr, tok("orchestrator", cls.org, 1, extra=svc))
        cls.svc2 = Client(cls.b.addr, tok("orchestrator", cls.org2, 1, extra=svc))
        cls.other_scope = Client(cls.a.addr, tok("orchestrator", cls.org, 5,
                                                 extra={"scope": "runtime.orchestrator"}))
        cls.user_c = Client(cls.a.addr, tok(cls.user, cls.org, 3))     # the requester
        cls.low = Client(cls.b.addr, tok(cls.user2, cls.org, 2))
        cls.high = Client(cls.b.addr, tok(cls.user2, cls.org, 5))
        cls.high_a = Client(cls.a.addr, tok(cls.user2, cls.org, 5))
        cls.foreign = Client(cls.b.addr, tok(cls.user, cls.org2, 5))
        cls.clients = (cls.svc, cls.svc_b, cls.svc2, cls.other_scope, cls.user_c, cls.low,
                       cls.high, cls.high_a, cls.foreign)
        cls.nc = nats_mini.Nats(NATS)
        cls.dec_sid, cls.dec_q = cls.nc.subscribe("approval.decided.%s" % cls.org)
        cls.nc.flush()

    @classmethod
    def tearDownClass(cls):
        for c in cls.clients:
            c.close()
        cls.a.stop()
        cls.b.stop()
        cls.nc.close()

    # ---- helpers ----
    def err(self, code, fn, *args, contains=None):
        return T.rpc_error(self, code, fn, *args, contains=contains)

    def req(self, **kw):
        d = dict(org_id=self.org, session_id=str(uuid.uuid4()), agent_id=self.agent,
                 kind="approval_gate", tool="deploy", tool_call_id="call-1",
                 pending_tool_intent=INTENT, required_clearance=3, summary="deploy to prod",
                 requested_by=self.user, correlation_key=secrets.token_hex(32),
                 agent_name="Builder")
        d.update(kw)
        return AP.OpenApprovalRequest(**d)

    def prompt_req(self, **kw):
        d = dict(kind="user_prompt", tool="", pending_tool_intent=b"", summary="",
                 question="Which region?", allow_text=True, required_clearance=1,
                 options=[AP.ApprovalOption(value="eu", label="Europe"),
                          AP.ApprovalOption(value="us", label="Americas")])
        d.update(kw)
        return self.req(**d)

    def open(self, req=None, client=None):
        return (client or self.svc)("OpenApproval", req or self.req())

    def rows(self, session):
        """The session's governance rows, counted in the org (RLS)."""
        out = T.psql(DSN, "SELECT set_config('app.org_id', '%s', true); SELECT count(*) FROM "
                     "workflow_engine.governance WHERE session_id = '%s'" % (self.org, session))
        return int(out.splitlines()[-1])

    def events(self, approval_id, wait=1.5, first=10):
        """Every ApprovalDecided of approval_id that arrives within wait seconds of the first
        (the first is awaited up to `first` seconds)."""
        got, end = [], time.time() + first
        while time.time() < end:
            try:
                subj, _, _, data = self.dec_q.get(timeout=max(0.05, end - time.time()))
            except Exception:
                break
            ev = AP.ApprovalDecided.FromString(data)
            if ev.approval_id == approval_id:
                self.assertEqual(subj, "approval.decided." + self.org)
                got.append(ev)
                end = min(end, time.time() + wait)
        return got

    def pending_ids(self, client):
        return [p.action.id for p in client("ListPendingApprovals",
                                            W.ListPendingApprovalsRequest(limit=100)).approvals]

    # ---- the opener ----
    def test_01_opener_needs_the_service_scope(self):
        r = self.req()
        # a member, whatever the clearance; another service scope; another org's service
        self.err(C.PERMISSION_DENIED, self.high, "OpenApproval", r, contains="approvals.open")
        self.err(C.PERMISSION_DENIED, self.other_scope, "OpenApproval", r, contains="approvals.open")
        self.err(C.PERMISSION_DENIED, self.svc2, "OpenApproval", r, contains="org_id")
        self.assertEqual(self.rows(r.session_id), 0)

    def test_02_bad_fields(self):
        big = "x" * 201
        opt = AP.ApprovalOption
        cases = [
            (dict(org_id=""), "org_id"), (dict(org_id="nope"), "org_id"),
            (dict(session_id=""), "session_id"), (dict(session_id="s-1"), "session_id"),
            (dict(agent_id="agent"), "agent_id"),
            (dict(kind=""), "kind"), (dict(kind="question_gate"), "kind"),
            (dict(tool=""), "tool"), (dict(tool=big), "tool"),
            (dict(tool_call_id=big), "tool_call_id"),
            (dict(pending_tool_intent=b""), "pending_tool_intent"),
            (dict(pending_tool_intent=b"x" * 65537), "pending_tool_intent"),
            (dict(required_clearance=0), "required_clearance"),
            (dict(required_clearance=6), "required_clearance"),
            (dict(required_clearance=-1), "required_clearance"),
            (dict(summary="s" * 2001), "summary"),
            (dict(options=[opt(value="a")]), "options"),
            (dict(allow_text=True), "allow_text"),
            (dict(answerable_by="owner"), "answerable_by"),
            (dict(timeout_seconds=-1), "timeout_seconds"),
            (dict(timeout_seconds=604801), "timeout_seconds"),
            (dict(requested_by=""), "requested_by"), (dict(requested_by="me"), "requested_by"),
            (dict(correlation_key=""), "correlation_key"),
            (dict(correlation_key="k" * 201), "correlation_key"),
            (dict(agent_name=big), "agent_name"),
        ]
        for kw, field in cases:
            r = self.req(**kw)
            e = self.err(C.INVALID_ARGUMENT, self.svc, "OpenApproval", r)
            self.assertIn(field, e.details(), kw)
            if r.session_id and "session_id" not in kw:
                self.assertEqual(self.rows(r.session_id), 0, kw)
        prompt_cases = [
            (dict(question=""), "question"),
            (dict(question="q" * 2001), "question"),
            (dict(options=[], allow_text=False), "options"),
            (dict(options=[opt(value="a")] * 21), "options"),
            (dict(options=[opt(value="a"), opt(value="a")]), "options[1].value"),
            (dict(options=[opt(value="")]), "options[0].value"),
            (dict(options=[opt(value="a", label=big)]), "options[0].label"),
            (dict(options=[opt(value="a", description="d" * 1001)]), "options[0].description"),
        ]
        for kw, field in prompt_cases:
            r = self.prompt_req(**kw)
            e = self.err(C.INVALID_ARGUMENT, self.svc, "OpenApproval", r)
            self.assertIn(field, e.details(), kw)
            self.assertEqual(self.rows(r.session_id), 0, kw)

    def test_03_idempotent_open_and_get(self):
        r = self.req()
        first = self.open(r)
        self.assertTrue(first.created)
        ap = first.approval
        self.assertEqual((ap.kind, ap.status, ap.session_id, ap.agent_id, ap.tool, ap.tool_call_id,
                          ap.requested_by, ap.required_clearance, ap.run_id, ap.action_id),
                         ("approval_gate", "pending", r.session_id, self.agent, "deploy", "call-1",
                          self.user, 3, "", ""))
        again = self.open(r, self.svc_b)
        self.assertEqual((again.created, again.approval.id), (False, ap.id))
        # the same key on another session is another approval
        other = self.open(self.req(correlation_key=r.correlation_key))
        self.assertTrue(other.created)
        self.assertNotEqual(other.approval.id, ap.id)
        # the same key for another tool: the caller's bug, said plainly
        self.err(C.ALREADY_EXISTS, self.svc, "OpenApproval", self.req(
            session_id=r.session_id, correlation_key=r.correlation_key, tool="rm"), contains="correlation_key")
        # concurrent opens of one key: one row, one creator
        r2 = self.req()
        out, errs = T.concurrently(10, lambda i: self.open(r2, (self.svc, self.svc_b)[i % 2]))
        self.assertEqual(errs, [])
        self.assertEqual(len(out), 10)
        self.assertEqual(len({o.approval.id for o in out}), 1)
        self.assertEqual(sum(o.created for o in out), 1)
        self.assertEqual(self.rows(r2.session_id), 1)
        # GetApproval: the org's members read it with the session's fields; the expiry is the
        # default window; can_decide follows the floor
        g = self.low("GetApproval", AP.GetApprovalRequest(approval_id=ap.id)).approval
        self.assertEqual((g.session_id, g.agent_id, g.tool, g.status, g.kind), (r.session_id, self.agent, "deploy", "pending", "approval_gate"))
        self.assertFalse(g.can_decide)
        self.assertAlmostEqual(g.expires_at.seconds - g.created_at.seconds, 86400, delta=5)
        self.assertEqual(js(g.spec)["summary"], "deploy to prod")
        self.assertTrue(self.high("GetApproval", AP.GetApprovalRequest(approval_id=ap.id)).approval.can_decide)
        # the raw intent is never a member's to read
        self.assertNotIn("intent", str(js(g)))
        self.err(C.NOT_FOUND, self.foreign, "GetApproval", AP.GetApprovalRequest(approval_id=ap.id))

    # ---- deciding ----
    def test_04_clearance_then_one_decision_one_event(self):
        r = self.req()
        ap = self.open(r).approval
        e = self.err(C.PERMISSION_DENIED, self.low, "RecordDecision",
                     AP.RecordDecisionRequest(approval_id=ap.id, decision=AP.DECISION_APPROVED),
                     contains="clearance 3")
        self.assertEqual(self.user_c("GetApproval", AP.GetApprovalRequest(approval_id=ap.id)).approval.status, "pending", e)
        out, errs = T.concurrently(20, lambda i: (self.high, self.high_a, self.user_c)[i % 3](
            "RecordDecision", AP.RecordDecisionRequest(approval_id=ap.id, decision=AP.DECISION_APPROVED,
                                                       comment="go %d" % i)))
        self.assertEqual(errs, [])
        self.assertEqual(sum(o.recorded for o in out), 1)
        self.assertEqual(sum(o.already_decided for o in out), 19)
        won = [o for o in out if o.recorded][0].approval
        self.assertEqual({(o.approval.status, o.approval.decided_by, o.approval.comment) for o in out},
                         {("approved", won.decided_by, won.comment)})
        evs = self.events(ap.id)
        self.assertEqual(len(evs), 1, evs)
        ev = evs[0]
        self.assertEqual((ev.org_id, ev.kind, ev.status, ev.decided_by, ev.comment, ev.session_id,
                          ev.agent_id, ev.tool, ev.tool_call_id, ev.pending_tool_intent,
                          ev.correlation_key, ev.run_id, ev.action_id),
                         (self.org, "approval_gate", "approved", won.decided_by, won.comment,
                          r.session_id, self.agent, "deploy", "call-1", INTENT, r.correlation_key,
                          "", ""))
        self.assertEqual(js(ev.response_payload)["decision"], "approved")
        # a later decision: already decided, nothing published
        late = self.high("RecordDecision", AP.RecordDecisionRequest(approval_id=ap.id, decision=AP.DECISION_REJECTED))
        self.assertEqual((late.recorded, late.already_decided, late.approval.status), (False, True, "approved"))
        self.assertEqual(self.events(ap.id, first=1.5), [])
        self.assertNotIn(ap.id, self.pending_ids(self.high))

    def test_05_listed_and_decided_through_the_action_doors(self):
        r = self.req(summary="rotate the signing key")
        ap = self.open(r).approval
        lp = self.user_c("ListPendingApprovals", W.ListPendingApprovalsRequest(limit=100))
        mine = [p for p in lp.approvals if p.action.id == ap.id]
        self.assertEqual(len(mine), 1)
        p = mine[0]
        self.assertEqual((p.workflow_name, p.agent_name, p.action.run_id, p.action.step_name,
                          p.action.agent_id, p.action.status, p.action.approval_id,
                          p.action.blocked_by, p.action.org_id),
                         ("", "Builder", "", "deploy", self.agent, "awaiting_approval", ap.id, ap.id,
                          self.org))
        # one redaction rule: the listed input is the spec GetApproval serves the same caller
        self.assertEqual(js(p.action.input),
                         js(self.user_c("GetApproval", AP.GetApprovalRequest(approval_id=ap.id)).approval.spec))
        # the agent filter, the floor, another org
        self.assertIn(ap.id, [x.action.id for x in self.user_c("ListPendingApprovals", W.ListPendingApprovalsRequest(agent_id=self.agent, limit=100)).approvals])
        self.assertNotIn(ap.id, [x.action.id for x in self.user_c("ListPendingApprovals", W.ListPendingApprovalsRequest(agent_id=str(uuid.uuid4()), limit=100)).approvals])
        self.assertNotIn(ap.id, self.pending_ids(self.low))
        self.assertNotIn(ap.id, self.pending_ids(self.foreign))
        # escalation raises the floor past the requester's clearance
        esc = self.user_c("EscalateAction", W.EscalateActionRequest(action_id=ap.id, comment="needs ops"))
        self.assertEqual(esc.action.status, "escalated")
        self.assertEqual(self.high("GetApproval", AP.GetApprovalRequest(approval_id=ap.id)).approval.required_clearance, 4)
        self.err(C.PERMISSION_DENIED, self.user_c, "RejectAction", W.RejectActionRequest(action_id=ap.id), contains="clearance 4")
        # RejectAction by the listed id
        rej = self.high("RejectAction", W.RejectActionRequest(action_id=ap.id, comment="not today"))
        self.assertEqual((rej.action.id, rej.action.status, rej.action.decided_by), (ap.id, "rejected", self.user2))
        self.err(C.FAILED_PRECONDITION, self.high, "ApproveAction", W.ApproveActionRequest(action_id=ap.id))
        evs = self.events(ap.id)
        self.assertEqual([(e.status, e.decided_by, e.comment, e.pending_tool_intent) for e in evs],
                         [("rejected", self.user2, "not today", INTENT)])
        # ApproveAction by the listed id, on a fresh one
        ap2 = self.open(self.req(required_clearance=2)).approval
        ok = self.low("ApproveAction", W.ApproveActionRequest(action_id=ap2.id))
        self.assertEqual((ok.action.status, list(ok.next_actions)), ("approved", []))
        self.assertEqual([e.status for e in self.events(ap2.id)], ["approved"])

    def test_06_expiry(self):
        r = self.req(timeout_seconds=1)
        ap = self.open(r).approval
        end, g = time.time() + 10, None
        while time.time() < end:
            g = self.user_c("GetApproval", AP.GetApprovalRequest(approval_id=ap.id)).approval
            if g.status != "pending":
                break
            time.sleep(0.1)
        self.assertEqual((g.status, g.decided_by, g.can_decide), ("expired", "timeout", False))
        evs = self.events(ap.id)
        self.assertEqual([(e.status, e.decided_by, e.session_id, e.pending_tool_intent) for e in evs],
                         [("expired", "timeout", r.session_id, INTENT)])
        late = self.high("RecordDecision", AP.RecordDecisionRequest(approval_id=ap.id, decision=AP.DECISION_APPROVED))
        self.assertEqual((late.recorded, late.already_decided, late.approval.status), (False, True, "expired"))
        self.assertNotIn(ap.id, self.pending_ids(self.high))
        # a decision that comes after the expiry, before any sweeper fired it, loses to it
        r2 = self.req(timeout_seconds=1)
        ap2 = self.open(r2).approval
        T.psql(DSN, "SELECT set_config('app.org_id', '%s', true); UPDATE workflow_engine.approval_timers "
               "SET due_at = now() + interval '1 hour' WHERE approval_id = '%s'" % (self.org, ap2.id))
        time.sleep(1.3)
        self.assertNotIn(ap2.id, self.pending_ids(self.high))
        late = self.high("RecordDecision", AP.RecordDecisionRequest(approval_id=ap2.id, decision=AP.DECISION_APPROVED))
        self.assertEqual((late.recorded, late.already_decided, late.approval.status, late.approval.decided_by),
                         (False, True, "expired", "timeout"))
        self.assertEqual([(e.status, e.decided_by) for e in self.events(ap2.id)], [("expired", "timeout")])

    def test_07_cross_tenant(self):
        ap = self.open(self.prompt_req()).approval
        gate = self.open().approval
        for aid in (ap.id, gate.id):
            self.err(C.NOT_FOUND, self.foreign, "GetApproval", AP.GetApprovalRequest(approval_id=aid))
            self.err(C.NOT_FOUND, self.foreign, "RecordDecision", AP.RecordDecisionRequest(
                approval_id=aid, decision=AP.DECISION_APPROVED, response_payload=T.struct({"choice": "eu"})))
            self.err(C.NOT_FOUND, self.foreign, "ApproveAction", W.ApproveActionRequest(action_id=aid))
            self.err(C.NOT_FOUND, self.foreign, "RejectAction", W.RejectActionRequest(action_id=aid))
            self.err(C.NOT_FOUND, self.foreign, "EscalateAction", W.EscalateActionRequest(action_id=aid))
            self.err(C.NOT_FOUND, self.foreign, "GetRunPrompt", W.GetRunPromptRequest(prompt_id=aid))
            self.err(C.NOT_FOUND, self.foreign, "AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=aid, choice="eu"))
            self.assertNotIn(aid, self.pending_ids(self.foreign))
            self.assertEqual(self.high("GetApproval", AP.GetApprovalRequest(approval_id=aid)).approval.status, "pending")
        # another org's service opens nothing here
        self.err(C.PERMISSION_DENIED, self.svc2, "OpenApproval", self.req(), contains="org_id")

    # ---- prompts ----
    def test_08_prompt_answered_once(self):
        r = self.prompt_req(answerable_by="requester", tool_call_id="ask-7")
        ap = self.open(r).approval
        self.assertEqual((ap.kind, ap.tool, ap.required_clearance), ("user_prompt", "ask_user", 1))
        pr = self.user_c("GetRunPrompt", W.GetRunPromptRequest(prompt_id=ap.id))
        self.assertEqual((pr.kind, pr.question, [o.value for o in pr.options], pr.allow_text,
                          pr.status, pr.can_answer, pr.answerable_by, pr.asked_by_agent_id),
                         ("user_prompt", "Which region?", ["eu", "us"], True, "pending", True,
                          "requester", self.agent))
        # only the member whose turn asked may answer
        self.assertFalse(self.high("GetRunPrompt", W.GetRunPromptRequest(prompt_id=ap.id)).can_answer)
        self.err(C.PERMISSION_DENIED, self.high, "AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=ap.id, choice="eu"), contains="requester")
        self.err(C.INVALID_ARGUMENT, self.user_c, "AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=ap.id, choice="mars"), contains="choice")
        self.assertIn(ap.id, self.pending_ids(self.user_c))
        self.assertNotIn(ap.id, self.pending_ids(self.high))
        out, errs = T.concurrently(50, lambda i: self.user_c("AnswerRunPrompt", W.AnswerRunPromptRequest(
            prompt_id=ap.id, choice=("eu", "us")[i % 2], text="answer %d" % i)))
        self.assertEqual(errs, [])
        self.assertEqual(sum(o.recorded for o in out), 1)
        self.assertEqual(sum(o.already_answered for o in out), 49)
        won = [o for o in out if o.recorded][0].prompt
        self.assertEqual({(o.prompt.status, o.prompt.answered_choice, o.prompt.answered_text) for o in out},
                         {("answered", won.answered_choice, won.answered_text)})
        evs = self.events(ap.id)
        self.assertEqual(len(evs), 1)
        self.assertEqual((evs[0].kind, evs[0].status, evs[0].session_id, evs[0].tool_call_id),
                         ("user_prompt", "answered", r.session_id, "ask-7"))
        self.assertEqual(js(evs[0].response_payload),
                         {"choice": won.answered_choice, "text": won.answered_text, "answered_by": self.user})
        # RecordDecision answers a session prompt too ({choice, text}); the first answer stands
        late = self.user_c("RecordDecision", AP.RecordDecisionRequest(
            approval_id=ap.id, decision=AP.DECISION_APPROVED, response_payload=T.struct({"choice": "eu"})))
        self.assertEqual((late.recorded, late.already_decided), (False, True))
        ap2 = self.open(self.prompt_req()).approval
        r2 = self.low("RecordDecision", AP.RecordDecisionRequest(
            approval_id=ap2.id, decision=AP.DECISION_APPROVED, response_payload=T.struct({"choice": "us", "text": "west"})))
        self.assertEqual((r2.recorded, r2.approval.status, js(r2.approval.response_payload)["choice"]), (True, "answered", "us"))
        self.assertEqual([e.status for e in self.events(ap2.id)], ["answered"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
