"""The autonomous plan loop over real gRPC (grpcio), Postgres, NATS and Redis: a SendMessage in
EXECUTION_MODE_AUTONOMOUS plans (step_goal "decompose goal into todo plan"), then runs one step
per todo (step_goal = its title) until the plan completes, max_loops, a stall, a cancel or an
error; the plan is durable (a lost worker's cycle runs again on the other one; a pause between
cycles, then a later SendMessage, continues at the same todo). build/bin/devworker scripts the
plans, the stalls and the crash. Fresh org UUIDs per run; processes stopped by pid."""
import json
import os
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
from upsquad.runtime.v1 import runtime_pb2 as R  # noqa: E402
from test_orchestrator import SECRET, KEK, LC, MIGRATIONS, DEVWORKER, apply_agent, drain  # noqa: E402
from test_orchestrator_pause import sql  # noqa: E402

AUTO = R.EXECUTION_MODE_AUTONOMOUS


def script(steps):
    return "#!script\n" + json.dumps(steps)


def planned(todos, **kw):
    """A goal whose PLAN step decomposes into todos (titles or TodoSpec objects)."""
    return script([{"decomposition": todos}, {"complete": "planned"}])


STALL = script([{"tokens": "trying again"},
                {"step_progress": {"produced_new_artifacts": False, "todo_marked_complete_by_model": False,
                                   "response_delta_hash": "same answer"}},
                {"complete": "no luck"}])


class AutonomyClient:
    """The calls and reads of a test of the loop: the class has ch, org, user and agent."""

    def tok(self):
        return T.mint(SECRET, sub=self.user, org=self.org)

    def unary(self, method, req, resp_cls):
        fn = self.ch.unary_unary(LC + method, request_serializer=req.SerializeToString,
                                 response_deserializer=resp_cls.FromString)
        return fn(req, metadata=[("authorization", "Bearer " + self.tok())], timeout=10)

    def create(self, agent=None):
        return self.unary("CreateSession", L.CreateSessionRequest(agent_id=agent or self.agent),
                          L.CreateSessionResponse).session_id

    def stream(self, message, sid="", mode=AUTO, timeout=60):
        fn = self.ch.unary_stream(LC + "SendMessage", request_serializer=L.SendMessageRequest.SerializeToString,
                                  response_deserializer=L.AgentEvent.FromString)
        req = L.SendMessageRequest(session_id=sid, message=message, agent_id="" if sid else self.agent,
                                   execution_mode=mode)
        return fn(req, metadata=[("authorization", "Bearer " + self.tok())], timeout=timeout)

    def run_loop(self, goal, sid):
        return list(self.stream(goal, sid))

    def details(self, evs):
        return [e.status.detail for e in evs if e.HasField("status") and e.status.detail]

    def audit(self, sid):
        rows = sql(self.org, "SELECT action_type, detail::text FROM orchestrator.audit_log"
                   " WHERE session_id = '%s' ORDER BY seq" % sid)
        return [(r[0], json.loads(r[1])) for r in rows]

    def plan_row(self, sid):
        r = sql(self.org, "SELECT cursor, cycles, state, reason, todos::text FROM orchestrator.session_plans"
                " WHERE session_id = '%s'" % sid)[0]
        return int(r[0]), int(r[1]), r[2], r[3], json.loads(r[4])

    def get(self, sid):
        return self.unary("GetSession", L.GetSessionRequest(session_id=sid), L.GetSessionResponse)


@unittest.skipUnless(os.path.exists(DEVWORKER), "build/bin/devworker is not built")
class Autonomy(AutonomyClient, unittest.TestCase):
    procs = []

    @classmethod
    def setUpClass(cls):
        addr = "127.0.0.1:%d" % T.free_port()
        wenv = {"UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_LOG_LEVEL": "info", "UPSQUAD_ORCHESTRATOR_ADDR": addr,
                "UPSQUAD_DEVWORKER_HEARTBEAT_INTERVAL": "200ms", "UPSQUAD_DEVWORKER_ALLOW_CRASH": "true"}
        cls.wenv = wenv
        cls.w1 = drain(T.Server("devworker", env=wenv))
        cls.w2 = drain(T.Server("devworker", env=wenv))
        cls.procs += [cls.w1, cls.w2]
        cls.o = drain(T.Server("orchestrator", env={
            "UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_PG_DSN": DSN, "UPSQUAD_MIGRATIONS_DIR": MIGRATIONS,
            "UPSQUAD_REDIS_URL": REDIS, "UPSQUAD_NATS_URL": NATS, "UPSQUAD_KEK": KEK,
            "UPSQUAD_WORKER_PROBE": "200ms", "UPSQUAD_LOG_LEVEL": "info", "UPSQUAD_GRPC_ADDR": addr,
            "UPSQUAD_APPROVALS_DURABLE": "none",
            "UPSQUAD_WORKER_TARGETS": cls.w1.addr + "," + cls.w2.addr}))
        cls.procs.append(cls.o)
        cls.ch = grpc.insecure_channel(cls.o.addr)
        cls.org, cls.user = str(uuid.uuid4()), str(uuid.uuid4())
        cls.agent = apply_agent(cls.org, {"role": "planner", "display_name": "Planner",
                                          "model": "claude-sonnet-4-6", "max_loops": 10})
        cls.short = apply_agent(cls.org, {"role": "short", "display_name": "Short leash",
                                          "model": "claude-sonnet-4-6", "max_loops": 3})
        T.until_served(lambda: list(cls().stream("warm up", mode=R.EXECUTION_MODE_SINGLE_TURN)))

    @classmethod
    def tearDownClass(cls):
        cls.ch.close()
        for p in cls.procs:
            p.stop()

    # ---- a 5-todo goal: plan + 5 steps + plan_complete ----
    def test_plan_runs_to_completion(self):
        sid = self.create()
        evs = self.run_loop("\n".join("todo %d" % i for i in range(1, 6)), sid)
        d = self.details(evs)
        self.assertEqual(d[0], "plan: 5 todo(s)")
        for i in range(1, 6):
            self.assertIn("todo-%d (%d/5): todo %d" % (i, i, i), d)
            self.assertIn("todo-%d done" % i, d)
        self.assertIn("autonomous loop ended: plan_complete after 5 cycle(s), 5/5 todo(s) done", d)
        arms = [e.WhichOneof("event") for e in evs]
        self.assertEqual(arms.count("completion"), 1)  # one, at the end
        self.assertEqual(arms[-1], "completion")
        self.assertEqual(evs[-1].completion.loop_iterations, 5)
        self.assertEqual(evs[-1].completion.final_response, "echo: todo 5")
        # spec CompletionEvent: token_usage "aggregated ... for this step", duration_ms its
        # wall-clock time: the loop's, over the PLAN step and the five cycles
        u = evs[-1].completion.token_usage
        self.assertGreaterEqual(u.output_tokens, 5)
        self.assertGreater(u.input_tokens, 0)
        self.assertTrue(u.model)
        self.assertGreater(evs[-1].completion.duration_ms, 0)
        # the steps' own tokens reached the caller
        self.assertIn("echo: todo 3", "".join(e.token.text for e in evs if e.HasField("token")))
        cursor, cycles, state, reason, todos = self.plan_row(sid)
        self.assertEqual((cursor, cycles, state, reason), (5, 5, "ended", "plan_complete"))
        self.assertEqual([t["id"] for t in todos], ["todo-%d" % i for i in range(1, 6)])
        self.assertTrue(all(t["done"] for t in todos))
        types = [t for t, _ in self.audit(sid)]
        self.assertEqual((types.count("plan_created"), types.count("todo_done"), types.count("loop_terminated")),
                         (1, 5, 1))
        # loop_count: the cycles as they run, and the worker's iterations its checkpoints show
        # (the PLAN step's one too, once its checkpoint arrived)
        self.assertIn(self.get(sid).loop_count, (5, 6))

    # ---- spec ExecuteStepRequest.prior_turns: "Empty on the autonomous / temporalwf path" ----
    def test_no_prior_turns_on_the_autonomous_path(self):
        sid = self.create()
        for i in range(2):  # chat turns first: the history a chat turn would carry
            list(self.stream("chat %d" % i, sid, mode=R.EXECUTION_MODE_SINGLE_TURN))
        look = script([{"inspect": True}, {"complete": "looked"}])
        evs = self.run_loop(script([{"inspect": True}, {"decomposition": [look]}, {"complete": "planned"}]), sid)
        seen = [json.loads(e.token.text)["request"] for e in evs
                if e.HasField("token") and e.token.text.startswith("{")]
        self.assertEqual(len(seen), 2)  # the plan step, the cycle
        self.assertEqual(seen[1]["step_goal"], look)
        for r in seen:
            self.assertEqual(r["execution_mode"], "EXECUTION_MODE_AUTONOMOUS")
            self.assertNotIn("prior_turns", r)
        # a chat turn after the loop carries the history again
        chat = script([{"inspect": True}, {"complete": "chat again"}])
        evs = list(self.stream(chat, sid, mode=R.EXECUTION_MODE_SINGLE_TURN))
        rq = [json.loads(e.token.text)["request"] for e in evs if e.HasField("token") and e.token.text.startswith("{")][0]
        self.assertGreaterEqual(len(rq.get("prior_turns", [])), 4)
        # spec: the snapshot is "immutable": a turn's mode is on the request, not in it
        self.assertEqual(rq["execution_mode"], "EXECUTION_MODE_SINGLE_TURN")
        for r in seen:
            self.assertEqual(r["snapshot"], rq["snapshot"])

    # ---- the plan's rules: stable order, empty titles dropped, ids re-indexed ----
    def test_plan_is_reindexed_and_ordered(self):
        sid = self.create()
        todos = [{"id": "x", "title": "third", "ordering": 2}, {"id": "y", "title": "   ", "ordering": 0},
                 {"id": "z", "title": "first", "ordering": 0}, {"title": "second", "ordering": 1}]
        self.run_loop(planned(todos), sid)
        _, cycles, _, reason, plan = self.plan_row(sid)
        self.assertEqual([(t["id"], t["title"]) for t in plan],
                         [("todo-1", "first"), ("todo-2", "second"), ("todo-3", "third")])
        self.assertEqual((cycles, reason), (3, "plan_complete"))

    # ---- an empty plan degrades to one seed todo: the goal ----
    def test_empty_plan_is_one_seed_todo(self):
        sid = self.create()
        goal = planned(["", "  "])
        evs = self.run_loop(goal, sid)
        self.assertEqual(self.details(evs)[0], "plan: 1 todo(s)")
        _, cycles, _, reason, plan = self.plan_row(sid)
        self.assertEqual((len(plan), plan[0]["title"], cycles, reason), (1, goal, 1, "plan_complete"))

    # ---- a stall stops the loop at the window ----
    def test_stall_stops_at_the_window(self):
        sid = self.create()
        evs = self.run_loop(planned([STALL, "never reached"]), sid)
        err = [e.error for e in evs if e.HasField("error")]
        self.assertEqual([e.code for e in err], ["AUTONOMOUS_STALLED"])
        self.assertFalse(err[0].retryable)
        cursor, cycles, state, reason, _ = self.plan_row(sid)
        # the first cycle sets the hash; three more repeat it (UPSQUAD_AUTONOMOUS_STALL_WINDOW 3)
        self.assertEqual((cursor, cycles, state, reason), (0, 4, "ended", "stall"))
        ended = [d for t, d in self.audit(sid) if t == "loop_terminated"]
        self.assertEqual((ended[0]["reason"], ended[0]["cycles"]), ("stall", 4))

    # ---- max_loops 3 stops at 3 ----
    def test_max_loops(self):
        sid = self.create(self.short)
        evs = self.run_loop("a\nb\nc\nd\ne", sid)
        self.assertEqual([e.error.code for e in evs if e.HasField("error")], ["AUTONOMOUS_MAX_LOOPS"])
        cursor, cycles, state, reason, _ = self.plan_row(sid)
        self.assertEqual((cursor, cycles, state, reason), (3, 3, "ended", "max_loops"))
        self.assertIn(self.get(sid).loop_count, (3, 4))

    # ---- kill -9 of the worker mid-plan: the same todo again on the other worker ----
    def test_worker_crash_mid_plan_continues_at_the_same_todo(self):
        sid = self.create()
        # the session's worker (affinity): the crash happens there, on todo-2
        where = json.loads(list(self.stream(script([{"inspect": True}, {"complete": "ok"}]), sid,
                                            mode=R.EXECUTION_MODE_SINGLE_TURN))[0].token.text)["worker"]["addr"]
        crash = script([{"tokens": "working"}, {"crash": True, "if_worker": where}, {"complete": "done elsewhere"}])
        evs = self.run_loop(planned(["one", crash, "three"]), sid)
        self.assertEqual(evs[-1].WhichOneof("event"), "completion", [e.WhichOneof("event") for e in evs])
        cursor, cycles, state, reason, plan = self.plan_row(sid)
        self.assertEqual((cursor, state, reason), (3, "ended", "plan_complete"))
        self.assertTrue(all(t["done"] for t in plan))
        done = [d["todo"] for t, d in self.audit(sid) if t == "todo_done"]
        self.assertEqual(done, ["todo-1", "todo-2", "todo-3"])  # todo-2 once, after the crash
        # the worker that crashed is replaced for the next tests
        victim = self.w1 if where == self.w1.addr else self.w2
        victim.proc.wait(10)
        victim.stop()
        fresh = drain(T.Server("devworker", env=dict(self.wenv, UPSQUAD_GRPC_ADDR=where)))
        self.procs.append(fresh)
        if victim is self.w1:
            type(self).w1 = fresh
        else:
            type(self).w2 = fresh

    # ---- one loop per session: a second autonomous message meanwhile is refused ----
    def test_one_loop_per_session(self):
        sid = self.create()
        slow = script([{"tokens": "slow"}, {"sleep_ms": 2000}, {"complete": "slow done"}])
        it = self.stream(planned([slow, "second"]), sid)
        evs = []
        th = threading.Thread(target=lambda: [evs.append(e) for e in it])
        th.start()
        deadline = time.time() + 10
        while time.time() < deadline and not any("todo-1 (1/2)" in d for d in self.details(evs)):
            time.sleep(0.05)
        with self.assertRaises(grpc.RpcError) as cm:
            list(self.stream("again", sid))
        self.assertEqual(cm.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("one autonomous loop runs at a time", cm.exception.details())
        th.join(20)
        cursor, cycles, state, reason, _ = self.plan_row(sid)
        self.assertEqual((cursor, cycles, state, reason), (2, 2, "ended", "plan_complete"))

    # ---- spec TerminateSession "ends an active session": no cycle after it ----
    def test_terminate_stops_the_loop(self):
        sid = self.create()
        slow = script([{"tokens": "slow"}, {"sleep_ms": 800}, {"complete": "slow done"}])
        it = self.stream(planned([slow] * 5), sid)
        evs, codes = [], []

        def read():
            try:
                for e in it:
                    evs.append(e)
            except grpc.RpcError as e:
                codes.append(e.code())

        th = threading.Thread(target=read)
        th.start()
        deadline = time.time() + 15
        while time.time() < deadline and not any("todo-1 (1/5)" in d for d in self.details(evs)):
            time.sleep(0.05)
        self.unary("TerminateSession", L.TerminateLifecycleSessionRequest(session_id=sid, reason="enough"),
                   L.TerminateLifecycleSessionResponse)
        th.join(20)
        self.assertFalse(th.is_alive())
        self.assertEqual(codes, [grpc.StatusCode.CANCELLED])
        self.assertIn("the session was terminated: the autonomous loop stops", self.details(evs))
        time.sleep(1.0)  # nothing runs on after the stream's end
        cursor, cycles, state, reason, _ = self.plan_row(sid)
        self.assertEqual((state, reason), ("ended", "cancel"))
        self.assertLessEqual(cycles, 2)  # the cycle the terminate cut short, at most
        self.assertLessEqual([t for t, _ in self.audit(sid)].count("todo_done"), 2)

    # ---- a pause between cycles, then a later SendMessage continues at the same todo ----
    def test_pause_between_cycles_then_continue(self):
        sid = self.create()
        slow = script([{"tokens": "slow"}, {"sleep_ms": 1500}, {"complete": "slow done"}])
        it = self.stream(planned([slow, "second", "third"]), sid)
        evs = []
        t = threading.Thread(target=lambda: [evs.append(e) for e in it])
        t.start()
        deadline = time.time() + 10
        while time.time() < deadline and not any("todo-1 (1/3)" in d for d in self.details(evs)):
            time.sleep(0.05)
        self.unary("PauseSession", L.PauseSessionRequest(session_id=sid, reason="look"), L.PauseSessionResponse)
        deadline = time.time() + 15
        while time.time() < deadline and not any(e.HasField("session_paused") for e in evs):
            time.sleep(0.05)
        self.assertTrue(any(e.HasField("session_paused") for e in evs), [e.WhichOneof("event") for e in evs])
        cursor, cycles, state, reason, _ = self.plan_row(sid)
        self.assertEqual((cursor, cycles, state, reason), (1, 1, "running", "paused"))
        self.unary("ResumeSession", L.ResumeSessionRequest(session_id=sid), L.ResumeSessionResponse)
        t.join(10)
        evs2 = self.run_loop("go on", sid)
        d = self.details(evs2)
        self.assertEqual(d[0], "continuing the plan")
        self.assertIn("todo-2 (2/3): second", d)
        self.assertNotIn("todo-1 (1/3)", " ".join(d))
        cursor, cycles, state, reason, _ = self.plan_row(sid)
        self.assertEqual((cursor, cycles, state, reason), (3, 3, "ended", "plan_complete"))
        self.assertEqual(evs2[-1].completion.loop_iterations, 3)


if __name__ == "__main__":
    unittest.main(verbosity=2)
