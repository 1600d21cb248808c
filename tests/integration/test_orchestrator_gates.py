"""Human gates on the chat path over real gRPC (grpcio), Postgres, NATS and Redis: a turn's
gated tool call (interrupt_required) and ask_user (input_required) open an approval / a prompt
in workflow-engine's ApprovalService; the session parks on it; the decision (RecordDecision /
AnswerRunPrompt on the engine, published on approval.decided.<org>) resumes the same turn exactly
once, re-entering only the gated call, on the stream that waits (whichever replica takes the
message) or with nobody listening.

Starts build/bin/workflow-engine, two orchestrator replicas (A and B, sharing the database and
one durable consumer of their own) and build/bin/devworker, which scripts each turn. Fresh org
UUIDs per run; processes are stopped by pid."""
import json
import os
import queue
import sys
import threading
import time
import unittest
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
import upsquad_testlib as T  # noqa: E402

DSN = os.environ.get("UPSQUAD_PG_DSN_ORCHESTRATOR")
WF_DSN = os.environ.get("UPSQUAD_PG_DSN_WORKFLOW_ENGINE")
REDIS = os.environ.get("UPSQUAD_REDIS_URL")
NATS = os.environ.get("UPSQUAD_NATS_URL")
if not DSN or not WF_DSN or not REDIS or not NATS:
    print("SKIP: UPSQUAD_PG_DSN_ORCHESTRATOR, UPSQUAD_PG_DSN_WORKFLOW_ENGINE, UPSQUAD_REDIS_URL "
          "and UPSQUAD_NATS_URL are required")
    sys.exit(0)

import grpc  # noqa: E402
from upsquad.runtime.v1 import lifecycle_pb2 as L  # noqa: E402
from upsquad.runtime.v1 import runtime_pb2 as R  # noqa: E402
from upsquad.approval.v1 import approval_pb2 as AP  # noqa: E402
from upsquad.workflow.v1 import workflow_pb2 as W  # noqa: E402
from test_orchestrator import SECRET, KEK, LC, MIGRATIONS, DEVWORKER, apply_agent, drain  # noqa: E402
from test_orchestrator_pause import sql  # noqa: E402

C = grpc.StatusCode
AGENT = {"role": "deployer", "display_name": "Deployer", "model": "claude-sonnet-4-6",
         "tools": ["deploy"], "approval_clearance": 4,
         "tool_policies": {"deploy": {"requires_approval": True, "required_clearance": 3}}}


def script(steps):
    return "#!script\n" + json.dumps(steps)


def gated(call="g1", after="deployed"):
    """A turn whose `deploy` call is gated; after the gate the script completes with `after`
    ({{answer}} becomes the denial / the answer)."""
    return script([{"token": "checking"},
                   {"tool_call": {"tool_name": "deploy", "tool_call_id": call, "arguments": {"env": "prod"}}},
                   {"interrupt": {"tool_name": "deploy", "tool_call_id": call,
                                  "pending_tool_intent": {"env": "prod", "secret": "SECRET-INTENT"}}},
                   {"tokens": "after the gate"},
                   {"complete": after}])


class Stream:
    """A SendMessage stream read on a thread: events arrive in a queue as they come."""

    def __init__(self, it):
        self.it, self.q, self.events, self.error = it, queue.Queue(), [], None
        self.th = threading.Thread(target=self._run, daemon=True)
        self.th.start()

    def _run(self):
        try:
            for e in self.it:
                self.q.put(e)
        except grpc.RpcError as x:
            self.error = x
        self.q.put(None)

    def until(self, arm, timeout=20):
        """Events up to and including the first of `arm`."""
        end = time.time() + timeout
        while time.time() < end:
            try:
                e = self.q.get(timeout=max(0.05, end - time.time()))
            except queue.Empty:
                break
            if e is None:
                self.q.put(None)
                break
            self.events.append(e)
            if e.WhichOneof("event") == arm:
                return e
        raise AssertionError("no %s on the stream: %s (error %s)" %
                             (arm, [x.WhichOneof("event") for x in self.events], self.error))

    def rest(self, timeout=30):
        """Every event until the stream ends."""
        self.th.join(timeout)
        while True:
            e = self.q.get(timeout=1)
            if e is None:
                break
            self.events.append(e)
        return self.events

    def cancel(self):
        self.it.cancel()


@unittest.skipUnless(os.path.exists(DEVWORKER), "build/bin/devworker is not built")
class ChatGates(unittest.TestCase):
    procs = []

    @classmethod
    def setUpClass(cls):
        cls.engine = drain(T.Server("workflow-engine", env=T.engine_env(
            WF_DSN, NATS, SECRET, UPSQUAD_WF_SCHEDULE_POLL="100ms")))
        cls.procs.append(cls.engine)
        base = {"UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_PG_DSN": DSN, "UPSQUAD_MIGRATIONS_DIR": MIGRATIONS,
                "UPSQUAD_REDIS_URL": REDIS, "UPSQUAD_NATS_URL": NATS, "UPSQUAD_KEK": KEK,
                "UPSQUAD_WORKER_PROBE": "200ms", "UPSQUAD_LOG_LEVEL": "info",
                "UPSQUAD_APPROVALS_ADDR": cls.engine.addr,
                # a durable of this test's own: another deployment on this NATS takes none
                "UPSQUAD_APPROVALS_DURABLE": "test-gates-" + uuid.uuid4().hex[:12]}
        # the worker checkpoints to replica A, whose port is chosen first (the worker retries
        # until A answers); both replicas run turns on it
        a_addr = "127.0.0.1:%d" % T.free_port()
        cls.w = drain(T.Server("devworker", env={"UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_LOG_LEVEL": "info",
                                                 "UPSQUAD_ORCHESTRATOR_ADDR": a_addr,
                                                 "UPSQUAD_DEVWORKER_HEARTBEAT_INTERVAL": "200ms"}))
        cls.procs.append(cls.w)
        cls.base_env = base
        cls.a = drain(T.Server("orchestrator", env=dict(base, UPSQUAD_WORKER_TARGETS=cls.w.addr,
                                                        UPSQUAD_GRPC_ADDR=a_addr)))
        cls.procs.append(cls.a)
        # B holds the streams and consumes no decision: every one reaches A, the replica that
        # does not hold the stream (UPSQUAD_APPROVALS_DURABLE=none)
        cls.b = drain(T.Server("orchestrator", env=dict(base, UPSQUAD_WORKER_TARGETS=cls.w.addr,
                                                        UPSQUAD_APPROVALS_DURABLE="none")))
        cls.procs.append(cls.b)
        cls.ch = grpc.insecure_channel(cls.b.addr)
        cls.org, cls.org2 = str(uuid.uuid4()), str(uuid.uuid4())
        cls.user, cls.member = str(uuid.uuid4()), str(uuid.uuid4())
        cls.agent = apply_agent(cls.org, AGENT)
        cls.lead = apply_agent(cls.org, {"role": "lead2", "display_name": "Lead", "model": "claude-sonnet-4-6",
                                         "tool_policies": {"delegate_to_agent": {"requires_approval": True,
                                                                                 "required_clearance": 2}}})
        apply_agent(cls.org, {"role": "helper2", "display_name": "Helper", "model": "claude-sonnet-4-6"})
        tok = lambda sub, org, c: T.mint(SECRET, sub=sub, org=org, clearance=c)
        cls.requester = T.WorkflowClient(cls.engine.addr, tok(cls.user, cls.org, 2))
        cls.low = T.WorkflowClient(cls.engine.addr, tok(cls.member, cls.org, 2))
        cls.approver = T.WorkflowClient(cls.engine.addr, tok(cls.member, cls.org, 3))
        cls.foreign = T.WorkflowClient(cls.engine.addr, tok(cls.member, cls.org2, 5))
        cls.clients = (cls.requester, cls.low, cls.approver, cls.foreign)
        warm = cls()
        T.until_served(lambda: list(warm.open_stream("warm up")))

    @classmethod
    def tearDownClass(cls):
        cls.ch.close()
        for c in cls.clients:
            c.close()
        for p in cls.procs:
            p.stop()

    # ---- helpers ----
    def tok(self, org=None):
        return T.mint(SECRET, sub=self.user, org=org or self.org, clearance=2)

    def unary(self, method, req, resp_cls, ch=None, token=None):
        fn = (ch or self.ch).unary_unary(LC + method, request_serializer=req.SerializeToString,
                                         response_deserializer=resp_cls.FromString)
        return fn(req, metadata=[("authorization", "Bearer " + (token or self.tok()))], timeout=10)

    def open_stream(self, message, session_id="", timeout=60):
        fn = self.ch.unary_stream(LC + "SendMessage", request_serializer=L.SendMessageRequest.SerializeToString,
                                  response_deserializer=L.AgentEvent.FromString)
        req = L.SendMessageRequest(session_id=session_id, message=message,
                                   agent_id="" if session_id else self.agent)
        return fn(req, metadata=[("authorization", "Bearer " + self.tok())], timeout=timeout)

    def create(self):
        return self.unary("CreateSession", L.CreateSessionRequest(agent_id=self.agent),
                          L.CreateSessionResponse).session_id

    def get(self, sid):
        return self.unary("GetSession", L.GetSessionRequest(session_id=sid), L.GetSessionResponse)

    def audit(self, sid):
        rows = sql(self.org, "SELECT action_type, detail::text FROM orchestrator.audit_log"
                   " WHERE session_id = '%s' ORDER BY seq" % sid)
        return [(r[0], json.loads(r[1])) for r in rows]

    def park(self, message):
        """A fresh session whose turn parks: (session id, stream, the approval id)."""
        sid = self.create()
        s = Stream(self.open_stream(message, sid))
        paused = s.until("session_paused")
        return sid, s, paused.session_paused

    def decide(self, aid, decision, client=None, **kw):
        return (client or self.approver)("RecordDecision", AP.RecordDecisionRequest(
            approval_id=aid, decision=decision, **kw))

    def wait_state(self, sid, want, timeout=20):
        end = time.time() + timeout
        while time.time() < end:
            got = sql(self.org, "SELECT state FROM orchestrator.sessions WHERE session_id = '%s'" % sid)
            if got and got[0][0] == want:
                return
            time.sleep(0.1)
        self.fail("session %s did not become %s" % (sid, want))

    # ---- an approved call runs once, on the waiting stream ----
    def test_approve_resumes_the_turn_once(self):
        sid, s, p = self.park(gated())
        ir = [e for e in s.events if e.HasField("interrupt_required")][0].interrupt_required
        self.assertEqual(p.pause_source, L.PAUSE_SOURCE_APPROVAL)
        self.assertEqual(p.correlation_id, ir.approval_id)
        # the pause names the frozen checkpoint it resumes from
        newest = sql(self.org, "SELECT max(loop_iteration) FROM orchestrator.checkpoints"
                     " WHERE session_id = '%s'" % sid)[0][0]
        self.assertEqual(p.checkpoint_key, "%s:%s" % (sid, newest))
        # ApprovalService has it: the session, the tool, the policy's clearance (3)
        ap = self.requester("GetApproval", AP.GetApprovalRequest(approval_id=ir.approval_id)).approval
        self.assertEqual((ap.kind, ap.session_id, ap.agent_id, ap.tool, ap.tool_call_id, ap.required_clearance,
                          ap.requested_by, ap.status),
                         ("approval_gate", sid, self.agent, "deploy", "g1", 3, self.user, "pending"))
        # below the clearance: refused, nothing changes
        T.rpc_error(self, C.PERMISSION_DENIED, self.decide, ir.approval_id, AP.DECISION_APPROVED, self.low)
        # ResumeSession cannot lift it
        T.rpc_error(self, C.FAILED_PRECONDITION, self.unary, "ResumeSession",
                    L.ResumeSessionRequest(session_id=sid), L.ResumeSessionResponse, contains=ir.approval_id)
        self.assertEqual(self.get(sid).status, R.AGENT_STATUS_SUSPENDED)
        r = self.decide(ir.approval_id, AP.DECISION_APPROVED, comment="ship it")
        self.assertTrue(r.recorded)
        resumed = s.until("session_resumed").session_resumed
        self.assertTrue(resumed.resumed_by_approval)
        self.assertEqual(resumed.approval_id, ir.approval_id)
        evs = s.rest()
        arms = [e.WhichOneof("event") for e in evs]
        self.assertEqual(arms[-1], "completion", arms)
        self.assertEqual(evs[-1].completion.final_response, "deployed")
        self.assertIsNone(s.error)
        self.assertNotIn(b"SECRET-INTENT", b"".join(e.SerializeToString() for e in evs))
        # the gated call ran once: one tool_result of g1, not an error
        rows = self.audit(sid)
        results = [d for t, d in rows if t == "tool_result" and d["tool_call_id"] == "g1"]
        self.assertEqual(len(results), 1, rows)
        self.assertFalse(results[0]["is_error"])
        self.assertEqual([t for t, _ in rows].count("session_resumed"), 1)
        resumed_row = [d for t, d in rows if t == "session_resumed"][0]
        self.assertEqual((resumed_row["approval_id"], resumed_row["status"]), (ir.approval_id, "approved"))
        self.wait_state(sid, "active")
        # a second decision is already_decided and resumes nothing
        again = self.decide(ir.approval_id, AP.DECISION_REJECTED)
        self.assertTrue(again.already_decided)
        time.sleep(1.5)
        self.assertEqual([t for t, _ in self.audit(sid)].count("session_resumed"), 1)
        # the session goes on: the next message is a fresh turn
        nxt = list(self.open_stream("hello again", sid))
        self.assertEqual(nxt[-1].WhichOneof("event"), "completion")

    # ---- a rejected call gets the denial as its result; the turn goes on ----
    def test_reject_gives_the_denied_result(self):
        sid, s, p = self.park(gated(call="g2", after="gate said {{answer}}"))
        self.decide(p.correlation_id, AP.DECISION_REJECTED, comment="not on a Friday")
        self.assertTrue(s.until("session_resumed").session_resumed.resumed_by_approval)
        evs = s.rest()
        final = evs[-1].completion.final_response
        denial = json.loads(final[len("gate said "):])
        self.assertEqual(denial, {"denied": True, "approval_id": p.correlation_id, "status": "rejected",
                                  "decided_by": self.member, "comment": "not on a Friday"})
        results = [d for t, d in self.audit(sid) if t == "tool_result" and d["tool_call_id"] == "g2"]
        self.assertEqual(len(results), 1)
        self.assertTrue(results[0]["is_error"])

    # ---- two replicas: the decision reaches A, the stream waits on B: B resumes, once ----
    def test_decisions_across_replicas_resume_once(self):
        parked = [self.park(gated(call="m%d" % i)) for i in range(6)]
        for _, _, p in parked:
            self.decide(p.correlation_id, AP.DECISION_APPROVED)
        for sid, s, p in parked:
            self.assertEqual(s.until("session_resumed").session_resumed.approval_id, p.correlation_id)
            evs = s.rest()
            self.assertEqual(evs[-1].completion.final_response, "deployed")
            self.assertEqual([e.WhichOneof("event") for e in evs].count("session_resumed"), 1)
            rows = [t for t, _ in self.audit(sid)]
            self.assertEqual(rows.count("session_resumed"), 1)
            self.assertEqual(rows.count("completion"), 1)
            # A took the decision and left it to B's stream; B resumed it there
            self.assertTrue(any("gate.deferred" in l and p.correlation_id in l for l in self.a.log))
            self.assertTrue(any("gate.resumed" in l and sid in l and "waiting stream" in l for l in self.b.log))
            self.assertFalse(any("gate.resumed" in l and sid in l for l in self.a.log))

    # ---- nobody listens: the turn resumes anyway, into the session's history ----
    def test_resume_with_nobody_listening(self):
        sid, s, p = self.park(gated(call="h1", after="done headless"))
        s.cancel()
        time.sleep(0.5)
        self.decide(p.correlation_id, AP.DECISION_APPROVED)
        end = time.time() + 20
        while time.time() < end:
            if "completion" in [t for t, _ in self.audit(sid)]:
                break
            time.sleep(0.2)
        rows = [t for t, _ in self.audit(sid)]
        self.assertEqual(rows.count("session_resumed"), 1, rows)
        self.assertEqual(rows.count("completion"), 1, rows)
        # resumed by a replica (the stream that waited is gone; a replica may still have seen
        # it waiting when the decision came, and resumed it there)
        self.assertTrue(any("gate.resumed" in l and sid in l for l in self.a.log + self.b.log))
        self.wait_state(sid, "active")
        turns = sql(self.org, "SELECT role, text FROM orchestrator.turns WHERE session_id = '%s'"
                    " ORDER BY turn_no" % sid)
        self.assertEqual(turns[-1], ["2", "done headless"])

    # ---- ask_user: a prompt, answered once; the turn resumes with the answer ----
    def test_ask_user_prompt_answered_once(self):
        sc = script([{"token": "one question"},
                     {"ask_user": {"question_spec": {"question": "Which environment?",
                                                     "options": ["staging", "prod"], "allow_text": False}}},
                     {"complete": "deploying to {{answer}}"}])
        sid, s, p = self.park(sc)
        self.assertEqual(p.pause_source, L.PAUSE_SOURCE_APPROVAL)
        self.assertIn("Which environment?", p.reason)
        pid = p.correlation_id
        # listed for the member who asked, with the question
        listed = self.requester("ListPendingApprovals", W.ListPendingApprovalsRequest(limit=100)).approvals
        mine = [x for x in listed if x.action.id == pid]
        self.assertEqual(len(mine), 1)
        self.assertEqual(mine[0].action.step_name, "ask_user")
        pr = self.requester("GetRunPrompt", W.GetRunPromptRequest(prompt_id=pid))
        self.assertTrue(pr.can_answer)
        # only the asker answers (no clearance of its own in the policy)
        T.rpc_error(self, C.PERMISSION_DENIED, self.approver, "AnswerRunPrompt",
                    W.AnswerRunPromptRequest(prompt_id=pid, choice="prod"))
        out, errs = T.concurrently(50, lambda i: self.requester("AnswerRunPrompt", W.AnswerRunPromptRequest(
            prompt_id=pid, choice=("staging", "prod")[i % 2])))
        self.assertEqual(errs, [])
        won = [o for o in out if o.recorded]
        self.assertEqual(len(won), 1)
        choice = won[0].prompt.answered_choice
        self.assertTrue(s.until("session_resumed").session_resumed.resumed_by_approval)
        evs = s.rest()
        answer = json.loads(evs[-1].completion.final_response[len("deploying to "):])
        self.assertEqual(answer, {"choice": choice, "text": "", "answered_by": self.user})
        rows = self.audit(sid)
        self.assertEqual([t for t, _ in rows].count("session_resumed"), 1)
        asked = [d for t, d in rows if t == "input_required"][0]
        self.assertEqual(asked["prompt_id"], pid)

    # ---- an approval nobody decides expires: the call is denied, the turn goes on ----
    def test_expiry_denies_the_call(self):
        c = drain(T.Server("orchestrator", env=dict(self.base_env, UPSQUAD_WORKER_TARGETS=self.w.addr,
                                                    UPSQUAD_APPROVAL_TIMEOUT="1")))
        ch = grpc.insecure_channel(c.addr)
        try:
            fn = ch.unary_stream(LC + "SendMessage", request_serializer=L.SendMessageRequest.SerializeToString,
                                 response_deserializer=L.AgentEvent.FromString)
            sid = self.create()
            s = Stream(fn(L.SendMessageRequest(session_id=sid, message=gated(call="t1", after="late: {{answer}}")),
                          metadata=[("authorization", "Bearer " + self.tok())], timeout=60))
            p = s.until("session_paused").session_paused
            self.assertEqual(s.until("session_resumed", timeout=30).session_resumed.approval_id, p.correlation_id)
            denial = json.loads(s.rest()[-1].completion.final_response[len("late: "):])
            self.assertEqual((denial["status"], denial["decided_by"]), ("expired", "timeout"))
            ap = self.requester("GetApproval", AP.GetApprovalRequest(approval_id=p.correlation_id)).approval
            self.assertEqual(ap.status, "expired")
            # a decision after the expiry changes nothing
            self.assertTrue(self.decide(p.correlation_id, AP.DECISION_APPROVED).already_decided)
        finally:
            ch.close()
            c.stop()

    # ---- a delegation the policy gates: DELEGATION_APPROVAL, then the child runs ----
    def test_delegation_needs_approval(self):
        sid = self.unary("CreateSession", L.CreateSessionRequest(agent_id=self.lead),
                         L.CreateSessionResponse).session_id
        child = script([{"tokens": "helping"}, {"complete": "helped"}])
        sc = script([{"token": "asking"},
                     {"interrupt": {"tool_name": "delegate_to_agent", "tool_call_id": "dg",
                                    "pending_tool_intent": {"agent": "helper2", "task": child}}},
                     {"complete": "got {{answer}}"}])
        s = Stream(self.open_stream(sc, sid))
        p = s.until("session_paused").session_paused
        self.assertEqual(p.pause_source, L.PAUSE_SOURCE_DELEGATION_APPROVAL)
        ap = self.requester("GetApproval", AP.GetApprovalRequest(approval_id=p.correlation_id)).approval
        self.assertEqual((ap.tool, ap.required_clearance), ("delegate_to_agent", 2))
        T.rpc_error(self, C.FAILED_PRECONDITION, self.unary, "ResumeSession",
                    L.ResumeSessionRequest(session_id=sid), L.ResumeSessionResponse)
        self.assertEqual(sql(self.org, "SELECT count(*) FROM orchestrator.sessions WHERE parent_session_id = '%s'"
                             % sid), [["0"]])  # nothing spawned before the decision
        self.decide(p.correlation_id, AP.DECISION_APPROVED)
        self.assertTrue(s.until("session_resumed").session_resumed.resumed_by_approval)
        d = s.until("session_paused").session_paused
        self.assertEqual(d.pause_source, L.PAUSE_SOURCE_DELEGATION)
        evs = s.rest()
        inner = [e.delegated.inner.WhichOneof("event") for e in evs if e.HasField("delegated")]
        self.assertEqual(inner[-1], "completion")
        result = json.loads(evs[-1].completion.final_response[len("got "):])
        self.assertEqual((result["status"], result["final_response"], result["child_session_id"]),
                         ("completed", "helped", d.correlation_id))
        # rejected: the call gets the denial, nothing is spawned
        sid2 = self.unary("CreateSession", L.CreateSessionRequest(agent_id=self.lead),
                          L.CreateSessionResponse).session_id
        s2 = Stream(self.open_stream(sc, sid2))
        p2 = s2.until("session_paused").session_paused
        self.decide(p2.correlation_id, AP.DECISION_REJECTED)
        denial = json.loads(s2.rest()[-1].completion.final_response[len("got "):])
        self.assertEqual((denial["denied"], denial["status"]), (True, "rejected"))
        self.assertEqual(sql(self.org, "SELECT count(*) FROM orchestrator.sessions WHERE parent_session_id = '%s'"
                             % sid2), [["0"]])

    # ---- another org sees and decides nothing ----
    def test_other_org_cannot_see_or_decide(self):
        sid, s, p = self.park(gated(call="x1"))
        aid = p.correlation_id
        T.rpc_error(self, C.NOT_FOUND, self.foreign, "GetApproval", AP.GetApprovalRequest(approval_id=aid))
        T.rpc_error(self, C.NOT_FOUND, self.decide, aid, AP.DECISION_APPROVED, self.foreign)
        listed = self.foreign("ListPendingApprovals", W.ListPendingApprovalsRequest(limit=100)).approvals
        self.assertNotIn(aid, [x.action.id for x in listed])
        # nor through the orchestrator: the session is another org's
        T.rpc_error(self, C.NOT_FOUND, self.unary, "GetSession", L.GetSessionRequest(session_id=sid),
                    L.GetSessionResponse, None, self.tok(self.org2))
        self.assertEqual(self.get(sid).status, R.AGENT_STATUS_SUSPENDED)
        self.decide(aid, AP.DECISION_APPROVED)
        s.until("session_resumed")
        s.rest()


if __name__ == "__main__":
    unittest.main(verbosity=2)
