"""The live user_prompt frame (spec: NodeIOFrame.user_prompt, UserPromptFrame, StreamNodeIO),
end to end over real gRPC, NATS and Postgres with two real services: workflow-engine opens the
prompt and publishes the frame on wfio.<org>.<run> through its outbox; stream-hub relays it to
StreamNodeIO subscribers at every clearance, honouring the node filter, and replays a still-open
prompt to a subscriber that comes later.

The test plays the orchestrator on the bus (it takes the engine's dispatches from AGENT_STEPS
and answers on agent.step.result, and tees token frames on wfio as the orchestrator does), so
the agent ask_user path is driven through the engine's real input_required handling. The hub
runs on a throw-away database with its own durable consumers; the engine on the runtime's
database with fresh org UUIDs."""
import os
import secrets
import sys
import threading
import time
import unittest
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
import upsquad_testlib as T  # noqa: E402
from upsquad_testlib import psql, with_database  # noqa: E402
import nats_mini  # noqa: E402

WF_DSN = os.environ.get("UPSQUAD_PG_DSN_WORKFLOW_ENGINE")
HUB_DSN = os.environ.get("UPSQUAD_PG_DSN_STREAM_HUB")
ADMIN_DSN = os.environ.get("UPSQUAD_PG_ADMIN_DSN")
NATS = os.environ.get("UPSQUAD_NATS_URL")
if not WF_DSN or not HUB_DSN or not ADMIN_DSN or not NATS:
    print("SKIP: UPSQUAD_PG_DSN_WORKFLOW_ENGINE, UPSQUAD_PG_DSN_STREAM_HUB, UPSQUAD_PG_ADMIN_DSN "
          "and UPSQUAD_NATS_URL are required")
    sys.exit(0)

import grpc  # noqa: E402
from upsquad.workflow.v1 import workflow_pb2 as W  # noqa: E402
from upsquad.approval.v1 import approval_pb2 as AP  # noqa: E402
from upsquad.internal.v1 import agent_step_pb2 as AS  # noqa: E402
from upsquad.internal.v1 import node_io_pb2 as NIO  # noqa: E402

SECRET = secrets.token_hex(16)
TAG = "%d%s" % (os.getpid(), secrets.token_hex(3))
SVC = "/upsquad.workflow.v1.WorkflowService/"
ENGINE_ENV = T.engine_env(WF_DSN, NATS, SECRET)


st = T.struct


def wait_until(pred, timeout, what):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        time.sleep(0.03)
    raise AssertionError("timed out waiting for " + what)


class Reader(threading.Thread):
    """One StreamNodeIO stream read into a list."""

    def __init__(self, ch, req, token):
        super().__init__(daemon=True)
        rpc = ch.unary_stream(SVC + "StreamNodeIO", request_serializer=W.StreamNodeIORequest.SerializeToString,
                               response_deserializer=W.StreamNodeIOResponse.FromString)
        self.call = rpc(req, metadata=[("authorization", "Bearer " + token)], timeout=60)
        self.msgs = []
        self.code = None
        self.start()

    def run(self):
        try:
            for m in self.call:
                self.msgs.append(m)
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.code = e.code()

    def ready(self):
        return any(m.snapshot_done for m in self.msgs)

    def prompts(self):
        return [m.live for m in self.msgs if m.HasField("live") and m.live.HasField("user_prompt")]

    def cancel(self):
        self.call.cancel()


class VisReader(Reader):
    """One StreamVisibleRuns stream (every status) read into a list."""

    def __init__(self, rpc, token):
        threading.Thread.__init__(self, daemon=True)
        self.call = rpc(W.StreamVisibleRunsRequest(), metadata=[("authorization", "Bearer " + token)],
                         timeout=60)
        self.msgs = []
        self.code = None
        self.start()


class PromptFrames(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.db = "prompt_it_%s" % TAG
        psql(ADMIN_DSN, "CREATE DATABASE %s" % cls.db)
        psql(with_database(ADMIN_DSN, cls.db), "CREATE SCHEMA stream_hub AUTHORIZATION stream_hub")
        cls.hub = T.Server("stream-hub", env={
            "UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_PG_DSN": with_database(HUB_DSN, cls.db),
            "UPSQUAD_NATS_URL": NATS, "UPSQUAD_LOG_LEVEL": "warn",
            "UPSQUAD_MIGRATIONS_DIR": os.path.join(T.ROOT, "services/stream-hub/migrations"),
            "UPSQUAD_HUB_PROJECTION_DURABLE": "prompt-it-%s-events" % TAG,
            "UPSQUAD_HUB_TRANSCRIPT_DURABLE": "prompt-it-%s-io" % TAG,
            "UPSQUAD_HUB_PROJECTION_FROM": "new", "UPSQUAD_HUB_NEW_RUN_GRACE": "5s",
            "UPSQUAD_SHUTDOWN_GRACE": "2s"})
        cls.engine = T.Server("workflow-engine", env=ENGINE_ENV)
        cls.org, cls.user, cls.team = str(uuid.uuid4()), str(uuid.uuid4()), str(uuid.uuid4())
        cls.wf_ch = grpc.insecure_channel(cls.engine.addr)
        cls.hub_ch = grpc.insecure_channel(cls.hub.addr)
        cls.nc = nats_mini.Nats(NATS)
        cls.nc.js_consumer("AGENT_STEPS", "orchestrator-steps", "agent.step.dispatch")

    @classmethod
    def tearDownClass(cls):
        cls.wf_ch.close()
        cls.hub_ch.close()
        cls.nc.close()
        cls.engine.stop()
        cls.hub.stop()
        psql(ADMIN_DSN, "DROP DATABASE %s WITH (FORCE)" % cls.db)

    # ---- helpers ----
    def tok(self, clearance):
        return T.mint(SECRET, sub=self.user, org=self.org, clearance=clearance, teams=[self.team])

    def call(self, method, req, resp, clearance=3, svc=SVC):
        f = self.wf_ch.unary_unary(svc + method, request_serializer=req.SerializeToString,
                                   response_deserializer=resp.FromString)
        return f(req, metadata=[("authorization", "Bearer " + self.tok(clearance))], timeout=15)

    def wf(self, method, req, clearance=3):
        return self.call(method, req, getattr(W, method + "Response"), clearance)

    def start(self, steps, start):
        d = {"version": 1, "start": start, "steps": steps}
        wf = self.wf("CreateWorkflow", W.CreateWorkflowRequest(name="prompts", definition=st(d),
                                                               team_id=self.team)).workflow
        return self.wf("TriggerWorkflow", W.TriggerWorkflowRequest(workflow_id=wf.id)).run.id

    def subscribe(self, run, clearance, node=""):
        r = Reader(self.hub_ch, W.StreamNodeIORequest(run_id=run, node_id=node), self.tok(clearance))
        wait_until(r.ready, 15, "snapshot_done")
        return r

    def late_prompts(self, run, clearance, node="", expect=True, timeout=10):
        """The prompt frames a subscriber gets right after snapshot_done, subscribing again until
        the hub's projection agrees with `expect` (it captures from the bus asynchronously)."""
        end = time.time() + timeout
        while True:
            r = self.subscribe(run, clearance, node)
            time.sleep(0.3)
            r.cancel()
            kinds = [m.WhichOneof("frame") for m in r.msgs]
            got = r.prompts()
            # replayed prompts come right after the marker, before any other live frame
            self.assertEqual(kinds[kinds.index("snapshot_done") + 1:][:len(got)], ["live"] * len(got))
            if bool(got) == expect or time.time() > end:
                return got

    def parked(self, run, step):
        end = time.time() + 15
        while time.time() < end:
            s = self.wf("GetWorkflowStatus", W.GetWorkflowStatusRequest(run_id=run))
            for a in s.actions:
                if a.step_name == step and a.status == "awaiting_approval":
                    return a
            time.sleep(0.05)
        self.fail("step %s never parked" % step)

    def dispatch_of(self, run, timeout=15):
        d = T.agent_dispatch(self.nc, run, timeout)
        if d is None:
            self.fail("no dispatch for run %s" % run)
        return d

    def reply(self, d, ask=None):
        r = AS.AgentStepResult(idempotency_key=d.idempotency_key, org_id=d.org_id, run_id=d.run_id,
                               action_id=d.action_id, step_name=d.step_name, iteration=d.iteration,
                               attempt=d.attempt, agent_id="agent-1", session_id="sess-" + d.action_id)
        if ask is not None:
            r.input_required.tool_call_id = "call-1"
            r.input_required.tool_name = "ask_user"
            r.input_required.question_spec = ask.encode()
        else:
            r.completed.text = "done"
            r.completed.output.update({"ok": True})
        self.nc.publish("agent.step.result.%s.%s" % (d.org_id, d.run_id), r.SerializeToString())

    def token_frame(self, run, step, session, seq, text):
        """A live token frame of an agent step, as the orchestrator tees it (core NATS)."""
        ev = NIO.NodeIOEvent(org_id=self.org, run_id=run, step_name=step)
        ev.frame.node_id, ev.frame.session_id, ev.frame.seq, ev.frame.token_text = step, session, seq, text
        self.nc.publish("wfio.%s.%s" % (self.org, run), ev.SerializeToString())

    def assertPromptFrame(self, f, prompt, step, question, asked_step, asked_role):
        self.assertEqual(f.WhichOneof("event"), "user_prompt")
        self.assertEqual((f.node_id, f.session_id, f.seq, f.iteration), (step, prompt.prompt_id, 1, 0))
        up = f.user_prompt
        self.assertEqual((up.prompt_id, up.question, up.asked_by_step, up.asked_by_role),
                         (prompt.prompt_id, question, asked_step, asked_role))
        # the attribution is GetRunPrompt's, field for field
        self.assertEqual((up.question, up.asked_by_step, up.asked_by_role),
                         (prompt.question, prompt.asked_by_step, prompt.asked_by_role))

    # ---- tests ----
    def test_1_user_input_prompt_reaches_every_clearance_and_honours_the_node_filter(self):
        run = self.start({"a": {"type": "agent_action", "agent_role": "reviewer", "prompt": "review", "next": "ask"},
                          "ask": {"type": "user_input", "question": "merge ${/steps/a/output/ok}?",
                                  "allow_text": True}}, "a")
        lo = self.subscribe(run, 2)
        hi = self.subscribe(run, 4)
        mine = self.subscribe(run, 1, node="ask")
        other = self.subscribe(run, 5, node="a")
        self.reply(self.dispatch_of(run))
        a = self.parked(run, "ask")
        p = self.wf("GetRunPrompt", W.GetRunPromptRequest(prompt_id=a.approval_id))
        self.assertEqual((p.prompt_id, a.blocked_by), (a.approval_id, a.approval_id))
        for r in (lo, hi, mine):
            wait_until(lambda: r.prompts(), 15, "the live prompt frame")
        time.sleep(0.3)  # nothing more arrives (one frame per prompt)
        for r in (lo, hi, mine, other):
            r.cancel()
        for r in (lo, hi, mine):
            self.assertEqual(len(r.prompts()), 1)
            self.assertPromptFrame(r.prompts()[0], p, "ask", "merge true?", "a", "reviewer")
            self.assertFalse(any(m.HasField("gap") for m in r.msgs))
        # below clearance 4 the frame is byte-identical: user_prompt is structural
        self.assertEqual(lo.prompts()[0].SerializeToString(), hi.prompts()[0].SerializeToString())
        self.assertEqual(other.prompts(), [])
        # a subscriber that comes while the prompt is open gets it right after snapshot_done
        late = self.late_prompts(run, 2)
        self.assertEqual([f.SerializeToString() for f in late], [hi.prompts()[0].SerializeToString()])
        self.assertEqual(self.late_prompts(run, 5, node="ask", expect=True)[0].user_prompt.prompt_id,
                         a.approval_id)
        self.assertEqual(self.late_prompts(run, 5, node="a", expect=False), [])
        # once answered, the prompt is no longer replayed
        self.assertTrue(self.wf("AnswerRunPrompt", W.AnswerRunPromptRequest(prompt_id=a.approval_id, text="yes")).recorded)
        self.assertEqual(self.late_prompts(run, 5, expect=False), [])

    def test_2_gates_have_no_prompt_frame(self):
        """An approval gate and a question gate park the run without a frame; the user_input
        after them (the outbox keeps order) is the first and only one."""
        run = self.start({"g": {"type": "approval_gate", "required_clearance": 1, "summary": "ship?", "on_approve": "q"},
                          "q": {"type": "question", "prompt": "risk?", "required_clearance": 1,
                                "options": [{"key": "go", "label": "Go", "next": "ask"}]},
                          "ask": {"type": "user_input", "question": "which region?", "allow_text": True}}, "g")
        r = self.subscribe(run, 5)
        g = self.parked(run, "g")
        self.wf("ApproveAction", W.ApproveActionRequest(action_id=g.id))
        q = self.parked(run, "q")
        self.call("RecordDecision", AP.RecordDecisionRequest(
            approval_id=q.approval_id, decision=AP.DECISION_APPROVED,
            response_payload=st({"option_key": "go", "fields": {}})), AP.RecordDecisionResponse,
            svc="/upsquad.approval.v1.ApprovalService/")
        a = self.parked(run, "ask")
        wait_until(lambda: r.prompts(), 15, "the user_input's frame")
        time.sleep(0.3)
        r.cancel()
        self.assertEqual([f.user_prompt.prompt_id for f in r.prompts()], [a.approval_id])
        self.assertNotIn(g.approval_id, [m.live.session_id for m in r.msgs if m.HasField("live")])

    def test_4_a_question_gate_names_its_approval_as_prompt_id(self):
        """spec VisibleRunEvent.prompt_id: the governance_approvals row id of the gate the run is
        parked on, which GetRunPrompt and RecordDecision take. A question's blocked_by is the
        sub-kind token "awaiting-question", not that id: the live delta and the snapshot row must
        still carry the id (the approval gate's blocked_by happens to be it)."""
        run = self.start({"g": {"type": "approval_gate", "required_clearance": 1, "summary": "ship?", "on_approve": "q"},
                          "q": {"type": "question", "prompt": "risk?", "required_clearance": 1,
                                "options": [{"key": "go", "label": "Go"}]}}, "g")
        rpc = self.hub_ch.unary_stream(SVC + "StreamVisibleRuns",
                                        request_serializer=W.StreamVisibleRunsRequest.SerializeToString,
                                        response_deserializer=W.VisibleRunEvent.FromString)
        live = VisReader(rpc, self.tok(1))
        wait_until(lambda: any(m.snapshot_done for m in live.msgs), 15, "snapshot_done")
        g = self.parked(run, "g")
        self.wf("ApproveAction", W.ApproveActionRequest(action_id=g.id))
        q = self.parked(run, "q")
        self.assertEqual(q.blocked_by, "awaiting-question")

        def parked_on(msgs, kind):
            return [m for m in msgs if m.run_id == run and m.prompt_kind == kind]
        wait_until(lambda: parked_on(live.msgs, W.RUN_PROMPT_KIND_QUESTION_GATE), 15,
                   "the question's live delta")
        live.cancel()
        self.assertEqual([m.prompt_id for m in parked_on(live.msgs, W.RUN_PROMPT_KIND_APPROVAL_GATE)],
                         [g.approval_id])
        [d] = parked_on(live.msgs, W.RUN_PROMPT_KIND_QUESTION_GATE)
        self.assertEqual((d.prompt_id, d.needs_approval, d.is_snapshot), (q.approval_id, True, False))
        end = time.time() + 10
        while True:     # the hub projects from the bus asynchronously
            snap = VisReader(rpc, self.tok(1))
            wait_until(lambda: any(m.snapshot_done for m in snap.msgs), 15, "snapshot_done")
            snap.cancel()
            rows = parked_on(snap.msgs, W.RUN_PROMPT_KIND_QUESTION_GATE)
            if rows or time.time() > end:
                break
        self.assertEqual([(m.prompt_id, m.is_snapshot) for m in rows], [(q.approval_id, True)])
        self.call("RecordDecision", AP.RecordDecisionRequest(
            approval_id=q.approval_id, decision=AP.DECISION_APPROVED,
            response_payload=st({"option_key": "go", "fields": {}})), AP.RecordDecisionResponse,
            svc="/upsquad.approval.v1.ApprovalService/")

    def test_5_a_deleted_workflows_run_leaves_the_visible_set(self):
        """DeleteWorkflow: spec, the runs "become UNDISCOVERABLE through the workflow". The
        engine says so on the bus for each run (RunScope.workflow_deleted): a StreamVisibleRuns
        subscriber gets `leaving` for the parked run, a new snapshot leaves it out, and the run
        stays readable by id."""
        d = {"version": 1, "start": "g",
             "steps": {"g": {"type": "approval_gate", "required_clearance": 1, "summary": "ship?"}}}
        wf = self.wf("CreateWorkflow", W.CreateWorkflowRequest(name="doomed", definition=st(d),
                                                               team_id=self.team)).workflow
        run = self.wf("TriggerWorkflow", W.TriggerWorkflowRequest(workflow_id=wf.id)).run.id
        self.parked(run, "g")
        rpc = self.hub_ch.unary_stream(SVC + "StreamVisibleRuns",
                                        request_serializer=W.StreamVisibleRunsRequest.SerializeToString,
                                        response_deserializer=W.VisibleRunEvent.FromString)

        def snapshot():
            r = VisReader(rpc, self.tok(1))
            wait_until(lambda: any(m.snapshot_done for m in r.msgs), 15, "snapshot_done")
            return r
        end = time.time() + 10
        while True:     # the hub projects from the bus asynchronously
            live = snapshot()
            if any(m.run_id == run and m.is_snapshot for m in live.msgs) or time.time() > end:
                break
            live.cancel()
        self.assertIn(run, [m.run_id for m in live.msgs if m.is_snapshot])
        self.wf("DeleteWorkflow", W.DeleteWorkflowRequest(workflow_id=wf.id))
        wait_until(lambda: any(m.run_id == run and m.leaving for m in live.msgs), 15, "leaving")
        live.cancel()
        end = time.time() + 10
        while True:
            snap = snapshot()
            snap.cancel()
            if run not in [m.run_id for m in snap.msgs] or time.time() > end:
                break
        self.assertNotIn(run, [m.run_id for m in snap.msgs])
        self.assertEqual(self.wf("GetWorkflowStatus", W.GetWorkflowStatusRequest(run_id=run)).run.id, run)

    def test_3_agent_ask_user_frame_between_token_frames_is_no_gap(self):
        run = self.start({"a": {"type": "agent_action", "agent_role": "eng", "prompt": "deploy"}}, "a")
        lo = self.subscribe(run, 3)
        hi = self.subscribe(run, 5, node="a")
        d = self.dispatch_of(run)
        sess = "sess-" + d.action_id
        self.token_frame(run, "a", sess, 1, "thinking about it")
        self.token_frame(run, "a", sess, 2, "I need to ask")
        self.reply(d, ask='{"question": "which env?", "options": ["staging", "prod"]}')
        a = self.parked(run, "a")
        p = self.wf("GetRunPrompt", W.GetRunPromptRequest(prompt_id=a.approval_id))
        self.assertEqual((p.kind, p.asked_by_step, p.asked_by_role), ("user_prompt", "a", "eng"))
        wait_until(lambda: lo.prompts() and hi.prompts(), 15, "the ask's frame")
        self.token_frame(run, "a", sess, 3, "after the prompt")
        wait_until(lambda: sum(1 for m in hi.msgs if m.HasField("live")) == 4, 15, "the token frame after it")
        time.sleep(0.2)
        for r in (lo, hi):
            r.cancel()
        self.assertPromptFrame(hi.prompts()[0], p, "a", "which env?", "a", "eng")
        self.assertEqual(lo.prompts()[0].SerializeToString(), hi.prompts()[0].SerializeToString())
        for r in (lo, hi):
            self.assertFalse(any(m.HasField("gap") for m in r.msgs), [m for m in r.msgs if m.HasField("gap")])
        live = [m.live for m in hi.msgs if m.HasField("live")]
        self.assertEqual([(f.session_id, f.seq) for f in live],
                         [(sess, 1), (sess, 2), (a.approval_id, 1), (sess, 3)])
        self.assertEqual(live[3].token_text, "after the prompt")
        # below clearance 4 the token frames are not sent (no arm is left in them), the prompt is
        # whole
        lo_live = [m.live for m in lo.msgs if m.HasField("live")]
        self.assertEqual([(f.WhichOneof("event"), f.session_id, f.seq) for f in lo_live],
                         [("user_prompt", a.approval_id, 1)])
        # a later subscriber of the agent's node gets the open ask too
        self.assertEqual([f.user_prompt.prompt_id for f in self.late_prompts(run, 3, node="a")], [a.approval_id])


if __name__ == "__main__":
    unittest.main(verbosity=2)
