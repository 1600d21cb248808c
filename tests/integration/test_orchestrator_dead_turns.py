"""Dead turns over real gRPC (grpcio) and Postgres: an orchestrator replica killed with SIGKILL
in the middle of a chat turn (after 3 streamed tokens, from a real devworker) leaves a lease
nobody renews; the restarted replica, or another live one, reclaims the turn within
UPSQUAD_TURN_LEASE_TTL and a third: GetSession stops claiming THINKING, a pending pause
commits, SendMessage works again. A turn that merely runs longer than the bound on a live
replica is never reclaimed (its replica renews the lease).

Every test uses its own org and its own replicas; processes are stopped by pid.
"""
import json
import os
import signal
import socket
import sys
import threading
import time
import unittest
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
sys.path.insert(0, os.path.dirname(__file__))
import upsquad_testlib as T  # noqa: E402
# (test_orchestrator skips the run, exit 0, when Postgres, Redis or NATS is not configured)
from test_orchestrator import DSN, REDIS, SECRET, KEK, LC, MIGRATIONS, DEVWORKER, AGENT, apply_agent, drain  # noqa: E402

import grpc  # noqa: E402
from upsquad.runtime.v1 import lifecycle_pb2 as L  # noqa: E402
from upsquad.runtime.v1 import runtime_pb2 as R  # noqa: E402
from test_orchestrator_pause import sql, script  # noqa: E402

TTL_S = 2.0
# the documented bound: a lease goes stale TTL after its last renewal, and every replica sweeps
# every third of the TTL; the slack covers process start and scheduling on a loaded machine
BOUND_S = TTL_S * 4 / 3 + 2.0
THINKING = R.AGENT_STATUS_THINKING
SUSPENDED = R.AGENT_STATUS_SUSPENDED
# a turn that streams 3 tokens, then runs long (the worker's sleep ends when the call is cut)
LONG_TURN = script([{"tokens": "one two three"}, {"sleep_ms": 600000}, {"complete": "late"}])


@unittest.skipUnless(os.path.exists(DEVWORKER), "build/bin/devworker is not built")
class DeadTurns(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.w = drain(T.Server("devworker", env={"UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_LOG_LEVEL": "warn"}))
        cls.env = {"UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_PG_DSN": DSN, "UPSQUAD_MIGRATIONS_DIR": MIGRATIONS,
                   "UPSQUAD_REDIS_URL": REDIS, "UPSQUAD_KEK": KEK, "UPSQUAD_WORKER_PROBE": "200ms",
                   "UPSQUAD_WORKER_TARGETS": cls.w.addr, "UPSQUAD_LOG_LEVEL": "info",
                   "UPSQUAD_PAUSED_STREAMS": "0", "UPSQUAD_TURN_LEASE_TTL": "%dms" % (TTL_S * 1000)}

    @classmethod
    def tearDownClass(cls):
        cls.w.stop()

    def setUp(self):
        self.org = str(uuid.uuid4())
        self.user = str(uuid.uuid4())
        self.agent = apply_agent(self.org, AGENT)

    # ---- helpers ----
    def replica(self):
        s = drain(T.Server("orchestrator", env=self.env))
        ch = grpc.insecure_channel(s.addr)
        self.addCleanup(s.stop)
        self.addCleanup(ch.close)
        s.ch = ch
        # the replica sees the worker live before its first turn
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                list(self.stream(s, "warm up"))
                break
            except grpc.RpcError:
                time.sleep(0.2)
        return s

    def md(self):
        return [("authorization", "Bearer " + T.mint(SECRET, sub=self.user, org=self.org))]

    def unary(self, s, method, req, resp_cls, timeout=10):
        fn = s.ch.unary_unary(LC + method, request_serializer=req.SerializeToString,
                              response_deserializer=resp_cls.FromString)
        return fn(req, metadata=self.md(), timeout=timeout)

    def stream(self, s, message, sid="", timeout=30):
        fn = s.ch.unary_stream(LC + "SendMessage", request_serializer=L.SendMessageRequest.SerializeToString,
                               response_deserializer=L.AgentEvent.FromString)
        return fn(L.SendMessageRequest(session_id=sid, message=message, agent_id="" if sid else self.agent),
                  metadata=self.md(), timeout=timeout)

    def create(self, s):
        return self.unary(s, "CreateSession", L.CreateSessionRequest(agent_id=self.agent),
                          L.CreateSessionResponse).session_id

    def get(self, s, sid):
        return self.unary(s, "GetSession", L.GetSessionRequest(session_id=sid), L.GetSessionResponse)

    def pause(self, s, sid, timeout=10, reason="operator looks"):
        return self.unary(s, "PauseSession", L.PauseSessionRequest(session_id=sid, reason=reason),
                          L.PauseSessionResponse, timeout=timeout)

    def code(self, fn):
        with self.assertRaises(grpc.RpcError) as cm:
            fn()
        return cm.exception.code(), cm.exception.details()

    def long_turn(self, s, sid):
        """Starts LONG_TURN on replica s and returns once 3 tokens arrived; the stream is read on
        (and its end ignored) by a thread."""
        it = self.stream(s, LONG_TURN, sid, timeout=60)
        got = [next(it).token.text for _ in range(3)]
        self.assertEqual("".join(got), "one two three")
        threading.Thread(target=lambda: [None for _ in self.drain_quietly(it)], daemon=True).start()
        return it

    @staticmethod
    def drain_quietly(it):
        try:
            for e in it:
                yield e
        except grpc.RpcError:
            return

    def kill9(self, s):
        s.signal(signal.SIGKILL)
        s.wait(10)
        return time.time()

    def row(self, sid):
        return sql(self.org, "SELECT state, agent_status, turns_running, pause_pending FROM orchestrator.sessions"
                   " WHERE session_id = '%s'" % sid)[0]

    def audit(self, sid):
        rows = sql(self.org, "SELECT action_id, action_type, coalesce(parent_action_id::text, ''), detail::text"
                   " FROM orchestrator.audit_log WHERE session_id = '%s' ORDER BY seq" % sid)
        return [(r[0], r[1], r[2], json.loads(r[3])) for r in rows]

    def leases(self, sid):
        return sql(self.org, "SELECT owner FROM orchestrator.turn_leases WHERE session_id = '%s'" % sid)

    def wait_settled(self, s, sid, since):
        """Polls GetSession on s until the session stops claiming THINKING; seconds since `since`."""
        deadline = since + BOUND_S + 10
        while time.time() < deadline:
            g = self.get(s, sid)
            if g.status != THINKING:
                return time.time() - since, g
            time.sleep(0.1)
        self.fail("session %s still THINKING %.1f s after its replica died" % (sid, time.time() - since))

    def check_reclaimed(self, sid, owner):
        """One turn_reclaimed row, child of the dead turn's message_received, naming the dead
        replica; the turn counts out and its lease is gone."""
        rows = self.audit(sid)
        rec = [x for x in rows if x[1] == "turn_reclaimed"]
        self.assertEqual(len(rec), 1, [x[1] for x in rows])
        received = [x for x in rows if x[1] == "message_received"]
        self.assertEqual(rec[0][2], received[-1][0])
        self.assertEqual(rec[0][3]["owner"], owner)
        self.assertGreaterEqual(rec[0][3]["silent_ms"], TTL_S * 1000)
        self.assertEqual(self.leases(sid), [])
        return rec[0]

    def owner_of(self, s):
        return "%s:%d" % (socket.gethostname()[:63], s.proc.pid)

    # ---- tests ----
    def test_restarted_replica_reclaims_the_dead_turn(self):
        v = self.replica()
        sa, sb = self.create(v), self.create(v)
        self.long_turn(v, sa)
        self.long_turn(v, sb)
        self.assertEqual(self.get(v, sa).status, THINKING)
        self.assertEqual(self.leases(sa), [[self.owner_of(v)]])
        owner = self.owner_of(v)
        # a pause asked while the turn runs times out waiting and stays pending: the session
        # takes no message until it commits
        c, _ = self.code(lambda: self.pause(v, sa, timeout=0.5, reason="first ask"))
        self.assertEqual(c, grpc.StatusCode.DEADLINE_EXCEEDED)
        c, d = self.code(lambda: list(self.stream(v, "hello", sa)))
        self.assertEqual(c, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("pausing", d)

        killed = self.kill9(v)
        v2 = self.replica()
        # the restarted replica sweeps at once when it starts: within the bound from the kill,
        # or at once when its start took longer than that
        bound = max(BOUND_S, time.time() - killed + 1.0)
        # GetSession is truthful within the bound: the turn ended without an outcome (ERROR)
        took, g = self.wait_settled(v2, sb, killed)
        self.assertLess(took, bound)
        self.assertEqual(g.status, R.AGENT_STATUS_ERROR)
        # the pending pause committed at the reclaim (the boundary the dead turn never reached)
        took, g = self.wait_settled(v2, sa, killed)
        self.assertLess(took, bound)
        self.assertEqual(g.status, SUSPENDED)
        p = self.pause(v2, sa)
        self.assertTrue(p.was_already_suspended)
        self.assertEqual(p.status, SUSPENDED)
        self.assertEqual(self.row(sa), ["suspended", str(SUSPENDED), "0", "f"])
        self.assertEqual(self.row(sb), ["active", str(R.AGENT_STATUS_ERROR), "0", "f"])
        rec = self.check_reclaimed(sa, owner)
        self.check_reclaimed(sb, owner)
        self.assertEqual(self.audit(sa)[-1][1], "session_paused")
        self.assertEqual(self.audit(sa)[-1][3]["reason"], "first ask")
        # the reclaim is in the verified hash chain of the session
        ch = self.unary(v2, "GetProvenanceChain", L.GetProvenanceChainRequest(session_id=sa, action_id=rec[0]),
                        L.GetProvenanceChainResponse)
        self.assertEqual([k.action_type for k in ch.chain], ["message_received", "turn_reclaimed"])
        self.assertTrue(all(k.anchor_verified for k in ch.chain))
        # the resume answers the spec's ACTIVE (THINKING, docs/orchestrator.md); the session,
        # idle, shows the settled status the reclaim left, never THINKING
        r = self.unary(v2, "ResumeSession", L.ResumeSessionRequest(session_id=sa), L.ResumeSessionResponse)
        self.assertEqual(r.status, R.AGENT_STATUS_THINKING)
        self.assertEqual(self.get(v2, sa).status, R.AGENT_STATUS_ERROR)
        # both sessions take messages again
        for sid in (sa, sb):
            evs = list(self.stream(v2, "hello again", sid))
            self.assertEqual(evs[-1].completion.final_response, "echo: hello again")
            self.assertEqual(self.get(v2, sid).status, R.AGENT_STATUS_COMPLETE)
        self.assertEqual(v2.metric("orchestrator_turns_reclaimed_total"), 2)

    def test_another_live_replica_reclaims(self):
        s = self.replica()  # lives throughout
        v = self.replica()  # dies mid-turn
        sc, sd, se = self.create(s), self.create(s), self.create(s)
        self.long_turn(v, sc)
        self.long_turn(v, sd)
        owner = self.owner_of(v)
        # a live turn on s that runs past the bound is renewed, never reclaimed
        live = self.stream(s, script([{"tokens": "slow"}, {"sleep_ms": int(TTL_S * 2500)}, {"complete": "done"}]),
                           se, timeout=30)
        res = {}

        def do_pause():
            try:
                res["r"] = self.pause(s, sc, timeout=BOUND_S + 10, reason="wait for it")
            except grpc.RpcError as e:
                res["e"] = e
        th = threading.Thread(target=do_pause)
        th.start()
        time.sleep(0.3)
        killed = self.kill9(v)
        # the pause that was waiting on the dead turn commits through the other replica
        th.join(BOUND_S + 15)
        self.assertNotIn("e", res, res.get("e"))
        self.assertLess(time.time() - killed, BOUND_S + 0.5)
        self.assertEqual(res["r"].status, SUSPENDED)
        self.assertFalse(res["r"].was_already_suspended)
        took, g = self.wait_settled(s, sd, killed)
        self.assertLess(took, BOUND_S)
        self.assertEqual(g.status, R.AGENT_STATUS_ERROR)
        self.check_reclaimed(sc, owner)
        self.check_reclaimed(sd, owner)
        evs = list(self.stream(s, "after the other replica died", sd))
        self.assertEqual(evs[-1].completion.final_response, "echo: after the other replica died")
        self.unary(s, "ResumeSession", L.ResumeSessionRequest(session_id=sc), L.ResumeSessionResponse)
        evs = list(self.stream(s, "resumed", sc))
        self.assertEqual(evs[-1].completion.final_response, "echo: resumed")
        # the long turn on the live replica ran to its completion, unreclaimed
        evs = list(self.drain_quietly(live))
        self.assertEqual(evs[-1].completion.final_response, "done")
        self.assertNotIn("turn_reclaimed", [x[1] for x in self.audit(se)])
        self.assertEqual(self.get(s, se).status, R.AGENT_STATUS_COMPLETE)
        self.assertEqual(s.metric("orchestrator_turns_reclaimed_total"), 2)

    def test_overdue_pause_commits_at_the_next_message(self):
        """A pending pause whose turn counts in flight no longer (a turn left with no lease by a
        replica that died, past its bound) commits when the next message comes, instead of
        refusing it: the session never takes no message for good."""
        s = self.replica()
        sid = self.create(s)
        sql(self.org, "UPDATE orchestrator.sessions SET turns_running = 1, agent_status = 1,"
            " turn_deadline = now() - interval '1 s', pause_pending = true, pause_reason = 'asked long ago',"
            " pause_source = 1 WHERE session_id = '%s'" % sid)
        c, d = self.code(lambda: list(self.stream(s, "hello", sid)))
        self.assertEqual(c, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("suspended", d)
        self.assertEqual(self.row(sid), ["suspended", str(SUSPENDED), "0", "f"])
        paused = [x for x in self.audit(sid) if x[1] == "session_paused"]
        self.assertEqual([x[3]["reason"] for x in paused], ["asked long ago"])
        r = self.unary(s, "ResumeSession", L.ResumeSessionRequest(session_id=sid), L.ResumeSessionResponse)
        self.assertEqual(r.status, R.AGENT_STATUS_THINKING)  # the spec's ACTIVE
        self.assertEqual(self.get(s, sid).status, R.AGENT_STATUS_ERROR)  # idle: the dead turn's
        evs = list(self.stream(s, "hello", sid))
        self.assertEqual(evs[-1].completion.final_response, "echo: hello")
        # one in flight within its bound still holds the next message back ("is pausing")
        sql(self.org, "UPDATE orchestrator.sessions SET turns_running = 1,"
            " turn_deadline = now() + interval '1 min', pause_pending = true WHERE session_id = '%s'" % sid)
        c, d = self.code(lambda: list(self.stream(s, "hello", sid)))
        self.assertEqual(c, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("pausing", d)
        self.assertEqual(self.row(sid)[0], "active")


if __name__ == "__main__":
    unittest.main(verbosity=2)
