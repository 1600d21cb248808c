"""PauseSession, ResumeSession and GetProvenanceChain over real gRPC (grpcio), with real
Postgres, Redis and NATS, two orchestrator replicas sharing the database and a real devworker
(build/bin/devworker: `#!script` messages choose its events and their timing).

A turn runs through replica B while the pause is asked of replica A: the pause reaches the turn
through the database only. Every test uses its own sessions in a fresh random org, plus a second
org for the cross-tenant checks. Processes are stopped by pid.
"""
import json
import os
import queue
import subprocess
import sys
import threading
import time
import unittest
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
sys.path.insert(0, os.path.dirname(__file__))
import upsquad_testlib as T  # noqa: E402

DSN = os.environ.get("UPSQUAD_PG_DSN_ORCHESTRATOR")
ADMIN = os.environ.get("UPSQUAD_PG_ADMIN_DSN")
REDIS = os.environ.get("UPSQUAD_REDIS_URL")
NATS = os.environ.get("UPSQUAD_NATS_URL")
WF_DSN = os.environ.get("UPSQUAD_PG_DSN_WORKFLOW_ENGINE")
if not DSN or not REDIS or not NATS or not WF_DSN:
    print("SKIP: UPSQUAD_PG_DSN_ORCHESTRATOR, UPSQUAD_PG_DSN_WORKFLOW_ENGINE, UPSQUAD_REDIS_URL and "
          "UPSQUAD_NATS_URL are required")
    sys.exit(0)

import grpc  # noqa: E402
from upsquad.runtime.v1 import lifecycle_pb2 as L  # noqa: E402
from upsquad.runtime.v1 import runtime_pb2 as R  # noqa: E402
from test_orchestrator import SECRET, KEK, LC, MIGRATIONS, DEVWORKER, AGENT, apply_agent, drain  # noqa: E402

SUSPENDED = R.AGENT_STATUS_SUSPENDED


def sql(org, query, dsn=None):
    """Rows of one query run as the orchestrator's role in org (row-level security applies)."""
    out = subprocess.run(["psql", dsn or DSN, "-X", "-Atq", "-F", "\t", "-v", "ON_ERROR_STOP=1",
                          "-c", "SET app.org_id = '%s'" % org, "-c", query],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return [l.split("\t") for l in out.stdout.strip().splitlines() if l]


def script(steps):
    return "#!script\n" + json.dumps(steps)


@unittest.skipUnless(os.path.exists(DEVWORKER), "build/bin/devworker is not built")
class Pause(unittest.TestCase):
    procs = []

    @classmethod
    def setUpClass(cls):
        # the engine's ApprovalService: a gated call's approval opens there
        cls.engine = T.Server("workflow-engine", env=T.engine_env(WF_DSN, NATS, SECRET))
        cls.procs.append(cls.engine)
        base = {"UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_PG_DSN": DSN, "UPSQUAD_MIGRATIONS_DIR": MIGRATIONS,
                "UPSQUAD_REDIS_URL": REDIS, "UPSQUAD_NATS_URL": NATS, "UPSQUAD_KEK": KEK,
                "UPSQUAD_WORKER_PROBE": "200ms", "UPSQUAD_LOG_LEVEL": "info",
                "UPSQUAD_APPROVALS_ADDR": cls.engine.addr, "UPSQUAD_APPROVALS_DURABLE": "none"}
        # replica A first (the worker checkpoints to it), then the worker, then replica B
        cls.a = drain(T.Server("orchestrator", env=dict(base, UPSQUAD_WORKER_TARGETS="127.0.0.1:1")))
        cls.procs.append(cls.a)
        cls.w = drain(T.Server("devworker", env={"UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_LOG_LEVEL": "info",
                                                 "UPSQUAD_ORCHESTRATOR_ADDR": cls.a.addr,
                                                 "UPSQUAD_DEVWORKER_HEARTBEAT_INTERVAL": "200ms"}))
        cls.procs.append(cls.w)
        # B ends a stream after its SessionPausedEvent (UPSQUAD_PAUSED_STREAMS=0), so these tests
        # read whole streams; test_paused_stream_waits_for_the_resume starts one that waits
        cls.base = dict(base, UPSQUAD_WORKER_TARGETS=cls.w.addr)
        cls.b = drain(T.Server("orchestrator", env=dict(cls.base, UPSQUAD_PAUSED_STREAMS="0")))
        cls.procs.append(cls.b)
        cls.cha = grpc.insecure_channel(cls.a.addr)
        cls.ch = grpc.insecure_channel(cls.b.addr)
        cls.org = str(uuid.uuid4())
        cls.org2 = str(uuid.uuid4())
        cls.user = str(uuid.uuid4())
        cls.agent = apply_agent(cls.org, AGENT)
        cls.agent2 = apply_agent(cls.org2, AGENT)
        # replica B sees the worker live before the first turn
        warm = cls()
        T.until_served(lambda: warm.stream_of("warm up"), 10)

    @classmethod
    def tearDownClass(cls):
        cls.ch.close()
        cls.cha.close()
        for p in cls.procs:
            p.stop()

    # ---- helpers ----
    def tok(self, org=None):
        return T.mint(SECRET, sub=self.user, org=org or self.org)

    def unary(self, method, req, resp_cls, token=None, ch=None, timeout=10):
        fn = (ch or self.ch).unary_unary(LC + method, request_serializer=req.SerializeToString,
                                         response_deserializer=resp_cls.FromString)
        return fn(req, metadata=[("authorization", "Bearer " + (token or self.tok()))], timeout=timeout)

    def code(self, fn):
        with self.assertRaises(grpc.RpcError) as cm:
            fn()
        return cm.exception.code(), cm.exception.details()

    def open_stream(self, message, session_id="", token=None, timeout=30):
        fn = self.ch.unary_stream(LC + "SendMessage", request_serializer=L.SendMessageRequest.SerializeToString,
                                  response_deserializer=L.AgentEvent.FromString)
        req = L.SendMessageRequest(session_id=session_id, message=message,
                                   agent_id="" if session_id else self.agent)
        return fn(req, metadata=[("authorization", "Bearer " + (token or self.tok()))], timeout=timeout)

    def stream_of(self, message, session_id="", token=None):
        return list(self.open_stream(message, session_id, token))

    def create(self, org=None):
        return self.unary("CreateSession", L.CreateSessionRequest(agent_id=self.agent2 if org == self.org2 else self.agent),
                          L.CreateSessionResponse, token=self.tok(org)).session_id

    def get(self, sid, token=None):
        return self.unary("GetSession", L.GetSessionRequest(session_id=sid), L.GetSessionResponse, token=token)

    def pause(self, sid, ch=None, timeout=10, token=None, **kw):
        return self.unary("PauseSession", L.PauseSessionRequest(session_id=sid, **kw), L.PauseSessionResponse,
                          ch=ch, timeout=timeout, token=token)

    def resume(self, sid, token=None, **kw):
        return self.unary("ResumeSession", L.ResumeSessionRequest(session_id=sid, **kw), L.ResumeSessionResponse,
                          token=token)

    def chain(self, sid, action, token=None, cross=False):
        return self.unary("GetProvenanceChain",
                          L.GetProvenanceChainRequest(session_id=sid, action_id=action, cross_session=cross),
                          L.GetProvenanceChainResponse, token=token)

    def audit(self, sid, org=None):
        """[(action_id, action_type, parent_action_id, detail dict)] oldest first."""
        rows = sql(org or self.org, "SELECT action_id, action_type, coalesce(parent_action_id::text, ''),"
                   " detail::text FROM orchestrator.audit_log WHERE session_id = '%s' ORDER BY seq" % sid)
        return [(r[0], r[1], r[2], json.loads(r[3])) for r in rows]

    def checkpoints_settled(self, sid, want):
        """Waits until the worker's checkpoints of the session reached the database (they are
        sent from its background queue); returns the newest loop_iteration."""
        deadline = time.time() + 15
        got = []
        while time.time() < deadline:
            got = sql(self.org, "SELECT count(*), coalesce(max(loop_iteration), -1) FROM orchestrator.checkpoints"
                      " WHERE session_id = '%s'" % sid)
            if int(got[0][0]) >= want:
                return int(got[0][1])
            time.sleep(0.1)
        self.fail("checkpoints of %s did not arrive: %s" % (sid, got))

    # ---- PauseSession / ResumeSession on an idle session ----
    def test_pause_resume_idle(self):
        sid = self.create()
        evs = self.stream_of("hello before the pause", sid)
        self.assertTrue(any(e.HasField("completion") for e in evs))
        loop = self.checkpoints_settled(sid, 1)
        t0 = time.time()
        r = self.pause(sid, ch=self.cha, reason="operator looks", pause_source=L.PAUSE_SOURCE_POLICY,
                       correlation_id="corr-1")
        self.assertEqual(r.status, SUSPENDED)
        self.assertFalse(r.was_already_suspended)
        self.assertEqual(r.checkpoint_key, "%s:%d" % (sid, loop))
        self.assertAlmostEqual(r.paused_at.seconds + r.paused_at.nanos / 1e9, t0, delta=5)
        g = self.get(sid)
        self.assertEqual(g.status, SUSPENDED)
        # idempotent: OK, flagged, the same pause
        r2 = self.pause(sid, reason="again", pause_source=L.PAUSE_SOURCE_OPERATOR)
        self.assertTrue(r2.was_already_suspended)
        self.assertEqual(r2.status, SUSPENDED)
        self.assertEqual(r2.checkpoint_key, r.checkpoint_key)
        self.assertEqual(r2.paused_at, r.paused_at)
        # suspended: no turn runs
        c, d = self.code(lambda: self.stream_of("are you there", sid))
        self.assertEqual(c, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("suspended", d)
        lst = self.unary("ListSessions", L.ListSessionsRequest(status_filter="suspended", page_size=100),
                         L.ListSessionsResponse)
        self.assertIn(sid, [s.session_id for s in lst.sessions])
        # one session_paused row (the repeat changed nothing) with reason, source, correlation
        rows = self.audit(sid)
        paused = [x for x in rows if x[1] == "session_paused"]
        self.assertEqual(len(paused), 1)
        self.assertEqual(paused[0][3], {"reason": "operator looks", "pause_source": "PAUSE_SOURCE_POLICY",
                                        "correlation_id": "corr-1", "checkpoint_key": r.checkpoint_key})
        self.assertEqual(rows[-1][1], "session_paused")
        # resume with operator input
        t1 = time.time()
        rr = self.resume(sid, operator_input=b'{"hint": "use the staging db", "n": [1, 2]}',
                         resume_reason="looked")
        self.assertEqual(rr.status, R.AGENT_STATUS_THINKING)  # the spec's ACTIVE
        self.assertEqual(rr.resumed_at_loop, loop)
        self.assertAlmostEqual(rr.resumed_at.seconds + rr.resumed_at.nanos / 1e9, t1, delta=5)
        self.assertEqual(self.get(sid).status, R.AGENT_STATUS_COMPLETE)
        resumed = [x for x in self.audit(sid) if x[1] == "session_resumed"]
        self.assertEqual(len(resumed), 1)
        self.assertEqual(resumed[0][3]["reason"], "looked")
        self.assertEqual(resumed[0][3]["resumed_at_loop"], loop)
        self.assertNotIn("staging", json.dumps(resumed[0][3]))  # sizes in the audit, never the text
        # resuming an active session
        c, d = self.code(lambda: self.resume(sid))
        self.assertEqual(c, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("active", d)
        # the next turn runs, and the operator input reached the worker as a system-tagged
        # context message: the newest of its prior turns
        evs = self.stream_of(script([{"inspect": True}, {"complete": "ok"}]), sid)
        seen = json.loads(evs[0].token.text)["request"]
        prior = seen["prior_turns"]
        self.assertEqual(prior[-1]["text"], '[system] operator_input: {"hint":"use the staging db","n":[1,2]}')
        self.assertEqual(prior[-2]["text"], "echo: hello before the pause")
        self.assertNotIn("operator_input", seen["user_message"])
        self.assertTrue(any(e.HasField("completion") for e in evs))

    def test_pause_without_checkpoint(self):
        sid = self.create()  # no turn yet: no checkpoint, AgentStatus UNSPECIFIED
        r = self.pause(sid)
        self.assertEqual(r.status, SUSPENDED)
        self.assertEqual(r.checkpoint_key, "")
        rows = self.audit(sid)
        self.assertEqual(rows[-1][1], "session_paused")
        # UNSPECIFIED is recorded as OPERATOR
        self.assertEqual(rows[-1][3]["pause_source"], "PAUSE_SOURCE_OPERATOR")
        rr = self.resume(sid)
        self.assertEqual(rr.resumed_at_loop, 0)
        self.assertEqual(rr.status, R.AGENT_STATUS_THINKING)
        self.assertEqual(self.get(sid).status, R.AGENT_STATUS_UNSPECIFIED)
        # the session takes messages again
        self.assertTrue(any(e.HasField("completion") for e in self.stream_of("back again", sid)))

    def test_validation_and_tenancy(self):
        sid = self.create()
        other = self.create(org=self.org2)
        for fn, field in ((lambda: self.pause(""), "session_id"),
                          (lambda: self.pause("not-a-uuid"), "session_id"),
                          (lambda: self.pause(sid, pause_source=9), "pause_source"),
                          (lambda: self.pause(sid, pause_source=-1), "pause_source"),
                          (lambda: self.pause(sid, reason="x" * 1025), "reason"),
                          (lambda: self.pause(sid, correlation_id="x" * 257), "correlation_id"),
                          (lambda: self.resume(""), "session_id"),
                          (lambda: self.resume("zz"), "session_id"),
                          (lambda: self.resume(sid, operator_input=b"{not json"), "operator_input"),
                          (lambda: self.resume(sid, operator_input=b'{"a": 1} trailing'), "operator_input"),
                          (lambda: self.resume(sid, operator_input=b'"\xff"'), "operator_input"),
                          (lambda: self.resume(sid, operator_input=b'"' + b"a" * (64 * 1024) + b'"'), "operator_input"),
                          (lambda: self.resume(sid, resume_reason="x" * 1025), "resume_reason"),
                          (lambda: self.chain("", str(uuid.uuid4())), "session_id"),
                          (lambda: self.chain(sid, ""), "action_id"),
                          (lambda: self.chain(sid, "nope"), "action_id")):
            c, d = self.code(fn)
            self.assertEqual(c, grpc.StatusCode.INVALID_ARGUMENT, field)
            self.assertIn(field, d)
        # nothing changed
        self.assertEqual(self.get(sid).status, R.AGENT_STATUS_UNSPECIFIED)
        self.assertEqual([x[1] for x in self.audit(sid)], ["session_started"])
        # unknown, and another org's session: NOT_FOUND, and the other org's stays active
        for fn in (lambda: self.pause(str(uuid.uuid4())), lambda: self.pause(other),
                   lambda: self.resume(other), lambda: self.resume(str(uuid.uuid4()))):
            c, d = self.code(fn)
            self.assertEqual(c, grpc.StatusCode.NOT_FOUND)
            self.assertIn("session_id", d)
        self.assertNotEqual(self.get(other, token=self.tok(self.org2)).status, SUSPENDED)
        # the other org pausing its own session works; this org cannot resume it
        self.pause(other, token=self.tok(self.org2))
        c, _ = self.code(lambda: self.resume(other))
        self.assertEqual(c, grpc.StatusCode.NOT_FOUND)
        self.assertEqual(self.resume(other, token=self.tok(self.org2)).status, R.AGENT_STATUS_THINKING)
        # no token, or one without an org
        c, _ = self.code(lambda: self.pause(sid, token="garbage"))
        self.assertEqual(c, grpc.StatusCode.UNAUTHENTICATED)
        c, _ = self.code(lambda: self.resume(sid, token=T.mint(SECRET, sub="u", org="")))
        self.assertEqual(c, grpc.StatusCode.UNAUTHENTICATED)
        # a terminated session is past pausing; resuming an active one is refused
        c, d = self.code(lambda: self.resume(sid))
        self.assertEqual(c, grpc.StatusCode.FAILED_PRECONDITION)
        self.unary("TerminateSession", L.TerminateLifecycleSessionRequest(session_id=sid, reason="done"),
                   L.TerminateLifecycleSessionResponse)
        c, d = self.code(lambda: self.pause(sid))
        self.assertEqual(c, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("terminated", d)
        # operator_input of exactly 64 KiB is accepted (a suspended session)
        s2 = self.create()
        self.pause(s2)
        big = b'"' + b"a" * (64 * 1024 - 2) + b'"'
        self.assertEqual(len(big), 64 * 1024)
        self.resume(s2, operator_input=big)
        # a suspended session can be terminated
        self.pause(s2)
        t = self.unary("TerminateSession", L.TerminateLifecycleSessionRequest(session_id=s2),
                       L.TerminateLifecycleSessionResponse)
        self.assertTrue(t.success)
        c, _ = self.code(lambda: self.resume(s2))
        self.assertEqual(c, grpc.StatusCode.FAILED_PRECONDITION)

    # ---- a pause while a turn runs ----
    def test_paused_stream_waits_for_the_resume(self):
        """spec SessionPausedEvent: "After this event the stream stays open ... until a
        SessionResumedEvent or TerminateSession": the turn's stream, after session_paused,
        waits; ResumeSession (on another replica) ends it with session_resumed, a
        termination ends it without."""
        c = drain(T.Server("orchestrator", env=self.base))  # UPSQUAD_PAUSED_STREAMS default
        ch = grpc.insecure_channel(c.addr)
        try:
            fn = ch.unary_stream(LC + "SendMessage", request_serializer=L.SendMessageRequest.SerializeToString,
                                 response_deserializer=L.AgentEvent.FromString)
            steps = [{"token": "first"}, {"sleep_ms": 800}, {"complete": "done"}]
            for end in ("resume", "terminate"):
                sid = self.create()
                deadline = time.time() + 10
                while True:  # C sees the worker live after its first probe
                    try:
                        stream = fn(L.SendMessageRequest(session_id=sid, message=script(steps)),
                                    metadata=[("authorization", "Bearer " + self.tok())], timeout=30)
                        first = next(stream)
                        break
                    except grpc.RpcError:
                        if time.time() > deadline:
                            raise
                        time.sleep(0.2)
                self.assertEqual(first.token.text, "first")
                r = self.pause(sid, timeout=20, reason="wait")
                self.assertEqual(r.status, SUSPENDED)
                events = []
                while not events or events[-1].WhichOneof("event") != "session_paused":
                    events.append(next(stream))
                got = queue.Queue()
                threading.Thread(target=lambda: [got.put(e) for e in stream] + [got.put(None)],
                                 daemon=True).start()
                time.sleep(1.0)
                self.assertTrue(got.empty(), "the stream ended (or sent more) while the session was paused")
                if end == "resume":
                    rr = self.resume(sid, resume_reason="go on")
                    e = got.get(timeout=10)
                    self.assertEqual(e.WhichOneof("event"), "session_resumed")
                    self.assertEqual(e.session_resumed.resumed_at_loop, rr.resumed_at_loop)
                    self.assertFalse(e.session_resumed.resumed_by_approval)
                    # "resumed_at is the timestamp of the transition": the one ResumeSession gave
                    self.assertEqual(e.session_resumed.resumed_at, rr.resumed_at)
                else:
                    self.unary("TerminateSession", L.TerminateLifecycleSessionRequest(session_id=sid),
                               L.TerminateLifecycleSessionResponse)
                self.assertIsNone(got.get(timeout=10))  # then the stream ends OK
        finally:
            ch.close()
            c.stop()

    def test_pause_in_flight(self):
        sid = self.create()
        steps = [{"status": "THINKING"}, {"token": "first"},
                 {"tool_call": {"tool_name": "search", "arguments": {"q": "x"}}}, {"sleep_ms": 600},
                 {"tool_result": {"result": {"ok": True}}}, {"tokens": "and the rest", "delay_ms": 100},
                 {"complete": "done"}]
        stream = self.open_stream(script(steps), sid)
        events = [next(stream), next(stream)]
        self.assertEqual(events[1].token.text, "first")
        # the pause goes to the other replica; it waits for the turn's end
        res = {}

        def do_pause():
            t = time.time()
            try:
                res["r"] = self.pause(sid, ch=self.cha, timeout=20, reason="hold on",
                                      pause_source=L.PAUSE_SOURCE_APPROVAL, correlation_id="appr-7")
            except grpc.RpcError as e:
                res["e"] = e
            res["t"] = time.time() - t
        th = threading.Thread(target=do_pause)
        th.start()
        # pending: still running (never mid-tool), and no new turn starts meanwhile
        deadline = time.time() + 5
        pending = False
        while time.time() < deadline and not pending:
            pending = sql(self.org, "SELECT pause_pending FROM orchestrator.sessions WHERE session_id = '%s'"
                          % sid)[0][0] == "t"
            time.sleep(0.02)
        self.assertTrue(pending)
        self.assertEqual(self.get(sid).status, R.AGENT_STATUS_THINKING)
        c, d = self.code(lambda: self.stream_of("meanwhile", sid))
        self.assertEqual(c, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("pausing", d)
        events += list(stream)  # the stream ends OK after the turn
        th.join(25)
        self.assertNotIn("e", res)
        r = res["r"]
        self.assertEqual(r.status, SUSPENDED)
        self.assertFalse(r.was_already_suspended)
        self.assertGreater(res["t"], 0.3)  # it waited for the boundary
        kinds = [e.WhichOneof("event") for e in events]
        self.assertEqual(kinds[-2:], ["completion", "session_paused"])
        self.assertEqual(events[-2].completion.final_response, "done")
        # the stream was told the pause is pending (once), while the turn still ran
        pend = [i for i, e in enumerate(events) if e.HasField("status") and e.status.pending_pause]
        self.assertEqual(len(pend), 1)
        self.assertLess(pend[0], kinds.index("completion"))
        self.assertEqual(events[pend[0]].status.status, R.AGENT_STATUS_THINKING)
        self.assertFalse(events[0].status.pending_pause)
        p = events[-1].session_paused
        self.assertEqual((p.reason, p.pause_source, p.correlation_id), ("hold on", L.PAUSE_SOURCE_APPROVAL, "appr-7"))
        self.assertEqual(p.checkpoint_key, r.checkpoint_key)
        self.assertEqual(p.paused_at, r.paused_at)
        # the key of the session's newest checkpoint when the pause committed (the worker sends
        # its checkpoints from a background queue: the turn's own may come later), or ""
        if r.checkpoint_key:
            self.assertRegex(r.checkpoint_key, "^%s:[0-9]+$" % sid)
        self.assertEqual(self.get(sid).status, SUSPENDED)
        # the audit: the whole turn (its tool result and completion) before the pause
        types = [x[1] for x in self.audit(sid)]
        self.assertEqual(types, ["session_started", "message_received", "tool_call", "tool_result",
                                 "completion", "session_paused"])
        self.resume(sid)

    def test_pause_deadline_then_commit(self):
        """A pause whose caller stops waiting stays recorded and commits at the turn's end."""
        sid = self.create()
        stream = self.open_stream(script([{"token": "t"}, {"sleep_ms": 1500}, {"complete": "late"}]), sid)
        self.assertEqual(next(stream).token.text, "t")
        c, d = self.code(lambda: self.pause(sid, timeout=0.5, reason="short wait"))
        self.assertEqual(c, grpc.StatusCode.DEADLINE_EXCEEDED)
        rest = list(stream)
        self.assertEqual([e.WhichOneof("event") for e in rest][-2:], ["completion", "session_paused"])
        self.assertEqual(rest[-1].session_paused.reason, "short wait")
        r = self.pause(sid)
        self.assertTrue(r.was_already_suspended)
        self.assertEqual(r.paused_at, rest[-1].session_paused.paused_at)
        # the second pause kept the first one's reason
        self.assertEqual([x[3]["reason"] for x in self.audit(sid) if x[1] == "session_paused"], ["short wait"])

    def test_pause_cancelled_turn(self):
        """The caller of the running turn going away is a boundary too."""
        sid = self.create()
        stream = self.open_stream(script([{"token": "t"}, {"hang": True}]), sid)
        self.assertEqual(next(stream).token.text, "t")
        res = {}
        th = threading.Thread(target=lambda: res.setdefault("r", self.pause(sid, timeout=15)))
        th.start()
        time.sleep(0.3)
        stream.cancel()
        th.join(20)
        self.assertEqual(res["r"].status, SUSPENDED)
        self.assertEqual(self.get(sid).status, SUSPENDED)

    def test_pause_then_terminate(self):
        """A session terminated while its pause waits for the turn: the pause is dropped."""
        sid = self.create()
        stream = self.open_stream(script([{"token": "t"}, {"hang": True}]), sid)
        self.assertEqual(next(stream).token.text, "t")
        res = {}

        def do_pause():
            try:
                self.pause(sid, ch=self.cha, timeout=15)
            except grpc.RpcError as e:
                res["e"] = e
        th = threading.Thread(target=do_pause)
        th.start()
        time.sleep(0.3)
        self.unary("TerminateSession", L.TerminateLifecycleSessionRequest(session_id=sid, reason="stop"),
                   L.TerminateLifecycleSessionResponse)
        th.join(20)
        self.assertEqual(res["e"].code(), grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("terminated", res["e"].details())
        stream.cancel()
        deadline = time.time() + 10
        while time.time() < deadline and sql(self.org, "SELECT turns_running FROM orchestrator.sessions"
                                              " WHERE session_id = '%s'" % sid)[0][0] != "0":
            time.sleep(0.05)
        self.assertNotIn("session_paused", [x[1] for x in self.audit(sid)])
        self.assertEqual(sql(self.org, "SELECT state, pause_pending FROM orchestrator.sessions"
                             " WHERE session_id = '%s'" % sid), [["terminated", "f"]])

    def test_pause_after_lost_turn(self):
        """A turn counted in flight past its bound (its replica died) holds no pause back."""
        sid = self.create()
        sql(self.org, "UPDATE orchestrator.sessions SET turns_running = 1, turn_deadline = now() - interval '1 s'"
            " WHERE session_id = '%s'" % sid)
        t = time.time()
        self.assertEqual(self.pause(sid).status, SUSPENDED)
        self.assertLess(time.time() - t, 2)
        self.resume(sid)
        # one still within its bound is waited for
        sql(self.org, "UPDATE orchestrator.sessions SET turns_running = 1, turn_deadline = now() + interval '1 min'"
            " WHERE session_id = '%s'" % sid)
        c, _ = self.code(lambda: self.pause(sid, timeout=0.6))
        self.assertEqual(c, grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertEqual(sql(self.org, "SELECT state, pause_pending FROM orchestrator.sessions"
                             " WHERE session_id = '%s'" % sid), [["active", "t"]])

    # ---- an interrupt parks the session on its approval ----
    def test_interrupt_parks_session(self):
        sid = self.create()
        steps = [{"token": "checking"},
                 {"tool_call": {"tool_name": "deploy", "tool_call_id": "g1", "arguments": {"env": "prod"}}},
                 {"interrupt": {"tool_name": "deploy", "tool_call_id": "g1", "pending_tool_intent": "SECRET-INTENT"}}]
        evs = self.stream_of(script(steps), sid)
        self.assertEqual([e.WhichOneof("event") for e in evs], ["token", "interrupt_required", "session_paused"])
        ir, p = evs[1].interrupt_required, evs[2].session_paused
        self.assertEqual((ir.tool_name, ir.tool_call_id), ("deploy", "g1"))
        self.assertRegex(ir.approval_id, "^[0-9a-f-]{36}$")
        self.assertEqual(p.pause_source, L.PAUSE_SOURCE_APPROVAL)
        self.assertEqual(p.correlation_id, ir.approval_id)
        self.assertIn("deploy", p.reason)
        self.assertNotIn(b"SECRET-INTENT", b"".join(e.SerializeToString() for e in evs))
        self.assertEqual(self.get(sid).status, SUSPENDED)
        c, d = self.code(lambda: self.stream_of("go on", sid))
        self.assertEqual(c, grpc.StatusCode.FAILED_PRECONDITION)
        # audited: the interrupt names its tool call and the approval; the pause its correlation
        rows = self.audit(sid)
        self.assertEqual([x[1] for x in rows], ["session_started", "message_received", "tool_call",
                                                "interrupt_required", "error", "session_paused"])
        self.assertEqual(rows[3][2], rows[2][0])
        self.assertEqual(rows[3][3]["approval_id"], ir.approval_id)
        self.assertEqual(rows[5][3]["correlation_id"], ir.approval_id)
        self.assertEqual(rows[5][3]["pause_source"], "PAUSE_SOURCE_APPROVAL")
        self.assertEqual([k.action_type for k in self.chain(sid, rows[3][0]).chain],
                         ["message_received", "tool_call", "interrupt_required"])
        # pausing again is the same pause; ResumeSession cannot lift it: a governed tool call
        # waits for its approval's decision (FAILED_PRECONDITION naming it; nothing changes)
        again = self.pause(sid)
        self.assertTrue(again.was_already_suspended)
        self.assertEqual(again.paused_at, p.paused_at)
        for reason in ("approved " + ir.approval_id, ""):
            c, d = self.code(lambda: self.resume(sid, resume_reason=reason))
            self.assertEqual(c, grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn(ir.approval_id, d)
        self.assertEqual(self.get(sid).status, SUSPENDED)
        self.assertEqual([x[1] for x in self.audit(sid)].count("session_resumed"), 0)
        c, d = self.code(lambda: self.stream_of("go on", sid))
        self.assertEqual(c, grpc.StatusCode.FAILED_PRECONDITION)

    # ---- GetProvenanceChain ----
    def test_provenance_chain(self):
        sid = self.create()
        steps = [{"tool_call": {"tool_name": "search", "tool_call_id": "c1", "arguments": {}}},
                 {"tool_call": {"tool_name": "fetch", "tool_call_id": "c2", "arguments": {}}},
                 {"tool_result": {"tool_call_id": "c1", "tool_name": "search", "result": "r1"}},
                 {"tool_result": {"tool_call_id": "c2", "tool_name": "fetch", "result": "r2"}},
                 {"complete": "done"}]
        self.stream_of(script(steps), sid)
        rows = self.audit(sid)
        self.assertEqual([x[1] for x in rows], ["session_started", "message_received", "tool_call", "tool_call",
                                                "tool_result", "tool_result", "completion"])
        started, msg, call1, call2, res1, res2, done = [x[0] for x in rows]
        # the parent links are set at the source: a result names its call
        self.assertEqual(rows[4][2], call1)
        self.assertEqual(rows[5][2], call2)
        r = self.chain(sid, res2)
        self.assertEqual(r.session_id, sid)
        self.assertEqual(r.action_id, res2)
        self.assertFalse(r.truncated_at_boundary)
        self.assertEqual([(k.action_id, k.action_type) for k in r.chain],
                         [(msg, "message_received"), (call2, "tool_call"), (res2, "tool_result")])
        self.assertEqual([k.parent_action_id for k in r.chain], ["", msg, call2])
        agent = self.get(sid).agent_id
        for k in r.chain:
            self.assertEqual(k.schema_version, "1")
            self.assertEqual(k.session_id, sid)
            self.assertEqual(k.agent_id, agent)
            self.assertFalse(k.is_boundary_crossing)
            self.assertTrue(k.anchor_verified)
            self.assertAlmostEqual(k.created_at.seconds, time.time(), delta=60)
        self.assertEqual([k.action_type for k in self.chain(sid, done).chain], ["message_received", "completion"])
        one = self.chain(sid, started).chain
        self.assertEqual([(k.action_id, k.parent_action_id) for k in one], [(started, "")])
        # cross_session on a root session: the same chain
        self.assertEqual(list(self.chain(sid, res1, cross=True).chain), list(self.chain(sid, res1).chain))
        # unknown action, another session's action, another org: NOT_FOUND
        other = self.create()
        for fn in (lambda: self.chain(sid, str(uuid.uuid4())), lambda: self.chain(other, res1),
                   lambda: self.chain(sid, res1, token=self.tok(self.org2))):
            c, d = self.code(fn)
            self.assertEqual(c, grpc.StatusCode.NOT_FOUND)
            self.assertIn("action_id", d)
        # pause/resume rows are root actions
        self.pause(sid)
        self.resume(sid)
        rows = self.audit(sid)
        for kind in ("session_paused", "session_resumed"):
            a = [x[0] for x in rows if x[1] == kind][0]
            self.assertEqual([k.action_type for k in self.chain(sid, a).chain], [kind])

    @unittest.skipUnless(ADMIN, "UPSQUAD_PG_ADMIN_DSN is required to alter the append-only audit log")
    def test_provenance_tampered(self):
        sid = self.create()
        self.stream_of(script([{"tool_call": {"tool_name": "s", "arguments": {}}},
                               {"tool_result": {"result": "r"}}, {"complete": "c"}]), sid)
        rows = self.audit(sid)
        call, res = rows[2][0], rows[3][0]
        self.assertEqual(len(self.chain(sid, res).chain), 3)
        # rewrite a row past the append-only trigger: its hash no longer recomputes
        subprocess.run(["psql", ADMIN, "-X", "-q", "-v", "ON_ERROR_STOP=1",
                        "-c", "SET session_replication_role = replica",
                        "-c", "UPDATE orchestrator.audit_log SET detail = '{\"tool_name\": \"forged\"}'"
                              " WHERE action_id = '%s'" % call], check=True, capture_output=True, timeout=30)
        c, d = self.code(lambda: self.chain(sid, res))
        self.assertEqual(c, grpc.StatusCode.DATA_LOSS)
        self.assertIn(call, d)
        # the message's own chain does not pass through the forged row: it still verifies
        self.assertEqual(len(self.chain(sid, rows[1][0]).chain), 1)

    def test_provenance_cross_session(self):
        parent = self.create()
        self.stream_of(script([{"tool_call": {"tool_name": "delegate", "arguments": {}}},
                               {"tool_result": {"result": "spawned"}}, {"complete": "p"}]), parent)
        prow = self.audit(parent)
        p_msg, p_call = prow[1][0], prow[2][0]
        child = self.create()
        self.stream_of(script([{"tool_call": {"tool_name": "work", "arguments": {}}},
                               {"tool_result": {"result": "w"}}, {"complete": "c"}]), child)
        crow = self.audit(child)
        c_msg, c_call, c_res = crow[1][0], crow[2][0], crow[3][0]
        # the child names its parent and the parent's action that spawned it, with that row's hash
        p_hash = sql(self.org, "SELECT hash FROM orchestrator.audit_log WHERE action_id = '%s'" % p_call)[0][0]
        sql(self.org, "UPDATE orchestrator.sessions SET parent_session_id = '%s', spawn_action_id = '%s',"
            " spawn_anchor_hash = '%s' WHERE session_id = '%s'" % (parent, p_call, p_hash, child))
        r = self.chain(child, c_res, cross=True)
        self.assertFalse(r.truncated_at_boundary)
        self.assertEqual([k.action_id for k in r.chain], [p_msg, p_call, c_msg, c_call, c_res])
        self.assertEqual([k.session_id for k in r.chain], [parent, parent, child, child, child])
        self.assertEqual([k.is_boundary_crossing for k in r.chain], [False, False, True, False, False])
        self.assertTrue(all(k.anchor_verified for k in r.chain))
        self.assertEqual(r.session_id, child)
        self.assertEqual(r.action_id, c_res)
        # without cross_session the walk stops at the session
        self.assertEqual([k.action_id for k in self.chain(child, c_res).chain], [c_msg, c_call, c_res])
        # an anchor that no longer matches: the trusted prefix only, flagged
        sql(self.org, "UPDATE orchestrator.sessions SET spawn_anchor_hash = '%s' WHERE session_id = '%s'"
            % ("0" * 64, child))
        r = self.chain(child, c_res, cross=True)
        self.assertTrue(r.truncated_at_boundary)
        self.assertEqual([k.action_id for k in r.chain], [c_msg, c_call, c_res])
        self.assertEqual([k.anchor_verified for k in r.chain], [False, True, True])
        self.assertFalse(any(k.is_boundary_crossing for k in r.chain))
        # no spawn action recorded: the anchor is the parent's newest row at the child's start
        sql(self.org, "UPDATE orchestrator.sessions SET spawn_action_id = NULL, spawn_anchor_hash = NULL"
            " WHERE session_id = '%s'" % child)
        r = self.chain(child, c_res, cross=True)
        p_last = prow[-1][0]  # the parent's completion, written before the child started
        self.assertEqual([k.action_id for k in r.chain], [p_msg, p_last, c_msg, c_call, c_res])
        self.assertFalse(r.truncated_at_boundary)
        # a grandparent: the walk goes on up
        grand = self.create()
        g_rows = self.audit(grand)
        sql(self.org, "UPDATE orchestrator.sessions SET parent_session_id = '%s', spawn_action_id = '%s'"
            " WHERE session_id = '%s'" % (grand, g_rows[0][0], parent))
        r = self.chain(child, c_res, cross=True)
        self.assertEqual([k.session_id for k in r.chain], [grand, parent, parent, child, child, child])
        self.assertEqual([k.is_boundary_crossing for k in r.chain], [False, True, False, True, False, False])
        # a cycle in the parent links ends at the bound, not in a loop
        sql(self.org, "UPDATE orchestrator.sessions SET parent_session_id = '%s', spawn_action_id = NULL"
            " WHERE session_id = '%s'" % (child, grand))
        r = self.chain(child, c_res, cross=True)
        self.assertLessEqual(len(r.chain), 256)
        # another org sees none of it
        c, _ = self.code(lambda: self.chain(child, c_res, token=self.tok(self.org2), cross=True))
        self.assertEqual(c, grpc.StatusCode.NOT_FOUND)


if __name__ == "__main__":
    unittest.main()
