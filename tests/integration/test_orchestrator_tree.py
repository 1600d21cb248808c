"""orchestrator subagent trees over real gRPC (grpcio) with real Postgres, Redis and NATS:
ListChildren, GetParentSession, GetSubagentTree, TerminateSubagentTree.

Nothing creates child sessions over the public API yet (delegation is driven by workers, a later
piece), so the tests create roots with CreateSession and then children and their bridge rows
(subagent_invocations) directly in Postgres, copying the root's row; every assertion goes
through the gRPC methods. Each test builds its trees in the class's org; a second org checks
tenancy. Processes are stopped by pid.
"""
import os
import secrets
import subprocess
import sys
import threading
import itertools
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
import fake_worker  # noqa: E402
from test_orchestrator import apply_agent, drain, AGENT  # noqa: E402

SECRET = secrets.token_hex(32)
KEK = "k1:" + secrets.token_hex(32)
LC = "/upsquad.runtime.v1.LifecycleService/"
MIGRATIONS = os.path.join(T.ROOT, "services", "orchestrator", "migrations")


def psql(org, sql):
    """Runs sql as the service's role inside org (row-level security as the service sees it)."""
    full = "SELECT set_config('app.org_id', '%s', false);\n%s" % (org, sql)
    out = subprocess.run(["psql", DSN, "-X", "-Atq", "-v", "ON_ERROR_STOP=1"], input=full,
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return out.stdout.strip().split("\n", 1)[1] if "\n" in out.stdout.strip() else ""


class Tree(unittest.TestCase):
    procs = []
    clock = itertools.count(1)  # seconds after its parent each child starts: creation order

    @classmethod
    def setUpClass(cls):
        cls.fake = fake_worker.FakeWorker()
        env = {"UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_PG_DSN": DSN,
               "UPSQUAD_MIGRATIONS_DIR": MIGRATIONS, "UPSQUAD_REDIS_URL": REDIS,
               "UPSQUAD_NATS_URL": NATS, "UPSQUAD_KEK": KEK, "UPSQUAD_WORKER_PROBE": "200ms",
               "UPSQUAD_WORKER_TARGETS": cls.fake.addr, "UPSQUAD_LOG_LEVEL": "info"}
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
        # under BUILD=build-asan a sanitizer report (leaks at exit included) fails the file
        time.sleep(0.2)
        report = [line for line in cls.orch.log if "Sanitizer" in line or "runtime error:" in line]
        if report or cls.orch.proc.returncode not in (0, -15):
            raise AssertionError("orchestrator exit %s: %s" % (cls.orch.proc.returncode, "".join(report[:20])))

    # ---- helpers ----
    def tok(self, org=None):
        return T.mint(SECRET, sub=self.user, org=org or self.org)

    def unary(self, method, req, resp_cls, token=None):
        fn = self.ch.unary_unary(LC + method, request_serializer=req.SerializeToString,
                                 response_deserializer=resp_cls.FromString)
        return fn(req, metadata=[("authorization", "Bearer " + (token or self.tok()))], timeout=30)

    def code(self, fn):
        with self.assertRaises(grpc.RpcError) as cm:
            fn()
        return cm.exception.code(), cm.exception.details()

    def root(self, org=None):
        agent = self.agent2 if org == self.org2 else self.agent
        r = self.unary("CreateSession", L.CreateSessionRequest(agent_id=agent),
                       L.CreateSessionResponse, token=self.tok(org))
        return r.session_id

    def children(self, parent, specs, org=None):
        """Creates children of parent, each with its bridge row, started in creation order
        (later than every earlier child, after the parent). spec: dict(role, status, error_code,
        state). Returns [(session_id, invocation_id)]."""
        org = org or self.org
        out, sql = [], []
        for s in specs:
            sid, inv = str(uuid.uuid4()), str(uuid.uuid4())
            state = s.get("state", "active")
            ended = "now()" if state in ("terminated", "error", "crashed") else "NULL"
            sql.append(
                "INSERT INTO sessions (session_id, org_id, user_id, agent_id, state, kind,"
                " execution_mode, model_id, snapshot, snapshot_hash, max_loops, parent_session_id,"
                " root_session_id, delegation_depth, started_at, ended_at)"
                " SELECT '%s', org_id, user_id, agent_id, '%s', kind, execution_mode, model_id,"
                " snapshot, snapshot_hash, max_loops, session_id, coalesce(root_session_id, session_id),"
                " delegation_depth + 1, started_at + interval '%d seconds', %s"
                " FROM sessions WHERE session_id = '%s';" % (sid, state, next(self.clock), ended, parent))
            sql.append("INSERT INTO session_directory (session_id, org_id) VALUES ('%s', '%s');" % (sid, org))
            sql.append(
                "INSERT INTO subagent_invocations (id, org_id, parent_session_id, child_session_id,"
                " subagent_role, status, error_code) VALUES ('%s', current_org(), '%s', '%s', '%s',"
                " '%s', '%s');" % (inv, parent, sid, s.get("role", "research"),
                                   s.get("status", "pending"), s.get("error_code", "")))
            out.append((sid, inv))
        psql(org, "\n".join(sql))
        return out

    def fan(self, parents, n):
        """n bare children (bridge rows pending) under each of parents, in three set-based
        statements. Returns the new ids, parent by parent, each parent's in order."""
        rows = [(str(uuid.uuid4()), str(uuid.uuid4()), p, next(self.clock)) for p in parents for _ in range(n)]
        v = ",".join("('%s','%s','%s',%d)" % r for r in rows)
        psql(self.org, "\n".join((
            "INSERT INTO sessions (session_id, org_id, user_id, agent_id, state, kind, execution_mode,"
            " model_id, snapshot, snapshot_hash, max_loops, parent_session_id, root_session_id,"
            " delegation_depth, started_at)"
            " SELECT v.id::uuid, p.org_id, p.user_id, p.agent_id, 'active', p.kind, p.execution_mode,"
            " p.model_id, p.snapshot, p.snapshot_hash, p.max_loops, p.session_id,"
            " coalesce(p.root_session_id, p.session_id), p.delegation_depth + 1,"
            " p.started_at + v.n * interval '1 second'"
            " FROM (VALUES %s) v(id, inv, parent, n) JOIN sessions p ON p.session_id = v.parent::uuid;" % v,
            "INSERT INTO session_directory (session_id, org_id) SELECT id::uuid, current_org()"
            " FROM (VALUES %s) v(id, inv, parent, n);" % v,
            "INSERT INTO subagent_invocations (id, org_id, parent_session_id, child_session_id, subagent_role)"
            " SELECT inv::uuid, current_org(), parent::uuid, id::uuid, 'bulk'"
            " FROM (VALUES %s) v(id, inv, parent, n);" % v)))
        return [r[0] for r in rows]

    def child(self, parent, org=None, **spec):
        return self.children(parent, [spec], org=org)[0][0]

    def parent(self, sid, token=None):
        return self.unary("GetParentSession", L.GetParentSessionRequest(session_id=sid),
                          L.GetParentSessionResponse, token=token)

    def list(self, sid, token=None, **kw):
        return self.unary("ListChildren", L.ListChildrenRequest(session_id=sid, **kw),
                          L.ListChildrenResponse, token=token)

    def tree(self, sid, token=None, **kw):
        return self.unary("GetSubagentTree", L.GetSubagentTreeRequest(session_id=sid, **kw),
                          L.GetSubagentTreeResponse, token=token)

    def terminate(self, sid, token=None, **kw):
        return self.unary("TerminateSubagentTree", L.TerminateSubagentTreeRequest(session_id=sid, **kw),
                          L.TerminateSubagentTreeResponse, token=token)

    # ---- GetParentSession ----
    def test_parent_of_root(self):
        r = self.root()
        p = self.parent(r)
        self.assertTrue(p.is_root)
        self.assertFalse(p.HasField("parent"))

    def test_parent_of_child(self):
        r = self.root()
        (c, inv_c), = self.children(r, [dict(role="research", status="ok", error_code="IGNORED")])
        (g, inv_g), = self.children(c, [dict(role="coder", status="error", error_code="TOOL_FAILED")])
        p = self.parent(c)
        self.assertFalse(p.is_root)
        link = p.parent
        # the parent's own fields ...
        self.assertEqual(link.session_id, r)
        self.assertEqual(link.parent_session_id, "")
        self.assertEqual(link.root_session_id, r)
        self.assertEqual(link.delegation_depth, 0)
        self.assertEqual(link.agent_id, self.agent)
        self.assertEqual(link.status, "active")
        self.assertTrue(link.started_at.seconds > 0)
        self.assertFalse(link.HasField("ended_at"))
        # ... with the bridge row of the edge parent -> queried session
        self.assertEqual(link.subagent_invocation_id, inv_c)
        self.assertEqual(link.subagent_role, "research")
        self.assertEqual(link.result_status, "ok")
        self.assertEqual(link.result_error_code, "")  # only echoed when not ok
        link = self.parent(g).parent
        self.assertEqual(link.session_id, c)
        self.assertEqual(link.parent_session_id, r)
        self.assertEqual(link.root_session_id, r)
        self.assertEqual(link.delegation_depth, 1)
        self.assertEqual(link.subagent_invocation_id, inv_g)
        self.assertEqual(link.subagent_role, "coder")
        self.assertEqual(link.result_status, "error")
        self.assertEqual(link.result_error_code, "TOOL_FAILED")

    # ---- ListChildren ----
    def test_list_children_pages(self):
        r = self.root()
        kids = self.children(r, [dict(role="r%d" % i) for i in range(5)])
        self.child(kids[0][0])  # a grandchild: not a direct child
        want = [k for k, _ in kids]
        got, token, pages = [], "", 0
        while True:
            page = self.list(r, page_size=2, page_token=token)
            pages += 1
            self.assertEqual(page.total_count, 5)
            self.assertLessEqual(len(page.children), 2)
            got += [c.session_id for c in page.children]
            token = page.next_page_token
            if not token:
                break
        self.assertEqual(pages, 3)
        self.assertEqual(got, want)  # started_at order, no duplicates, no gaps
        c = self.list(r).children[0]
        self.assertEqual(c.parent_session_id, r)
        self.assertEqual(c.root_session_id, r)
        self.assertEqual(c.delegation_depth, 1)
        self.assertEqual(c.agent_id, self.agent)
        self.assertEqual(c.subagent_role, "r0")
        self.assertEqual(c.subagent_invocation_id, kids[0][1])
        self.assertEqual(c.result_status, "pending")
        self.assertEqual(c.status, "active")
        self.assertFalse(c.HasField("ended_at"))
        # 0 is the default (20); above 100 is served as 100
        self.assertEqual(len(self.list(r, page_size=0).children), 5)
        self.assertEqual(len(self.list(r, page_size=1000).children), 5)
        # a leaf has no children
        leaf = self.list(kids[4][0])
        self.assertEqual((len(leaf.children), leaf.total_count, leaf.next_page_token), (0, 0, ""))

    def test_list_children_bad_input(self):
        r = self.root()
        self.children(r, [{}, {}, {}])
        c, d = self.code(lambda: self.list(r, page_size=-1))
        self.assertEqual(c, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("page_size", d)
        token = self.list(r, page_size=1).next_page_token
        self.assertTrue(token)
        # tampered: each half of the token
        for bad in (token[:-2] + ("AA" if token[-2:] != "AA" else "BB"),
                    ("B" if token[0] != "B" else "C") + token[1:], "garbage", "1_" + str(uuid.uuid4())):
            c, d = self.code(lambda: self.list(r, page_size=1, page_token=bad))
            self.assertEqual(c, grpc.StatusCode.INVALID_ARGUMENT, bad)
            self.assertIn("page_token", d)
        # a token of another session's children
        other = self.root()
        self.children(other, [{}, {}])
        c, d = self.code(lambda: self.list(other, page_size=1, page_token=token))
        self.assertEqual(c, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("page_token", d)
        # the same session's token presented by another org
        c, _ = self.code(lambda: self.list(r, page_size=1, page_token=token, token=self.tok(self.org2)))
        self.assertEqual(c, grpc.StatusCode.INVALID_ARGUMENT)
        # the genuine token still works
        self.assertEqual(len(self.list(r, page_size=1, page_token=token).children), 1)

    # ---- GetSubagentTree ----
    def test_tree_dfs_and_depth(self):
        r = self.root()
        (a, _), (b, _) = self.children(r, [dict(role="a"), dict(role="b")])
        a1 = self.child(a, role="a1", status="timeout", error_code="DEADLINE")
        a1x = self.child(a1, role="a1x")
        b1 = self.child(b, role="b1")
        t = self.tree(r)  # default depth 3: all four levels (0..3)
        self.assertEqual([n.session_id for n in t.nodes], [r, a, a1, a1x, b, b1])
        self.assertEqual(t.truncated_at_depth, 0)
        self.assertFalse(t.truncated_at_fanout)
        root = t.nodes[0]
        self.assertEqual((root.parent_session_id, root.subagent_role, root.subagent_invocation_id,
                          root.result_status, root.delegation_depth), ("", "", "", "", 0))
        n = t.nodes[2]
        self.assertEqual((n.parent_session_id, n.root_session_id, n.delegation_depth,
                          n.subagent_role, n.result_status, n.result_error_code),
                         (a, r, 2, "a1", "timeout", "DEADLINE"))
        a1xy = self.child(a1x, role="deep")
        t = self.tree(r)
        self.assertNotIn(a1xy, [n.session_id for n in t.nodes])
        self.assertEqual(t.truncated_at_depth, 3)
        t = self.tree(r, max_depth=1)
        self.assertEqual([n.session_id for n in t.nodes], [r, a, b])
        self.assertEqual(t.truncated_at_depth, 1)
        t = self.tree(r, max_depth=4)
        self.assertEqual([n.session_id for n in t.nodes], [r, a, a1, a1x, a1xy, b, b1])
        self.assertEqual(t.truncated_at_depth, 0)
        # above 10 is served as 10
        t = self.tree(r, max_depth=50)
        self.assertEqual(len(t.nodes), 7)
        self.assertEqual(t.truncated_at_depth, 0)
        # a subtree: its node first, with its own parent
        t = self.tree(a, max_depth=1)
        self.assertEqual([n.session_id for n in t.nodes], [a, a1])
        self.assertEqual(t.nodes[0].parent_session_id, r)
        self.assertEqual(t.truncated_at_depth, 1)
        c, d = self.code(lambda: self.tree(r, max_depth=-1))
        self.assertEqual(c, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("max_depth", d)

    def test_tree_depth_ten(self):
        r = self.root()
        chain = [r]
        for _ in range(11):
            chain.append(self.child(chain[-1]))
        t = self.tree(r, max_depth=10)
        self.assertEqual([n.session_id for n in t.nodes], chain[:11])
        self.assertEqual([n.delegation_depth for n in t.nodes], list(range(11)))
        self.assertEqual(t.truncated_at_depth, 10)
        t = self.tree(r, max_depth=99)
        self.assertEqual(t.truncated_at_depth, 10)

    def test_tree_fanout(self):
        r = self.root()
        kids = self.children(r, [{} for _ in range(50)])
        t = self.tree(r, max_depth=1)
        self.assertEqual(len(t.nodes), 51)
        self.assertFalse(t.truncated_at_fanout)
        extra = self.child(r)
        t = self.tree(r, max_depth=1)
        self.assertEqual(len(t.nodes), 51)  # the node and the first 50 children
        self.assertTrue(t.truncated_at_fanout)
        self.assertEqual([n.session_id for n in t.nodes[1:]], [k for k, _ in kids])
        self.assertNotIn(extra, [n.session_id for n in t.nodes])
        # the rest pages through ListChildren
        lc = self.list(r, page_size=100)
        self.assertEqual(lc.total_count, 51)
        self.assertEqual(lc.children[-1].session_id, extra)

    def test_node_and_cascade_bounds(self):
        r = self.root()
        level1 = self.fan([r], 50)
        level2 = self.fan(level1, 21)  # 1 + 50 + 1050 nodes: above the 1000-node bound
        t = self.tree(r, max_depth=2)
        ids = [n.session_id for n in t.nodes]
        self.assertEqual(len(ids), 1000)
        self.assertTrue(t.truncated_at_fanout)  # no node has more than 50 children: the node bound
        self.assertEqual(t.truncated_at_depth, 0)
        self.assertEqual(ids[:24], [r, level1[0]] + level2[:21] + [level1[1]])  # DFS
        want = [r]
        for i, p in enumerate(level1):
            want += [p] + level2[21 * i:21 * (i + 1)]
        self.assertEqual(ids, want[:1000])
        # the cascade refuses more than 1000 sessions, changing nothing
        c, d = self.code(lambda: self.terminate(r, include_root=True))
        self.assertEqual(c, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("1000", d)
        self.assertEqual({n.status for n in self.tree(r, max_depth=2).nodes}, {"active"})
        # a subtree goes
        t = self.terminate(level1[0], include_root=True)
        self.assertEqual(len(t.terminated_session_ids), 22)
        self.assertEqual(t.updated_bridge_row_count, 22)

    # ---- TerminateSubagentTree ----
    def audit(self, sid):
        return psql(self.org, "SELECT string_agg(action_type || ':' || coalesce(detail->>'reason', ''),"
                    " ',' ORDER BY seq) FROM audit_log WHERE session_id = '%s';" % sid)

    def test_terminate_tree(self):
        r = self.root()
        (a, inv_a), (b, inv_b) = self.children(r, [dict(role="a"), dict(role="b", state="terminated",
                                                                        status="pending")])
        (a1, inv_a1), (a2, inv_a2) = self.children(a, [dict(role="a1"), dict(role="a2", status="ok")])
        told_before = list(self.fake.terminated)
        t = self.terminate(r, reason="operator stop")
        self.assertEqual(sorted(t.terminated_session_ids), sorted([a, a1, a2]))
        self.assertEqual(list(t.skipped_session_ids), [b])
        self.assertEqual(t.updated_bridge_row_count, 2)  # a and a1 pending; a2 ok; b not ended here
        # the root lives on; the descendants are over, audited with the reason
        nodes = {n.session_id: n for n in self.tree(r).nodes}
        self.assertEqual(nodes[r].status, "active")
        self.assertFalse(nodes[r].HasField("ended_at"))
        for s in (a, a1, a2):
            self.assertEqual(nodes[s].status, "terminated")
            self.assertTrue(nodes[s].HasField("ended_at"))
            self.assertEqual(self.audit(s), "session_terminated:operator stop")
        self.assertEqual(self.audit(r), "session_started:")
        self.assertEqual((nodes[a].result_status, nodes[a1].result_status, nodes[a2].result_status,
                          nodes[b].result_status), ("cancelled", "cancelled", "ok", "pending"))
        # the workers were told (best effort)
        told = self.fake.terminated[len(told_before):]
        self.assertEqual(sorted(told), sorted([a, a1, a2]))
        # a terminated session takes no messages
        fn = self.ch.unary_stream(LC + "SendMessage", request_serializer=L.SendMessageRequest.SerializeToString,
                                  response_deserializer=L.AgentEvent.FromString)
        with self.assertRaises(grpc.RpcError) as cm:
            list(fn(L.SendMessageRequest(session_id=a, message="hi"),
                    metadata=[("authorization", "Bearer " + self.tok())], timeout=10))
        self.assertEqual(cm.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
        # idempotent: everything skipped, nothing flipped, nothing audited again
        t2 = self.terminate(r, reason="again")
        self.assertEqual(list(t2.terminated_session_ids), [])
        self.assertEqual(sorted(t2.skipped_session_ids), sorted([a, a1, a2, b]))
        self.assertEqual(t2.updated_bridge_row_count, 0)
        self.assertEqual(self.audit(a), "session_terminated:operator stop")
        # include_root: the root too
        t3 = self.terminate(r, include_root=True)
        self.assertEqual(list(t3.terminated_session_ids), [r])
        self.assertEqual(t3.updated_bridge_row_count, 0)
        self.assertEqual(self.tree(r, max_depth=0).nodes[0].status, "terminated")
        self.assertEqual(self.audit(r), "session_started:,session_terminated:terminated with its subagent tree")

    def test_terminate_subtree_only(self):
        r = self.root()
        (a, _), (b, _) = self.children(r, [{}, {}])
        a1 = self.child(a)
        t = self.terminate(a, include_root=True, reason="x")
        self.assertEqual(list(t.terminated_session_ids), [a, a1])  # parents first
        self.assertEqual(t.updated_bridge_row_count, 2)
        nodes = {n.session_id: n.status for n in self.tree(r).nodes}
        self.assertEqual(nodes, {r: "active", a: "terminated", a1: "terminated", b: "active"})
        c, d = self.code(lambda: self.terminate(r, reason="x" * 1025))
        self.assertEqual(c, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("reason", d)
        self.assertEqual(self.tree(r).nodes[0].status, "active")

    def test_terminate_concurrent(self):
        """Overlapping cascades at once: each session ends exactly once, audited once, no
        deadlock (rows are locked parents first in both)."""
        r = self.root()
        level1 = self.fan([r], 5)
        level2 = self.fan(level1, 4)
        results, errors = [], []

        def run(sid):
            try:
                results.append(self.terminate(sid, include_root=True, reason="race"))
            except grpc.RpcError as e:
                errors.append(e)
        threads = [threading.Thread(target=run, args=(s,)) for s in (r, level1[0], level1[3], r)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self.assertEqual(errors, [])
        ended = [s for res in results for s in res.terminated_session_ids]
        self.assertEqual(sorted(ended), sorted([r] + level1 + level2))  # each exactly once
        self.assertEqual(sum(res.updated_bridge_row_count for res in results), 25)
        for s in [r] + level1[:1] + level2[:1]:
            self.assertEqual(self.audit(s).count("session_terminated"), 1)

    # ---- every method: validation, tenancy ----
    def calls(self, sid, token=None, **kw):
        return (lambda: self.parent(sid, token=token),
                lambda: self.list(sid, token=token),
                lambda: self.tree(sid, token=token),
                lambda: self.terminate(sid, token=token, include_root=True))

    def test_bad_session_id(self):
        for sid in ("", "not-a-uuid", "1234"):
            for fn in self.calls(sid):
                c, d = self.code(fn)
                self.assertEqual(c, grpc.StatusCode.INVALID_ARGUMENT, sid)
                self.assertIn("session_id", d)
        for fn in self.calls(str(uuid.uuid4())):
            c, d = self.code(fn)
            self.assertEqual(c, grpc.StatusCode.NOT_FOUND)
            self.assertIn("session_id", d)

    def test_cross_tenant(self):
        r = self.root()
        a = self.child(r)
        other = self.tok(self.org2)
        for sid in (r, a):
            for fn in self.calls(sid, token=other):
                c, _ = self.code(fn)
                self.assertEqual(c, grpc.StatusCode.NOT_FOUND)
        # nothing changed, and tenant_id in the request is ignored (the token's org rules)
        t = self.unary("GetSubagentTree", L.GetSubagentTreeRequest(session_id=r, tenant_id=self.org2),
                       L.GetSubagentTreeResponse)
        self.assertEqual([(n.session_id, n.status) for n in t.nodes], [(r, "active"), (a, "active")])
        c, _ = self.code(lambda: self.unary(
            "ListChildren", L.ListChildrenRequest(session_id=r, tenant_id=self.org), L.ListChildrenResponse,
            token=other))
        self.assertEqual(c, grpc.StatusCode.NOT_FOUND)
        # another org's tree under the same shape is its own
        r2 = self.root(org=self.org2)
        a2 = self.child(r2, org=self.org2)
        self.assertEqual([c.session_id for c in self.list(r2, token=other).children], [a2])
        self.assertEqual(self.list(r).total_count, 1)

    def test_unauthenticated(self):
        for fn in self.calls(str(uuid.uuid4()), token="garbage"):
            c, _ = self.code(fn)
            self.assertEqual(c, grpc.StatusCode.UNAUTHENTICATED)


if __name__ == "__main__":
    unittest.main(verbosity=2)
