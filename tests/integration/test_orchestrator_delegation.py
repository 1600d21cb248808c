"""Delegation to sub-agents over real gRPC (grpcio), Postgres, NATS and Redis: a worker's
delegate_to_agent call spawns a child session of the named agent (its bridge row), the parent's
stream gets SessionPaused(DELEGATION) and the child's events as DelegatedEventEnvelopes (nested
for a grandchild), then the parent's turn resumes from its frozen checkpoint with the child's
result as the call's result. Limits refuse cleanly; TerminateSubagentTree stops a running child's
worker step. build/bin/devworker scripts every level. Fresh org UUIDs; processes stopped by pid."""
import json
import os
import signal
import sys
import threading
import time
import unittest
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
import upsquad_testlib as T  # noqa: E402

DSN = os.environ.get("UPSQUAD_PG_DSN_ORCHESTRATOR")
REDIS = os.environ.get("UPSQUAD_REDIS_URL")
NATS = os.environ.get("UPSQUAD_NATS_URL")
if not DSN or not REDIS or not NATS:
    print("SKIP: UPSQUAD_PG_DSN_ORCHESTRATOR, UPSQUAD_REDIS_URL and UPSQUAD_NATS_URL are required")
    sys.exit(0)

import grpc  # noqa: E402
from upsquad.runtime.v1 import lifecycle_pb2 as L  # noqa: E402
from test_orchestrator import SECRET, KEK, LC, MIGRATIONS, DEVWORKER, apply_agent, drain  # noqa: E402
from test_orchestrator_pause import sql  # noqa: E402


def script(steps):
    return "#!script\n" + json.dumps(steps)


def delegating(call, agent, task, before="asking", after="got {{answer}}"):
    return script([{"tokens": before},
                   {"interrupt": {"tool_name": "delegate_to_agent", "tool_call_id": call,
                                  "pending_tool_intent": {"agent": agent, "task": task}}},
                   {"complete": after}])


def unwrap(e):
    """(child ids outermost first, the innermost event)."""
    ids = []
    while e.WhichOneof("event") == "delegated":
        ids.append(e.delegated.child_session_id)
        e = e.delegated.inner
    return ids, e


@unittest.skipUnless(os.path.exists(DEVWORKER), "build/bin/devworker is not built")
class Delegation(unittest.TestCase):
    procs = []

    @classmethod
    def setUpClass(cls):
        addr = "127.0.0.1:%d" % T.free_port()
        cls.w = drain(T.Server("devworker", env={
            "UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_LOG_LEVEL": "info", "UPSQUAD_ORCHESTRATOR_ADDR": addr,
            "UPSQUAD_DEVWORKER_HEARTBEAT_INTERVAL": "200ms"}))
        cls.procs.append(cls.w)
        cls.o = drain(T.Server("orchestrator", env={
            "UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_PG_DSN": DSN, "UPSQUAD_MIGRATIONS_DIR": MIGRATIONS,
            "UPSQUAD_REDIS_URL": REDIS, "UPSQUAD_NATS_URL": NATS, "UPSQUAD_KEK": KEK,
            "UPSQUAD_WORKER_PROBE": "200ms", "UPSQUAD_LOG_LEVEL": "info", "UPSQUAD_GRPC_ADDR": addr,
            "UPSQUAD_APPROVALS_DURABLE": "none", "UPSQUAD_WORKER_TARGETS": cls.w.addr,
            "UPSQUAD_DELEGATION_MAX_DEPTH": "2"}))
        cls.procs.append(cls.o)
        cls.ch = grpc.insecure_channel(cls.o.addr)
        cls.org, cls.user = str(uuid.uuid4()), str(uuid.uuid4())
        cls.lead = apply_agent(cls.org, {"role": "lead", "display_name": "Lead", "model": "claude-sonnet-4-6"})
        cls.helper = apply_agent(cls.org, {"role": "helper", "display_name": "Helper", "model": "claude-sonnet-4-6"})
        cls.researcher = apply_agent(cls.org, {"role": "researcher", "display_name": "Researcher",
                                               "model": "claude-sonnet-4-6"})
        T.until_served(lambda: list(cls().stream("warm up", cls().create())))

    @classmethod
    def tearDownClass(cls):
        cls.ch.close()
        for p in cls.procs:
            p.stop()

    def tok(self):
        return T.mint(SECRET, sub=self.user, org=self.org)

    def unary(self, method, req, resp_cls, timeout=10):
        fn = self.ch.unary_unary(LC + method, request_serializer=req.SerializeToString,
                                 response_deserializer=resp_cls.FromString)
        return fn(req, metadata=[("authorization", "Bearer " + self.tok())], timeout=timeout)

    def create(self):
        return self.unary("CreateSession", L.CreateSessionRequest(agent_id=self.lead),
                          L.CreateSessionResponse).session_id

    def stream(self, message, sid, timeout=60):
        fn = self.ch.unary_stream(LC + "SendMessage", request_serializer=L.SendMessageRequest.SerializeToString,
                                  response_deserializer=L.AgentEvent.FromString)
        return fn(L.SendMessageRequest(session_id=sid, message=message),
                  metadata=[("authorization", "Bearer " + self.tok())], timeout=timeout)

    def tree(self, sid):
        return self.unary("GetSubagentTree", L.GetSubagentTreeRequest(session_id=sid, max_depth=5),
                          L.GetSubagentTreeResponse)

    # ---- parent -> child -> grandchild, envelopes nested, results carried up ----
    def test_nested_delegation(self):
        sid = self.create()
        grand = script([{"tokens": "researching"}, {"complete": "the answer is 42"}])
        child = delegating("d2", "researcher", grand, before="helping", after="child got {{answer}}")
        evs = list(self.stream(delegating("d1", "helper", child, before="let me ask",
                                          after="parent got {{answer}}"), sid))
        top = [e.WhichOneof("event") for e in evs]
        # the parent's own events: its tokens, the park on the child, the resume, its answer
        self.assertEqual([a for a in top if a != "delegated"],
                         ["token", "token", "token", "session_paused", "session_resumed", "completion"])
        paused = [e.session_paused for e in evs if e.HasField("session_paused")][0]
        self.assertEqual(paused.pause_source, L.PAUSE_SOURCE_DELEGATION)
        child_id = paused.correlation_id
        # the envelopes: the child's events once wrapped, the grandchild's twice, in order
        wrapped = [unwrap(e) for e in evs if e.HasField("delegated")]
        self.assertTrue(all(ids[0] == child_id for ids, _ in wrapped))
        inner_child = [(len(ids), ev.WhichOneof("event")) for ids, ev in wrapped]
        self.assertIn((1, "session_paused"), inner_child)
        self.assertIn((2, "completion"), inner_child)
        grand_done = [ev for ids, ev in wrapped if len(ids) == 2 and ev.HasField("completion")][0]
        self.assertEqual(grand_done.completion.final_response, "the answer is 42")
        child_done = [ev for ids, ev in wrapped if len(ids) == 1 and ev.HasField("completion")][0]
        child_result = json.loads(child_done.completion.final_response[len("child got "):])
        self.assertEqual((child_result["status"], child_result["final_response"], child_result["agent"]),
                         ("completed", "the answer is 42", "researcher"))
        # the order: every child envelope comes between the parent's pause and its resume
        i_p, i_r = top.index("session_paused"), top.index("session_resumed")
        self.assertTrue(all(i_p < i < i_r for i, a in enumerate(top) if a == "delegated"))
        e0 = [e for e in evs if e.HasField("delegated")][0].delegated
        self.assertEqual(e0.child_agent_id, self.helper)
        self.assertRegex(e0.subagent_invocation_id, "^[0-9a-f-]{36}$")
        # the parent's answer uses the child's result
        result = json.loads(evs[-1].completion.final_response[len("parent got "):])
        self.assertEqual((result["status"], result["child_session_id"]), ("completed", child_id))
        self.assertIn("the answer is 42", result["final_response"])
        # the tree, with real statuses and results: root first, then depth-first
        nodes = self.tree(sid).nodes
        self.assertEqual([(n.session_id, n.delegation_depth) for n in nodes],
                         [(sid, 0), (child_id, 1), (nodes[2].session_id, 2)])
        self.assertEqual([(n.subagent_role, n.status, n.result_status) for n in nodes[1:]],
                         [("helper", "active", "ok"), ("researcher", "active", "ok")])
        self.assertEqual((nodes[1].parent_session_id, nodes[2].parent_session_id), (sid, child_id))
        self.assertEqual({n.root_session_id for n in nodes[1:]}, {sid})

    # ---- a child's error reaches the parent wrapped, never as the parent's own ----
    def test_child_error_reaches_the_parent_wrapped(self):
        """The child's gated call cannot open its approval (this replica has no ApprovalService):
        the child's APPROVAL_UNAVAILABLE goes inside the child's envelope, and the parent's
        turn goes on with the child's result."""
        sid = self.create()
        child = script([{"interrupt": {"tool_name": "deploy", "tool_call_id": "x1", "pending_tool_intent": {}}},
                        {"complete": "never"}])
        evs = list(self.stream(delegating("d1", "helper", child, after="parent got {{answer}}"), sid))
        top = [e.WhichOneof("event") for e in evs]
        self.assertNotIn("error", top)  # the parent's own stream has no error of its own
        inner = [ev for _, ev in (unwrap(e) for e in evs if e.HasField("delegated"))]
        errors = [ev.error for ev in inner if ev.HasField("error")]
        self.assertEqual([e.code for e in errors], ["APPROVAL_UNAVAILABLE"], top)
        self.assertEqual(top[-1], "completion")  # the parent's turn goes on with the result
        result = json.loads(evs[-1].completion.final_response[len("parent got "):])
        self.assertTrue(result["is_error"], result)

    # ---- the depth limit: refused as the call's error result; the turn goes on ----
    def test_depth_limit_refused(self):
        sid = self.create()
        great = script([{"complete": "too deep to run"}])
        grand = delegating("d3", "helper", great, after="grand got {{answer}}")
        child = delegating("d2", "researcher", grand, after="child got {{answer}}")
        evs = list(self.stream(delegating("d1", "helper", child), sid))
        self.assertEqual(evs[-1].WhichOneof("event"), "completion")
        wrapped = [unwrap(e) for e in evs if e.HasField("delegated")]
        grand_done = [ev for ids, ev in wrapped if len(ids) == 2 and ev.HasField("completion")][0]
        refused = json.loads(grand_done.completion.final_response[len("grand got "):])
        self.assertEqual((refused["status"], refused["is_error"]), ("refused", True))
        self.assertIn("depth 3 is over the limit 2", refused["error"])
        # nothing was created for it
        n = sql(self.org, "SELECT count(*), max(delegation_depth) FROM orchestrator.sessions"
                " WHERE root_session_id = '%s' AND session_id <> '%s'" % (sid, sid))
        self.assertEqual(n, [["2", "2"]])
        # an unknown agent is refused the same way
        evs = list(self.stream(delegating("d9", "nobody", "x", after="got {{answer}}"), self.create()))
        bad = json.loads(evs[-1].completion.final_response[len("got "):])
        self.assertEqual(bad["status"], "refused")
        self.assertIn("no agent nobody", bad["error"])

    # ---- TerminateSubagentTree mid-run stops the child's worker step ----
    def test_terminate_tree_stops_the_child(self):
        sid = self.create()
        slow = script([{"tokens": "working"}, {"sleep_ms": 8000}, {"complete": "too late"}])
        it = self.stream(delegating("d1", "helper", slow, after="got {{answer}}"), sid)
        evs = []
        th = threading.Thread(target=lambda: [evs.append(e) for e in it])
        th.start()
        deadline = time.time() + 10
        while time.time() < deadline and not any(e.HasField("delegated") for e in evs):
            time.sleep(0.05)
        child = [e.session_paused.correlation_id for e in evs if e.HasField("session_paused")][0]
        t0 = time.time()
        r = self.unary("TerminateSubagentTree", L.TerminateSubagentTreeRequest(session_id=sid, reason="stop"),
                       L.TerminateSubagentTreeResponse)
        self.assertIn(child, list(r.terminated_session_ids))
        th.join(15)
        self.assertLess(time.time() - t0, 5)  # the child's 8 s step was stopped
        result = json.loads(evs[-1].completion.final_response[len("got "):])
        self.assertEqual((result["status"], result["is_error"]), ("terminated", True))
        row = sql(self.org, "SELECT status FROM orchestrator.subagent_invocations WHERE child_session_id = '%s'"
                  % child)
        self.assertEqual(row, [["cancelled"]])

    def test_replica_lost_mid_delegation_ends_the_bridge_row(self):
        """The replica relaying a delegating turn is killed (SIGKILL) while the child works: the
        surviving replica reclaims the parent's turn when its lease goes stale, and the child's
        bridge row ends as an error (parent_turn_reclaimed) instead of staying pending."""
        v = drain(T.Server("orchestrator", env={
            "UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_PG_DSN": DSN, "UPSQUAD_MIGRATIONS_DIR": MIGRATIONS,
            "UPSQUAD_REDIS_URL": REDIS, "UPSQUAD_NATS_URL": NATS, "UPSQUAD_KEK": KEK,
            "UPSQUAD_WORKER_PROBE": "200ms", "UPSQUAD_LOG_LEVEL": "info", "UPSQUAD_APPROVALS_DURABLE": "none",
            "UPSQUAD_WORKER_TARGETS": self.w.addr, "UPSQUAD_TURN_LEASE_TTL": "1500ms"}))
        ch = grpc.insecure_channel(v.addr)
        try:
            sid = self.create()
            slow = script([{"tokens": "working"}, {"sleep_ms": 6000}, {"complete": "too late"}])
            fn = ch.unary_stream(LC + "SendMessage", request_serializer=L.SendMessageRequest.SerializeToString,
                                 response_deserializer=L.AgentEvent.FromString)
            it = fn(L.SendMessageRequest(session_id=sid, message=delegating("d1", "helper", slow)),
                    metadata=[("authorization", "Bearer " + self.tok())], timeout=30)
            for e in it:
                if e.HasField("delegated"):
                    break
            bridge = "SELECT status, coalesce(error_code, '-') FROM orchestrator.subagent_invocations" \
                     " WHERE parent_session_id = '%s'" % sid
            self.assertEqual(sql(self.org, bridge), [["pending", "-"]])
            v.signal(signal.SIGKILL)
            v.wait(10)
            # the surviving replica's sweep reclaims the parent's turn once its lease is stale by
            # that replica's own TTL (15 s, the default)
            deadline = time.time() + 30
            while time.time() < deadline and sql(self.org, bridge)[0][0] == "pending":
                time.sleep(0.2)
            self.assertEqual(sql(self.org, bridge), [["error", "parent_turn_reclaimed"]])
            child = [n for n in self.tree(sid).nodes if n.parent_session_id == sid]
            self.assertEqual([n.result_status for n in child], ["error"])  # the same through GetSubagentTree
        finally:
            ch.close()
            v.stop()


if __name__ == "__main__":
    unittest.main(verbosity=2)
