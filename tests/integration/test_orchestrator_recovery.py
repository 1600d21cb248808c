"""Crash recovery over real gRPC (grpcio), Postgres, Redis and NATS, with real devworkers
(docs/orchestrator.md, "Crash recovery"): a worker killed with SIGKILL while it holds live
sessions is found dead by its missed heartbeats, and every session resumes on another worker
from its latest checkpoint (the devworker's `inspect` directive tells what InitWorkerSession
restored and how often it was called); a checkpoint the new worker cannot load ends the session
`crashed` with a session_crashed audit row; with two replicas each session is recovered exactly
once; ResumeSession rehydrates a worker from the latest checkpoint.

Every test uses its own org, orchestrator replicas and devworkers, stopped by pid.
"""
import json
import os
import signal
import sys
import threading
import time
import unittest
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
sys.path.insert(0, os.path.dirname(__file__))
import upsquad_testlib as T  # noqa: E402

DSN = os.environ.get("UPSQUAD_PG_DSN_ORCHESTRATOR")
REDIS = os.environ.get("UPSQUAD_REDIS_URL")
NATS = os.environ.get("UPSQUAD_NATS_URL")
if not DSN or not REDIS or not NATS:
    print("SKIP: UPSQUAD_PG_DSN_ORCHESTRATOR, UPSQUAD_REDIS_URL and UPSQUAD_NATS_URL are required")
    sys.exit(0)

import grpc  # noqa: E402
from upsquad.runtime.v1 import lifecycle_pb2 as L  # noqa: E402
from test_orchestrator import SECRET, KEK, LC, MIGRATIONS, DEVWORKER, AGENT, apply_agent, drain  # noqa: E402
from test_orchestrator_pause import sql, script  # noqa: E402

HB = "200ms"        # worker heartbeat interval (devworker and orchestrator)
MISSES = "3"        # dead after 3 missed heartbeats: 600 ms
RECOVERY_BOUND = 10  # seconds from the kill until every session lives on the other worker
INSPECT = script([{"inspect": True}, {"complete": "ok"}])


@unittest.skipUnless(os.path.exists(DEVWORKER), "build/bin/devworker is not built")
class Recovery(unittest.TestCase):
    def setUp(self):
        self.procs = []
        self.channels = []
        self.org = str(uuid.uuid4())
        self.user = str(uuid.uuid4())
        self.agent = apply_agent(self.org, AGENT)
        self.wa_addr = "127.0.0.1:%d" % T.free_port()
        self.wb_addr = "127.0.0.1:%d" % T.free_port()

    def tearDown(self):
        for ch in self.channels:
            ch.close()
        for p in reversed(self.procs):
            p.stop()

    # ---- processes ----
    def orchestrator(self, **env):
        base = {"UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_PG_DSN": DSN, "UPSQUAD_MIGRATIONS_DIR": MIGRATIONS,
                "UPSQUAD_REDIS_URL": REDIS, "UPSQUAD_NATS_URL": NATS, "UPSQUAD_KEK": KEK,
                "UPSQUAD_WORKER_PROBE": "200ms", "UPSQUAD_LOG_LEVEL": "info",
                "UPSQUAD_WORKER_TARGETS": self.wa_addr + "," + self.wb_addr,
                "UPSQUAD_WORKER_HEARTBEAT_INTERVAL": HB, "UPSQUAD_WORKER_HEARTBEAT_MISSES": MISSES,
                "UPSQUAD_RECOVERY_LEASE": "5s"}
        base.update(env)
        p = drain(T.Server("orchestrator", env=base))
        self.procs.append(p)
        ch = grpc.insecure_channel(p.addr)
        self.channels.append(ch)
        p.ch = ch
        return p

    def worker(self, addr, orch, **env):
        base = {"UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_LOG_LEVEL": "info", "UPSQUAD_GRPC_ADDR": addr,
                "UPSQUAD_ORCHESTRATOR_ADDR": orch.addr, "UPSQUAD_DEVWORKER_HEARTBEAT_INTERVAL": HB}
        base.update(env)
        w = drain(T.Server("devworker", env=base))
        self.procs.append(w)
        return w

    def kill(self, p):
        p.signal(signal.SIGKILL)
        p.wait(10)

    # ---- calls ----
    def tok(self):
        return T.mint(SECRET, sub=self.user, org=self.org)

    def unary(self, ch, method, req, resp_cls):
        fn = ch.unary_unary(LC + method, request_serializer=req.SerializeToString,
                            response_deserializer=resp_cls.FromString)
        return fn(req, metadata=[("authorization", "Bearer " + self.tok())], timeout=15)

    def send(self, ch, message, sid=""):
        fn = ch.unary_stream(LC + "SendMessage", request_serializer=L.SendMessageRequest.SerializeToString,
                             response_deserializer=L.AgentEvent.FromString)
        req = L.SendMessageRequest(session_id=sid, message=message, agent_id="" if sid else self.agent)
        return list(fn(req, metadata=[("authorization", "Bearer " + self.tok())], timeout=30))

    def new_session(self, ch, message):
        """CreateSession (InitWorkerSession on a live worker), then one turn."""
        deadline = time.time() + 10
        while True:  # until the replica's probe has seen a worker live (nothing is stored before)
            try:
                sid = self.unary(ch, "CreateSession", L.CreateSessionRequest(agent_id=self.agent),
                                 L.CreateSessionResponse).session_id
                break
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.time() > deadline:
                    raise
                time.sleep(0.1)
        evs = self.send(ch, message, sid)
        self.assertTrue(any(e.HasField("completion") for e in evs), evs)
        return sid

    def inspect(self, ch, sid):
        evs = self.send(ch, INSPECT, sid)
        self.assertTrue(any(e.HasField("completion") for e in evs), evs)
        return json.loads(evs[0].token.text)

    def wait_for(self, pred, timeout, what):
        deadline = time.time() + timeout
        while time.time() < deadline:
            v = pred()
            if v:
                return v
            time.sleep(0.1)
        self.fail("not within %ss: %s" % (timeout, what))

    def latest_loop(self, sid):
        """The newest checkpointed loop, -1 before the first (psql prints max()'s NULL as nothing)."""
        rows = sql(self.org, "SELECT coalesce(max(loop_iteration), -1) FROM checkpoints"
                   " WHERE session_id = '%s'" % sid)
        return int(rows[0][0])

    def wait_checkpointed(self, sids, loops):
        """Waits until each session's checkpoints reached loops[sid] (the worker sends them
        asynchronously)."""
        self.wait_for(lambda: all(self.latest_loop(s) >= loops[s] for s in sids), 10,
                      "the checkpoints reached the orchestrator")

    def workers_of(self, sids):
        rows = sql(self.org, "SELECT session_id, worker, state FROM sessions WHERE session_id IN (%s)"
                   % ",".join("'%s'" % s for s in sids))
        return {r[0]: (r[1], r[2]) for r in rows}

    def audit_types(self, sid):
        return [r[0] for r in sql(self.org, "SELECT action_type FROM audit_log WHERE session_id = '%s'"
                                  " ORDER BY seq" % sid)]

    def chain_ok(self, sid):
        """The audit rows stay one chain: gapless seq, each prev_hash the previous hash."""
        rows = sql(self.org, "SELECT seq, prev_hash, hash FROM audit_log WHERE session_id = '%s'"
                   " ORDER BY seq" % sid)
        seqs = [int(r[0]) for r in rows]
        self.assertEqual(seqs, list(range(seqs[0], seqs[0] + len(seqs))))
        for prev, cur in zip(rows, rows[1:]):
            self.assertEqual(cur[1], prev[2])

    # ---- tests ----
    def test_worker_death_moves_every_session(self):
        a = self.orchestrator()
        wa = self.worker(self.wa_addr, a)
        sids = []
        for i in range(20):  # two turns each, on the only live worker
            sid = self.new_session(a.ch, "hello %d" % i)
            self.assertTrue(any(e.HasField("completion") for e in self.send(a.ch, "again %d" % i, sid)))
            sids.append(sid)
        self.assertTrue(all(w == self.wa_addr for w, _ in self.workers_of(sids).values()))
        loops = {s: 1 for s in sids}  # iterations 0 and 1 checkpointed
        self.wait_checkpointed(sids, loops)
        loops = {s: self.latest_loop(s) for s in sids}
        self.worker(self.wb_addr, a)
        time.sleep(1)  # replica A's probe sees worker B live
        t0 = time.time()
        self.kill(wa)
        placed = self.wait_for(lambda: (lambda m: m if all(w == self.wb_addr for w, _ in m.values()) else None)(
            self.workers_of(sids)), RECOVERY_BOUND, "every session placed on worker B")
        took = time.time() - t0
        print("recovery of 20 sessions: %.2f s after the kill" % took, file=sys.stderr)
        if os.environ.get("RECOVERY_LOG"):
            with open(os.environ["RECOVERY_LOG"], "w") as f:
                f.write("kill at %.3f\n" % t0)
                f.writelines(a.log)
        self.assertTrue(all(st == "active" for _, st in placed.values()))
        for sid in sids:
            seen = self.inspect(a.ch, sid)
            self.assertEqual(seen["worker"]["addr"], self.wb_addr)
            # restored from the latest checkpoint, by exactly one InitWorkerSession
            self.assertEqual(seen["session"]["inits"], 1, sid)
            self.assertEqual(seen["session"]["restored_loop"], loops[sid], sid)
            self.assertGreater(seen["session"]["next_loop"], loops[sid])
            types = self.audit_types(sid)
            self.assertEqual(types.count("session_recovered"), 1, types)
            self.assertNotIn("session_crashed", types)
            self.chain_ok(sid)
        # the next turn's checkpoint continues past the restored loop: state continued
        self.wait_for(lambda: all(self.latest_loop(s) > loops[s] for s in sids), 10,
                      "every session checkpointed past its restored loop on worker B")

    def test_unsupported_checkpoint_version_crashes(self):
        a = self.orchestrator()
        wa = self.worker(self.wa_addr, a)
        sid = self.new_session(a.ch, "hello")
        self.wait_checkpointed([sid], {sid: 0})
        # worker B reads schema version 2 only: the version-1 checkpoint is refused
        self.worker(self.wb_addr, a, UPSQUAD_DEVWORKER_CHECKPOINT_VERSION="2")
        time.sleep(1)
        self.kill(wa)
        self.wait_for(lambda: self.workers_of([sid])[sid][1] == "crashed", RECOVERY_BOUND,
                      "the session crashed")
        types = self.audit_types(sid)
        self.assertEqual(types[-1], "session_crashed")
        detail = json.loads(sql(self.org, "SELECT detail FROM audit_log WHERE session_id = '%s'"
                                " AND action_type = 'session_crashed'" % sid)[0][0])
        self.assertIn("version", detail["reason"])
        self.assertEqual(detail["worker"], self.wa_addr)
        self.assertEqual(detail["loop_iteration"], 0)
        self.chain_ok(sid)
        row = sql(self.org, "SELECT agent_status, worker, ended_at IS NOT NULL, last_error FROM sessions"
                  " WHERE session_id = '%s'" % sid)[0]
        self.assertEqual(row[:3], ["4", "", "t"])  # reset: ERROR, no worker, ended
        self.assertIn("crash recovery failed", row[3])
        # a crashed session takes no more messages
        evs_or_err = None
        try:
            evs_or_err = self.send(a.ch, "more", sid)
        except grpc.RpcError as e:
            evs_or_err = e.code()
        self.assertEqual(evs_or_err, grpc.StatusCode.FAILED_PRECONDITION)

    def test_two_replicas_recover_each_session_once(self):
        a = self.orchestrator()
        b = self.orchestrator()
        wa = self.worker(self.wa_addr, a)
        sids = [self.new_session((a if i % 2 else b).ch, "hello %d" % i) for i in range(10)]
        self.wait_checkpointed(sids, {s: 0 for s in sids})
        self.worker(self.wb_addr, a)
        time.sleep(1)
        self.kill(wa)
        self.wait_for(lambda: all(w == self.wb_addr for w, _ in self.workers_of(sids).values()),
                      RECOVERY_BOUND, "every session placed on worker B")
        time.sleep(1.5)  # more sweeps of both replicas: nothing is recovered twice
        for sid in sids:
            seen = self.inspect(b.ch, sid)
            self.assertEqual(seen["session"]["inits"], 1, sid)
            self.assertEqual(self.audit_types(sid).count("session_recovered"), 1)
            # one replica acted on it: one recovery log line in both replicas' logs together
            acted = [l for p in (a, b) for l in p.log if "recovery.recovered" in l and sid in l]
            self.assertEqual(len(acted), 1, acted)

    def test_lease_of_a_dead_replica_expires(self):
        a = self.orchestrator()
        wa = self.worker(self.wa_addr, a)
        sid = self.new_session(a.ch, "hello")
        self.wait_checkpointed([sid], {sid: 0})
        self.worker(self.wb_addr, a)
        time.sleep(1)
        # a replica that claimed the session and died before acting: its lease stands for 3 s
        sql(self.org, "UPDATE session_placement SET lease_owner = 'gone:1',"
                      " lease_until = now() + interval '3 seconds' WHERE session_id = '%s'" % sid)
        t0 = time.time()
        self.kill(wa)
        time.sleep(2)
        self.assertEqual(self.workers_of([sid])[sid][0], self.wa_addr)  # nobody else acts yet
        self.wait_for(lambda: self.workers_of([sid])[sid][0] == self.wb_addr, RECOVERY_BOUND,
                      "the session placed on worker B after the lease expired")
        self.assertGreaterEqual(time.time() - t0, 2.5)
        self.assertEqual(self.inspect(a.ch, sid)["session"]["inits"], 1)

    def test_turn_in_flight_ends_with_retryable_error(self):
        a = self.orchestrator()
        wa = self.worker(self.wa_addr, a)
        sid = self.new_session(a.ch, "hello")
        got = []

        def run():
            try:
                got.extend(self.send(a.ch, script([{"token": "one"}, {"sleep_ms": 8000}, {"complete": "late"}]), sid))
            except grpc.RpcError as e:
                got.append(e)
        t = threading.Thread(target=run)
        t.start()  # on worker A, the only live one
        time.sleep(0.5)
        self.worker(self.wb_addr, a)
        time.sleep(1)
        self.kill(wa)
        t.join(20)
        self.assertFalse(t.is_alive(), "the turn hangs")
        errs = [e for e in got if not isinstance(e, grpc.RpcError) and e.HasField("error")]
        self.assertEqual(len(errs), 1, got)
        self.assertTrue(errs[0].error.retryable)
        self.assertIn("crash recovery", errs[0].error.message)
        self.wait_for(lambda: self.workers_of([sid])[sid][0] == self.wb_addr, RECOVERY_BOUND,
                      "the session placed on worker B")
        self.assertTrue(any(e.HasField("completion") for e in self.send(a.ch, "retry", sid)))

    def test_resume_rehydrates_a_worker(self):
        a = self.orchestrator()
        self.worker(self.wa_addr, a)
        sid = self.new_session(a.ch, "hello")
        self.send(a.ch, "again", sid)
        self.wait_checkpointed([sid], {sid: 1})
        loop = self.latest_loop(sid)
        p = self.unary(a.ch, "PauseSession", L.PauseSessionRequest(session_id=sid, reason="look"),
                       L.PauseSessionResponse)
        self.assertTrue(p.checkpoint_key)
        rr = self.unary(a.ch, "ResumeSession", L.ResumeSessionRequest(session_id=sid),
                        L.ResumeSessionResponse)
        self.assertEqual(rr.resumed_at_loop, loop)
        seen = self.inspect(a.ch, sid)
        self.assertEqual(seen["session"]["restored_loop"], loop)
        self.assertGreaterEqual(seen["session"]["inits"], 1)
        # not suspended: FAILED_PRECONDITION, nothing changes
        with self.assertRaises(grpc.RpcError) as cm:
            self.unary(a.ch, "ResumeSession", L.ResumeSessionRequest(session_id=sid), L.ResumeSessionResponse)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)


if __name__ == "__main__":
    unittest.main()
