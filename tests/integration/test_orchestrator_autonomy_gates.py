"""A human gate inside an autonomous cycle, over real gRPC (grpcio), Postgres, NATS and Redis: a
todo's gated tool call (interrupt_required) or ask_user parks the session on an approval / a
prompt in workflow-engine's ApprovalService; the decision resumes that cycle itself (its
ExecuteStep carries the cycle's step_goal, from the frozen checkpoint): the approved call runs
once (a denial is its error result, an answer the ask's result), the cycle completes, its todo
is done once, and the plan goes on with its next todos on the stream that waited; with nobody
listening the resumed cycle completes and the next autonomous SendMessage continues the plan at
the next todo.

Starts build/bin/workflow-engine, one orchestrator (consuming the decisions on a durable of its
own) and build/bin/devworker, which scripts the plans. Fresh org UUIDs per run; processes are
stopped by pid."""
import json
import os
import sys
import time
import unittest
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
import upsquad_testlib as T  # noqa: E402
# these skip (exit 0) without Postgres, NATS and Redis
from test_orchestrator_gates import DSN, WF_DSN, REDIS, NATS, Stream  # noqa: E402
from test_orchestrator_autonomy import AutonomyClient, script, planned  # noqa: E402

import grpc  # noqa: E402
from upsquad.runtime.v1 import lifecycle_pb2 as L  # noqa: E402
from upsquad.runtime.v1 import runtime_pb2 as R  # noqa: E402
from upsquad.approval.v1 import approval_pb2 as AP  # noqa: E402
from upsquad.workflow.v1 import workflow_pb2 as W  # noqa: E402
from test_orchestrator import SECRET, KEK, MIGRATIONS, DEVWORKER, apply_agent, drain  # noqa: E402

AGENT = {"role": "auto-deployer", "display_name": "Auto deployer", "model": "claude-sonnet-4-6",
         "tools": ["deploy"], "max_loops": 10,
         "tool_policies": {"deploy": {"requires_approval": True, "required_clearance": 3}}}


def gated(call, after="deployed"):
    """A todo whose `deploy` call is gated; after the gate it completes with `after` ({{answer}}
    becomes the denial)."""
    return script([{"tokens": "checking " + call},
                   {"tool_call": {"tool_name": "deploy", "tool_call_id": call, "arguments": {"env": "prod"}}},
                   {"interrupt": {"tool_name": "deploy", "tool_call_id": call,
                                  "pending_tool_intent": {"env": "prod"}}},
                   {"tokens": "after the gate " + call},
                   {"complete": after}])


@unittest.skipUnless(os.path.exists(DEVWORKER), "build/bin/devworker is not built")
class AutonomyGates(AutonomyClient, unittest.TestCase):
    procs = []

    @classmethod
    def setUpClass(cls):
        cls.engine = drain(T.Server("workflow-engine", env=T.engine_env(
            WF_DSN, NATS, SECRET, UPSQUAD_WF_SCHEDULE_POLL="100ms")))
        cls.procs.append(cls.engine)
        addr = "127.0.0.1:%d" % T.free_port()
        cls.w = drain(T.Server("devworker", env={"UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_LOG_LEVEL": "info",
                                                 "UPSQUAD_ORCHESTRATOR_ADDR": addr,
                                                 "UPSQUAD_DEVWORKER_HEARTBEAT_INTERVAL": "200ms"}))
        cls.procs.append(cls.w)
        cls.o = drain(T.Server("orchestrator", env={
            "UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_PG_DSN": DSN, "UPSQUAD_MIGRATIONS_DIR": MIGRATIONS,
            "UPSQUAD_REDIS_URL": REDIS, "UPSQUAD_NATS_URL": NATS, "UPSQUAD_KEK": KEK,
            "UPSQUAD_WORKER_PROBE": "200ms", "UPSQUAD_LOG_LEVEL": "info", "UPSQUAD_GRPC_ADDR": addr,
            "UPSQUAD_APPROVALS_ADDR": cls.engine.addr,
            "UPSQUAD_APPROVALS_DURABLE": "test-auto-gates-" + uuid.uuid4().hex[:12],
            "UPSQUAD_WORKER_TARGETS": cls.w.addr}))
        cls.procs.append(cls.o)
        cls.ch = grpc.insecure_channel(cls.o.addr)
        cls.org, cls.user, cls.member = str(uuid.uuid4()), str(uuid.uuid4()), str(uuid.uuid4())
        cls.agent = apply_agent(cls.org, AGENT)
        cls.lead = apply_agent(cls.org, {"role": "auto-lead", "display_name": "Lead", "model": "claude-sonnet-4-6",
                                         "max_loops": 10,
                                         "tool_policies": {"delegate_to_agent": {"requires_approval": True,
                                                                                 "required_clearance": 2}}})
        apply_agent(cls.org, {"role": "auto-helper", "display_name": "Helper", "model": "claude-sonnet-4-6"})
        tok = lambda sub, c: T.mint(SECRET, sub=sub, org=cls.org, clearance=c)
        cls.requester = T.WorkflowClient(cls.engine.addr, tok(cls.user, 2))
        cls.approver = T.WorkflowClient(cls.engine.addr, tok(cls.member, 3))
        warm = cls()
        T.until_served(lambda: list(warm.stream("warm up", warm.create(), mode=R.EXECUTION_MODE_SINGLE_TURN)))

    @classmethod
    def tearDownClass(cls):
        cls.ch.close()
        cls.requester.close()
        cls.approver.close()
        for p in cls.procs:
            p.stop()

    # ---- helpers ----
    def park(self, goal):
        """A fresh session whose autonomous run parks on a gate: (session id, stream, pause)."""
        sid = self.create()
        s = Stream(self.stream(goal, sid))
        return sid, s, s.until("session_paused").session_paused

    def decide(self, aid, decision, **kw):
        return self.approver("RecordDecision", AP.RecordDecisionRequest(approval_id=aid, decision=decision, **kw))

    def results(self, sid, call):
        return [d for t, d in self.audit(sid) if t == "tool_result" and d["tool_call_id"] == call]

    def done_todos(self, sid):
        return [d["todo"] for t, d in self.audit(sid) if t == "todo_done"]

    def assert_parked_at_todo_2(self, sid, pause):
        self.assertEqual(pause.pause_source, L.PAUSE_SOURCE_APPROVAL)
        cursor, cycles, state, reason, _ = self.plan_row(sid)
        self.assertEqual((cursor, cycles, state, reason), (1, 2, "running", "gate"))
        self.assertEqual(self.done_todos(sid), ["todo-1"])
        stopped = [d for t, d in self.audit(sid) if t == "loop_stopped"]
        self.assertEqual([(d["reason"], d.get("approval_id")) for d in stopped], [("gate", pause.correlation_id)])

    # ---- approved: the call runs once inside the cycle, the todo is done once, the plan goes on ----
    def test_approved_call_resumes_the_cycle_and_the_plan(self):
        sid, s, p = self.park(planned(["one", gated("a1"), "three"]))
        self.assert_parked_at_todo_2(sid, p)
        ir = [e for e in s.events if e.HasField("interrupt_required")][0].interrupt_required
        self.assertEqual((ir.approval_id, ir.tool_name), (p.correlation_id, "deploy"))
        self.assertTrue(self.decide(p.correlation_id, AP.DECISION_APPROVED).recorded)
        resumed = s.until("session_resumed").session_resumed
        self.assertEqual((resumed.resumed_by_approval, resumed.approval_id), (True, p.correlation_id))
        evs = s.rest()
        self.assertIsNone(s.error)
        after = evs[evs.index([e for e in evs if e.HasField("session_resumed")][0]) + 1:]
        d = self.details(after)
        # the resumed step ran the cycle's step_goal (the todo's script) from its suspension
        self.assertEqual(d[0], "todo-2 (2/3) resumed: " + gated("a1"))
        toks = "".join(e.token.text for e in after if e.HasField("token"))
        self.assertIn("after the gate a1", toks)
        self.assertNotIn("checking a1", toks)
        self.assertIn("todo-2 done", d)
        self.assertIn("todo-3 (3/3): three", d)
        self.assertIn("autonomous loop ended: plan_complete after 3 cycle(s), 3/3 todo(s) done", d)
        arms = [e.WhichOneof("event") for e in after]
        self.assertEqual(arms.count("completion"), 1, arms)  # the plan's, at the end
        self.assertEqual(after[-1].completion.final_response, "echo: three")
        self.assertEqual(after[-1].completion.loop_iterations, 3)
        # the gated call ran once, approved; one gate; each todo done once
        res = self.results(sid, "a1")
        self.assertEqual(len(res), 1, res)
        self.assertFalse(res[0]["is_error"])
        types = [t for t, _ in self.audit(sid)]
        self.assertEqual((types.count("interrupt_required"), types.count("session_resumed")), (1, 1))
        self.assertEqual(self.done_todos(sid), ["todo-1", "todo-2", "todo-3"])
        cursor, cycles, state, reason, todos = self.plan_row(sid)
        self.assertEqual((cursor, cycles, state, reason), (3, 3, "ended", "plan_complete"))
        self.assertTrue(all(t["done"] for t in todos))
        ended = [d for t, d in self.audit(sid) if t == "loop_terminated"]
        self.assertEqual([(x["reason"], x["todos_done"]) for x in ended], [("plan_complete", 3)])
        # nothing pending is left: the next autonomous message is a new plan
        nxt = list(self.stream("fresh goal", sid))
        self.assertEqual(self.details(nxt)[0], "plan: 1 todo(s)")
        self.assertEqual(len(self.results(sid, "a1")), 1)

    # ---- the resumed step is the cycle's: its step_goal, the plan's goal, the autonomous mode ----
    def test_resumed_step_carries_the_cycle(self):
        todo = script([{"interrupt": {"tool_name": "deploy", "tool_call_id": "i1", "pending_tool_intent": {}}},
                       {"inspect": True}, {"complete": "inspected"}])
        goal = planned(["one", todo])
        sid, s, p = self.park(goal)
        self.decide(p.correlation_id, AP.DECISION_APPROVED)
        s.until("session_resumed")
        evs = s.rest()
        seen = [json.loads(e.token.text) for e in evs if e.HasField("token") and e.token.text.startswith("{")]
        self.assertEqual(len(seen), 1, seen)
        rq = seen[0]["request"]
        self.assertEqual((rq["step_goal"], rq["user_message"]), (todo, goal))
        self.assertEqual(rq["execution_mode"], "EXECUTION_MODE_AUTONOMOUS")
        self.assertNotIn("ask_user_resume", rq)  # approved: the call runs, nothing spliced
        self.assertEqual(len(self.results(sid, "i1")), 1)
        self.assertEqual(self.plan_row(sid)[:4], (2, 2, "ended", "plan_complete"))

    # ---- a delegation that waits for its approval inside a cycle: the child's answer reaches it ----
    def test_delegation_approved_in_a_cycle(self):
        sid = self.create(self.lead)
        child = script([{"tokens": "helping"}, {"complete": "helped"}])
        todo = script([{"interrupt": {"tool_name": "delegate_to_agent", "tool_call_id": "dg",
                                      "pending_tool_intent": {"agent": "auto-helper", "task": child}}},
                       {"complete": "got {{answer}}"}])
        s = Stream(self.stream(planned(["one", todo]), sid))
        p = s.until("session_paused").session_paused
        self.assertEqual(p.pause_source, L.PAUSE_SOURCE_DELEGATION_APPROVAL)
        self.decide(p.correlation_id, AP.DECISION_APPROVED)
        s.until("session_resumed")
        evs = s.rest()
        self.assertIsNone(s.error)
        result = json.loads(evs[-1].completion.final_response[len("got "):])
        self.assertEqual((result["status"], result["final_response"]), ("completed", "helped"))
        self.assertEqual(self.done_todos(sid), ["todo-1", "todo-2"])
        self.assertEqual(self.plan_row(sid)[:4], (2, 2, "ended", "plan_complete"))

    # ---- two gated todos: the stream waits on each park in turn; each call runs once ----
    def test_two_gates_in_one_plan_on_one_stream(self):
        sid, s, p = self.park(planned([gated("t1"), "two", gated("t3")]))
        self.decide(p.correlation_id, AP.DECISION_APPROVED)
        s.until("session_resumed")
        p2 = s.until("session_paused").session_paused
        self.assertNotEqual(p2.correlation_id, p.correlation_id)
        self.assertEqual(self.plan_row(sid)[:4], (2, 3, "running", "gate"))
        self.assertEqual(self.done_todos(sid), ["todo-1", "todo-2"])
        self.decide(p2.correlation_id, AP.DECISION_APPROVED)
        self.assertEqual(s.until("session_resumed").session_resumed.approval_id, p2.correlation_id)
        evs = s.rest()
        self.assertIsNone(s.error)
        self.assertEqual(evs[-1].completion.final_response, "deployed")
        self.assertEqual((len(self.results(sid, "t1")), len(self.results(sid, "t3"))), (1, 1))
        self.assertEqual(self.done_todos(sid), ["todo-1", "todo-2", "todo-3"])
        types = [t for t, _ in self.audit(sid)]
        self.assertEqual((types.count("interrupt_required"), types.count("session_resumed")), (2, 2))
        self.assertEqual(self.plan_row(sid)[:4], (3, 3, "ended", "plan_complete"))

    # ---- rejected: the denial is the call's error result inside the cycle; the plan goes on ----
    def test_rejected_call_gets_the_denial_in_the_cycle(self):
        sid, s, p = self.park(planned(["one", gated("r1", after="gate said {{answer}}"), "three"]))
        self.assert_parked_at_todo_2(sid, p)
        self.decide(p.correlation_id, AP.DECISION_REJECTED, comment="not today")
        s.until("session_resumed")
        evs = s.rest()
        self.assertIsNone(s.error)
        self.assertEqual(evs[-1].completion.final_response, "echo: three")
        res = self.results(sid, "r1")
        self.assertEqual(len(res), 1, res)
        self.assertTrue(res[0]["is_error"])
        # the cycle's answer carried the denial (the turn's history keeps the plan's last answer;
        # the resumed cycle's final text is in the worker's completion, seen through its tokens
        # and the todo it completed)
        self.assertIn("todo-2 done", self.details(evs))
        self.assertEqual(self.done_todos(sid), ["todo-1", "todo-2", "todo-3"])
        types = [t for t, _ in self.audit(sid)]
        self.assertEqual(types.count("interrupt_required"), 1)
        self.assertEqual(self.plan_row(sid)[:4], (3, 3, "ended", "plan_complete"))

    # ---- the denial as the last todo's answer: the plan's final response carries it ----
    def test_rejected_call_denial_reaches_the_answer(self):
        sid, s, p = self.park(planned(["one", gated("r2", after="gate said {{answer}}")]))
        self.decide(p.correlation_id, AP.DECISION_REJECTED, comment="no")
        s.until("session_resumed")
        final = s.rest()[-1].completion.final_response
        denial = json.loads(final[len("gate said "):])
        self.assertEqual(denial, {"denied": True, "approval_id": p.correlation_id, "status": "rejected",
                                  "decided_by": self.member, "comment": "no"})
        self.assertEqual(self.plan_row(sid)[:4], (2, 2, "ended", "plan_complete"))

    # ---- ask_user inside a cycle: answered once, the cycle goes on with the answer ----
    def test_ask_user_in_a_cycle(self):
        ask = script([{"ask_user": {"question_spec": {"question": "Which environment?", "allow_text": True}}},
                      {"complete": "deploying to {{answer}}"}])
        sid, s, p = self.park(planned(["one", ask]))
        self.assertIn("Which environment?", p.reason)
        out = self.requester("AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=p.correlation_id, text="staging"))
        self.assertTrue(out.recorded)
        s.until("session_resumed")
        evs = s.rest()
        self.assertIsNone(s.error)
        answer = json.loads(evs[-1].completion.final_response[len("deploying to "):])
        self.assertEqual(answer, {"choice": "", "text": "staging", "answered_by": self.user})
        asks = [d for t, d in self.audit(sid) if t == "tool_result" and d["tool_name"] == "ask_user"]
        self.assertEqual(len(asks), 1)
        types = [t for t, _ in self.audit(sid)]
        self.assertEqual(types.count("input_required"), 1)
        self.assertEqual(self.done_todos(sid), ["todo-1", "todo-2"])
        self.assertEqual(self.plan_row(sid)[:4], (2, 2, "ended", "plan_complete"))

    # ---- nobody listens: the cycle completes headless; the next message goes on at todo 3 ----
    def test_resume_with_nobody_listening_then_continue(self):
        sid, s, p = self.park(planned(["one", gated("h1"), "three"]))
        s.cancel()
        time.sleep(0.5)
        self.decide(p.correlation_id, AP.DECISION_APPROVED)
        end = time.time() + 20
        while time.time() < end and "todo-2" not in self.done_todos(sid):
            time.sleep(0.2)
        self.assertEqual(self.done_todos(sid), ["todo-1", "todo-2"])
        end = time.time() + 10
        while time.time() < end and self.plan_row(sid)[3] != "unattended":
            time.sleep(0.1)
        self.assertEqual(self.plan_row(sid)[:4], (2, 2, "running", "unattended"))
        self.assertTrue(any("gate.resumed" in l and sid in l for l in self.o.log))
        self.assertEqual(len(self.results(sid, "h1")), 1)
        evs = list(self.stream("go on", sid))
        d = self.details(evs)
        self.assertEqual(d[0], "continuing the plan")
        self.assertEqual(d[1], "todo-3 (3/3): three")
        self.assertEqual(evs[-1].completion.final_response, "echo: three")
        self.assertEqual(self.done_todos(sid), ["todo-1", "todo-2", "todo-3"])
        self.assertEqual(len(self.results(sid, "h1")), 1)  # never again
        self.assertEqual([t for t, _ in self.audit(sid)].count("interrupt_required"), 1)
        self.assertEqual(self.plan_row(sid)[:4], (3, 3, "ended", "plan_complete"))


if __name__ == "__main__":
    unittest.main()
