"""The agent-step boundary over the real system: workflow-engine, orchestrator and devworker
processes with the runtime's Postgres, Redis and NATS (docs/workflow-engine.md "Agent steps",
docs/orchestrator.md "Agent steps for workflows", docs/devworker.md).

Every agent step's prompt is a devworker `#!script`, so the test decides what the worker does:
hang until cancelled (CancelRun reaches the worker), fail retryably or not (the engine's retry
policy), ask the user (the turn resumes with AskUserResume). Each run of this file uses a fresh
org; processes are stopped by pid."""
import json
import os
import queue
import secrets
import subprocess
import sys
import time
import unittest
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
import upsquad_testlib as T  # noqa: E402

WF_DSN, ORCH_DSN, REDIS, NATS = T.require(
    ["UPSQUAD_PG_DSN_WORKFLOW_ENGINE", "UPSQUAD_PG_DSN_ORCHESTRATOR", "UPSQUAD_REDIS_URL", "UPSQUAD_NATS_URL"],
    bins=("workflow-engine", "orchestrator", "devworker", "upsquad-agents"))

import grpc  # noqa: E402
from google.protobuf import json_format  # noqa: E402
from upsquad.workflow.v1 import workflow_pb2 as W  # noqa: E402
from upsquad.internal.v1 import agent_step_pb2 as AS  # noqa: E402
import nats_mini  # noqa: E402

SECRET = secrets.token_hex(32)
KEK = "k1:" + secrets.token_hex(32)
SVC = "/upsquad.workflow.v1.WorkflowService/"
ROLE = "scripted"


st = T.struct


def js(s):
    return json_format.MessageToDict(s)


def script(*directives):
    return "#!script\n" + json.dumps(list(directives))


def agent(prompt, nxt=None, **kw):
    s = {"type": "agent_action", "agent_role": ROLE, "prompt": prompt}
    if nxt:
        s["next"] = nxt
    s.update(kw)
    return s


def apply_agent(org):
    T.apply_agent(org, {"role": ROLE, "display_name": "Scripted", "model": "claude-sonnet-4-6"}, ORCH_DSN, KEK)


Client = T.WorkflowClient


class AgentSteps(unittest.TestCase):
    procs = []

    @classmethod
    def setUpClass(cls):
        # one devworker (no heartbeats: the orchestrators' health probes find it live), two
        # orchestrator replicas sharing the dispatch queue: a cancel must reach whichever runs
        # the turn
        cls.worker = T.drain(T.Server("devworker", env={"UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_LOG_LEVEL": "info",
                                                      "UPSQUAD_ORCHESTRATOR_ADDR": ""}))
        cls.procs.append(cls.worker)
        orch_env = {
            "UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_PG_DSN": ORCH_DSN, "UPSQUAD_REDIS_URL": REDIS,
            "UPSQUAD_NATS_URL": NATS, "UPSQUAD_KEK": KEK, "UPSQUAD_WORKER_PROBE": "200ms",
            "UPSQUAD_MIGRATIONS_DIR": os.path.join(T.ROOT, "services/orchestrator/migrations"),
            "UPSQUAD_WORKER_TARGETS": cls.worker.addr, "UPSQUAD_LOG_LEVEL": "info",
            "UPSQUAD_AGENT_STEP_NO_WORKER_DELIVERIES": "2"}
        cls.orch_env = orch_env
        cls.orchs = [T.drain(T.Server("orchestrator", env=orch_env)) for _ in range(2)]
        cls.procs.extend(cls.orchs)
        cls.engine = T.drain(T.Server("workflow-engine", env=T.engine_env(
            WF_DSN, NATS, SECRET, UPSQUAD_WF_LEASE="2s", UPSQUAD_WF_AGENT_RETRIES="2",
            UPSQUAD_WF_AGENT_RETRY_BACKOFF="200ms", UPSQUAD_LOG_LEVEL="info")))
        cls.procs.append(cls.engine)
        cls.org = str(uuid.uuid4())
        cls.user = str(uuid.uuid4())
        apply_agent(cls.org)
        cls.A = Client(cls.engine.addr, T.mint(SECRET, sub=cls.user, org=cls.org, clearance=5))
        cls.nc = nats_mini.Nats(NATS)
        cls.results = queue.Queue()
        cls.seen = []
        cls.nc.subscribe("agent.step.result.%s.>" % cls.org, q=cls.results)
        cls.cancels = queue.Queue()
        cls.nc.subscribe("agent.step.cancel.%s.>" % cls.org, q=cls.cancels)
        cls.nc.flush()

    @classmethod
    def tearDownClass(cls):
        cls.A.close()
        cls.nc.close()
        for p in reversed(cls.procs):
            p.stop()

    # ---- helpers ----
    def start(self, d):
        w = self.A("CreateWorkflow", W.CreateWorkflowRequest(name="agent-steps", definition=st(d))).workflow
        return self.A("TriggerWorkflow", W.TriggerWorkflowRequest(workflow_id=w.id)).run.id

    def status(self, run):
        return self.A("GetWorkflowStatus", W.GetWorkflowStatusRequest(run_id=run))

    def wait_for(self, run, pred, timeout=30):
        end = time.time() + timeout
        s = None
        while time.time() < end:
            s = self.status(run)
            if pred(s):
                return s
            time.sleep(0.1)
        try:
            info = self.nc.request("$JS.API.CONSUMER.INFO.AGENT_STEPS.orchestrator-steps", b"")
            print("dispatch consumer:", info, file=sys.stderr)  # where the dispatches stand
        except Exception as e:  # noqa: BLE001
            print("no consumer info:", e, file=sys.stderr)
        logs = [l.strip()[:250] for o in self.orchs + [self.engine, self.worker] for l in o.log if "heartbeat" not in l]
        self.fail("timed out; last: %s %s\n%s" % (s.run.status, [(a.step_name, a.status) for a in s.actions],
                                                  "\n".join(logs[-20:])))

    def done(self, run, timeout=30):
        return self.wait_for(run, lambda s: s.run.status in ("completed", "failed", "cancelled"), timeout)

    def results_of(self, run, n, timeout=20):
        """The first n AgentStepResults the orchestrator published for run (core NATS)."""
        end = time.time() + timeout
        while time.time() < end:
            mine = [r for r in self.seen if r.run_id == run]
            if len(mine) >= n:
                return mine[:n]
            try:
                _, _, _, data = self.results.get(timeout=0.2)
                self.seen.append(AS.AgentStepResult.FromString(data))
            except queue.Empty:
                pass
        return [r for r in self.seen if r.run_id == run]

    def frozen_turns(self, run):
        """agent_steps rows of run that still hold a checkpoint (read in the run's org: RLS)."""
        out = subprocess.run(["psql", WF_DSN, "-X", "-Atq", "-v", "ON_ERROR_STOP=1", "-c",
                              "SELECT set_config('app.org_id', '%s', false)" % self.org, "-c",
                              "SELECT count(*) FROM workflow_engine.agent_steps WHERE run_id = '%s' "
                              "AND checkpoint IS NOT NULL" % run],
                             capture_output=True, text=True, timeout=30)
        self.assertEqual(out.returncode, 0, out.stderr)
        return int(out.stdout.split()[-1])

    def worker_logged(self, event, session_id, timeout=5):
        end = time.time() + timeout
        while time.time() < end:
            if any('"%s"' % event in line and session_id in line for line in self.worker.log):
                return True
            time.sleep(0.05)
        return False

    # ---- 0. one trace id from the call that triggers the run to the worker's step ----
    def test_0_the_trigger_trace_reaches_the_worker(self):
        trace = secrets.token_hex(16)
        marker = uuid.uuid4().hex
        w = self.A("CreateWorkflow", W.CreateWorkflowRequest(name="traced", definition=st(
            {"version": 1, "start": "a", "steps": {"a": agent(script({"complete": marker}))}}))).workflow
        trigger = self.A.ch.unary_unary("/upsquad.workflow.v1.WorkflowService/TriggerWorkflow",
                                        request_serializer=W.TriggerWorkflowRequest.SerializeToString,
                                        response_deserializer=W.TriggerWorkflowResponse.FromString)
        run = trigger(W.TriggerWorkflowRequest(workflow_id=w.id), timeout=10, metadata=self.A.md + [
            ("traceparent", "00-%s-00f067aa0ba902b7-01" % trace)]).run.id
        self.assertEqual(self.done(run).run.status, "completed")

        def traced(proc):
            lines = []
            for line in list(proc.log):
                try:
                    j = json.loads(line)
                except ValueError:
                    continue
                if j.get("trace_id") == trace:
                    lines.append(j)
            return lines
        end = time.time() + 5
        while time.time() < end and not (traced(self.engine) and traced(self.worker) and
                                         any(traced(o) for o in self.orchs)):
            time.sleep(0.05)
        self.assertTrue(traced(self.engine), "the engine logged nothing under the trace")
        fields = [j for j in traced(self.engine) if j.get("event") == "run.triggered"]
        self.assertEqual([(j.get("org_id"), j.get("run_id")) for j in fields], [(self.org, run)])
        self.assertTrue(any(traced(o) for o in self.orchs), "no orchestrator logged the step under it")
        self.assertTrue(traced(self.worker), "the devworker logged nothing under the trace")
        started = [j for j in traced(self.worker) if j.get("event") == "step.started"]
        self.assertEqual(len(started), 1)
        self.assertEqual(started[0].get("org_id"), self.org)
        self.assertTrue(started[0].get("session_id"))

    # ---- 1. CancelRun stops a dispatched agent turn ----
    def test_1_cancel_reaches_the_worker(self):
        marker = uuid.uuid4().hex
        run = self.start({"version": 1, "start": "a", "steps": {
            "a": agent(script({"token": marker}, {"hang": True}), "b"),
            "b": agent(script({"complete": "must never run"}))}})
        s = self.wait_for(run, lambda s: any(a.step_name == "a" and a.status == "in_progress" for a in s.actions))
        # the worker is running the turn (it hangs until cancelled)
        end = time.time() + 20
        while time.time() < end and not any('"step.hang"' in l for l in self.worker.log):
            time.sleep(0.05)
        hangs = [l for l in self.worker.log if '"step.hang"' in l]
        self.assertTrue(hangs, "the devworker never started the turn")
        t0 = time.time()
        r = self.A("CancelRun", W.CancelRunRequest(run_id=run, reason="stop it"))
        self.assertEqual(r.run.status, "cancelled")
        # the cancel went out on the bus, keyed to the attempt in flight
        subj, _, _, data = self.cancels.get(timeout=5)
        c = AS.AgentStepCancel.FromString(data)
        self.assertEqual((c.org_id, c.run_id, c.step_name, c.reason), (self.org, run, "a", "cancelled"))
        self.assertEqual(subj, "agent.step.cancel.%s.%s" % (self.org, run))
        a = [x for x in s.actions if x.step_name == "a"][0]
        self.assertEqual(c.action_id, a.id)
        # the worker saw its ExecuteStep cancelled within a few seconds
        res = self.results_of(run, 1)
        self.assertEqual(len(res), 1, "the orchestrator published no result for the cancelled turn")
        self.assertEqual((res[0].WhichOneof("outcome"), res[0].failed.code), ("failed", "cancelled"))
        self.assertEqual(res[0].idempotency_key, c.idempotency_key)
        self.assertTrue(self.worker_logged("step.cancelled", res[0].session_id), "the worker was not cancelled")
        self.assertLess(time.time() - t0, 5)
        # the run stays cancelled, the late result is ignored, no further step starts
        time.sleep(1.0)
        s = self.status(run)
        self.assertEqual(s.run.status, "cancelled")
        self.assertEqual([(x.step_name, x.status) for x in s.actions], [("a", "failed")])
        self.assertEqual(js(s.actions[0].output).get("error"), "cancelled")
        # idempotent: a second cancel changes nothing and sends no second cancel
        self.assertEqual(self.A("CancelRun", W.CancelRunRequest(run_id=run)).run.status, "cancelled")
        with self.assertRaises(queue.Empty):
            self.cancels.get(timeout=1)


    # ---- 2. retries of retryable failures ----
    def test_2_retryable_failure_is_retried_then_fails(self):
        err = {"code": "LLM_RATE_LIMIT", "message": "rate limited", "retryable": True}
        run = self.start({"version": 1, "start": "a", "steps": {
            "a": agent(script({"token": "x"}, {"error": err}), "b"),
            "b": agent(script({"complete": "must never run"}))}})
        s = self.done(run)
        self.assertEqual(s.run.status, "failed")
        self.assertEqual([(x.step_name, x.status) for x in s.actions], [("a", "failed")])
        self.assertEqual(js(s.actions[0].output)["error"], "LLM_RATE_LIMIT")
        # UPSQUAD_WF_AGENT_RETRIES=2: three attempts, each its own key, spaced by the backoff
        res = self.results_of(run, 4, timeout=3)
        self.assertEqual([r.attempt for r in res], [1, 2, 3])
        self.assertEqual(len({r.idempotency_key for r in res}), 3)
        self.assertTrue(all(r.failed.code == "LLM_RATE_LIMIT" and r.failed.retryable for r in res))
        gaps = [res[i + 1].finished_at.ToMilliseconds() - res[i].finished_at.ToMilliseconds() for i in (0, 1)]
        self.assertGreaterEqual(gaps[0], 200)
        self.assertGreaterEqual(gaps[1], 400)  # doubled
        logs = self.A("GetWorkflowStatus", W.GetWorkflowStatusRequest(run_id=run))
        self.assertEqual(logs.run.status, "failed")

    def test_2_non_retryable_failure_fails_at_once(self):
        err = {"code": "BAD_REQUEST", "message": "no", "retryable": False}
        run = self.start({"version": 1, "start": "a", "steps": {"a": agent(script({"error": err}))}})
        s = self.done(run)
        self.assertEqual(s.run.status, "failed")
        self.assertEqual(js(s.actions[0].output)["error"], "BAD_REQUEST")
        time.sleep(0.5)
        self.assertEqual([r.attempt for r in self.results_of(run, 2, timeout=1)], [1])

    def test_2_plain_goal_answers_the_expected_fields(self):
        # devworker's echo of a goal that asks for fields (the orchestrator appends them) is a
        # JSON object with one value per declared type, so the step's expects are met offline
        run = self.start({"version": 1, "start": "a", "steps": {
            "a": agent("Design a fix", expects={
                "plan": {"type": "string", "required": True, "description": "The design: in Markdown."},
                "files": {"type": "array", "required": True}, "pr": {"type": "integer"},
                "ok": {"type": "boolean"}, "meta": {"type": "object"}},
                acceptance={"max_redos": 0, "check": {"op": "exists", "path": "/steps/a/output/files/0"}})}})
        s = self.done(run)
        self.assertEqual(s.run.status, "completed", [(a.step_name, js(a.output)) for a in s.actions])
        self.assertEqual(js(s.actions[0].output),
                         {"plan": "plan", "files": ["files"], "pr": 1, "ok": True, "meta": {}})

    def test_2_retry_succeeds(self):
        # the worker fails the call the first time it runs this goal (first_runs), as a flaky
        # backend would: the orchestrator reports WORKER_FAILED (retryable), the engine retries
        marker = uuid.uuid4().hex
        run = self.start({"version": 1, "start": "a", "steps": {
            "a": agent(script({"fail": {"code": "INTERNAL", "message": "backend down"}, "first_runs": 1},
                              {"complete": "ok " + marker}))}})
        s = self.done(run)
        self.assertEqual(s.run.status, "completed", [(a.step_name, js(a.output)) for a in s.actions])
        self.assertEqual(js(s.actions[0].output), {"text": "ok " + marker})
        res = self.results_of(run, 2)
        self.assertEqual([(r.attempt, r.WhichOneof("outcome")) for r in res], [(1, "failed"), (2, "completed")])
        self.assertEqual((res[0].failed.code, res[0].failed.retryable), ("WORKER_FAILED", True))
        self.assertNotEqual(res[0].idempotency_key, res[1].idempotency_key)

    def test_1_cancelled_before_pickup_never_runs(self):
        # the cancel reaches the replicas before the dispatch is taken (it sat in the queue):
        # the attempt is answered "cancelled" without a turn
        import hashlib
        run = str(uuid.uuid4())
        key = hashlib.sha256(("%s:late:0:1" % run).encode()).hexdigest()
        c = AS.AgentStepCancel(idempotency_key=key, org_id=self.org, run_id=run, action_id=str(uuid.uuid4()),
                               step_name="late", reason="cancelled")
        self.nc.js_publish("agent.step.cancel.%s.%s" % (self.org, run), c.SerializeToString(), msg_id="cancel:" + key)
        time.sleep(0.3)
        marker = uuid.uuid4().hex
        d = AS.AgentStepDispatch(idempotency_key=key, org_id=self.org, run_id=run, workflow_id=str(uuid.uuid4()),
                                 action_id=c.action_id, step_name="late", attempt=1, agent_role=ROLE,
                                 goal=script({"token": marker}, {"complete": "ran"}))
        self.nc.js_publish("agent.step.dispatch", d.SerializeToString(), msg_id=key)
        res = self.results_of(run, 1)
        self.assertEqual(len(res), 1)
        self.assertEqual((res[0].failed.code, res[0].failed.retryable), ("cancelled", False))
        self.assertEqual(res[0].session_id, "")  # no session, no turn

    def test_1_run_failure_cancels_a_parallel_turn(self):
        # one branch hangs on the worker, the other fails: the run fails and the hanging turn
        # is cancelled on the worker ("run failed")
        run = self.start({"version": 1, "start": "p", "steps": {
            "p": {"type": "parallel", "branches": ["slow", "bad"]},
            "slow": agent(script({"token": uuid.uuid4().hex}, {"hang": True})),
            "bad": agent(script({"sleep_ms": 1500}, {"error": {"code": "NOPE", "message": "no"}}))}})
        s = self.done(run)
        self.assertEqual(s.run.status, "failed")
        slow = [a for a in s.actions if a.step_name == "slow"][0]
        self.assertEqual(js(slow.output).get("error"), "run failed")
        mine = [r for r in self.results_of(run, 2) if r.step_name == "slow"]
        self.assertEqual(len(mine), 1)
        self.assertEqual(mine[0].failed.code, "cancelled")
        self.assertTrue(self.worker_logged("step.cancelled", mine[0].session_id))

    def test_2_retries_are_not_redos(self):
        # max_redos 1 and a flaky first run of each distinct message: attempt 1 fails (retried),
        # 2 answers badly (redone with feedback: a new message), 3 fails (retried), 4 answers
        # badly again: the one redo is used, the step fails on acceptance. Were retries counted
        # as redos, attempt 2 would already have failed the step.
        run = self.start({"version": 1, "start": "a", "steps": {
            "a": agent(script({"fail": {"code": "INTERNAL", "message": "flaky"}, "first_runs": 1},
                              {"complete": "{\"y\": 1}"}),
                       expects={"x": {"type": "string", "required": True}}, acceptance={"max_redos": 1})}})
        s = self.done(run)
        self.assertEqual(s.run.status, "failed")
        self.assertEqual(js(s.actions[0].output).get("error"), "acceptance")
        res = self.results_of(run, 4)
        self.assertEqual([(r.attempt, r.WhichOneof("outcome")) for r in res],
                         [(1, "failed"), (2, "completed"), (3, "failed"), (4, "completed")])

    # ---- 3. ask_user resumes the frozen turn ----
    def test_3_ask_user_resumes_with_ask_user_resume(self):
        ask = {"question_spec": {"question": "Which environment?", "allow_text": True}}
        run = self.start({"version": 1, "start": "a", "steps": {
            "a": agent(script({"tokens": "let me ask"}, {"ask_user": ask}, {"complete": "deploying to {{answer}}"}))}})
        s = self.wait_for(run, lambda s: any(a.status == "awaiting_approval" for a in s.actions))
        a = s.actions[0]
        first = self.results_of(run, 1)[0]
        self.assertEqual(first.WhichOneof("outcome"), "input_required")
        self.assertTrue(first.input_required.checkpoint)
        p = self.A("GetRunPrompt", W.GetRunPromptRequest(prompt_id=a.approval_id))
        self.assertEqual((p.kind, p.status, p.question, p.allow_text, len(p.options)),
                         ("user_prompt", "pending", "Which environment?", True, 0))
        self.assertNotIn(first.input_required.checkpoint.decode(), json.dumps(js(p)))  # never shown
        self.assertEqual(self.frozen_turns(run), 1)  # kept durably while the prompt waits
        r = self.A("AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=a.approval_id, text="staging please"))
        self.assertTrue(r.recorded)
        s = self.done(run)
        self.assertEqual(s.run.status, "completed")
        out = js(s.actions[0].output)["text"]
        self.assertTrue(out.startswith("deploying to "), out)
        self.assertIn("staging please", out)
        self.assertEqual(json.loads(out[len("deploying to "):])["text"], "staging please")
        # the worker resumed the same frozen turn (AskUserResume), keyed to the pending call
        second = self.results_of(run, 2)[1]
        self.assertEqual(second.WhichOneof("outcome"), "completed")
        self.assertEqual(second.attempt, first.attempt + 1)
        end = time.time() + 5
        lines = []
        while time.time() < end and not lines:
            lines = [l for l in self.worker.log if '"step.ask_resumed"' in l and second.session_id in l]
            time.sleep(0.05)
        self.assertTrue(lines, "the worker did not resume a frozen turn")
        self.assertIn(first.input_required.tool_call_id, lines[0])
        self.assertEqual(self.frozen_turns(run), 0)  # dropped when the step ended
        # a second answer is not recorded, and nothing is dispatched again
        r = self.A("AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=a.approval_id, text="prod"))
        self.assertFalse(r.recorded)
        time.sleep(0.5)
        self.assertEqual(len(self.results_of(run, 3, timeout=1)), 2)


    def test_3_ask_user_with_options(self):
        ask = {"question_spec": {"question": "Where to?", "options": ["staging", {"value": "prod", "label": "Production"}],
                                 "allow_text": False}}
        run = self.start({"version": 1, "start": "a", "steps": {
            "a": agent(script({"ask_user": ask}, {"complete": "going to {{answer}}"}))}})
        s = self.wait_for(run, lambda s: any(a.status == "awaiting_approval" for a in s.actions))
        pid = s.actions[0].approval_id
        p = self.A("GetRunPrompt", W.GetRunPromptRequest(prompt_id=pid))
        self.assertEqual((p.question, p.allow_text), ("Where to?", False))
        self.assertEqual([(o.value, o.label) for o in p.options], [("staging", "staging"), ("prod", "Production")])
        for bad, field in ((dict(text="somewhere"), "text"), (dict(choice="moon"), "choice")):
            with self.assertRaises(grpc.RpcError) as ctx:
                self.A("AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=pid, **bad))
            self.assertEqual(ctx.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn(field, ctx.exception.details())
        self.assertTrue(self.A("AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=pid, choice="prod")).recorded)
        s = self.done(run)
        self.assertEqual(s.run.status, "completed")
        out = js(s.actions[0].output)["text"]
        self.assertEqual(json.loads(out[len("going to "):])["choice"], "prod")


    def test_3_cancel_while_asking(self):
        run = self.start({"version": 1, "start": "a", "steps": {
            "a": agent(script({"ask_user": {"question_spec": {"question": "?"}}}, {"complete": "x"}))}})
        self.wait_for(run, lambda s: any(a.status == "awaiting_approval" for a in s.actions))
        self.assertEqual(self.frozen_turns(run), 1)
        self.assertEqual(self.A("CancelRun", W.CancelRunRequest(run_id=run)).run.status, "cancelled")
        self.assertEqual(self.frozen_turns(run), 0)
        # nothing was in flight: no cancel goes out for a parked ask
        end = time.time() + 1
        while time.time() < end:
            try:
                _, _, _, data = self.cancels.get(timeout=0.2)
            except queue.Empty:
                continue
            self.assertNotEqual(AS.AgentStepCancel.FromString(data).run_id, run)

    # ---- late: replicas replaced ----
    def test_8_replica_started_after_the_cancel(self):
        # the cancel is published while no orchestrator runs; a replica started afterwards reads
        # it from the stream and never runs that attempt
        import hashlib
        for o in self.orchs:
            o.stop()
        run = str(uuid.uuid4())
        key = hashlib.sha256(("%s:later:0:1" % run).encode()).hexdigest()
        c = AS.AgentStepCancel(idempotency_key=key, org_id=self.org, run_id=run, action_id=str(uuid.uuid4()),
                               step_name="later", reason="cancelled")
        self.nc.js_publish("agent.step.cancel.%s.%s" % (self.org, run), c.SerializeToString(), msg_id="cancel:" + key)
        d = AS.AgentStepDispatch(idempotency_key=key, org_id=self.org, run_id=run, workflow_id=str(uuid.uuid4()),
                                 action_id=c.action_id, step_name="later", attempt=1, agent_role=ROLE,
                                 goal=script({"complete": "ran"}))
        self.nc.js_publish("agent.step.dispatch", d.SerializeToString(), msg_id=key)
        type(self).orchs = [T.drain(T.Server("orchestrator", env=self.orch_env))]
        self.procs.extend(self.orchs)
        res = self.results_of(run, 1)
        self.assertEqual(len(res), 1)
        self.assertEqual((res[0].failed.code, res[0].session_id), ("cancelled", ""))

    # ---- last: the worker goes away ----
    def test_9_no_live_worker_follows_the_retry_policy(self):
        self.worker.stop()
        run = self.start({"version": 1, "start": "a", "steps": {"a": agent(script({"complete": "unreachable"}))}})
        s = self.done(run, timeout=40)
        self.assertEqual(s.run.status, "failed")
        # the worker may still look live to the first attempt (WORKER_UNAVAILABLE: the call
        # failed), then it is marked down (NO_WORKER); both are retryable
        unreachable = ("NO_WORKER", "WORKER_UNAVAILABLE")
        self.assertIn(js(s.actions[0].output).get("error"), unreachable)
        res = self.results_of(run, 3)
        self.assertEqual([r.attempt for r in res], [1, 2, 3])
        self.assertTrue(all(r.failed.code in unreachable and r.failed.retryable for r in res),
                        [(r.failed.code, r.failed.retryable) for r in res])
        self.assertEqual(res[-1].failed.code, "NO_WORKER")


if __name__ == "__main__":
    unittest.main(verbosity=2)
