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
import queue
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
import nats_mini  # noqa: E402
from upsquad.internal.v1 import agent_step_pb2 as AS  # noqa: E402
from upsquad.internal.v1 import node_io_pb2 as NIO  # noqa: E402

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


def canonical(s):
    """The documented canonical encoding of a SessionSnapshot (docs/orchestrator.md), written
    independently of the C code: field number, then big-endian lengths/values, fields 1, 2 (the
    session's identity), 11, 19 and 20 left out."""
    out = [b"upsquad.snapshot.v2\n"]

    def st(n, v):
        b = v.encode()
        out.append(struct.pack(">BI", n, len(b)) + b)

    def i64(n, v):
        out.append(struct.pack(">Bq", n, v))

    def strs(n, vs):
        out.append(struct.pack(">BI", n, len(vs)) + b"".join(struct.pack(">I", len(x.encode())) + x.encode() for x in vs))

    st(3, s.agent_id); st(4, s.model_id)
    out.append(struct.pack(">Bd", 5, s.temperature + 0.0))
    i64(6, s.max_tokens); strs(7, list(s.tools)); strs(8, list(s.guardrail_hashes))
    g = sorted(s.rbac_grants.items(), key=lambda kv: kv[0].encode())
    out.append(struct.pack(">BI", 9, len(g)) + b"".join(
        struct.pack(">I", len(k.encode())) + k.encode() + struct.pack(">I", len(v.encode())) + v.encode() for k, v in g))
    st(10, s.persona); i64(12, s.max_loops); i64(13, s.execution_mode)
    if s.HasField("fallback_chain"):
        out.append(b"\x0e\x01")
        st(1, s.fallback_chain.primary_model); st(2, s.fallback_chain.secondary_model); st(3, s.fallback_chain.tertiary_model)
    else:
        out.append(b"\x0e\x00")
    st(15, s.context_engine_address)
    if s.HasField("security_config"):
        c = s.security_config
        out.append(b"\x10\x01")
        st(1, c.input_filter_mode); st(2, c.output_filter_mode)
        out.append(struct.pack(">BBBBBB", 3, c.redact_secrets, 4, c.redact_pii, 5, c.redact_system_prompt))
        st(6, c.schema_validation_mode); out.append(struct.pack(">BB", 7, c.tool_scan_enabled))
        i64(8, c.tool_result_max_bytes)
        for n, pats in ((9, c.custom_block_patterns), (10, c.custom_pii_patterns)):
            out.append(struct.pack(">BI", n, len(pats)))
            for p in pats:
                st(1, p.id); st(2, p.regex); st(3, p.severity); st(4, p.category); st(5, p.description)
    else:
        out.append(b"\x10\x00")
    st(17, s.runtime); st(18, s.llm_base_url)
    return hashlib.sha256(b"".join(out)).hexdigest()


class Orch(unittest.TestCase):
    procs = []

    @classmethod
    def setUpClass(cls):
        cls.fake = fake_worker.FakeWorker()
        cls.fake2 = fake_worker.FakeWorker()
        env = {"UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_PG_DSN": DSN,
               "UPSQUAD_MIGRATIONS_DIR": MIGRATIONS, "UPSQUAD_REDIS_URL": REDIS,
               "UPSQUAD_NATS_URL": NATS, "UPSQUAD_KEK": KEK, "UPSQUAD_WORKER_PROBE": "200ms",
               "UPSQUAD_WORKER_TARGETS": cls.fake.addr + "," + cls.fake2.addr, "UPSQUAD_LOG_LEVEL": "info",
               # a stream parked on a paused session ends at once (test_orchestrator_pause.py
               # has the waiting ones)
               "UPSQUAD_PAUSED_STREAMS": "0"}
        if MR_DSN:
            cls.mr = T.Server("model-registry", env={
                "UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_PG_DSN": MR_DSN, "UPSQUAD_NATS_URL": "",
                "UPSQUAD_MIGRATIONS_DIR": os.path.join(T.ROOT, "services", "model-registry", "migrations"),
                "UPSQUAD_MODEL_CATALOG_FILE": os.path.join(T.ROOT, "services", "model-registry", "catalog", "models.json")})
            cls.procs.append(cls.mr)
            env["UPSQUAD_MODEL_REGISTRY_ADDR"] = cls.mr.addr
        cls.env = env
        cls.orch = drain(T.Server("orchestrator", env=env))
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
        init = [i for i in self.fake.inits + self.fake2.inits if i.snapshot.session_id == r.session_id]
        self.assertEqual(len(init), 1)
        self.assertEqual(init[0].snapshot.snapshot_hash, r.snapshot_hash)
        self.assertEqual(init[0].snapshot.tenant_id, self.org)
        self.assertEqual(list(init[0].snapshot.tools), ["web_search"])
        # the hash follows the documented encoding, recomputed here independently
        self.assertEqual(canonical(init[0].snapshot), r.snapshot_hash)
        snap = R.SessionSnapshot()
        snap.CopyFrom(init[0].snapshot)
        snap.org_version_seq = 99
        snap.mcp_servers["x"].prefix = "y"
        self.assertEqual(canonical(snap), r.snapshot_hash)

    def test_snapshot_hash_detects_drift(self):
        """Equal configurations hash alike whatever the session, the tenant or the time; every
        configuration field, and each override, changes the hash."""
        org = str(uuid.uuid4())
        tok = self.tok(org)
        base = {"role": "drift", "display_name": "Drift", "model": "claude-sonnet-4-6",
                "persona": "be brief", "tools": ["web_search", "mcp:gh"], "max_loops": 7,
                "mcp_servers": {"gh": {"prefix": "github", "unit_id": "u1"}}}
        agent = apply_agent(org, base)

        def hash_of(token=tok, **kw):
            r = self.create(agent_id=agent, token=token, **kw)
            self.assertEqual(self.get(r.session_id, token=token).snapshot_hash, r.snapshot_hash)
            init = [i for i in self.fake.inits + self.fake2.inits if i.snapshot.session_id == r.session_id]
            self.assertEqual(len(init), 1)
            self.assertEqual(canonical(init[0].snapshot), r.snapshot_hash)
            return r.snapshot_hash

        h0 = hash_of()
        time.sleep(0.01)
        self.assertEqual(hash_of(), h0)  # another session, later, by another user
        self.assertEqual(hash_of(token=self.tok(org, sub=str(uuid.uuid4()))), h0)
        # mcp_servers is left out (spec): re-pointing a server leaves the configuration's hash
        apply_agent(org, dict(base, mcp_servers={"gh": {"prefix": "gh2", "unit_id": "u9"}}))
        self.assertEqual(hash_of(), h0)
        variants = {
            "model": "claude-haiku-4-5-20251001", "temperature": 0.7, "max_tokens": 99,
            "tools": ["web_search"], "guardrail_hashes": ["g" * 64], "rbac_grants": {"repo:*": "read"},
            "persona": "be long", "max_loops": 8, "execution_mode": "autonomous",
            "fallback_chain": ["gpt-5.5"], "context_engine_address": "ce:1", "runtime": "claude_sdk",
            "llm_base_url": "https://llm.example",
            "security_config": {"input_filter_mode": "strict"},
            "security_config.redact_pii": {"redact_pii": True},
            "security_config.tool_result_max_bytes": {"tool_result_max_bytes": 1024},
            "security_config.custom_block_patterns": {"custom_block_patterns": [{"id": "p", "regex": "x+"}]},
        }
        seen = {h0: "base"}
        for field, value in variants.items():
            key = field.split(".")[0]
            apply_agent(org, dict(base, **{key: value}))
            h = hash_of()
            self.assertNotIn(h, seen, "%s: hashes like %s" % (field, seen.get(h)))
            seen[h] = field
        # the same configuration again: the same hash (drift is visible, and reversible)
        apply_agent(org, base)
        self.assertEqual(hash_of(), h0)
        # the overrides frozen at creation are configuration too
        h = hash_of(execution_mode=R.EXECUTION_MODE_MULTI_TURN)
        self.assertNotIn(h, seen)
        seen[h] = "execution_mode override"
        self.assertEqual(hash_of(execution_mode=R.EXECUTION_MODE_MULTI_TURN), h)
        if MR_DSN:
            h = hash_of(model_override="gpt-6.1-terra")
            self.assertNotIn(h, seen)
            self.assertEqual(hash_of(model_override="GPT-6.1-Terra"), h)  # the catalogue's spelling

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
        r = self.create(model_override="GPT-6.1-Terra")
        self.assertEqual(self.get(r.session_id).model_id, "gpt-6.1-terra")  # the catalogue's id
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
        told = self.fake.terminated + self.fake2.terminated
        self.assertEqual(told.count(sid), 1)
        c, _ = self.code(lambda: self.send("hi", session_id=sid))
        self.assertEqual(c, grpc.StatusCode.FAILED_PRECONDITION)
        audit = psql("SELECT string_agg(action_type, ',' ORDER BY seq) FROM audit_log WHERE session_id = '%s'" % sid)
        self.assertEqual(audit, "")  # RLS: the service's role sees no tenant rows without app.org_id
        admin = os.environ.get("UPSQUAD_PG_ADMIN_DSN")
        if admin:
            rows = subprocess.run(
                ["psql", admin, "-X", "-Atq", "-F", "\t", "-c",
                 "SELECT seq, action_id, action_type, coalesce(parent_action_id::text, ''), detail::text,"
                 " prev_hash, hash FROM orchestrator.audit_log WHERE session_id = '%s' ORDER BY seq" % sid],
                capture_output=True, text=True).stdout.strip().split("\n")
            prev = "0" * 64
            types = []
            for line in rows:
                seq, aid, typ, parent, detail, p, h = line.split("\t")
                self.assertEqual(p, prev)
                want = hashlib.sha256("|".join([prev, seq, aid, typ, parent, detail]).encode()).hexdigest()
                self.assertEqual(h, want)
                prev = h
                types.append(typ)
            self.assertEqual(types, ["session_started", "session_terminated"])
            # append-only, even for the owner
            out = subprocess.run(["psql", admin, "-X", "-Atq", "-c",
                                  "UPDATE orchestrator.audit_log SET action_type = 'x' WHERE session_id = '%s'" % sid],
                                 capture_output=True, text=True)
            self.assertNotEqual(out.returncode, 0)
        c, _ = self.code(lambda: self.unary("TerminateSession",
                                            L.TerminateLifecycleSessionRequest(session_id=str(uuid.uuid4())),
                                            L.TerminateLifecycleSessionResponse))
        self.assertEqual(c, grpc.StatusCode.NOT_FOUND)

    # ---- SendMessage ----
    def requests_of(self, sid):
        return [r for r in self.fake.requests + self.fake2.requests if r.session_id == sid]

    def test_chat_turn(self):
        hello = "hello world " + uuid.uuid4().hex
        evs = self.send(hello)
        text = "".join(e.token.text for e in evs if e.HasField("token"))
        self.assertEqual(text, "echo: " + hello)
        done = [e for e in evs if e.HasField("completion")]
        self.assertEqual(len(done), 1)
        self.assertEqual(done[0].completion.final_response, "echo: " + hello)
        sid = self.sid_of(hello)
        g = self.get(sid)
        self.assertEqual(g.status, 3)  # COMPLETE
        # second turn: prior_turns carry the first, never the current one
        self.send("second message", session_id=sid, agent_id="")
        reqs = sorted(self.requests_of(sid), key=lambda r: r.user_message != hello)
        self.assertEqual(len(reqs), 2)
        r = reqs[1]
        self.assertEqual([(t.role, t.text) for t in r.prior_turns],
                         [(1, hello), (2, "echo: " + hello)])
        self.assertEqual(len(reqs[0].prior_turns), 0)
        self.assertEqual(r.user_message, "second message")
        self.assertEqual(r.tenant_id, self.org)
        self.assertEqual(r.snapshot.session_id, sid)
        self.assertEqual(r.snapshot.snapshot_hash, g.snapshot_hash)
        # bearers: signed, audiences pinned, agent/org/session claims, fresh per step
        for tokfield, aud, ttl in (("agent_gateway_token", "upsquad-agent-gateway", 600),
                                   ("context_engine_token", "upsquad-context-engine", 300)):
            t = getattr(r, tokfield)
            h, p, sig = t.split(".")
            claims = json.loads(T.base64.urlsafe_b64decode(p + "=" * (-len(p) % 4)))
            self.assertEqual(claims["aud"], aud)
            self.assertEqual(claims["agent_id"], self.agent)
            self.assertEqual(claims["org_id"], self.org)
            self.assertEqual(claims["session_id"], sid)
            self.assertAlmostEqual(claims["exp"] - claims["iat"], ttl, delta=2)
            self.assertNotEqual(t, getattr(reqs[0], tokfield))
        self.assertNotEqual(r.agent_gateway_token, r.context_engine_token)

    def sid_of(self, message):
        """The session of the (unique) turn that carried message."""
        sids = {r.session_id for r in self.fake.requests + self.fake2.requests if r.user_message == message}
        self.assertEqual(len(sids), 1, message)
        return sids.pop()

    def fake_turn(self, events, sid=""):
        return self.send("#!fake " + json.dumps(events), session_id=sid, agent_id="" if sid else None)

    def test_projection(self):
        big = "x" * 5000
        events = [
            {"status": {"status": "AGENT_STATUS_THINKING", "detail": "thinking"}},
            {"metrics": {"model": "m", "inputTokens": 5, "outputTokens": 7, "costUsd": 0.5}},
            {"toolCall": {"toolName": "web_search", "toolCallId": "c1", "arguments": {"q": "x"}}},
            {"toolResult": {"toolCallId": "c1", "toolName": "web_search", "result": "SECRET-RESULT"}},
            {"security": {"violationCode": "input_injection_detected", "detail": "SECRET-DETAIL",
                          "severity": "block", "patternId": "p1"}},
            {"checkpoint": {"state": "AAAA", "hash": "h"}},
            {"stepProgress": {"madeToolCalls": True}},
            {"structuredAnswer": {"summary": "ok", "columns": ["a"], "rows": [{"cells": ["1"]}],
                                  "followups": ["more"]}},
            {"structuredAnswer": {"summary": big}},
            {"structuredAnswer": {"summary": "s", "columns": ["c"] * 33}},
            {"structuredAnswer": {"summary": "s", "rows": [{"cells": ["1"]}] * 201}},
            {"structuredAnswer": {"summary": "s", "followups": ["f"] * 9}},
            {"structuredAnswer": {"summary": "s", "rows": [{"cells": ["y" * 1025]}]}},
            {"structuredAnswer": {"summary": "tagged", "schemaId": "chart.v2"}},
            {"structuredAnswer": {"summary": "long tag", "schemaId": "t" * 65}},  # not a budget
            {"writeConfirm": {"approvalId": "0d5e0000-0000-0000-0000-000000000009",
                              "summary": "é" * 1500, "deepLink": "https://evil.example/x",
                              "requiredClearance": 9, "actionType": "trigger_workflow"}},
            {"writeConfirm": {"approvalId": "<script>", "summary": "s", "deepLink": "/approvals/1",
                              "requiredClearance": -3, "actionType": "Bad Type!"}},
            {"token": {"text": "after", "index": 0}},
            {"completion": {"finalResponse": "after", "tokenUsage": {"inputTokens": 1, "outputTokens": 1}}},
        ]
        evs = self.fake_turn(events)
        kinds = [e.WhichOneof("event") for e in evs]
        self.assertEqual(kinds, ["status", "structured_answer", "structured_answer", "structured_answer",
                                 "write_confirm", "write_confirm", "token", "completion"])
        self.assertEqual(evs[1].structured_answer.summary, "ok")
        self.assertEqual([(e.structured_answer.summary, e.structured_answer.schema_id) for e in evs[2:4]],
                         [("tagged", "chart.v2"), ("long tag", "")])
        w1, w2 = evs[4].write_confirm, evs[5].write_confirm
        self.assertEqual(w1.approval_id, "0d5e0000-0000-0000-0000-000000000009")
        self.assertLessEqual(len(w1.summary.encode()), 2048)
        self.assertEqual(w1.summary, "\u00e9" * 1024)  # never a cut character
        self.assertEqual(w1.deep_link, "")
        self.assertEqual(w1.required_clearance, 5)
        self.assertEqual(w1.action_type, "trigger_workflow")
        self.assertEqual((w2.approval_id, w2.deep_link, w2.required_clearance, w2.action_type),
                         ("", "/approvals/1", 0, ""))
        raw = b"".join(e.SerializeToString() for e in evs)
        for leak in (b"SECRET-DETAIL", b"SECRET-RESULT", b"web_search", b"input_injection"):
            self.assertNotIn(leak, raw)

    def test_interrupt_projection(self):
        evs = self.fake_turn([{"token": {"text": "checking", "index": 0}},
                              {"interruptRequired": {"toolCallId": "call-7", "toolName": "deploy",
                                                     "idempotencyKey": "k", "pendingToolIntent": "U0VDUkVULUlOVEVOVA=="}}])
        # these replicas have no ApprovalService (UPSQUAD_APPROVALS_ADDR unset): the gate cannot
        # open, so nothing parks and the gated call never runs; the caller is told, retryably
        # (the projection and the park on a real approval: test_orchestrator_gates.py)
        self.assertEqual([e.WhichOneof("event") for e in evs], ["token", "error"])
        self.assertEqual(evs[1].error.code, "APPROVAL_UNAVAILABLE")
        self.assertTrue(evs[1].error.retryable)
        self.assertIn("did not run", evs[1].error.message)
        self.assertNotIn(b"SECRET-INTENT", b"".join(e.SerializeToString() for e in evs))

    def test_nothing_after_the_end(self):
        """"completion signals the step has finished": a worker's events after its completion
        (or its error) never reach the caller."""
        tok = {"token": {"text": "a", "index": 0}}
        evs = self.fake_turn([tok, {"completion": {"finalResponse": "a"}}, {"token": {"text": "late", "index": 1}}])
        self.assertEqual([e.WhichOneof("event") for e in evs], ["token", "completion"])
        evs = self.fake_turn([tok, {"error": {"code": "E", "message": "m"}}, {"completion": {"finalResponse": "x"}}])
        self.assertEqual([e.WhichOneof("event") for e in evs], ["token", "error"])

    def test_a_recoverable_error_does_not_end_the_step(self):
        """ErrorEvent is "a recoverable or terminal error": a retryable one reaches the caller
        and the step goes on to its completion (the turn completes); a terminal one after it
        ends the step, and the turn ends in error."""
        sid = self.create().session_id
        rate = {"error": {"code": "LLM_RATE_LIMIT", "message": "slow down", "retryable": True}}
        evs = self.fake_turn([{"token": {"text": "a", "index": 0}}, rate, {"token": {"text": "b", "index": 1}},
                              {"completion": {"finalResponse": "ab"}}], sid=sid)
        self.assertEqual([e.WhichOneof("event") for e in evs], ["token", "error", "token", "completion"])
        self.assertEqual((evs[1].error.code, evs[1].error.retryable), ("LLM_RATE_LIMIT", True))
        self.assertEqual(self.get(sid).status, 3)  # AGENT_STATUS_COMPLETE
        evs = self.fake_turn([rate, {"error": {"code": "E", "message": "gave up"}}, {"token": {"text": "late", "index": 0}}],
                             sid=sid)
        self.assertEqual([(e.WhichOneof("event"), e.error.code) for e in evs], [("error", "LLM_RATE_LIMIT"), ("error", "E")])
        self.assertEqual(self.get(sid).status, 4)  # AGENT_STATUS_ERROR
        # a worker that ends its stream after a retryable error: the turn failed with it, told once
        evs = self.fake_turn([rate], sid=sid)
        self.assertEqual([e.WhichOneof("event") for e in evs], ["error"])
        self.assertEqual(self.get(sid).status, 4)

    def test_a_long_error_message_cut_inside_a_character_still_ends_the_turn(self):
        """The audit row of a failed turn keeps at most 512 bytes of the worker's message, cut
        on a character boundary: a split UTF-8 sequence would make the jsonb detail (and with
        it the turn's end) fail, leaving the session THINKING."""
        sid = self.create().session_id
        msg = "a" * 511 + "\u00e9" * 10  # the 512-byte cut falls inside the first "é"
        evs = self.fake_turn([{"error": {"code": "E", "message": msg}}], sid=sid)
        self.assertEqual([e.WhichOneof("event") for e in evs], ["error"])
        self.assertEqual(self.get(sid).status, 4)  # AGENT_STATUS_ERROR: the turn's end was stored

    def test_status_follows_the_worker(self):
        """GetSession.status is "the current session status": a StatusEvent the worker relays
        mid-turn is what GetSession reports until the turn ends (COMPLETE)."""
        sid = self.create().session_id
        self.assertTrue(self.get(sid).HasField("last_heartbeat"))  # the worker answered InitWorkerSession
        out = []
        t = threading.Thread(target=lambda: out.extend(self.fake_turn(
            [{"status": {"status": "AGENT_STATUS_ACTING", "detail": "tool"}}, {"sleepMs": 1500},
             {"completion": {"finalResponse": "done"}}], sid=sid)))
        t.start()
        seen, t0 = set(), time.time()
        while t.is_alive() and time.time() - t0 < 10:
            seen.add(self.get(sid).status)
            time.sleep(0.05)
        t.join()
        self.assertIn(2, seen)  # AGENT_STATUS_ACTING
        self.assertEqual(self.get(sid).status, 3)  # AGENT_STATUS_COMPLETE

    def test_terminate_during_a_turn(self):
        """TerminateSession's status is "the final session status after termination": the turn
        it cuts short does not overwrite it when it ends."""
        sid = self.create().session_id
        fn = self.ch.unary_stream(LC + "SendMessage", request_serializer=L.SendMessageRequest.SerializeToString,
                                  response_deserializer=L.AgentEvent.FromString)
        call = fn(L.SendMessageRequest(session_id=sid, message="#!hang"),
                  metadata=[("authorization", "Bearer " + self.tok())], timeout=30)
        self.assertEqual(next(call).token.text, "waiting")
        r = self.unary("TerminateSession", L.TerminateLifecycleSessionRequest(session_id=sid, reason="stop"),
                       L.TerminateLifecycleSessionResponse)
        call.cancel()  # the turn ends (cancelled), after the termination
        time.sleep(0.5)
        self.assertEqual(self.get(sid).status, r.status)

    def test_retry_on_another_worker(self):
        msg = "#!fail-once\nretried " + uuid.uuid4().hex
        evs = self.send(msg)
        self.assertEqual("".join(e.token.text for e in evs if e.HasField("token")),
                         "echo: " + msg.split("\n")[1])
        sid = self.sid_of(msg)
        self.assertEqual(len(self.requests_of(sid)), 2)

    def test_worker_fails_after_relaying(self):
        msg = "#!fail-after\n" + uuid.uuid4().hex
        evs = self.send(msg)
        kinds = [e.WhichOneof("event") for e in evs]
        self.assertEqual(kinds, ["token", "error"])
        self.assertTrue(evs[1].error.code.startswith("WORKER_"))
        sid = self.sid_of(msg)
        self.assertEqual(len(self.requests_of(sid)), 1)  # no retry once something was relayed
        self.assertEqual(self.get(sid).status, 4)  # ERROR

    def test_cancel_reaches_worker(self):
        for f in (self.fake, self.fake2):
            f.cancelled.clear()
        fn = self.ch.unary_stream(LC + "SendMessage",
                                  request_serializer=L.SendMessageRequest.SerializeToString,
                                  response_deserializer=L.AgentEvent.FromString)
        call = fn(L.SendMessageRequest(agent_id=self.agent, message="#!hang"),
                  metadata=[("authorization", "Bearer " + self.tok())], timeout=30)
        first = next(call)
        self.assertEqual(first.token.text, "waiting")
        t0 = time.time()
        call.cancel()
        ok = False
        while time.time() - t0 < 5 and not ok:
            ok = self.fake.cancelled.is_set() or self.fake2.cancelled.is_set()
            time.sleep(0.02)
        self.assertTrue(ok, "the worker's ExecuteStep was not cancelled")
        self.assertLess(time.time() - t0, 2.0)

    def test_send_bad_input(self):
        for kw, field in (({"message": ""}, "message"), ({"message": "x", "session_id": "nope"}, "session_id"),
                          ({"message": "x", "agent_id": ""}, "agent_id")):
            c, d = self.code(lambda: self.send(kw["message"], session_id=kw.get("session_id", ""),
                                               agent_id=kw.get("agent_id")))
            self.assertEqual(c, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn(field, d)
        c, _ = self.code(lambda: self.send("x", agent_id=str(uuid.uuid4())))
        self.assertEqual(c, grpc.StatusCode.NOT_FOUND)
        c, _ = self.code(lambda: self.send("x" * 70000))
        self.assertEqual(c, grpc.StatusCode.INVALID_ARGUMENT)

    def test_provider_keys_encrypted(self):
        org = str(uuid.uuid4())
        agent = apply_agent(org, AGENT)
        key = "sk-test-" + secrets.token_hex(16)
        out = agents_tool(org, "keys", "set", "anthropic", stdin=key + "\n")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertNotIn(key, out.stdout + out.stderr)
        evs = self.send("keys please", agent_id=agent, token=self.tok(org=org))
        self.assertTrue(any(e.HasField("completion") for e in evs))
        reqs = [r for r in self.fake.requests + self.fake2.requests if r.tenant_id == org]
        self.assertEqual(dict(reqs[-1].provider_keys), {"anthropic": key})
        admin = os.environ.get("UPSQUAD_PG_ADMIN_DSN")
        if admin:
            dump = subprocess.run(["psql", admin, "-X", "-Atq", "-c",
                                   "SELECT encode(ciphertext, 'escape'), kek_id FROM orchestrator.provider_keys"
                                   " WHERE org_id = '%s'" % org], capture_output=True, text=True).stdout
            self.assertIn("k1", dump)
            self.assertNotIn(key, dump)
            self.assertNotIn(key.encode().hex(), dump)
        # never in the service's log either
        self.assertNotIn(key, "".join(self.orch.log))
        # a key of another org is never sent
        reqs2 = [r for r in self.fake.requests + self.fake2.requests if r.tenant_id == self.org]
        self.assertTrue(all("anthropic" not in dict(r.provider_keys) for r in reqs2))

    # ---- Heartbeat / Checkpoint ----
    def rt(self, method, req, resp, token=None):
        return self.unary(method, req, resp, token=token or self.worker_tok(), svc=RT)

    def test_heartbeat(self):
        sid = self.create().session_id
        r = self.rt("Heartbeat", R.HeartbeatRequest(session_id=sid, worker_id="w-test", active_sessions=3),
                    R.HeartbeatResponse)
        self.assertTrue(r.acknowledged)
        g = self.get(sid)
        self.assertAlmostEqual(g.last_heartbeat.seconds, time.time(), delta=30)
        # any verified token reaches its own org's sessions (worker_id optional with a session)...
        before = self.get(sid).last_heartbeat.ToNanoseconds()
        time.sleep(0.01)
        r = self.rt("Heartbeat", R.HeartbeatRequest(session_id=sid), R.HeartbeatResponse, token=self.tok())
        self.assertTrue(r.acknowledged)
        self.assertGreater(self.get(sid).last_heartbeat.ToNanoseconds(), before)
        # ... and never another org's
        c, _ = self.code(lambda: self.rt("Heartbeat", R.HeartbeatRequest(session_id=sid), R.HeartbeatResponse,
                                         token=self.tok(org=self.org2)))
        self.assertEqual(c, grpc.StatusCode.NOT_FOUND)
        c, _ = self.code(lambda: self.rt("Heartbeat", R.HeartbeatRequest(), R.HeartbeatResponse))
        self.assertEqual(c, grpc.StatusCode.INVALID_ARGUMENT)
        c, _ = self.code(lambda: self.rt("Heartbeat", R.HeartbeatRequest(worker_id="w" * 129), R.HeartbeatResponse))
        self.assertEqual(c, grpc.StatusCode.INVALID_ARGUMENT)
        c, _ = self.code(lambda: self.rt("Heartbeat", R.HeartbeatRequest(worker_id="w", session_id=str(uuid.uuid4())),
                                         R.HeartbeatResponse))
        self.assertEqual(c, grpc.StatusCode.NOT_FOUND)

    def test_worker_choice_by_heartbeat_load(self):
        def load(w, n):
            self.rt("Heartbeat", R.HeartbeatRequest(worker_id=w.addr, active_sessions=n), R.HeartbeatResponse)
        try:
            for busy, idle in ((self.fake, self.fake2), (self.fake2, self.fake)):
                load(busy, 1000)
                load(idle, 0)
                time.sleep(0.6)  # the next probe round reads the loads
                msgs = ["load %s %d" % (uuid.uuid4().hex, i) for i in range(4)]
                for m in msgs:
                    self.send(m)
                self.assertEqual(sorted(r.user_message for r in idle.requests if r.user_message in msgs),
                                 sorted(msgs))
        finally:
            load(self.fake, 0)
            load(self.fake2, 0)

    def test_checkpoint(self):
        sid = self.create().session_id
        blob = struct.pack(">I", 1) + b"state-" + os.urandom(16)
        sha = hashlib.sha256(blob).hexdigest()
        req = R.CheckpointRequest(session_id=sid, bytes=blob, bytes_sha256=sha, loop_iteration=1)
        r = self.rt("Checkpoint", req, R.CheckpointResponse)
        self.assertEqual((r.hash, r.state), (sha, blob))  # "carries the serialized worker state"
        r = self.rt("Checkpoint", req, R.CheckpointResponse)  # idempotent replay
        self.assertEqual((r.hash, r.state), (sha, blob))
        other = struct.pack(">I", 1) + b"different"
        c, _ = self.code(lambda: self.rt("Checkpoint", R.CheckpointRequest(
            session_id=sid, bytes=other, bytes_sha256=hashlib.sha256(other).hexdigest(), loop_iteration=1),
            R.CheckpointResponse))
        self.assertEqual(c, grpc.StatusCode.ALREADY_EXISTS)
        for bad in (R.CheckpointRequest(session_id=sid, bytes=b"\x00\x00", bytes_sha256=hashlib.sha256(b"\x00\x00").hexdigest(), loop_iteration=2),
                    R.CheckpointRequest(session_id=sid, bytes=blob, bytes_sha256="0" * 64, loop_iteration=2),
                    R.CheckpointRequest(session_id=sid, bytes=blob, bytes_sha256="xyz", loop_iteration=2),
                    R.CheckpointRequest(session_id="nope", bytes=blob, bytes_sha256=sha, loop_iteration=2),
                    R.CheckpointRequest(session_id=sid, bytes=blob, bytes_sha256=sha, loop_iteration=-1)):
            c, _ = self.code(lambda: self.rt("Checkpoint", bad, R.CheckpointResponse))
            self.assertEqual(c, grpc.StatusCode.INVALID_ARGUMENT)
        huge = struct.pack(">I", 1) + b"\0" * (4 << 20)
        c, _ = self.code(lambda: self.rt("Checkpoint", R.CheckpointRequest(
            session_id=sid, bytes=huge, bytes_sha256=hashlib.sha256(huge).hexdigest(), loop_iteration=3),
            R.CheckpointResponse))
        self.assertIn(c, (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED))
        # a user's token: its own org's session (replay: OK), another org's: NOT_FOUND
        self.assertEqual(self.rt("Checkpoint", req, R.CheckpointResponse, token=self.tok()).hash, sha)
        c, _ = self.code(lambda: self.rt("Checkpoint", req, R.CheckpointResponse, token=self.tok(org=self.org2)))
        self.assertEqual(c, grpc.StatusCode.NOT_FOUND)
        c, _ = self.code(lambda: self.rt("Checkpoint", R.CheckpointRequest(
            session_id=str(uuid.uuid4()), bytes=blob, bytes_sha256=sha, loop_iteration=1), R.CheckpointResponse))
        self.assertEqual(c, grpc.StatusCode.NOT_FOUND)
        # pruning: only the newest N (5) per session are kept
        for i in range(2, 10):
            b = struct.pack(">I", 1) + bytes([i])
            self.rt("Checkpoint", R.CheckpointRequest(session_id=sid, bytes=b, bytes_sha256=hashlib.sha256(b).hexdigest(),
                                                      loop_iteration=i), R.CheckpointResponse)
        admin = os.environ.get("UPSQUAD_PG_ADMIN_DSN")
        if admin:
            its = subprocess.run(["psql", admin, "-X", "-Atq", "-c",
                                  "SELECT string_agg(loop_iteration::text, ',' ORDER BY loop_iteration)"
                                  " FROM orchestrator.checkpoints WHERE session_id = '%s'" % sid],
                                 capture_output=True, text=True).stdout.strip()
            self.assertEqual(its, "5,6,7,8,9")
        self.assertEqual(self.get(sid).loop_count, 10)  # iterations 0..9: ten completed
        # the schema version prefix is opaque: version 0 is stored like any other
        zero = struct.pack(">I", 0) + b"v0"
        r = self.rt("Checkpoint", R.CheckpointRequest(session_id=sid, bytes=zero, bytes_sha256=hashlib.sha256(zero).hexdigest(),
                                                      loop_iteration=20), R.CheckpointResponse)
        self.assertEqual(r.state, zero)

    def test_turn_end_races_checkpoints(self):
        """A worker checkpoints while the turn it serves ends (the devworker does, from its
        reporter thread): both commit, neither is lost to a deadlock. GetSession then shows the
        finished turn (COMPLETE) and the next turn's prior_turns carry its answer."""
        sid = self.create().session_id
        stop, failures, done = threading.Event(), [], [0]

        def hammer():
            it = 0
            while not stop.is_set():
                b = struct.pack(">I", 1) + b"ck-%d" % it
                try:
                    self.rt("Checkpoint", R.CheckpointRequest(session_id=sid, bytes=b, loop_iteration=it,
                                                              bytes_sha256=hashlib.sha256(b).hexdigest()),
                            R.CheckpointResponse)
                    done[0] += 1
                except grpc.RpcError as e:
                    failures.append((e.code(), e.details()))
                it += 1

        th = threading.Thread(target=hammer)
        th.start()
        bad, msgs = [], []
        try:
            for i in range(20):
                msg = "race %d %s" % (i, uuid.uuid4().hex[:8])
                msgs.append(msg)
                evs = self.send(msg, session_id=sid, agent_id="")
                self.assertTrue(any(e.HasField("completion") for e in evs))
                g = self.get(sid)
                if g.status != 3:
                    bad.append((i, g.status))
        finally:
            stop.set()
            th.join()
        self.assertEqual(bad, [], "turns whose end was not recorded")
        self.assertEqual(failures, [], "checkpoints refused")
        self.assertGreater(done[0], 0)
        # every answer was stored: each turn's prior_turns end with the previous turn's answer
        for prev, msg in zip(msgs, msgs[1:]):
            r = [r for r in self.requests_of(sid) if r.user_message == msg][0]
            self.assertEqual([(t.role, t.text) for t in r.prior_turns][-2:], [(1, prev), (2, "echo: " + prev)])

    def test_tenant_must_be_a_uuid(self):
        # a token whose org_id names no tenant is refused, never "try again"
        t = T.mint(SECRET, sub=self.user, org="acme")
        for fn in (lambda: self.create(token=t),
                   lambda: self.get(str(uuid.uuid4()), token=t),
                   lambda: self.unary("ListSessions", L.ListSessionsRequest(), L.ListSessionsResponse, token=t),
                   lambda: self.unary("TerminateSession", L.TerminateLifecycleSessionRequest(session_id=str(uuid.uuid4())),
                                      L.TerminateLifecycleSessionResponse, token=t),
                   lambda: self.send("hello", token=t)):
            c, d = self.code(fn)
            self.assertEqual(c, grpc.StatusCode.UNAUTHENTICATED, d)
            self.assertIn("org_id", d)

    # ---- upsquad-agents ----
    def test_upsquad_agents(self):
        org = str(uuid.uuid4())
        d = "/tmp/agents-%s" % uuid.uuid4().hex
        os.makedirs(d)
        try:
            good = os.path.join(d, "good.json")
            bad = os.path.join(d, "bad.json")
            with open(good, "w") as f:
                json.dump([dict(AGENT, role="writer"), dict(AGENT, role="planner")], f)
            with open(bad, "w") as f:
                json.dump(dict(AGENT, role="x", security_config={"redact_pii": "yes"}), f)
            out = agents_tool(org, "apply", good, bad)
            self.assertEqual(out.returncode, 1)
            self.assertIn("bad.json: /security_config/redact_pii", out.stderr)
            self.assertEqual(agents_tool(org, "list").stdout.strip(), "")  # nothing changed
            out = agents_tool(org, "apply", good)
            self.assertEqual(out.returncode, 0, out.stderr)
            ids = [l.split()[0] for l in out.stdout.splitlines()]
            self.assertEqual([l.split()[2] for l in out.stdout.splitlines()], ["created", "created"])
            again = agents_tool(org, "apply", good)
            self.assertEqual([l.split()[0] for l in again.stdout.splitlines()], ids)  # stable ids
            self.assertEqual([l.split()[2] for l in again.stdout.splitlines()], ["updated", "updated"])
            shown = json.loads(agents_tool(org, "show", ids[0]).stdout)
            self.assertEqual(shown["definition"]["role"], "writer")
            self.assertEqual(agents_tool(str(uuid.uuid4()), "show", ids[0]).returncode, 1)  # other org
            with open(bad, "w") as f:
                f.write("{not json")
            self.assertEqual(agents_tool(org, "apply", bad).returncode, 1)
            self.assertNotEqual(agents_tool(org, "keys", "set", "anthropic", stdin="").returncode, 0)
        finally:
            subprocess.run(["rm", "-rf", d])

    def test_upsquad_agents_as_a_user_runs_it(self):
        """The README's way: the run's env file sourced (UPSQUAD_PG_DSN unset, the orchestrator's
        DSN under its own name), stdout a pipe. It used to free the getenv() fallback (abort, and
        the buffered output lost with it)."""
        org = str(uuid.uuid4())
        ids = [apply_agent(org, dict(AGENT, role=r)) for r in ("writer", "planner")]
        envfile = "/tmp/agents-env-%s" % uuid.uuid4().hex
        with open(envfile, "w") as f:
            f.write("export UPSQUAD_PG_DSN_ORCHESTRATOR='%s'\nexport UPSQUAD_DEV_ORG_ID=%s\n"
                    "export UPSQUAD_KEK=%s\nexport UPSQUAD_LOG_LEVEL=warn\n" % (DSN, org, KEK))
        env = {k: v for k, v in os.environ.items() if not k.startswith("UPSQUAD_")}
        tool = os.path.join(T.BUILD, "bin", "upsquad-agents")
        try:
            out = subprocess.run(["bash", "-c", 'set -o pipefail; source "$1" && "$2" --org "$UPSQUAD_DEV_ORG_ID" list | cat',
                                  "sh", envfile, tool], env=env, capture_output=True, text=True, timeout=30)
        finally:
            os.unlink(envfile)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertNotIn("invalid pointer", out.stderr)
        rows = [l.split() for l in out.stdout.splitlines()]
        self.assertEqual(sorted(r[0] for r in rows), sorted(ids))
        self.assertEqual(sorted(r[1] for r in rows), ["planner", "writer"])

    def test_status_filters_and_worker_side_methods(self):
        self.send("filter me " + uuid.uuid4().hex)
        r = self.unary("ListSessions", L.ListSessionsRequest(status_filter="AGENT_STATUS_COMPLETE", page_size=100),
                       L.ListSessionsResponse)
        self.assertTrue(r.total_count >= 1 and all(s.status == 3 for s in r.sessions))
        r2 = self.unary("ListSessions", L.ListSessionsRequest(status_filter="complete", page_size=100),
                        L.ListSessionsResponse)
        self.assertEqual(r.total_count, r2.total_count)
        # the worker side of RuntimeService is not the orchestrator's
        c, _ = self.code(lambda: self.rt("InitWorkerSession", R.InitWorkerSessionRequest(), R.InitWorkerSessionResponse))
        self.assertEqual(c, grpc.StatusCode.UNIMPLEMENTED)
        # a worker token signed with another key is unauthenticated
        forged = T.mint("y" * 32, sub="w", org="system", extra={"scope": "runtime.worker"})
        c, _ = self.code(lambda: self.rt("Heartbeat", R.HeartbeatRequest(worker_id="w"), R.HeartbeatResponse,
                                         token=forged))
        self.assertEqual(c, grpc.StatusCode.UNAUTHENTICATED)


drain = T.drain


@unittest.skipUnless(os.path.exists(DEVWORKER), "build/bin/devworker is not built")
class WithDevworkers(unittest.TestCase):
    """Two orchestrator replicas and two devworkers (heartbeating and checkpointing to replica A)."""
    procs = []

    @classmethod
    def setUpClass(cls):
        base = {"UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_PG_DSN": DSN, "UPSQUAD_MIGRATIONS_DIR": MIGRATIONS,
                "UPSQUAD_REDIS_URL": REDIS, "UPSQUAD_NATS_URL": NATS, "UPSQUAD_KEK": KEK,
                "UPSQUAD_WORKER_PROBE": "200ms", "UPSQUAD_LOG_LEVEL": "info"}
        cls.base = base
        # replica A first (workers report to it), then the workers, then replica B
        cls.a = drain(T.Server("orchestrator", env=dict(base, UPSQUAD_WORKER_TARGETS="127.0.0.1:1")))
        cls.procs.append(cls.a)
        cls.w = [cls.start_worker() for _ in range(2)]
        targets = ",".join(w.addr for w in cls.w)
        cls.b = drain(T.Server("orchestrator", env=dict(base, UPSQUAD_WORKER_TARGETS=targets)))
        cls.procs.append(cls.b)
        cls.ch = grpc.insecure_channel(cls.b.addr)
        cls.org = str(uuid.uuid4())
        cls.user = str(uuid.uuid4())
        cls.agent = apply_agent(cls.org, AGENT)

    @classmethod
    def start_worker(cls):
        w = drain(T.Server("devworker", env={"UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_LOG_LEVEL": "info",
                                             "UPSQUAD_ORCHESTRATOR_ADDR": cls.a.addr,
                                             "UPSQUAD_DEVWORKER_HEARTBEAT_INTERVAL": "200ms"}))
        cls.procs.append(w)
        return w

    @classmethod
    def tearDownClass(cls):
        cls.ch.close()
        for p in cls.procs:
            p.stop()

    tok = Orch.tok
    unary = Orch.unary
    code = Orch.code
    send = Orch.send
    get = Orch.get
    create = Orch.create

    def test_chat_turn_through_devworker(self):
        msg = "hello devworker " + uuid.uuid4().hex
        sid = self.create().session_id  # this test's session, whatever else the org holds
        evs = self.send(msg, session_id=sid, agent_id="")
        self.assertEqual("".join(e.token.text for e in evs if e.HasField("token")), "echo: " + msg)
        c = [e.completion for e in evs if e.HasField("completion")]
        self.assertEqual(len(c), 1)
        self.assertEqual(c[0].token_usage.output_tokens, len(("echo: " + msg).split()))
        lst = self.unary("ListSessions", L.ListSessionsRequest(page_size=100), L.ListSessionsResponse)
        self.assertIn(sid, [s.session_id for s in lst.sessions])
        # the worker checkpointed its iteration to replica A (same database): loop_count follows.
        deadline = time.time() + 20
        while time.time() < deadline and self.get(sid).loop_count < 1:
            time.sleep(0.1)
        self.assertGreaterEqual(self.get(sid).loop_count, 1)
        done = list(evs)
        # a script: projection through a real worker
        script = [{"status": "THINKING"}, {"tool_call": {"tool_name": "search", "arguments": {"q": "w"}}},
                  {"tool_result": {"result": {"temp": 21}}}, {"security": {"violation_code": "x", "detail": "HIDDEN"}},
                  {"metrics": {"model": "m", "cost_usd": 0.1}}, {"tokens": "it is warm"}, {"complete": "It is warm."}]
        evs = self.send("#!script\n" + json.dumps(script), session_id=sid, agent_id="")
        done += evs
        kinds = [e.WhichOneof("event") for e in evs]
        self.assertEqual(kinds[0], "status")
        self.assertEqual(kinds[-1], "completion")
        self.assertEqual(set(kinds[1:-1]), {"token"})
        self.assertNotIn(b"HIDDEN", b"".join(e.SerializeToString() for e in evs))
        # a step in flight is heartbeated per session (to replica A): last_heartbeat is set
        done += self.send("#!script\n" + json.dumps([{"token": "a"}, {"sleep_ms": 700}, {"complete": "done"}]),
                          session_id=sid, agent_id="")
        self.assertAlmostEqual(self.get(sid).last_heartbeat.seconds, time.time(), delta=30)
        # every iteration of the three turns reaches replica A as a checkpoint, whichever worker
        # ran the turn (a turn stays on the session's worker while it is live), each counting the
        # session's iterations from what it saw; a worker whose iteration another worker already
        # checkpointed re-keys it to the next one instead of dropping it (ALREADY_EXISTS)
        # (iterations 0..want-1; the newest UPSQUAD_CHECKPOINTS_KEEP, 5 by default, are kept)
        want = sum(e.completion.loop_iterations for e in done if e.HasField("completion"))
        self.assertGreaterEqual(want, 3)
        expect = "%d %d" % (min(want, 5), want - 1)
        admin = os.environ.get("UPSQUAD_PG_ADMIN_DSN")
        got, deadline = "", time.time() + 20
        while admin and got != expect and time.time() < deadline:
            got = subprocess.run(["psql", admin, "-X", "-Atq", "-F", " ", "-c",
                                  "SELECT count(*), max(loop_iteration) FROM orchestrator.checkpoints"
                                  " WHERE session_id = '%s'" % sid],
                                 capture_output=True, text=True).stdout.strip()
            if got != expect:
                time.sleep(0.1)
        if admin:
            self.assertEqual(got, expect)
        self.assertEqual([l for w in self.w for l in w.log if "checkpoint.refused" in l and sid in l], [])
        # the count is the iterations, however the checkpoints raced the turns' ends
        self.assertEqual(self.get(sid).loop_count, want)

    def test_turns_stay_on_the_sessions_worker(self):
        """Affinity: a session's turns run on the worker holding its state (initialised at
        creation, then the worker of its last turn) while it is live; the other worker is only
        taken when that one is down."""
        sid = self.create().session_id
        inspect = "#!script\n" + json.dumps([{"inspect": True}, {"complete": "ok"}])
        seen = [json.loads(self.send(inspect, session_id=sid, agent_id="")[0].token.text)["worker"]["addr"]
                for _ in range(4)]
        self.assertEqual(len(set(seen)), 1, seen)
        self.assertIn(seen[0], [w.addr for w in self.w])

    def test_cancel_through_devworker(self):
        fn = self.ch.unary_stream(LC + "SendMessage", request_serializer=L.SendMessageRequest.SerializeToString,
                                  response_deserializer=L.AgentEvent.FromString)
        script = [{"token": "started"}, {"hang": True}]
        call = fn(L.SendMessageRequest(agent_id=self.agent, message="#!script\n" + json.dumps(script)),
                  metadata=[("authorization", "Bearer " + self.tok())], timeout=30)
        self.assertEqual(next(call).token.text, "started")
        t0 = time.time()
        call.cancel()
        deadline = t0 + 5
        seen = False
        while time.time() < deadline and not seen:
            seen = any("cancel" in l for w in self.w for l in w.log)
            time.sleep(0.05)
        self.assertTrue(seen, "the devworker did not log the cancelled step")

    def test_worker_crash_mid_stream(self):
        script = [{"token": "before"}, {"sleep_ms": 100}, {"crash": True}]
        evs = self.send("#!script\n" + json.dumps(script))
        kinds = [e.WhichOneof("event") for e in evs]
        self.assertEqual(kinds, ["token", "error"])
        self.assertTrue(evs[1].error.code.startswith("WORKER_"))
        # the surviving worker serves the next turn (the dead one is marked down)
        deadline = time.time() + 5
        ok = False
        while time.time() < deadline and not ok:
            evs = self.send("still there")
            ok = any(e.HasField("completion") for e in evs)
        self.assertTrue(ok)
        # replace the crashed worker for the other tests
        for i, w in enumerate(self.w):
            if w.proc.poll() is not None:
                self.w[i] = self.start_worker()

    def test_no_live_worker(self):
        # (and NATS unreachable: the replica serves its RPCs, agent steps wait for NATS)
        c = drain(T.Server("orchestrator", env=dict(self.base, UPSQUAD_WORKER_TARGETS="127.0.0.1:1",
                                                    UPSQUAD_NATS_URL="nats://127.0.0.1:1")))
        try:
            ch = grpc.insecure_channel(c.addr)
            code, d = self.code(lambda: self.send("anyone?", ch=ch))
            self.assertEqual(code, grpc.StatusCode.UNAVAILABLE)
            self.assertIn("worker", d)
            code, _ = self.code(lambda: self.unary("CreateSession", L.CreateSessionRequest(agent_id=self.agent),
                                                   L.CreateSessionResponse, ch=ch))
            self.assertEqual(code, grpc.StatusCode.UNAVAILABLE)
            ch.close()
        finally:
            c.stop()

    # ---- workflow agent steps ----
    def dispatch(self, nc, goal, role="assistant", key=None, msg_id=None):
        run = str(uuid.uuid4())
        key = key or hashlib.sha256(("%s:step:0:1" % run).encode()).hexdigest()
        d = AS.AgentStepDispatch(idempotency_key=key, org_id=self.org, run_id=run,
                                 workflow_id=str(uuid.uuid4()), action_id=str(uuid.uuid4()),
                                 step_name="draft", iteration=0, attempt=1, agent_role=role, goal=goal)
        return d

    def run_step(self, nc, d, msg_id=None):
        res_subj = "agent.step.result.%s.%s" % (d.org_id, d.run_id)
        io_subj = "wfio.%s.%s" % (d.org_id, d.run_id)
        q = queue.Queue()
        sids = [nc.subscribe(res_subj, q=q)[0], nc.subscribe(io_subj, q=q)[0]]
        nc.flush()
        nc.js_publish("agent.step.dispatch", d.SerializeToString(), msg_id=msg_id or d.idempotency_key)
        frames, result = [], None
        try:
            while True:
                try:
                    subj, _, hdr, data = q.get(timeout=15)
                except queue.Empty:
                    break
                if subj == io_subj:
                    frames.append(NIO.NodeIOEvent.FromString(data))
                elif subj == res_subj:
                    result = AS.AgentStepResult.FromString(data)
                    self.assertEqual(nc.headers(hdr).get("Nats-Msg-Id"), d.idempotency_key)
                    break
        finally:
            for sid in sids:
                nc.unsubscribe(sid)
        return result, frames

    def test_agent_step(self):
        nc = nats_mini.Nats(NATS)
        try:
            script = [{"status": "THINKING"}, {"tokens": " ".join("w%d" % i for i in range(40))},
                      {"tool_call": {"tool_name": "search", "tool_call_id": "t1", "arguments": {"q": "x"}}},
                      {"tool_result": {"tool_call_id": "t1", "result": {"hits": 3}}},
                      {"complete": "{\"answer\": 42}"}]
            d = self.dispatch(nc, "#!script\n" + json.dumps(script))
            result, frames = self.run_step(nc, d)
            self.assertIsNotNone(result, "no AgentStepResult")
            self.assertEqual(result.WhichOneof("outcome"), "completed")
            self.assertEqual(result.completed.text, '{"answer": 42}')
            self.assertEqual(result.completed.output["answer"], 42)
            self.assertEqual((result.run_id, result.step_name, result.attempt), (d.run_id, "draft", 1))
            self.assertEqual(result.agent_id, self.agent)
            self.assertEqual(len(result.session_id), 36)
            live = [f.frame for f in frames if f.HasField("frame")]
            self.assertEqual([f.seq for f in live], list(range(1, len(live) + 1)))
            self.assertTrue(all(f.session_id == result.session_id and f.node_id == "draft" for f in live))
            kinds = [f.WhichOneof("event") for f in live]
            self.assertEqual(kinds[0], "status")
            toks = "".join(f.token_text for f in live if f.WhichOneof("event") == "token_text")
            self.assertEqual(toks.split(), ["w%d" % i for i in range(40)])
            self.assertLess(kinds.count("token_text"), 40)  # coalesced
            self.assertIn("tool_call", kinds)
            self.assertIn("tool_result", kinds)
            tr = [f.transcript.event_type for f in frames if f.HasField("transcript")]
            self.assertEqual(tr, ["tool_call", "tool_result", "assistant_message"])
            # redelivered (another message id, so JetStream stores it): answered from the record
            again, frames2 = self.run_step(nc, d, msg_id=uuid.uuid4().hex)
            self.assertIsNotNone(again)
            self.assertEqual(again.session_id, result.session_id)
            self.assertEqual(again.completed.text, result.completed.text)
            self.assertEqual([f for f in frames2 if f.HasField("frame")], [])
            # unknown role: failed, not retryable
            bad, _ = self.run_step(nc, self.dispatch(nc, "hi", role="astronaut"))
            self.assertEqual(bad.WhichOneof("outcome"), "failed")
            self.assertEqual(bad.failed.code, "agent_not_found")
            self.assertFalse(bad.failed.retryable)
        finally:
            nc.close()

    def test_heartbeats_recorded(self):
        # devworkers heartbeat to replica A: their liveness keys exist in Redis with a TTL
        out = subprocess.run(["redis-cli", "-u", REDIS, "--scan", "--pattern", "orch:worker:*"],
                             capture_output=True, text=True, timeout=10).stdout
        for w in self.w:
            self.assertIn("orch:worker:" + w.addr, out)
            ttl = subprocess.run(["redis-cli", "-u", REDIS, "PTTL", "orch:worker:" + w.addr],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
            self.assertGreater(int(ttl), 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
