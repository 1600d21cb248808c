"""devworker over real gRPC (grpcio): the directive language, echo replies with usage and cost,
cancellation, TerminateSession, crash, auth, InitWorkerSession resume, and the worker's own
calls (Heartbeat, Checkpoint) observed by a tiny fake orchestrator RuntimeService served by
this test (python grpcio, generic handlers).

Starts build/bin/devworker processes on free loopback ports and stops them by pid. Needs no
Postgres, Redis or NATS. Expected usage and cost are recomputed here from docs/devworker.md.
"""
import base64
import concurrent.futures
import hashlib
import hmac
import json
import os
import secrets
import signal
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
import upsquad_testlib as T  # noqa: E402

import grpc  # noqa: E402
from upsquad.runtime.v1 import runtime_pb2 as R  # noqa: E402

SVC = "/upsquad.runtime.v1.RuntimeService/"
SECRET = secrets.token_hex(16)
PRICES = {"gpt-5.5": (5.0, 30.0), "claude-sonnet-4-6": (3.0, 15.0)}  # docs/devworker.md
TIMEOUT = 10


def claims_of(token):
    """The payload of an HS256 JWT after checking its signature with SECRET."""
    head, body, sig = token.split(".")
    want = hmac.new(SECRET.encode(), (head + "." + body).encode(), hashlib.sha256).digest()
    got = base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4))
    if not hmac.compare_digest(want, got):
        raise AssertionError("bad signature")
    return json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))


class FakeOrchestrator:
    """RuntimeService.Heartbeat and .Checkpoint, recording what the worker sent."""

    def __init__(self, port=0, checkpoint_code=None, taken=()):
        self.lock = threading.Lock()
        self.heartbeats = []  # (request, metadata dict, claims)
        self.checkpoints = []
        self.checkpoint_code = checkpoint_code
        self.taken = set(taken)  # iterations another worker holds: ALREADY_EXISTS
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
        handlers = {
            "Heartbeat": grpc.unary_unary_rpc_method_handler(
                self.heartbeat, request_deserializer=R.HeartbeatRequest.FromString,
                response_serializer=R.HeartbeatResponse.SerializeToString),
            "Checkpoint": grpc.unary_unary_rpc_method_handler(
                self.checkpoint, request_deserializer=R.CheckpointRequest.FromString,
                response_serializer=R.CheckpointResponse.SerializeToString),
        }
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("upsquad.runtime.v1.RuntimeService", handlers),))
        self.port = self.server.add_insecure_port("127.0.0.1:%d" % port)
        self.addr = "127.0.0.1:%d" % self.port
        self.server.start()

    def _auth(self, context):
        md = dict(context.invocation_metadata())
        auth = md.get("authorization", "")
        if not auth.startswith("Bearer "):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing bearer")
        try:
            claims = claims_of(auth[7:])
        except Exception as e:  # noqa: BLE001
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
        if claims.get("aud") != "upsquad" or claims.get("exp", 0) < time.time():
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong audience or expired")
        return md, claims

    def heartbeat(self, req, context):
        md, claims = self._auth(context)
        with self.lock:
            self.heartbeats.append((req, md, claims))
        return R.HeartbeatResponse(acknowledged=True)

    def checkpoint(self, req, context):
        md, claims = self._auth(context)
        with self.lock:
            self.checkpoints.append((req, md, claims))
        if self.checkpoint_code:
            context.abort(self.checkpoint_code, "refused by the test")
        if req.loop_iteration in self.taken:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, "another hash holds this iteration")
        return R.CheckpointResponse()

    def wait_for(self, what, pred, timeout=5.0):
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self.lock:
                hits = [x for x in getattr(self, what) if pred(x)]
            if hits:
                return hits
            time.sleep(0.02)
        return []

    def stop(self):
        self.server.stop(0)


def start_worker(orch_addr="", env=None):
    e = {"UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_ORCHESTRATOR_ADDR": orch_addr,
         "UPSQUAD_DEVWORKER_HEARTBEAT_INTERVAL": "200ms",
         "UPSQUAD_DEVWORKER_HEARTBEAT_BACKOFF_MAX": "300ms",
         "UPSQUAD_SHUTDOWN_GRACE": "1s"}
    e.update(env or {})
    return T.Server("devworker", env=e)


class Client:
    def __init__(self, addr, token=None):
        self.ch = grpc.insecure_channel(addr)
        # the orchestrator's calls carry its scope, which the worker requires by default
        self.token = token if token is not None else T.mint(
            SECRET, sub="orchestrator", org="platform", extra={"scope": "runtime.orchestrator"})
        self.step = self.ch.unary_stream(
            SVC + "ExecuteStep", request_serializer=R.ExecuteStepRequest.SerializeToString,
            response_deserializer=R.ExecuteStepEvent.FromString)
        self.unary = {}
        for name, req, resp in (
                ("InitWorkerSession", R.InitWorkerSessionRequest, R.InitWorkerSessionResponse),
                ("TerminateSession", R.TerminateSessionRequest, R.TerminateSessionResponse),
                ("Checkpoint", R.CheckpointRequest, R.CheckpointResponse),
                ("Heartbeat", R.HeartbeatRequest, R.HeartbeatResponse)):
            self.unary[name] = self.ch.unary_unary(SVC + name,
                                                   request_serializer=req.SerializeToString,
                                                   response_deserializer=resp.FromString)

    def md(self, token=None):
        return [("authorization", "Bearer " + (token or self.token))]

    def run(self, message, session="s-1", model="gpt-5.5", token=None, **kw):
        req = R.ExecuteStepRequest(session_id=session, tenant_id="org-1", user_message=message,
                                   snapshot=R.SessionSnapshot(model_id=model), **kw)
        return list(self.step(req, metadata=self.md(token), timeout=TIMEOUT))

    def call(self, name, req, token=None):
        return self.unary[name](req, metadata=self.md(token), timeout=TIMEOUT)

    def close(self):
        self.ch.close()


def script(*elements):
    return "#!script\n" + json.dumps(list(elements))


def arms(events):
    return [e.WhichOneof("event") for e in events]


class DevworkerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.orch = FakeOrchestrator()
        cls.w = start_worker(cls.orch.addr)
        cls.c = Client(cls.w.addr)

    @classmethod
    def tearDownClass(cls):
        cls.c.close()
        cls.w.stop()
        cls.orch.stop()

    # ---- echo ----
    def test_echo_reply_usage_and_cost(self):
        msg = "what  is the   weather"
        prior = [R.PriorTurn(role=R.PriorTurn.ROLE_USER, text="hi there"),
                 R.PriorTurn(role=R.PriorTurn.ROLE_ASSISTANT, text="echo: hi there")]
        ev = self.c.run(msg, session="echo-1", prior_turns=prior)
        self.assertEqual(arms(ev), ["token"] * 5 + ["completion"])
        toks = [e.token for e in ev[:-1]]
        self.assertEqual([t.index for t in toks], list(range(5)))
        self.assertEqual("".join(t.text for t in toks), "echo: " + msg)
        self.assertEqual(toks[0].text, "echo:")
        done = ev[-1].completion
        self.assertEqual(done.final_response, "echo: " + msg)
        u = done.token_usage
        in_words = 4 + 2 + 3  # the message and the prior turns, in words
        self.assertEqual((u.input_tokens, u.output_tokens, u.model), (in_words, 5, "gpt-5.5"))
        pin, pout = PRICES["gpt-5.5"]
        self.assertAlmostEqual(u.cost_usd, (in_words * pin + 5 * pout) / 1e6, places=12)
        self.assertEqual(done.loop_iterations, 1)

    def test_echo_unknown_model_costs_nothing(self):
        ev = self.c.run("hello", session="echo-2", model="no-such-model")
        u = ev[-1].completion.token_usage
        self.assertEqual((u.model, u.cost_usd, u.input_tokens, u.output_tokens),
                         ("no-such-model", 0.0, 1, 2))

    def test_step_goal_wins_over_user_message(self):
        ev = self.c.run("the goal", session="goal-1", step_goal="write the tests")
        self.assertEqual(ev[-1].completion.final_response, "echo: write the tests")
        ev = self.c.run("the goal", session="goal-1",
                        step_goal=script({"tokens": "todo ran"}, {"complete": "ok"}))
        self.assertEqual(arms(ev), ["token", "token", "completion"])

    def test_plan_step_decomposes_the_goal(self):
        plan = "decompose goal into todo plan"
        ev = self.c.run("Collect the failing tests\n\n  Bisect the culprit \nFix it",
                        session="plan-1", step_goal=plan,
                        execution_mode=R.EXECUTION_MODE_AUTONOMOUS)
        self.assertEqual(arms(ev), ["decomposition", "completion"])
        todos = ev[0].decomposition.todos
        self.assertEqual([(t.id, t.title, t.ordering) for t in todos],
                         [("todo-1", "Collect the failing tests", 0),
                          ("todo-2", "Bisect the culprit", 1), ("todo-3", "Fix it", 2)])
        self.assertEqual(ev[-1].completion.final_response, "planned 3 todo(s)")
        # a scripted goal plans itself (its decomposition titles may be scripts in turn)
        todo = script({"tokens": "did it"}, {"complete": "done"})
        ev = self.c.run(script({"decomposition": [todo]}, {"complete": "planned"}),
                        session="plan-1", step_goal=plan)
        self.assertEqual(arms(ev), ["decomposition", "completion"])
        ev = self.c.run("the goal", session="plan-1",
                        step_goal=ev[0].decomposition.todos[0].title)
        self.assertEqual(ev[-1].completion.final_response, "done")

    # ---- directives ----
    def test_every_directive(self):
        t0 = time.time()
        ev = self.c.run(script(
            {"status": "THINKING"},
            {"status": {"status": "AGENT_STATUS_ACTING", "detail": "calling", "pending_pause": True}},
            {"token": "Hi"},
            {"tokens": " there you", "delay_ms": 20},
            {"tool_call": {"tool_name": "search", "arguments": {"q": "x", "n": [1, 2]}}},
            {"tool_result": {"result": {"hits": 2}, "duration_ms": 7}},
            {"tool_call": {"tool_name": "fetch", "tool_call_id": "c-9"}},
            {"tool_result": {"result": "boom", "is_error": True}},
            {"structured_answer": {"summary": "S", "columns": ["a", "b"],
                                   "rows": [["1", "2"], {"cells": ["3", "4"]}],
                                   "note": "N", "followups": ["more"]}},
            {"write_confirm": {"approval_id": "ap-1", "summary": "merge", "deep_link": "/a/1",
                               "required_clearance": 3, "action_type": "trigger_workflow"}},
            {"metrics": {"input_tokens": 10, "output_tokens": 3, "cost_usd": 0.5,
                         "ttft_ms": 12, "total_ms": 40}},
            {"security": {"violation_code": "input_injection_detected", "detail": "secret!",
                          "severity": "block", "pattern_id": "p1"}},
            {"step_progress": {"made_tool_calls": True, "tool_calls_errored": 1,
                               "response_delta_hash": "abc"}},
            {"decomposition": ["first", {"title": "second", "acceptance": "done"}]},
            {"error": {"code": "LLM_RATE_LIMIT", "message": "slow down", "retryable": True}},
            {"sleep_ms": 100},
            {"checkpoint": True},
            {"complete": "all done"},
        ), session="dir-1")
        elapsed = time.time() - t0
        self.assertEqual(arms(ev), [
            "status", "status", "token", "token", "token", "tool_call", "tool_result",
            "tool_call", "tool_result", "structured_answer", "write_confirm", "metrics",
            "security", "step_progress", "decomposition", "error", "checkpoint", "completion"])
        self.assertGreaterEqual(elapsed, 0.14)  # two token delays + sleep_ms
        self.assertEqual(ev[0].status.status, R.AGENT_STATUS_THINKING)
        self.assertGreater(ev[0].status.timestamp.seconds, 0)
        self.assertEqual((ev[1].status.status, ev[1].status.detail, ev[1].status.pending_pause),
                         (R.AGENT_STATUS_ACTING, "calling", True))
        self.assertEqual([(e.token.text, e.token.index) for e in ev[2:5]],
                         [("Hi", 0), (" there", 1), (" you", 2)])
        tc = ev[5].tool_call
        self.assertEqual((tc.tool_name, tc.tool_call_id), ("search", "call-4"))
        self.assertEqual(tc.arguments["q"], "x")
        self.assertEqual(list(tc.arguments["n"]), [1, 2])
        tr = ev[6].tool_result
        self.assertEqual((tr.tool_call_id, tr.tool_name, json.loads(tr.result), tr.duration_ms),
                         ("call-4", "search", {"hits": 2}, 7))
        tr2 = ev[8].tool_result
        self.assertEqual((tr2.tool_call_id, tr2.tool_name, tr2.result, tr2.is_error),
                         ("c-9", "fetch", "boom", True))
        sa = ev[9].structured_answer
        self.assertEqual((sa.summary, list(sa.columns), [list(r.cells) for r in sa.rows],
                          sa.note, list(sa.followups)),
                         ("S", ["a", "b"], [["1", "2"], ["3", "4"]], "N", ["more"]))
        wc = ev[10].write_confirm
        self.assertEqual((wc.approval_id, wc.required_clearance, wc.action_type),
                         ("ap-1", 3, "trigger_workflow"))
        m = ev[11].metrics
        self.assertEqual((m.model, m.input_tokens, m.cost_usd, m.ttft_ms),
                         ("gpt-5.5", 10, 0.5, 12))  # model defaults to the snapshot's
        self.assertEqual(ev[12].security.detail, "secret!")
        sp = ev[13].step_progress
        self.assertEqual((sp.made_tool_calls, sp.tool_calls_errored, sp.response_delta_hash),
                         (True, 1, b"abc"))
        todos = ev[14].decomposition.todos
        self.assertEqual([(t.title, t.ordering, t.acceptance) for t in todos],
                         [("first", 0, ""), ("second", 1, "done")])
        er = ev[15].error
        self.assertEqual((er.code, er.message, er.retryable), ("LLM_RATE_LIMIT", "slow down", True))
        ck = ev[16].checkpoint
        self.assertEqual(ck.state[:4], b"\x00\x00\x00\x01")
        self.assertEqual(ck.hash, hashlib.sha256(ck.state).hexdigest())
        body = json.loads(ck.state[4:])
        self.assertEqual(body["session_id"], "dir-1")
        done = ev[17].completion
        self.assertEqual(done.final_response, "all done")
        self.assertEqual(done.token_usage.output_tokens, 3)  # TokenEvents streamed
        self.assertEqual(done.loop_iterations, 3)  # two tool results, one checkpoint
        self.assertGreaterEqual(done.duration_ms, 140)

    def test_complete_with_explicit_usage(self):
        ev = self.c.run(script({"complete": {
            "final_response": "x", "loop_iterations": 4, "duration_ms": 9,
            "token_usage": {"input_tokens": 100, "output_tokens": 50, "model": "m",
                            "cost_usd": 1.25}}}), session="cmp-1")
        c = ev[0].completion
        self.assertEqual((c.final_response, c.loop_iterations, c.duration_ms), ("x", 4, 9))
        self.assertEqual((c.token_usage.input_tokens, c.token_usage.cost_usd), (100, 1.25))

    def test_interrupt_suspends_the_step(self):
        ev = self.c.run(script(
            {"tokens": "let me merge"},
            {"interrupt": {"tool_name": "merge_pr", "pending_tool_intent": {"pr": 7}}},
            {"complete": "never reached"}), session="int-1")
        self.assertEqual(arms(ev), ["token", "token", "token", "interrupt_required"])
        ir = ev[-1].interrupt_required
        self.assertEqual((ir.tool_name, ir.tool_call_id), ("merge_pr", "call-1"))
        self.assertEqual(json.loads(ir.pending_tool_intent), {"pr": 7})
        self.assertEqual(len(ir.idempotency_key), 64)

    def test_interrupt_resumes_after_init_with_its_checkpoint(self):
        sc = script({"tokens": "merging"},
                    {"interrupt": {"tool_name": "github.merge", "pending_tool_intent": {"pr": 1}}},
                    {"tokens": "merged"}, {"complete": "done"})
        ev = self.c.run(sc, session="sus-1")
        self.assertEqual(arms(ev)[-1], "interrupt_required")
        state = self.c.call("Checkpoint", R.CheckpointRequest(session_id="sus-1")).state
        body = json.loads(state[4:])
        self.assertEqual((body["suspended_at"], body["tool_call_id"], body["tool_name"]),
                         (2, "call-1", "github.merge"))
        # the orchestrator received the same state
        hits = self.orch.wait_for("checkpoints", lambda x: x[0].bytes == state)
        self.assertTrue(hits)
        # approval: any worker is initialised from it, and the same message resumes
        w2 = start_worker()
        c2 = Client(w2.addr)
        try:
            r = c2.call("InitWorkerSession", R.InitWorkerSessionRequest(
                snapshot=R.SessionSnapshot(session_id="sus-1", model_id="gpt-5.5"),
                resume_checkpoint=state, resume_loop_iteration=body["loop_iteration"]))
            self.assertTrue(r.success)
            ev = c2.run(sc, session="sus-1")
            self.assertEqual(arms(ev), ["tool_result", "token", "completion"])
            self.assertEqual((ev[0].tool_result.tool_call_id, ev[0].tool_result.tool_name,
                              json.loads(ev[0].tool_result.result)),
                             ("call-1", "github.merge", {"approved": True}))
            self.assertEqual(ev[-1].completion.final_response, "done")
            # one resume per restore: the next run of the message is a fresh turn
            self.assertEqual(arms(c2.run(sc, session="sus-1"))[-1], "interrupt_required")
            # another message after a restore does not resume either
            c2.call("InitWorkerSession", R.InitWorkerSessionRequest(
                snapshot=R.SessionSnapshot(session_id="sus-1"), resume_checkpoint=state))
            self.assertEqual(arms(c2.run("hello", session="sus-1")), ["token", "token", "completion"])
            self.assertEqual(arms(c2.run(sc, session="sus-1"))[-1], "interrupt_required")
            # a rejection: the same restore, and the denial spliced as the gated call's result
            # (an ask_user_resume naming that call); the script goes on after the interrupt
            c2.call("InitWorkerSession", R.InitWorkerSessionRequest(
                snapshot=R.SessionSnapshot(session_id="sus-1"), resume_checkpoint=state))
            denial = {"denied": True, "approval_id": "a-1", "reason": "not today"}
            ev = c2.run(sc, session="sus-1", ask_user_resume=R.AskUserResume(
                checkpoint=state,
                answer_tool_result=json.dumps({"tool_call_id": "call-1", "result": denial}).encode()))
            self.assertEqual(arms(ev), ["tool_result", "token", "completion"])
            self.assertTrue(ev[0].tool_result.is_error)
            self.assertEqual(json.loads(ev[0].tool_result.result), denial)
            # a resume naming another call is no denial of this one: the call runs
            c2.call("InitWorkerSession", R.InitWorkerSessionRequest(
                snapshot=R.SessionSnapshot(session_id="sus-1"), resume_checkpoint=state))
            ev = c2.run(sc, session="sus-1", ask_user_resume=R.AskUserResume(
                checkpoint=state,
                answer_tool_result=json.dumps({"tool_call_id": "call-9", "result": denial}).encode()))
            self.assertFalse(ev[0].tool_result.is_error)
            self.assertEqual(json.loads(ev[0].tool_result.result), {"approved": True})
        finally:
            c2.close()
            w2.stop()

    def test_ask_user_and_resume(self):
        sc = script({"token": "Which?"},
                    {"ask_user": {"question_spec": {"question": "Which env?",
                                                    "options": ["dev", "prod"]}}},
                    {"tokens": "deploying now"},
                    {"complete": "deployed"})
        ev = self.c.run(sc, session="ask-1")
        self.assertEqual(arms(ev), ["token", "input_required"])
        ir = ev[-1].input_required
        self.assertEqual((ir.tool_name, ir.tool_call_id), ("ask_user", "call-1"))
        self.assertEqual(json.loads(ir.question_spec)["options"], ["dev", "prod"])
        frozen = json.loads(ir.checkpoint)
        self.assertEqual(frozen["tool_call_id"], "call-1")
        self.assertEqual(ir.idempotency_key, hashlib.sha256(
            ("ask-1:%d:call-1" % frozen["loop_iteration"]).encode()).hexdigest())
        answer = json.dumps({"tool_call_id": "call-1",
                             "result": {"choice": "prod", "text": "", "answered_by": "u1"}})
        ev2 = self.c.run(sc, session="ask-1", ask_user_resume=R.AskUserResume(
            checkpoint=ir.checkpoint, answer_tool_result=answer.encode()))
        self.assertEqual(arms(ev2), ["tool_result", "token", "token", "completion"])
        tr = ev2[0].tool_result
        self.assertEqual((tr.tool_call_id, tr.tool_name, json.loads(tr.result)["choice"]),
                         ("call-1", "ask_user", "prod"))
        self.assertEqual(ev2[-1].completion.final_response, "deployed")
        ev3 = self.c.run(sc, session="ask-1", ask_user_resume=R.AskUserResume(
            checkpoint=b"not a frozen turn", answer_tool_result=answer.encode()))
        self.assertEqual(arms(ev3), ["error"])
        self.assertEqual(ev3[0].error.code, "RESUME_INVALID")

    def test_inspect_shows_the_request_without_secrets(self):
        key = "sk-ant-" + secrets.token_hex(12)
        gw = T.mint(SECRET, sub="agent-1", org="org-1", aud="agent-gateway",
                    extra={"agent_id": "agent-1", "session_id": "insp-1"})
        req = R.ExecuteStepRequest(
            session_id="insp-1", tenant_id="org-1", agent_id="agent-1",
            user_message=script({"inspect": True}),
            execution_mode=R.EXECUTION_MODE_SINGLE_TURN,
            provider_keys={"anthropic": key}, agent_gateway_token=gw,
            prior_turns=[R.PriorTurn(role=R.PriorTurn.ROLE_USER, text="hi"),
                         R.PriorTurn(role=R.PriorTurn.ROLE_ASSISTANT, text="echo: hi")],
            snapshot=R.SessionSnapshot(
                model_id="gpt-5.5", temperature=0.5, tools=["mcp:s1"], snapshot_hash="h" * 64,
                rbac_grants={"wf/*": "read"}, org_version_seq=7,
                mcp_servers={"s1": R.McpServerRef(prefix="gh", unit_id="u1")}))
        ev = list(self.c.step(req, metadata=self.c.md(), timeout=TIMEOUT))
        self.assertEqual(arms(ev), ["token"])
        text = ev[0].token.text
        self.assertNotIn(key, text)
        self.assertNotIn(gw.split(".")[2], text)  # no signature
        got = json.loads(text)
        self.assertEqual(got["worker"]["id"], self.w.addr)
        r = got["request"]
        self.assertEqual(r["provider_keys"],
                         {"anthropic": "sha256:" + hashlib.sha256(key.encode()).hexdigest()})
        self.assertEqual((r["agent_gateway_token"]["aud"], r["agent_gateway_token"]["agent_id"]),
                         ("agent-gateway", "agent-1"))
        self.assertNotIn("context_engine_token", r)  # empty fields are left out
        self.assertEqual(r["prior_turns"], [{"role": "ROLE_USER", "text": "hi"},
                                            {"role": "ROLE_ASSISTANT", "text": "echo: hi"}])
        self.assertEqual(r["execution_mode"], "EXECUTION_MODE_SINGLE_TURN")
        sn = r["snapshot"]
        self.assertEqual((sn["model_id"], sn["temperature"], sn["tools"], sn["org_version_seq"]),
                         ("gpt-5.5", 0.5, ["mcp:s1"], 7))
        self.assertEqual(sn["rbac_grants"], {"wf/*": "read"})
        self.assertEqual(sn["mcp_servers"], {"s1": {"prefix": "gh", "unit_id": "u1"}})

    def test_concurrent_steps_of_one_session_never_share_an_iteration(self):
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda i: self.c.run("turn %d" % i, session="conc-1"), range(8)))
        deadline = time.time() + 5
        hits = []
        while len(hits) < 8 and time.time() < deadline:
            hits = self.orch.wait_for("checkpoints", lambda x: x[0].session_id == "conc-1")
            time.sleep(0.02)
        self.assertEqual(sorted(h[0].loop_iteration for h in hits), list(range(8)))

    def test_fail_ends_the_step_with_a_grpc_status(self):
        got = []
        with self.assertRaises(grpc.RpcError) as cm:
            for e in self.c.step(R.ExecuteStepRequest(session_id="fail-1", user_message=script(
                    {"token": "partial"},
                    {"fail": {"code": "UNAVAILABLE", "message": "model backend down"}},
                    {"complete": "never"})), metadata=self.c.md(), timeout=TIMEOUT):
                got.append(e)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(cm.exception.details(), "model backend down")
        self.assertEqual(arms(got), ["token"])
        with self.assertRaises(grpc.RpcError) as cm:
            self.c.run(script({"fail": {"code": 13}}), session="fail-1")
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INTERNAL)

    def test_worker_conditions(self):
        me, other = self.w.addr, "10.9.9.9:1"
        ev = self.c.run(script({"token": "mine", "if_worker": me},
                               {"token": "theirs", "if_worker": other},
                               {"token": "not-mine", "unless_worker": me},
                               {"fail": {"code": "UNAVAILABLE"}, "unless_worker": me},
                               {"crash": True, "if_worker": other},
                               {"complete": "done"}), session="cond-1")
        self.assertEqual([e.token.text for e in ev if e.HasField("token")], ["mine"])
        self.assertEqual(ev[-1].completion.final_response, "done")

    # ---- malformed scripts ----
    def test_malformed_scripts(self):
        cases = [
            ("#!script\n[1, 2", "not valid JSON", ""),
            ("#!script\n{\"token\": \"x\"}", "expected a JSON array", ""),
            ("#!script\n", "not valid JSON", ""),
            (script({"token": "ok"}, "text"), "script element 1: expected an object", "/1"),
            (script({"nope": 1}), "script element 0: unknown directive \"nope\"", "/0"),
            (script({}), "script element 0: no directive", "/0"),
            (script({"token": "a", "status": "THINKING"}), "more than one directive", "/0"),
            (script({"token": 5}), "script element 0: token: expected a string", "/0/token"),
            (script({"status": "SLEEPING"}), "unknown upsquad.runtime.v1.AgentStatus", ""),
            (script({"token": "a"}, {"tool_call": {"tool_nam": "x"}}),
             "script element 1: tool_call.tool_nam: unknown field", "/1/tool_call/tool_nam"),
            (script({"tool_call": {"tool_name": "x", "arguments": [1]}}),
             "tool_call.arguments: expected an object", "/0/tool_call/arguments"),
            (script({"write_confirm": {"required_clearance": 1.5}}),
             "write_confirm.required_clearance: expected an integer", ""),
            (script({"metrics": {"input_tokens": 1e12}}), "out of range", ""),
            (script({"structured_answer": {"rows": [["a", 1]]}}),
             "structured_answer.rows.0.1: expected a string",
             "/0/structured_answer/rows/0/1"),
            (script({"structured_answer": {"rows": [{"cells": ["a", 1]}]}}),
             "structured_answer.rows.0.cells.1: expected a string",
             "/0/structured_answer/rows/0/cells/1"),
            (script({"sleep_ms": -1}), "sleep_ms: -1 is out of range", "/0/sleep_ms"),
            (script({"hang": False}), "hang: expected true", "/0/hang"),
            (script({"crash": "yes"}), "crash: expected true", "/0/crash"),
            (script({"tokens": "a", "delay_ms": "5"}), "delay_ms: expected an integer", ""),
            (script({"status": "THINKING", "delay_ms": 5}), "delay_ms: only allowed", ""),
            (script({"decomposition": {"title": "x"}}), "decomposition: expected an array", ""),
            (script({"checkpoint": {"stat": "x"}}), "checkpoint.stat: unknown field", ""),
            (script({"step_progress": {"tool_calls_errored": -1}}), "out of range", ""),
            (script({"fail": {"code": "OK"}}), "fail.code: unknown gRPC status", "/0/fail/code"),
            (script({"fail": {"message": "x"}}), "fail.code: required", "/0/fail/code"),
            (script({"token": "a", "if_worker": 5}), "if_worker: expected a worker id", ""),
        ]
        for msg, want, pointer in cases:
            with self.subTest(msg=msg):
                ev = self.c.run(msg, session="bad-1")
                self.assertEqual(arms(ev), ["error"], ev)  # nothing of a bad script runs
                e = ev[0].error
                self.assertEqual((e.code, e.retryable), ("SCRIPT_INVALID", False))
                self.assertIn(want, e.message)
                if pointer:
                    self.assertEqual(e.detail, pointer)

    def test_script_marker_must_be_the_whole_first_line(self):
        ev = self.c.run("#!scripted\n[]", session="mk-1")
        self.assertEqual(ev[-1].completion.final_response, "echo: #!scripted\n[]")
        ev = self.c.run("#!script  \r\n[{\"token\": \"x\"}]", session="mk-1")
        self.assertEqual(arms(ev), ["token"])

    # ---- request validation and auth ----
    def test_invalid_requests(self):
        with self.assertRaises(grpc.RpcError) as cm:
            self.c.run("hi", session="")
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("session_id", cm.exception.details())
        with self.assertRaises(grpc.RpcError) as cm:
            self.c.run("", session="v-1")
        self.assertIn("user_message", cm.exception.details())
        with self.assertRaises(grpc.RpcError) as cm:
            self.c.call("InitWorkerSession", R.InitWorkerSessionRequest())
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("snapshot", cm.exception.details())
        with self.assertRaises(grpc.RpcError) as cm:
            self.c.call("Heartbeat", R.HeartbeatRequest(worker_id="x"))
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNIMPLEMENTED)

    def test_auth(self):
        for tok in (T.mint("another-secret-0123456789abcdef"), T.mint(SECRET, aud="other"),
                    T.mint(SECRET, ttl=-120)):
            with self.assertRaises(grpc.RpcError) as cm:
                self.c.run("hi", token=tok)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
        with self.assertRaises(grpc.RpcError) as cm:
            list(self.c.step(R.ExecuteStepRequest(session_id="a", user_message="x"),
                             timeout=TIMEOUT))
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAUTHENTICATED)

    def test_required_scope(self):
        # by default (self.w has no UPSQUAD_DEVWORKER_REQUIRE_SCOPE): a member's token, of any
        # tenant, or a worker's own, cannot drive the worker; only the orchestrator's scope can
        for extra in (None, {"scope": "runtime.worker"}, {"scope": "runtime.orchestratorx"}):
            for org in ("org-1", "org-2"):
                with self.assertRaises(grpc.RpcError) as cm:
                    self.c.run("hi", token=T.mint(SECRET, org=org, clearance=5, extra=extra))
                self.assertEqual(cm.exception.code(), grpc.StatusCode.PERMISSION_DENIED)
                self.assertIn("runtime.orchestrator", cm.exception.details())
        for scope in ("runtime.orchestrator", "a runtime.orchestrator", ["runtime.orchestrator"]):
            ev = self.c.run("hi", token=T.mint(SECRET, extra={"scope": scope}))
            self.assertEqual(ev[-1].completion.final_response, "echo: hi")
        # `any` opts out (a developer's upsquad-token)
        w = start_worker(env={"UPSQUAD_DEVWORKER_REQUIRE_SCOPE": "any"})
        c = Client(w.addr)
        try:
            ev = c.run("hi", token=T.mint(SECRET))
            self.assertEqual(ev[-1].completion.final_response, "echo: hi")
        finally:
            c.close()
            w.stop()

    # ---- cancellation, termination, crash ----
    def test_cancel_reaches_the_worker_promptly(self):
        before = self.w.metric("devworker_steps_cancelled_total")
        it = self.c.step(R.ExecuteStepRequest(session_id="hang-1", user_message=script(
            {"token": "waiting"}, {"hang": True}, {"complete": "never"})),
            metadata=self.c.md(), timeout=TIMEOUT)
        first = next(it)
        self.assertEqual(first.token.text, "waiting")
        self.assertEqual(self.w.metric("devworker_steps_in_flight"), 1.0)
        t0 = time.time()
        it.cancel()
        while self.w.metric("devworker_steps_in_flight") != 0.0 and time.time() - t0 < 3:
            time.sleep(0.01)
        self.assertLess(time.time() - t0, 1.0)  # typically a few ms; bounded for loaded CI
        self.assertEqual(self.w.metric("devworker_steps_cancelled_total"), before + 1)
        self.assertEqual(self.c.run("still here")[-1].completion.final_response,
                         "echo: still here")

    def test_many_waiting_steps_run_at_once(self):
        its = [self.c.step(R.ExecuteStepRequest(session_id="many-%d" % i, user_message=script(
            {"token": "x"}, {"hang": True})), metadata=self.c.md(), timeout=TIMEOUT)
            for i in range(40)]
        try:
            for it in its:  # each has started: none queued behind the hanging ones
                self.assertEqual(next(it).token.text, "x")
            self.assertEqual(self.w.metric("devworker_steps_in_flight"), 40.0)
        finally:
            for it in its:
                it.cancel()
        deadline = time.time() + 3
        while self.w.metric("devworker_steps_in_flight") != 0.0 and time.time() < deadline:
            time.sleep(0.01)
        self.assertEqual(self.w.metric("devworker_steps_in_flight"), 0.0)

    def test_sleep_is_cancelled_by_the_deadline(self):
        t0 = time.time()
        with self.assertRaises(grpc.RpcError) as cm:
            list(self.c.step(R.ExecuteStepRequest(session_id="dl-1", user_message=script(
                {"sleep_ms": 60000})), metadata=self.c.md(), timeout=0.3))
        self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertLess(time.time() - t0, 2)

    def test_terminate_session_ends_a_running_step(self):
        out = []
        th = threading.Thread(target=lambda: out.extend(self.c.run(
            script({"token": "a"}, {"hang": True}), session="term-1")))
        th.start()
        deadline = time.time() + 3
        while self.w.metric("devworker_steps_in_flight") < 1 and time.time() < deadline:
            time.sleep(0.01)
        r = self.c.call("TerminateSession", R.TerminateSessionRequest(session_id="term-1",
                                                                      reason="test"))
        self.assertTrue(r.success)
        th.join(3)
        self.assertFalse(th.is_alive())
        self.assertEqual(arms(out), ["token", "error"])
        self.assertEqual(out[-1].error.code, "SESSION_TERMINATED")
        # idempotent, and for a session it never saw
        self.assertTrue(self.c.call("TerminateSession",
                                    R.TerminateSessionRequest(session_id="term-1")).success)
        self.assertTrue(self.c.call("TerminateSession",
                                    R.TerminateSessionRequest(session_id="never-seen")).success)

    def test_crash_exits_the_process_mid_stream(self):
        w = start_worker()
        c = Client(w.addr)
        got = []
        try:
            with self.assertRaises(grpc.RpcError) as cm:
                for e in c.step(R.ExecuteStepRequest(session_id="cr-1", user_message=script(
                        {"tokens": "one two three"}, {"crash": True}, {"complete": "no"})),
                        metadata=c.md(), timeout=TIMEOUT):
                    got.append(e)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAVAILABLE)
            self.assertEqual([e.token.text for e in got], ["one", " two", " three"])
            self.assertEqual(w.wait(5), 3)
        finally:
            c.close()
            w.stop()

    def test_crash_can_be_disabled(self):
        w = start_worker(env={"UPSQUAD_DEVWORKER_ALLOW_CRASH": "false"})
        c = Client(w.addr)
        try:
            ev = c.run(script({"token": "a"}, {"crash": True}, {"complete": "no"}))
            self.assertEqual(arms(ev), ["token", "error"])
            self.assertEqual(ev[-1].error.code, "CRASH_DISABLED")
            self.assertIsNone(w.proc.poll())
        finally:
            c.close()
            w.stop()

    # ---- sessions and resume ----
    def test_init_resume_and_checkpoint_poll(self):
        c = self.c
        snap = R.SessionSnapshot(session_id="res-1", tenant_id="org-9", model_id="claude-sonnet-4-6")
        body = json.dumps({"session_id": "res-1", "loop_iteration": 41}).encode()
        r = c.call("InitWorkerSession", R.InitWorkerSessionRequest(
            snapshot=snap, resume_checkpoint=b"\x00\x00\x00\x01" + body, resume_loop_iteration=41))
        self.assertTrue(r.success, r.error_message)
        polled = c.call("Checkpoint", R.CheckpointRequest(session_id="res-1"))
        self.assertEqual(polled.state, b"\x00\x00\x00\x01" + body)
        self.assertEqual(polled.hash, hashlib.sha256(polled.state).hexdigest())
        # the next step continues the loop counter and prices with the session's model
        req = R.ExecuteStepRequest(session_id="res-1", tenant_id="org-9", user_message="go on")
        ev = list(c.step(req, metadata=c.md(), timeout=TIMEOUT))
        self.assertEqual(ev[-1].completion.token_usage.model, "claude-sonnet-4-6")
        hits = self.orch.wait_for("checkpoints", lambda x: x[0].session_id == "res-1")
        self.assertEqual([h[0].loop_iteration for h in hits], [42])
        self.assertEqual(hits[0][2]["org_id"], "org-9")
        polled = c.call("Checkpoint", R.CheckpointRequest(session_id="res-1"))
        self.assertEqual(polled.state, hits[0][0].bytes)
        # version mismatch and a short blob: success=false, the session is not started
        for blob, want in ((b"\x00\x00\x00\x02{}", "version 2"), (b"\x00\x01", "shorter")):
            r = c.call("InitWorkerSession", R.InitWorkerSessionRequest(
                snapshot=R.SessionSnapshot(session_id="res-2"), resume_checkpoint=blob))
            self.assertFalse(r.success)
            self.assertIn(want, r.error_message)
        with self.assertRaises(grpc.RpcError) as cm:
            c.call("Checkpoint", R.CheckpointRequest(session_id="res-2"))
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)

    # ---- the worker's own calls ----
    def test_heartbeats(self):
        hits = self.orch.wait_for("heartbeats", lambda x: x[0].session_id == "")
        self.assertTrue(hits)
        req, md, claims = hits[-1]
        self.assertEqual(req.worker_id, self.w.addr)
        self.assertEqual(md.get("x-upsquad-worker-addr"), self.w.addr)
        self.assertEqual((claims["scope"], claims["aud"], claims["sub"]),
                         ("runtime.worker", "upsquad", self.w.addr))
        # a step in flight: its session is named, and the load counts it
        it = self.c.step(R.ExecuteStepRequest(session_id="hb-1", user_message=script(
            {"token": "x"}, {"hang": True})), metadata=self.c.md(), timeout=TIMEOUT)
        next(it)
        try:
            hits = self.orch.wait_for("heartbeats", lambda x: x[0].session_id == "hb-1")
            self.assertTrue(hits)
            self.assertGreaterEqual(hits[0][0].active_sessions, 1)
        finally:
            it.cancel()

    def test_checkpoint_each_iteration(self):
        self.c.run(script({"tool_call": {"tool_name": "t"}}, {"tool_result": {"result": "r"}},
                          {"tokens": "ok"}, {"complete": "fin"}), session="ck-1")
        self.c.run("again", session="ck-1")
        hits = self.orch.wait_for("checkpoints", lambda x: x[0].session_id == "ck-1")
        deadline = time.time() + 3
        while len(hits) < 3 and time.time() < deadline:
            time.sleep(0.02)
            hits = self.orch.wait_for("checkpoints", lambda x: x[0].session_id == "ck-1")
        self.assertEqual([h[0].loop_iteration for h in hits], [0, 1, 2])
        for req, md, claims in hits:
            self.assertEqual(req.bytes[:4], b"\x00\x00\x00\x01")
            self.assertEqual(req.bytes_sha256, hashlib.sha256(req.bytes).hexdigest())
            self.assertEqual(json.loads(req.bytes[4:])["loop_iteration"], req.loop_iteration)
            self.assertEqual((claims["org_id"], claims["scope"]), ("org-1", "runtime.worker"))


class UnreachableOrchestratorTest(unittest.TestCase):
    def test_serves_and_retries_until_the_orchestrator_appears(self):
        port = T.free_port()
        w = start_worker("127.0.0.1:%d" % port, env={"UPSQUAD_LOG_LEVEL": "info"})
        c = Client(w.addr)
        orch = None
        try:
            # nothing listens: the worker serves regardless, and keeps the checkpoint
            ev = c.run("while down", session="down-1")
            self.assertEqual(ev[-1].completion.final_response, "echo: while down")
            time.sleep(1.0)
            # backing off (200, 300, 300 ms …), not hammering: a handful of tries in a second
            failed = w.metric("devworker_heartbeats_total", 'result="failed"')
            self.assertTrue(2 <= failed <= 8, failed)
            orch = FakeOrchestrator(port)
            self.assertTrue(orch.wait_for("heartbeats", lambda x: True, timeout=5))
            hits = orch.wait_for("checkpoints", lambda x: x[0].session_id == "down-1")
            self.assertEqual([h[0].loop_iteration for h in hits], [0])
            c.close()
            w.signal(signal.SIGTERM)
            self.assertEqual(w.wait(10), 0)
            log = w.log_text(wait=10)
        finally:
            c.close()
            w.stop()
            if orch:
                orch.stop()
        # once per change of state, however many retries failed
        self.assertEqual(log.count("orchestrator.unreachable"), 1, log[-2000:])
        self.assertEqual(log.count("orchestrator.reachable"), 1, log[-2000:])

    def test_a_cancelled_step_is_logged(self):
        w = start_worker(env={"UPSQUAD_LOG_LEVEL": "info"})
        c = Client(w.addr)
        try:
            it = c.step(R.ExecuteStepRequest(session_id="log-1", user_message=script(
                {"token": "x"}, {"hang": True})), metadata=c.md(), timeout=TIMEOUT)
            next(it)
            it.cancel()
            deadline = time.time() + 3
            while w.metric("devworker_steps_cancelled_total") < 1 and time.time() < deadline:
                time.sleep(0.01)
        finally:
            c.close()
            w.signal(signal.SIGTERM)
            w.wait(10)
            log = w.log_text(wait=10)
            w.stop()
        lines = [json.loads(l) for l in log.splitlines() if l.startswith("{")]
        hits = [l for l in lines if l["event"] == "step.cancelled"]
        self.assertEqual(len(hits), 1, log[-2000:])
        self.assertIn("log-1", hits[0]["msg"])
        self.assertEqual(hits[0]["level"], "info")

    def test_refused_heartbeats_are_logged_once(self):
        orch = FakeOrchestrator()
        w = start_worker(orch.addr, env={"UPSQUAD_JWT_AUDIENCE": "someone-else",
                                         "UPSQUAD_LOG_LEVEL": "info"})
        try:
            time.sleep(1.2)  # six intervals, every heartbeat refused (wrong audience)
            self.assertGreaterEqual(w.metric("devworker_heartbeats_total", 'result="failed"'), 2)
            self.assertEqual(w.metric("devworker_heartbeats_total", 'result="ok"'), 0)
        finally:
            w.signal(signal.SIGTERM)
            w.wait(10)
            log = w.log_text(wait=10)
            w.stop()
            orch.stop()
        self.assertEqual(log.count("heartbeat.refused"), 1, log[-2000:])
        self.assertNotIn("orchestrator.unreachable", log)

    def test_refused_checkpoint_is_dropped_not_retried(self):
        orch = FakeOrchestrator(checkpoint_code=grpc.StatusCode.INVALID_ARGUMENT)
        w = start_worker(orch.addr)
        c = Client(w.addr)
        try:
            c.run("one", session="ref-1")
            self.assertTrue(orch.wait_for("checkpoints", lambda x: True))
            time.sleep(0.5)
            self.assertEqual(len(orch.checkpoints), 1)
            self.assertEqual(w.metric("devworker_checkpoints_total", 'result="refused"'), 1.0)
        finally:
            c.close()
            w.stop()
            orch.stop()

    def test_taken_iteration_is_rekeyed(self):
        # another worker ran the session's earlier turns (iterations 0 and 1): this worker's
        # first checkpoint goes as iteration 2, its state naming 2, and its counter follows
        orch = FakeOrchestrator(taken={0, 1})
        w = start_worker(orch.addr)
        c = Client(w.addr)
        try:
            c.run("one", session="rekey-1")
            c.run("two", session="rekey-1")
            self.assertTrue(orch.wait_for("checkpoints", lambda x: x[0].loop_iteration == 3))
            # accepted in order: the first turn as 2, the second as 3 (whether the second turn
            # reserved 1 before or after the first checkpoint was re-keyed)
            its = [x[0].loop_iteration for x in orch.checkpoints]
            self.assertEqual([i for i in its if i not in (0, 1)], [2, 3], its)
            self.assertEqual(sorted(its), [0, 1, 2, 3])
            for req, _, _ in orch.checkpoints:
                self.assertEqual(hashlib.sha256(req.bytes).hexdigest(), req.bytes_sha256)
                self.assertEqual(json.loads(req.bytes[4:])["loop_iteration"], req.loop_iteration)
            self.assertEqual(w.metric("devworker_checkpoints_total", 'result="refused"'), 0.0)
        finally:
            c.close()
            w.stop()
            orch.stop()

    def test_rekeying_is_bounded(self):
        orch = FakeOrchestrator(checkpoint_code=grpc.StatusCode.ALREADY_EXISTS)
        w = start_worker(orch.addr)
        c = Client(w.addr)
        try:
            c.run("one", session="rekey-2")
            deadline = time.time() + 10
            while time.time() < deadline and w.metric("devworker_checkpoints_total", 'result="refused"') < 1:
                time.sleep(0.05)
            self.assertEqual(w.metric("devworker_checkpoints_total", 'result="refused"'), 1.0)
            self.assertEqual(len(orch.checkpoints), 65)  # the first try and 64 re-keyed ones
        finally:
            c.close()
            w.stop()
            orch.stop()


if __name__ == "__main__":
    unittest.main(verbosity=2)
