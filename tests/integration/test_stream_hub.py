"""stream-hub over real gRPC (grpcio), with real Postgres and NATS, two replicas.

The inputs are published by build/bin/hub-publisher exactly as the workflow-engine (RunEvent on
wf.status / wf.log, JetStream with Nats-Msg-Id) and the orchestrator (NodeIOEvent on wfio) put
them on the bus. The test creates a throw-away database, uses its own durable consumer names
(so other runs on the same NATS are not disturbed), starts replicas A and B of
build/bin/stream-hub on free loopback ports and stops them by pid. Every test uses fresh org
and run UUIDs.
"""
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import unittest
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
import upsquad_testlib as T  # noqa: E402
from upsquad_testlib import psql, with_database  # noqa: E402

DSN = os.environ.get("UPSQUAD_PG_DSN_STREAM_HUB")
ADMIN_DSN = os.environ.get("UPSQUAD_PG_ADMIN_DSN")
NATS = os.environ.get("UPSQUAD_NATS_URL")
if not DSN or not NATS or not ADMIN_DSN:
    print("SKIP: UPSQUAD_PG_DSN_STREAM_HUB, UPSQUAD_PG_ADMIN_DSN and UPSQUAD_NATS_URL are required")
    sys.exit(0)

import grpc  # noqa: E402
from google.protobuf import json_format  # noqa: E402
from upsquad.workflow.v1 import workflow_pb2 as W  # noqa: E402

SVC = "/upsquad.workflow.v1.WorkflowService/"
MIGRATIONS = os.path.join(T.ROOT, "services", "stream-hub", "migrations")
PUBLISHER = os.path.join(T.BUILD, "bin", "hub-publisher")
SECRET = secrets.token_hex(16)
TAG = "%d%s" % (os.getpid(), secrets.token_hex(3))
QUEUE = 64          # frames per subscriber queue (UPSQUAD_RPC_STREAM_QUEUE)
HOLE_WAIT_S = 10  # UPSQUAD_HUB_HOLE_WAIT here (45 s by default)
STALL_MS = 1500     # UPSQUAD_HUB_STALL_LIMIT
MANY = int(os.environ.get("HUB_TEST_SUBSCRIPTIONS", "1000"))

METHODS = {
    "StreamRunStatus": (W.StreamRunStatusRequest, W.StreamRunStatusResponse),
    "StreamRunLogs": (W.StreamRunLogsRequest, W.StreamRunLogsResponse),
    "StreamNodeIO": (W.StreamNodeIORequest, W.StreamNodeIOResponse),
    "StreamVisibleRuns": (W.StreamVisibleRunsRequest, W.VisibleRunEvent),
}


def uid():
    return str(uuid.uuid4())


def wait_until(pred, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.03)
    raise AssertionError("timed out waiting for " + what)


class Publisher:
    """hub-publisher as a subprocess: one JSON command per line, one answer per line."""

    def __init__(self):
        self.p = subprocess.Popen([PUBLISHER, NATS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
        self.mu = threading.Lock()

    def __call__(self, op, **kw):
        kw["op"] = op
        with self.mu:
            self.p.stdin.write(json.dumps(kw) + "\n")
            self.p.stdin.flush()
            line = self.p.stdout.readline().strip()
        if not line.startswith("ok"):
            raise RuntimeError("publisher: %r for %r" % (line, kw))
        return line

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=10)
        self.p.stdout.close()


class Reader(threading.Thread):
    """Reads one server stream into a list; records the final status code."""

    def __init__(self, rpc, req, md, pause_after_first=0.0, hold=None):
        super().__init__(daemon=True)
        self.call = rpc(req, metadata=md, timeout=60)
        self.msgs = []
        self.code = None
        self.details = ""
        self.pause = pause_after_first
        self.hold = hold  # a threading.Event: after the first frame, no reading until it is set
        self.start()

    def run(self):
        try:
            for m in self.call:
                self.msgs.append(m)
                if self.pause:  # a client that stops reading for a while
                    time.sleep(self.pause)
                    self.pause = 0
                if self.hold:
                    self.hold.wait(30)
                    self.hold = None
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.code = e.code()
            self.details = e.details()

    def cancel(self):
        self.call.cancel()


class StreamHub(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        name = "hub_it_%s" % TAG
        psql(ADMIN_DSN, "CREATE DATABASE %s" % name)
        cls.db = name
        cls.admin = with_database(ADMIN_DSN, name)
        psql(cls.admin, "CREATE SCHEMA stream_hub AUTHORIZATION stream_hub")
        cls.dsn = with_database(DSN, name)
        cls.servers = []
        cls.a = cls.start()
        cls.b = cls.start()
        cls.pub = Publisher()
        cls.channels = {}

    @classmethod
    def start(cls, **extra):
        env = {
            "UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_PG_DSN": cls.dsn, "UPSQUAD_NATS_URL": NATS,
            "UPSQUAD_MIGRATIONS_DIR": MIGRATIONS, "UPSQUAD_LOG_LEVEL": "warn",
            "UPSQUAD_HUB_PROJECTION_DURABLE": "hub-it-%s-events" % TAG,
            "UPSQUAD_HUB_TRANSCRIPT_DURABLE": "hub-it-%s-io" % TAG,
            "UPSQUAD_HUB_PROJECTION_FROM": "new",
            "UPSQUAD_RPC_STREAM_QUEUE": str(QUEUE), "UPSQUAD_HUB_STALL_LIMIT": "%dms" % STALL_MS,
            "UPSQUAD_RPC_MAX_STREAMS": "4096", "UPSQUAD_RPC_STREAM_WORKERS": "16",
            "UPSQUAD_SHUTDOWN_GRACE": "2s", "UPSQUAD_HUB_NEW_RUN_GRACE": "1s",
            "UPSQUAD_HUB_HOLE_WAIT": "%ds" % HOLE_WAIT_S}
        env.update(extra)
        srv = T.Server("stream-hub", env=env)
        cls.servers.append(srv)
        return srv

    @classmethod
    def tearDownClass(cls):
        for ch in cls.channels.values():
            ch.close()
        cls.pub.close()
        for s in cls.servers:
            s.stop()
        psql(ADMIN_DSN, "DROP DATABASE %s WITH (FORCE)" % cls.db)

    def retire(self, srv):
        """A replica a test started and stopped: out of the class's list, its log kept for
        tearDown's report."""
        self.__class__.servers.remove(srv)
        self.retired = getattr(self, "retired", []) + [srv]

    def tearDown(self):
        # a failure shows its assertion and the replicas' warnings (hub.hole, hub.project,
        # hub.repair) next to the test's name, where a CI excerpt of the output keeps them
        res = self._outcome.result
        mine = [tb for t, tb in list(res.failures) + list(res.errors) if t is self]
        if mine:
            print("failed: %s" % " / ".join(mine[-1].strip().splitlines()[-6:])[-1200:],
                  file=sys.stderr)
            for srv in self.servers + getattr(self, "retired", []):
                warns = [l for l in srv.log_text().splitlines() if '"hub.' in l or '"bus.' in l]
                print("%s warnings: %s" % (srv.addr, " | ".join(warns[-8:])[-1500:]),
                      file=sys.stderr)

    # ---- helpers ----
    def channel(self, srv):
        ch = self.channels.get(srv.addr)
        if ch is None:
            ch = self.channels[srv.addr] = grpc.insecure_channel(srv.addr)
        return ch

    def rpc(self, srv, method):
        req, resp = METHODS[method]
        return self.channel(srv).unary_stream(SVC + method, request_serializer=req.SerializeToString,
                                              response_deserializer=resp.FromString)

    @staticmethod
    def handled(srv):
        """Frames srv queued to its subscribers or dropped."""
        return srv.metric("stream_hub_frames_total") + srv.metric("stream_hub_dropped_frames_total")

    def small_window_node_io(self, srv, key):
        """StreamNodeIO on a connection of its own without BDP probing: its HTTP/2 window stays
        at 64 KiB, so what a slow client does not read backs up into the hub's queue quickly."""
        small = grpc.insecure_channel(srv.addr, options=[("grpc.http2.bdp_probe", 0),
                                                         ("grpc.use_local_subchannel_pool", 1)])
        self.channels[key] = small
        return small.unary_stream(SVC + "StreamNodeIO",
                                  request_serializer=W.StreamNodeIORequest.SerializeToString,
                                  response_deserializer=W.StreamNodeIOResponse.FromString)

    def token(self, org, clearance=5, teams=(), sub=None):
        return T.mint(SECRET, sub=sub or uid(), org=org, clearance=clearance, teams=teams)

    def md(self, org, extra=(), **kw):
        return (("authorization", "Bearer " + self.token(org, **kw)),) + tuple(extra)

    def read(self, srv, method, req, org, extra=(), **kw):
        return Reader(self.rpc(srv, method), req, self.md(org, extra, **kw))

    def transcript(self, srv, org, run, node, clearance=5, sub=None):
        call = self.channel(srv).unary_unary(
            SVC + "GetNodeTranscript", request_serializer=W.GetNodeTranscriptRequest.SerializeToString,
            response_deserializer=W.GetNodeTranscriptResponse.FromString)
        return call(W.GetNodeTranscriptRequest(run_id=run, node_id=node),
                    metadata=self.md(org, clearance=clearance, sub=sub), timeout=10)

    def projected(self, run, seq):
        """Waits until the projection holds the run's event `seq`."""
        wait_until(lambda: psql(self.admin, "SELECT count(*) FROM stream_hub.run_events "
                                "WHERE run_id = '%s' AND seq = %d" % (run, seq)) == "1",
                   15, "seq %d of run %s in the projection" % (seq, run))

    def new_run(self, org, team="", status="running", visibility="team", owner="", name="wf"):
        run = uid()
        self.pub("run", org=org, run=run, seq=1, status=status, team=team, visibility=visibility,
                 owner=owner, workflow_name=name, workflow_id=uid(), nodes_total=3)
        return run

    def assertFailsFirst(self, reader, code):
        reader.join(15)
        self.assertEqual(reader.code, code, reader.details)
        self.assertEqual(reader.msgs, [], "frames sent before the error")

    def test_a_run_subscribed_before_its_first_event_is_projected_is_served(self):
        # A client may subscribe the moment TriggerWorkflow returns: the hub looks the run up
        # again for UPSQUAD_HUB_NEW_RUN_GRACE (1 s here) before answering NOT_FOUND.
        org, run = uid(), uid()
        r = self.read(self.a, "StreamRunStatus", W.StreamRunStatusRequest(run_id=run), org)
        time.sleep(0.3)
        self.pub("run", org=org, run=run, seq=1, status="running", team="", visibility="team",
                 owner="", workflow_name="wf", workflow_id=uid(), nodes_total=1)
        self.pub("node", org=org, run=run, seq=2, node_id="plan", status="running")
        wait_until(lambda: r.msgs or r.code is not None, 15, "a frame of the new run")
        r.cancel()
        self.assertTrue(r.msgs, "ended %s: %s" % (r.code, r.details))

    # ---- tenancy and arguments ----
    def test_foreign_and_unknown_runs_are_not_found_before_anything_is_sent(self):
        org, other = uid(), uid()
        run = self.new_run(org)
        self.projected(run, 1)
        for method, req in (("StreamRunStatus", W.StreamRunStatusRequest(run_id=run)),
                            ("StreamRunLogs", W.StreamRunLogsRequest(run_id=run)),
                            ("StreamNodeIO", W.StreamNodeIORequest(run_id=run))):
            for srv in (self.a, self.b):
                self.assertFailsFirst(self.read(srv, method, req, other), grpc.StatusCode.NOT_FOUND)
            unknown = type(req)(run_id=uid())
            self.assertFailsFirst(self.read(self.a, method, unknown, org), grpc.StatusCode.NOT_FOUND)
            # a token whose org is not a tenant UUID is a bad token, as in every service
            self.assertFailsFirst(self.read(self.a, method, req, "not-a-tenant"),
                                  grpc.StatusCode.UNAUTHENTICATED)
            # spec: run_id is "the workflow run UUID (required)"; a malformed one is bad input,
            # the same answer the workflow-engine gives for GetWorkflowStatus
            bad_id = self.read(self.a, method, type(req)(run_id="not-a-uuid"), org)
            self.assertFailsFirst(bad_id, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("run_id", bad_id.details)
            self.assertFailsFirst(self.read(self.a, method, type(req)(), org),
                                  grpc.StatusCode.INVALID_ARGUMENT)
            r = Reader(self.rpc(self.a, method), req, ())
            self.assertFailsFirst(r, grpc.StatusCode.UNAUTHENTICATED)
        self.assertFailsFirst(self.read(self.a, "StreamVisibleRuns", W.StreamVisibleRunsRequest(),
                                        "not-a-tenant"), grpc.StatusCode.UNAUTHENTICATED)
        with self.assertRaises(grpc.RpcError) as e:
            self.transcript(self.a, other, run, "plan")
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(grpc.RpcError) as e:
            self.transcript(self.a, org, "not-a-uuid", "plan")
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("run_id", e.exception.details())
        with self.assertRaises(grpc.RpcError) as e:
            self.transcript(self.a, org, run, "")
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("node_id", e.exception.details())
        bad = self.read(self.a, "StreamRunLogs", W.StreamRunLogsRequest(run_id=run), org,
                        extra=(("x-upsquad-resume-seq", "abc"),))
        self.assertFailsFirst(bad, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("x-upsquad-resume-seq", bad.details)
        vis = self.read(self.a, "StreamVisibleRuns", W.StreamVisibleRunsRequest(status_filter=9),
                        org)
        self.assertFailsFirst(vis, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("status_filter", vis.details)

    def test_row_level_security_confines_the_service_role_to_one_org(self):
        org, other = uid(), uid()
        run = self.new_run(org)
        self.projected(run, 1)

        def as_service(sql):  # the hub's own login role, as the hub runs its transactions
            return psql(self.dsn, "BEGIN; SELECT set_config('app.org_id', '%s', true); %s; COMMIT"
                        % (other, sql)).splitlines()[-1]
        self.assertEqual(as_service("SELECT count(*) FROM stream_hub.run_events WHERE run_id = "
                                    "'%s'" % run), "0")
        self.assertEqual(as_service("SELECT count(*) FROM stream_hub.runs"), "0")
        self.assertEqual(psql(self.dsn, "SELECT count(*) FROM stream_hub.runs"), "0")  # no org
        with self.assertRaises(RuntimeError) as e:
            as_service("INSERT INTO stream_hub.runs (org_id, run_id) VALUES ('%s', '%s')"
                       % (org, uid()))
        self.assertIn("row-level security", str(e.exception))

    def test_node_io_resume_from_a_session_seq_skips_the_snapshot(self):
        org = uid()
        run = self.new_run(org)
        self.projected(run, 1)
        io = dict(org=org, run=run, node="coder", session="s9")
        self.pub("io", seq=1, status="thinking",
                 transcript={"event_type": "assistant_message", "content": {"text": "t"}}, **io)
        wait_until(lambda: len(self.transcript(self.a, org, run, "coder").events) == 1, 10,
                   "the transcript")
        r = self.read(self.b, "StreamNodeIO", W.StreamNodeIORequest(run_id=run), org,
                      extra=(("x-upsquad-resume-seq", "s9:3"),))
        wait_until(lambda: r.msgs, 10, "snapshot_done")
        for seq in (3, 6, 7):  # 3 was seen; 4 and 5 were published while it was away
            self.pub("io", seq=seq, token="t%d" % seq, **io)
        wait_until(lambda: len(r.msgs) >= 4, 10, "live frames")
        time.sleep(0.2)
        r.cancel()
        self.assertEqual([m.WhichOneof("frame") for m in r.msgs],
                         ["snapshot_done", "gap", "live", "live"])
        self.assertEqual((r.msgs[1].gap.from_seq, r.msgs[1].gap.to_seq), (3, 6))
        self.assertEqual([m.live.seq for m in r.msgs[2:]], [6, 7])

    # ---- snapshot, then live ----
    def test_status_snapshot_then_live_with_events_fired_during_the_snapshot(self):
        org = uid()
        run = self.new_run(org)
        nodes = ["n%d" % i for i in range(5)]
        seq = 1
        for i in range(40):  # history: the fold keeps the newest per node
            seq += 1
            self.pub("node", org=org, run=run, seq=seq, node_id=nodes[i % 5], status="running",
                     run_status="running", cost_usd=seq)
        self.projected(run, seq)
        burst_end = seq + 300

        def burst():
            for s in range(seq + 1, burst_end + 1):
                if s % 7 == 0:  # log lines share the run's seq: the status stream skips them
                    self.pub("log", org=org, run=run, seq=s, message="line %d" % s)
                else:
                    self.pub("node", org=org, run=run, seq=s, node_id=nodes[s % 5],
                             status="running", run_status="running", cost_usd=s)
        t = threading.Thread(target=burst)
        t.start()
        readers = []
        for k in range(6):  # subscribing on both replicas while the burst is being published
            srv = self.a if k % 2 == 0 else self.b
            readers.append(self.read(srv, "StreamRunStatus", W.StreamRunStatusRequest(run_id=run),
                                     org))
            time.sleep(0.05)
        t.join()
        end = burst_end + 1
        self.pub("node", org=org, run=run, seq=end, node_id=nodes[0], status="done",
                 run_status="completed", cost_usd=end)
        self.pub("run", org=org, run=run, seq=end + 1, status="completed", nodes_total=5,
                 nodes_done=5)
        node_seqs = {s for s in range(2, end + 1) if not (s > seq and s % 7 == 0)}
        for r in readers:
            r.join(20)
            self.assertEqual(r.code, grpc.StatusCode.OK, r.details)  # ended by the terminal status
            got = [m.update.cost_usd for m in r.msgs]
            self.assertEqual(got, sorted(set(got)), "out of order or duplicated")
            self.assertEqual(got[-1], end)
            # the snapshot is the fold (one update per node, in seq order); after its newest
            # event every node event arrives exactly once, whatever fired during the snapshot
            snap = got[:5]
            self.assertEqual({m.update.node_id for m in r.msgs[:5]}, set(nodes))
            self.assertEqual(got[5:], sorted(s for s in node_seqs if s > snap[-1]))
            self.assertTrue(all(m.update.run_id == run for m in r.msgs))
        # a new subscriber of the finished run gets the fold and the end
        r = self.read(self.b, "StreamRunStatus", W.StreamRunStatusRequest(run_id=run), org)
        r.join(10)
        self.assertEqual(r.code, grpc.StatusCode.OK)
        self.assertEqual(len(r.msgs), 5)  # one per node
        self.assertEqual({m.update.node_id for m in r.msgs}, set(nodes))

    def test_status_snapshot_elapsed_is_so_far_for_running_and_blocked_nodes(self):
        """spec NodeStatusUpdate.elapsed_ms: "time spent in `running` so far ...; for blocked
        nodes the time since the gate was hit": a snapshot row of a node still running or
        blocked counts up to the snapshot; a finished or queued node keeps its value, and a
        live update is its transition's."""
        org = uid()
        run = self.new_run(org)
        for seq, node, status, elapsed, ago in ((2, "gate", "blocked", 0, 5000),
                                                (3, "work", "running", 1000, 3000),
                                                (4, "over", "done", 700, 4000),
                                                (5, "next", "queued", 0, 2000)):
            self.pub("node", org=org, run=run, seq=seq, node_id=node, status=status,
                     run_status="running", elapsed_ms=elapsed, at_ms_ago=ago)
        for seq in range(2, 6):  # every one: the snapshot folds the contiguous prefix only (two
            self.projected(run, seq)  # replicas project in parallel), the rest is sent as live
        r = self.read(self.a, "StreamRunStatus", W.StreamRunStatusRequest(run_id=run), org)
        wait_until(lambda: len(r.msgs) >= 4, 10, "the snapshot")
        got = {m.update.node_id: m.update.elapsed_ms for m in r.msgs[:4]}
        self.assertGreaterEqual(got["gate"], 5000)
        self.assertGreaterEqual(got["work"], 4000)
        self.assertLess(got["gate"], 5000 + 30000)
        self.assertEqual((got["over"], got["next"]), (700, 0))
        self.pub("node", org=org, run=run, seq=6, node_id="work", status="running",
                 run_status="running", elapsed_ms=10, at_ms_ago=3000)
        wait_until(lambda: len(r.msgs) >= 5, 10, "the live update")
        r.cancel()
        self.assertEqual((r.msgs[4].update.node_id, r.msgs[4].update.elapsed_ms), ("work", 10))

    def test_events_projected_out_of_order_advance_the_snapshot_once_the_hole_is_filled(self):
        # The snapshot covers the seqs without a hole below them (the projector keeps where that
        # prefix ends). Seqs 5..8 are projected before 4: a subscriber meanwhile gets the fold up
        # to 3 and then the rest in order; once 4 is in, a fresh subscriber gets the fold of
        # everything (one update per node), not the history after the old hole.
        org = uid()
        run = self.new_run(org)
        nodes = ["a", "b", "c"]
        for s in (2, 3, 5, 6, 7, 8):
            self.pub("node", org=org, run=run, seq=s, node_id=nodes[s % 3], status="running",
                     run_status="running", cost_usd=s)
        self.projected(run, 8)
        r = self.read(self.a, "StreamRunStatus", W.StreamRunStatusRequest(run_id=run), org)
        wait_until(lambda: len(r.msgs) >= 2, 10, "the fold up to the hole")
        time.sleep(0.3)
        self.assertEqual(sorted(m.update.cost_usd for m in r.msgs), [2, 3])
        self.pub("node", org=org, run=run, seq=4, node_id=nodes[4 % 3], status="running",
                 run_status="running", cost_usd=4)
        wait_until(lambda: len(r.msgs) >= 7, 10, "seq 4 and the events after it")
        r.cancel()
        self.assertEqual([m.update.cost_usd for m in r.msgs[2:]], [4, 5, 6, 7, 8])
        r2 = self.read(self.b, "StreamRunStatus", W.StreamRunStatusRequest(run_id=run), org)
        wait_until(lambda: len(r2.msgs) >= 3, 10, "the fold of every node")
        time.sleep(0.3)
        r2.cancel()
        self.assertEqual(sorted(m.update.cost_usd for m in r2.msgs), [6, 7, 8])

    def test_a_snapshot_of_a_long_run_costs_what_a_short_one_does(self):
        # Every subscriber pays for its snapshot on a stream worker and a Postgres connection:
        # when that grows with the run's length, subscribers of a long run queue behind each
        # other (after a churn of subscribers, a fresh StreamRunStatus of the ended run waited
        # past its deadline). 40,000 stored events (bulk-written in the projection's table, as
        # a long run leaves it), then the run's last events through the projector: 30 fresh
        # subscribers of it one after the other take about as long as 30 of a 5-event run.
        org = uid()

        def ended_run(filler):
            run = uid()
            first = filler + 1
            if filler:
                tmpl = self.new_run(org)
                self.pub("node", org=org, run=tmpl, seq=2, node_id="x", status="running",
                         run_status="running")
                self.projected(tmpl, 2)
                psql(self.admin, "INSERT INTO stream_hub.run_events (org_id, run_id, seq, kind, "
                     "node_id, body) SELECT org_id, '%s', g, 'n', 'n' || (g %% 5), body "
                     "FROM stream_hub.run_events, generate_series(1, %d) g "
                     "WHERE run_id = '%s' AND seq = 2" % (run, filler, tmpl))
            self.pub("run", org=org, run=run, seq=first, status="running", workflow_id=uid(),
                     workflow_name="wf", nodes_total=5)
            for i in range(5):
                self.pub("node", org=org, run=run, seq=first + 1 + i, node_id="n%d" % i,
                         status="done", run_status="running", elapsed_ms=i)
            self.pub("run", org=org, run=run, seq=first + 6, status="completed", nodes_total=5,
                     nodes_done=5)
            # every one of them (two replicas project them, not always in order)
            wait_until(lambda: psql(self.admin, "SELECT count(*) FROM stream_hub.run_events "
                                    "WHERE run_id = '%s' AND seq >= %d" % (run, first)) == "7",
                       15, "the run's last events in the projection")
            return run

        rpc = self.rpc(self.a, "StreamRunStatus")

        def serve(run):
            t0 = time.time()
            msgs = list(rpc(W.StreamRunStatusRequest(run_id=run), metadata=self.md(org),
                             timeout=30))
            self.assertEqual(len(msgs), 5)  # the fold, then OK: the run has ended
            return time.time() - t0
        short, long_ = ended_run(0), ended_run(40000)
        serve(short)  # warm: connections, plans
        serve(long_)
        t_short = t_long = 0.0
        for _ in range(30):  # interleaved: the machine's load weighs on both alike
            t_short += serve(short)
            t_long += serve(long_)
        print("30 snapshots: 5-event run %.2fs, 40,005-event run %.2fs" % (t_short, t_long),
              file=sys.stderr)
        self.assertLess(t_long, 3 * t_short + 2.0)

    def test_logs_tail_live_and_resume_from_a_sequence_on_the_other_replica(self):
        org = uid()
        run = self.new_run(org)
        for s in range(2, 12):
            self.pub("log", org=org, run=run, seq=s, message="line %d" % s)
        self.projected(run, 11)
        r = self.read(self.a, "StreamRunLogs", W.StreamRunLogsRequest(run_id=run), org)
        wait_until(lambda: len(r.msgs) >= 10, 10, "the log snapshot")
        for s in range(12, 20):
            self.pub("log", org=org, run=run, seq=s, message="line %d" % s)
        wait_until(lambda: len(r.msgs) >= 18, 10, "live lines")
        r.cancel()
        self.assertEqual([m.line.message for m in r.msgs], ["line %d" % s for s in range(2, 20)])
        # the client saw up to seq 15, reconnects to B: seq 16.. and nothing before
        r2 = self.read(self.b, "StreamRunLogs", W.StreamRunLogsRequest(run_id=run), org,
                       extra=(("x-upsquad-resume-seq", "15"),))
        for s in range(20, 23):
            self.pub("log", org=org, run=run, seq=s, message="line %d" % s)
        wait_until(lambda: len(r2.msgs) >= 7, 10, "resumed lines")
        time.sleep(0.2)
        r2.cancel()
        self.assertEqual([m.line.message for m in r2.msgs], ["line %d" % s for s in range(16, 23)])

    def test_batched_events_are_served_once_per_seq_whatever_the_messages(self):
        # the engine publishes a run's events many per message (RunEventBatch); a batch re-sent
        # after a failure may overlap one already delivered: every subscriber and the
        # projection see each (run, seq) once, in order, and a bare RunEvent still works
        org = uid()
        run = self.new_run(org)  # seq 1: a bare RunEvent
        self.projected(run, 1)
        logs = self.read(self.a, "StreamRunLogs", W.StreamRunLogsRequest(run_id=run), org)
        status = self.read(self.b, "StreamRunStatus", W.StreamRunStatusRequest(run_id=run), org)
        # the status stream is live before the batches (a node event, seq 2, reached it): had
        # it subscribed after them, its snapshot would fold node a's three events into one. The
        # logs stream needs no such wait: whatever it missed live it reads from the store, and
        # its first lines, a burst, open the stream (the first carries the response headers)
        self.pub("node", org=org, run=run, seq=2, node_id="p", status="running", run_status="running")
        wait_until(lambda: any(m.run_seq == 2 for m in status.msgs), 15, "the status stream live")
        self.pub("log", org=org, run=run, seq=3, repeat=8, batch=4, message="line")  # 3-6, 7-10
        self.pub("log", org=org, run=run, seq=5, repeat=8, batch=8, message="line")  # 5-12 again
        self.pub("node", org=org, run=run, seq=13, repeat=3, batch=3, node_id="a",
                 status="running", run_status="running")
        self.projected(run, 15)
        end = time.time() + 15  # the lists are compared below, whatever came
        while time.time() < end and (len(logs.msgs) < 10 or len([m for m in status.msgs if m.run_seq > 2]) < 3):
            time.sleep(0.05)
        time.sleep(0.3)
        logs.cancel()
        status.cancel()
        self.assertEqual([m.run_seq for m in logs.msgs], list(range(3, 13)), (logs.code, getattr(logs, "details", None)))
        self.assertEqual([m.run_seq for m in status.msgs if m.run_seq > 2], [13, 14, 15])
        # the projection too, once it has caught up (the lists above came live): each seq once
        q = ("SELECT count(*), min(seq), max(seq) FROM stream_hub.run_events WHERE run_id = '%s'"
             % run)
        wait_until(lambda: int(psql(self.admin, q).split("|")[0]) >= 15, 15, "the projection")
        self.assertEqual(psql(self.admin, q), "15|1|15")
        # from the store (the snapshot's replay) and resumed mid-batch on the other replica
        r = self.read(self.b, "StreamRunLogs", W.StreamRunLogsRequest(run_id=run), org,
                      extra=(("x-upsquad-resume-seq", "7"),))
        wait_until(lambda: len(r.msgs) >= 5, 10, "resumed lines")
        time.sleep(0.2)
        r.cancel()
        self.assertEqual([m.run_seq for m in r.msgs], list(range(8, 13)))

    def test_the_projection_stores_a_burst_without_waiting_out_a_fetch(self):
        # Both replicas pull the run events from one durable consumer, 128 messages a fetch.
        # A pull request for several messages that waits stays open at the server until it
        # has them all, and a message that came into such a fetch sat there until the
        # fetch's timeout (500 ms): 2-3% of a burst's events were stored half a second late,
        # and a subscriber fed from the store waited as long (a batched test's count once
        # read 13 of 15). Every event of these bursts is stored within 250 ms of its publish.
        org = uid()
        for i in range(30):
            run = self.new_run(org)
            self.pub("log", org=org, run=run, seq=2, repeat=8, batch=4, message="line")
            self.pub("log", org=org, run=run, seq=4, repeat=8, batch=8, message="line")
            self.pub("node", org=org, run=run, seq=12, repeat=3, batch=3, node_id="a",
                     status="running", run_status="running")
            time.sleep(0.4 + (i % 7) * 0.047)  # idle fetches time out (500 ms) in between
        q = "SELECT count(*) FROM stream_hub.run_events WHERE org_id = '%s'" % org
        wait_until(lambda: psql(self.admin, q) == str(30 * 14), 30, "every event stored")
        late = psql(self.admin, "SELECT count(*), coalesce(max(round(extract(epoch FROM "
                    "projected_at - at) * 1000)), 0) FROM stream_hub.run_events WHERE org_id = "
                    "'%s' AND projected_at - at > interval '250 ms'" % org)
        self.assertEqual(late.split("|")[0], "0", "events stored late (count|worst ms): " + late)

    def test_a_hole_is_waited_for_while_its_events_may_still_come_and_an_old_one_is_skipped(self):
        # A replica that dies holding fetched messages leaves a hole in a run's stored seqs,
        # which another replica fills after the projection's ack wait. A live subscriber on
        # another replica waits for it until the event above the hole has been stored for
        # UPSQUAD_HUB_HOLE_WAIT (10 s here): it used to skip the hole 5 s after it first saw
        # it, losing those events for good. A hole older than that (events lost upstream) is
        # skipped at once by a later subscriber rather than stalling each one again.
        org = uid()
        run, lost = self.new_run(org), self.new_run(org)
        self.pub("log", org=org, run=lost, seq=3, repeat=3, message="line")  # 2 never comes
        self.projected(lost, 5)
        lost_at = time.time()
        self.projected(run, 1)
        logs = self.read(self.a, "StreamRunLogs", W.StreamRunLogsRequest(run_id=run), org)
        self.pub("log", org=org, run=run, seq=2, message="line")
        wait_until(lambda: logs.msgs, 15, "the live log line")
        self.pub("log", org=org, run=run, seq=5, repeat=3, message="line")  # 3 and 4 held
        self.projected(run, 7)
        time.sleep(6.5)  # past the old 5 s, well within the wait
        self.assertEqual([m.run_seq for m in logs.msgs], [2], "the hole was skipped")
        self.pub("log", org=org, run=run, seq=3, repeat=2, message="line")  # the held ones
        wait_until(lambda: len(logs.msgs) >= 6, 15, "the hole's lines and those after it")
        time.sleep(0.2)
        logs.cancel()
        self.assertEqual([m.run_seq for m in logs.msgs], list(range(2, 8)))
        time.sleep(max(0.0, lost_at + HOLE_WAIT_S + 0.5 - time.time()))
        t0 = time.time()
        r = self.read(self.b, "StreamRunLogs", W.StreamRunLogsRequest(run_id=lost), org)
        wait_until(lambda: len(r.msgs) >= 3, 15, "the lines above the old hole")
        took = time.time() - t0
        time.sleep(0.2)
        r.cancel()
        self.assertEqual([m.run_seq for m in r.msgs], [3, 4, 5])
        self.assertLess(took, 3.0, "a hole older than the wait stalled a new subscriber")
        self.assertIn("never arrived; skipped", self.b.log_text())

    def test_resume_from_the_seq_read_on_the_stream_after_a_replica_dies(self):
        # Every StreamRunStatus/StreamRunLogs frame carries the run seq (run_seq, an Upsquad
        # extension of the response wrapper). A client reads some frames from replica C, C is
        # killed (SIGKILL: no orderly end), events are published meanwhile, and the client
        # reconnects to B with the last run_seq it read: it gets exactly the rest, once each.
        org = uid()
        run = self.new_run(org)

        def publish(lo, hi):
            for s in range(lo, hi + 1):
                if s % 3 == 0:
                    self.pub("log", org=org, run=run, seq=s, message="line %d" % s)
                else:  # one node per event: the status snapshot (a fold) keeps them all
                    self.pub("node", org=org, run=run, seq=s, node_id="n%d" % s,
                             status="running", run_status="running", cost_usd=s)
        publish(2, 30)  # history: the snapshots
        self.projected(run, 30)
        # C projects through durables of its own: messages it fetched and never acked must not
        # hold A's and B's shared durables up for the ack wait
        c = self.start(UPSQUAD_HUB_PROJECTION_DURABLE="hub-it-%s-c-events" % TAG,
                       UPSQUAD_HUB_TRANSCRIPT_DURABLE="hub-it-%s-c-io" % TAG)
        try:
            st = self.read(c, "StreamRunStatus", W.StreamRunStatusRequest(run_id=run), org)
            lg = self.read(c, "StreamRunLogs", W.StreamRunLogsRequest(run_id=run), org)
            t = threading.Thread(target=publish, args=(31, 600))
            t.start()
            wait_until(lambda: st.msgs and st.msgs[-1].run_seq >= 45 and lg.msgs and
                       lg.msgs[-1].run_seq >= 45, 15, "live frames from replica C")
            c.signal(signal.SIGKILL)
            c.wait(10)
            st.join(10)
            lg.join(10)
            self.assertNotEqual(st.code, grpc.StatusCode.OK)
            t.join()
        finally:
            c.stop()
            self.retire(c)
            self.channels.pop(c.addr, None)
        self.projected(run, 600)
        last_st, last_lg = st.msgs[-1].run_seq, lg.msgs[-1].run_seq
        self.assertLess(last_st, 599, "the client saw everything: nothing left to resume")
        st2 = self.read(self.b, "StreamRunStatus", W.StreamRunStatusRequest(run_id=run), org,
                        extra=(("x-upsquad-resume-seq", str(last_st)),))
        lg2 = self.read(self.b, "StreamRunLogs", W.StreamRunLogsRequest(run_id=run), org,
                        extra=(("x-upsquad-resume-seq", str(last_lg)),))
        publish(601, 610)  # live after the resume
        self.pub("run", org=org, run=run, seq=611, status="completed", nodes_total=3,
                 nodes_done=3)
        st2.join(15)
        self.assertEqual(st2.code, grpc.StatusCode.OK, st2.details)
        wait_until(lambda: lg2.msgs and lg2.msgs[-1].run_seq >= 609, 10, "the resumed log lines")
        time.sleep(0.2)
        lg2.cancel()
        status = [m.run_seq for m in st.msgs + st2.msgs]
        logs = [m.run_seq for m in lg.msgs + lg2.msgs]
        self.assertEqual(status, [s for s in range(2, 611) if s % 3], "status: lost or repeated")
        self.assertEqual(logs, [s for s in range(2, 611) if s % 3 == 0], "logs: lost or repeated")
        # the seq is the event's own: it agrees with the payload the publisher put in it
        self.assertTrue(all(m.update.cost_usd == m.run_seq for m in st.msgs + st2.msgs))
        self.assertTrue(all(m.line.message == "line %d" % m.run_seq for m in lg.msgs + lg2.msgs))

    # ---- node I/O: clearance floors, snapshot de-duplication ----
    def test_node_io_clearance_floor_live_and_in_transcripts(self):
        org = uid()
        run = self.new_run(org)
        self.projected(run, 1)
        io = dict(org=org, run=run, node="coder", session="s1")
        self.pub("io", seq=1, status="thinking", **io)
        self.pub("io", seq=2, token="private tokens", **io)
        self.pub("io", seq=3, tool_call={"name": "gh", "id": "c1", "args": "repo=x"},
                 transcript={"event_type": "tool_call", "content": {
                     "tool_name": "gh", "tool_call_id": "c1", "arguments": "secret args"}}, **io)
        self.pub("io", seq=4, tool_result={"name": "gh", "id": "c1", "summary": "secret summary",
                                           "duration_ms": 5},
                 transcript={"event_type": "tool_result", "content": {
                     "tool_name": "gh", "tool_call_id": "c1", "result": "secret result",
                     "is_error": False}}, **io)
        self.pub("io", seq=5, no_frame=True, transcript={
            "event_type": "assistant_message", "content": {"text": "secret answer"}}, **io)
        wait_until(lambda: len(self.transcript(self.a, org, run, "coder").events) == 3, 10,
                   "the transcript")
        hi = self.read(self.a, "StreamNodeIO", W.StreamNodeIORequest(run_id=run), org, clearance=4)
        lo = self.read(self.b, "StreamNodeIO", W.StreamNodeIORequest(run_id=run), org, clearance=3)
        other_node = self.read(self.a, "StreamNodeIO",
                               W.StreamNodeIORequest(run_id=run, node_id="reviewer"), org)
        for r in (hi, lo, other_node):
            wait_until(lambda: any(m.snapshot_done for m in r.msgs), 10, "snapshot_done")
        self.pub("io", seq=3, token="duplicate of the snapshot", **io)  # (session, seq) seen
        self.pub("io", seq=6, token="live secret", **io)
        self.pub("io", seq=7, tool_result={"name": "gh", "id": "c2", "summary": "live summary",
                                           "is_error": True}, **io)
        self.pub("io", seq=8, status="done", **io)
        for r, n in ((hi, 3), (lo, 2)):
            wait_until(lambda: sum(1 for m in r.msgs if m.HasField("live")) >= n, 10, "live")
        time.sleep(0.2)
        for r in (hi, lo, other_node):
            r.cancel()
        kinds = [m.WhichOneof("frame") for m in hi.msgs]
        self.assertEqual(kinds, ["snapshot_event"] * 3 + ["snapshot_done"] + ["live"] * 3)
        self.assertEqual([m.live.seq for m in hi.msgs[4:]], [6, 7, 8])
        self.assertEqual(hi.msgs[4].live.token_text, "live secret")
        self.assertEqual(hi.msgs[5].live.tool_result.summary, "live summary")
        self.assertEqual(hi.msgs[0].snapshot_event.content["arguments"], "secret args")
        self.assertEqual(hi.msgs[2].snapshot_event.content["text"], "secret answer")
        # below clearance 4: structural only, everywhere; the token frame (seq 6) is not sent at
        # all (a frame with no arm is no structural frame) and costs no gap
        self.assertEqual([m.WhichOneof("frame") for m in lo.msgs], kinds[:-1])
        for m in lo.msgs[:3]:
            for k in ("text", "arguments", "result"):
                self.assertNotIn(k, m.snapshot_event.content)
        self.assertEqual(lo.msgs[0].snapshot_event.content["tool_name"], "gh")
        self.assertEqual([m.live.seq for m in lo.msgs[4:]], [7, 8])
        self.assertEqual(lo.msgs[4].live.tool_result.summary, "")
        self.assertTrue(lo.msgs[4].live.tool_result.is_error)
        self.assertEqual(lo.msgs[5].live.status, "done")
        self.assertNotIn(b"secret", b"".join(m.SerializeToString() for m in lo.msgs))
        # the node filter: the snapshot and live frames of other nodes are not sent
        self.assertEqual([m.WhichOneof("frame") for m in other_node.msgs], ["snapshot_done"])
        t_lo = self.transcript(self.b, org, run, "coder", clearance=2)
        self.assertEqual(list(t_lo.redacted_fields), ["arguments", "result", "text"])
        self.assertNotIn(b"secret", t_lo.SerializeToString())
        t_hi = self.transcript(self.a, org, run, "coder", clearance=5)
        self.assertEqual(list(t_hi.redacted_fields), [])
        self.assertEqual([e.seq for e in t_hi.events], [3, 4, 5])
        self.assertTrue(all(e.session_id == "s1" for e in t_hi.events))
        self.assertFalse(t_hi.session_missing)
        self.assertTrue(self.transcript(self.a, org, run, "nobody").session_missing)

    def test_transcripts_follow_the_one_redaction_rule_at_every_clearance(self):
        # GetNodeTranscript and StreamNodeIO's snapshot at clearances 1..5 against the rule the
        # workflow-engine's reads follow (tests/lib: T.redact_visible): the free-text fields
        # from clearance 4, a key naming a secret from 4 too, names and ids at every clearance
        org = uid()
        run = self.new_run(org)
        self.projected(run, 1)
        io = dict(org=org, run=run, node="coder", session="s1")
        content = {"tool_name": "gh", "tool_call_id": "c1", "arguments": "secret args",
                   "api_key": "secret key", "note": "plain"}
        self.pub("io", seq=1, tool_call={"name": "gh", "id": "c1", "args": "x"},
                 transcript={"event_type": "tool_call", "content": content}, **io)
        self.pub("io", seq=2, no_frame=True, transcript={
            "event_type": "assistant_message", "content": {"text": "secret answer"}}, **io)
        wait_until(lambda: len(self.transcript(self.a, org, run, "coder").events) == 2, 10,
                   "the transcript")
        free = ("text", "arguments", "result")
        kind = lambda k: "free_text" if k in free else "payload"  # noqa: E731
        for c in range(1, 6):
            want = [T.redacted(content, c, 0, kind), T.redacted({"text": "secret answer"}, c, 0, kind)]
            t = self.transcript(self.b, org, run, "coder", clearance=c)
            got = [json_format.MessageToDict(e.content) for e in t.events]
            self.assertEqual(got, want, "GetNodeTranscript at clearance %d" % c)
            removed = sorted({k for o in (content, {"text": ""}) for k in o
                              if not T.redact_visible(c, 0, kind(k), k)})
            self.assertEqual(sorted(t.redacted_fields), removed, c)
            r = self.read(self.a, "StreamNodeIO", W.StreamNodeIORequest(run_id=run), org,
                          clearance=c)
            wait_until(lambda: any(m.snapshot_done for m in r.msgs), 10, "snapshot_done")
            r.cancel()
            snap = [json_format.MessageToDict(m.snapshot_event.content) for m in r.msgs
                    if m.HasField("snapshot_event")]
            self.assertEqual(snap, want, "StreamNodeIO's snapshot at clearance %d" % c)

    def test_node_io_below_clearance_4_sends_no_armless_frame_and_no_gap_for_it(self):
        # spec NodeIOFrame: "Exactly one event arm is set"; StreamNodeIO below clearance 4
        # "receives STRUCTURAL frames only (status, tool_call name/id, tool_result
        # is_error/timing, user_prompt)". A token frame is not sent there at all, and the seqs it
        # takes are seen, not lost: no StreamGap for them; a frame dropped by the publisher
        # still is one, from the last seq the client saw. A frame published with no arm is sent
        # at no clearance.
        org = uid()
        run = self.new_run(org)
        self.projected(run, 1)
        io = dict(org=org, run=run, node="coder", session="s1")
        lo = self.read(self.a, "StreamNodeIO", W.StreamNodeIORequest(run_id=run), org, clearance=3)
        lo1 = self.read(self.b, "StreamNodeIO", W.StreamNodeIORequest(run_id=run), org,
                        clearance=1)
        hi = self.read(self.a, "StreamNodeIO", W.StreamNodeIORequest(run_id=run), org, clearance=4)
        for r in (lo, lo1, hi):
            wait_until(lambda: any(m.snapshot_done for m in r.msgs), 10, "snapshot_done")
        self.pub("io", seq=1, status="thinking", **io)
        self.pub("io", seq=2, token="secret 2", **io)
        self.pub("io", seq=3, token="secret 3", **io)
        self.pub("io", seq=4, tool_call={"name": "gh", "id": "c1", "args": "repo=x"}, **io)
        self.pub("io", seq=5, token="secret 5", **io)
        self.pub("io", seq=7, token="secret 7", **io)   # 6 dropped by the publisher
        self.pub("io", seq=8, **io)                     # no arm
        self.pub("io", seq=9, tool_result={"name": "gh", "id": "c1", "summary": "secret",
                                           "duration_ms": 3}, **io)
        self.pub("io", seq=10, token="secret 10", **io)
        self.pub("io", seq=11, status="done", **io)
        for r in (lo, lo1, hi):
            wait_until(lambda: any(m.live.status == "done" for m in r.msgs), 10, "the last frame")
        time.sleep(0.2)
        for r in (lo, lo1, hi):
            r.cancel()

        def frames(r):
            return [("gap", m.gap.from_seq, m.gap.to_seq) if m.HasField("gap") else
                    (m.live.WhichOneof("event"), m.live.seq) for m in r.msgs[1:]]

        for r in (lo, lo1):
            self.assertEqual(r.msgs[0].WhichOneof("frame"), "snapshot_done")
            self.assertEqual(frames(r), [("status", 1), ("tool_call", 4), ("gap", 4, 9),
                                         ("tool_result", 9), ("status", 11)])
            self.assertNotIn(b"secret", b"".join(m.SerializeToString() for m in r.msgs))
        self.assertEqual(frames(hi), [("status", 1), ("token_text", 2), ("token_text", 3),
                                      ("tool_call", 4), ("token_text", 5), ("gap", 5, 7),
                                      ("token_text", 7), ("tool_result", 9),
                                      ("token_text", 10), ("status", 11)])

    def test_node_io_frames_held_during_the_snapshot_below_clearance_4(self):
        # the same floor for frames that arrive while the snapshot is sent (held, then handed
        # over): token frames stream, a status frame after every 20, while subscribers of
        # clearance 3 come; they get the status frames only, with no StreamGap over token
        # frames alone. A StreamGap is right only where a status frame was lost for want of
        # room (a queue, or the frames held during the snapshot: UPSQUAD_HUB_PENDING_MAX, 16
        # on replica C); it then goes before the next frame delivered, its to_seq. (The held
        # frames used to take a slot per token frame, and a full hold put its StreamGap before
        # the first held frame: from 0 to 21, over tokens only.)
        c = self.start(UPSQUAD_HUB_PENDING_MAX="16",
                       UPSQUAD_HUB_PROJECTION_DURABLE="hub-it-%s-p16-events" % TAG,
                       UPSQUAD_HUB_TRANSCRIPT_DURABLE="hub-it-%s-p16-io" % TAG)
        try:
            self.held_frames_below_clearance_4((self.a, self.b, c))
        finally:
            c.stop()
            self.retire(c)
            self.channels.pop(c.addr, None)

    def held_frames_below_clearance_4(self, replicas):
        org = uid()
        run = self.new_run(org)
        self.projected(run, 1)
        io = dict(org=org, run=run, node="coder", session="s1")
        for seq in range(1, 201):   # a snapshot that takes a while to send
            self.pub("io", seq=seq, no_frame=True, transcript={
                "event_type": "assistant_message", "content": {"text": "x" * 2000}}, **io)
        wait_until(lambda: len(self.transcript(self.a, org, run, "coder").events) == 200, 15,
                   "the transcript")
        flow = dict(org=org, run=run, node="coder", session="s2")
        done = threading.Event()

        def tokens():   # 20 token frames, a status frame, ...
            seq = 1
            while not done.is_set():
                self.pub("tokens", **flow, **{"from": seq, "count": 20, "size": 32, "rate": 0})
                self.pub("io", seq=seq + 20, status="thinking", **flow)
                seq += 21
                time.sleep(0.005)
            self.pub("io", seq=seq, status="done", **flow)

        th = threading.Thread(target=tokens, daemon=True)
        th.start()
        subs = []
        for i in range(6):
            subs.append(self.read(replicas[i % len(replicas)], "StreamNodeIO",
                                  W.StreamNodeIORequest(run_id=run), org, clearance=3))
            time.sleep(0.05)
        for r in subs:
            wait_until(lambda: any(m.snapshot_done for m in r.msgs), 15, "snapshot_done")
        time.sleep(0.3)
        done.set()
        th.join(15)
        for r in subs:
            wait_until(lambda: any(m.live.status == "done" for m in r.msgs), 10, "the last frame")
            r.cancel()
        gaps = 0
        for r in subs:
            kinds = [m.WhichOneof("frame") for m in r.msgs]
            self.assertEqual(kinds[:201], ["snapshot_event"] * 200 + ["snapshot_done"])
            rest = r.msgs[201:]
            live = [m.live for m in rest if m.WhichOneof("frame") == "live"]
            self.assertEqual({f.WhichOneof("event") for f in live}, {"status"})
            self.assertEqual([f.seq % 21 for f in live[:-1]], [0] * (len(live) - 1))
            self.assertEqual(live[-1].status, "done")
            for i, m in enumerate(rest):
                if m.WhichOneof("frame") != "gap":
                    continue
                gaps += 1
                # a status frame (every 21st seq) lies inside it, and it names the next frame
                self.assertGreaterEqual(m.gap.to_seq - m.gap.from_seq, 42, m.gap)
                self.assertEqual(rest[i + 1].live.seq, m.gap.to_seq, m.gap)
            # and every status frame lost lies inside a gap: two frames with none between
            # them are 21 seqs apart (the last, "done", follows its status frame at once)
            for prev, m in zip(rest, rest[1:-1]):
                if prev.WhichOneof("frame") == "live" and m.WhichOneof("frame") == "live":
                    self.assertEqual(m.live.seq - prev.live.seq, 21, "frames lost without a gap")
        print("StreamGaps after a lost status frame: %d" % gaps, file=sys.stderr)

    def test_transcript_by_action_id_is_every_attempt_of_its_step(self):
        # spec GetNodeTranscriptRequest.node_id: the step name or the workflow_action UUID,
        # "Both map to the node's step_name"; the response holds the node's events "across ALL
        # of its attempts". A loop lap is an action of its own: asking by lap 1's action id
        # answers lap 2's session too, exactly like asking by the step name.
        org = uid()
        run = self.new_run(org)
        self.projected(run, 1)
        lap1, lap2 = uid(), uid()
        for session, action, lap in (("s-lap1", lap1, 1), ("s-lap2", lap2, 2)):
            self.pub("io", org=org, run=run, node="coder", session=session, seq=1, iteration=lap,
                     action_id=action, no_frame=True, transcript={
                         "event_type": "assistant_message", "content": {"text": "lap %d" % lap}})
        self.pub("io", org=org, run=run, node="reviewer", session="s-other", seq=1,
                 action_id=uid(), no_frame=True,
                 transcript={"event_type": "assistant_message", "content": {"text": "other"}})
        wait_until(lambda: len(self.transcript(self.a, org, run, "coder").events) == 2, 10,
                   "the transcript")
        by_step = self.transcript(self.a, org, run, "coder")
        for node in (lap1, lap2):
            by_action = self.transcript(self.a, org, run, node)
            self.assertEqual([(e.session_id, e.seq) for e in by_action.events],
                             [(e.session_id, e.seq) for e in by_step.events])
            self.assertEqual(sorted(e.session_id for e in by_action.events), ["s-lap1", "s-lap2"])
            self.assertFalse(by_action.session_missing)
        self.assertTrue(self.transcript(self.a, org, run, uid()).session_missing)

    def test_a_private_workflows_run_is_not_found_for_another_member(self):
        # spec: GetNodeTranscript is "org-scoped and run-scoped fail-closed exactly like
        # GetNodeIO", and the workflow-engine answers GetNodeIO / GetWorkflowStatus for a
        # private workflow's run of another member NOT_FOUND: the hub reads runs the same way,
        # on every stream too. The owner is served.
        org, me, other = uid(), uid(), uid()
        run = self.new_run(org, visibility="private", owner=me)
        self.pub("node", org=org, run=run, seq=2, node_id="plan", status="running",
                 visibility="private", owner=me)
        self.pub("io", org=org, run=run, node="plan", session="s1", seq=1, no_frame=True,
                 transcript={"event_type": "assistant_message", "content": {"text": "t"}})
        self.projected(run, 2)
        for method, req in (("StreamRunStatus", W.StreamRunStatusRequest(run_id=run)),
                            ("StreamRunLogs", W.StreamRunLogsRequest(run_id=run)),
                            ("StreamNodeIO", W.StreamNodeIORequest(run_id=run))):
            self.assertFailsFirst(self.read(self.a, method, req, org, sub=other),
                                  grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(grpc.RpcError) as e:
            self.transcript(self.a, org, run, "plan", sub=other)
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
        wait_until(lambda: len(self.transcript(self.a, org, run, "plan", sub=me).events) == 1, 10,
                   "the owner's transcript")
        mine = self.read(self.a, "StreamRunStatus", W.StreamRunStatusRequest(run_id=run), org,
                         sub=me)
        wait_until(lambda: mine.msgs, 10, "the owner's snapshot")
        mine.cancel()
        self.assertEqual(mine.msgs[0].update.status, "running")

    # ---- backpressure ----
    def test_a_gap_with_no_frame_after_it_is_sent_with_the_last_frame_dropped(self):
        # A subscriber that stops reading loses the end of a burst, the node's last frame
        # included, and no frame follows. Its StreamGap used to wait for the next frame sent,
        # so it never learned of the loss nor saw the last frame; now, once its queue has room,
        # it gets the gap and the newest frame dropped (the gap's to_seq).
        org = uid()
        run = self.new_run(org)
        self.projected(run, 1)
        req = W.StreamNodeIORequest(run_id=run)
        rpc = self.small_window_node_io(self.a, "small-tail")
        # the client reads nothing after snapshot_done until the hub has handled the whole
        # burst (a pause of fixed length could end mid-burst on a loaded machine, and the
        # frames after it would then go out after the gap)
        hold = threading.Event()
        slow = Reader(rpc, req, self.md(org), hold=hold)
        wait_until(lambda: slow.msgs, 10, "snapshot_done")
        n = 400  # 1 KiB each, at once: past its 64 KiB window and 64-frame queue
        h0, drops0 = self.handled(self.a), self.a.metric("stream_hub_dropped_frames_total")
        self.pub("tokens", org=org, run=run, node="coder", session="s1", count=n, size=1024,
                 rate=0)
        try:
            # a gap, or a kept frame sent late, counts as a frame queued too, so the count can
            # pass h0 + n a little early: the burst is over when it also stops moving
            def burst_handled():
                h = self.handled(self.a)
                time.sleep(0.2)
                return h >= h0 + n and self.handled(self.a) == h
            wait_until(burst_handled, 10, "the burst handled")
            hold.set()  # within the stall limit of the first drop: the burst took far less
            self.assertGreater(self.a.metric("stream_hub_dropped_frames_total"), drops0 + 1)
            wait_until(lambda: any(m.HasField("live") and m.live.seq == n for m in slow.msgs), 10,
                       "the last frame")
        finally:
            slow.cancel()
        kinds = [m.WhichOneof("frame") for m in slow.msgs]
        self.assertEqual(kinds[-2:], ["gap", "live"])
        gap = slow.msgs[-2].gap
        lives = [m.live.seq for m in slow.msgs if m.HasField("live")]
        self.assertEqual(gap.to_seq, n)
        self.assertEqual(gap.from_seq, lives[-2])  # the last seq it saw before the gap
        self.assertEqual(lives, sorted(lives))
        self.assertLess(len(lives), n)

    def test_a_frame_kept_from_a_full_queue_goes_late_without_a_gap_when_nothing_else_was_lost(self):
        # spec StreamGap: frames "were dropped". The newest frame refused by a full queue is
        # kept and sent once there is room; when it is the only one refused, nothing was lost
        # and no StreamGap goes before it (one used to, from the frame before it to itself,
        # e.g. over token frames a clearance-3 subscriber is never sent). Frames are published
        # one at a time until the hub counts the first drop, so exactly one is refused.
        org = uid()
        run = self.new_run(org)
        self.projected(run, 1)
        rpc = self.small_window_node_io(self.a, "small-kept")
        hold = threading.Event()  # set at the drop: the stall limit counts from there
        slow = Reader(rpc, W.StreamNodeIORequest(run_id=run), self.md(org), hold=hold)
        wait_until(lambda: slow.msgs, 10, "snapshot_done")
        drops0 = self.a.metric("stream_hub_dropped_frames_total")
        t0, seq = time.time(), 0
        while self.a.metric("stream_hub_dropped_frames_total") == drops0:
            self.assertLess(time.time() - t0, 20, "no frame refused while the client paused")
            seq += 1
            n0 = self.handled(self.a)
            self.pub("tokens", org=org, run=run, node="coder", session="s1", count=1, size=1024,
                     rate=0, **{"from": seq})
            wait_until(lambda: self.handled(self.a) > n0, 5, "frame %d handled" % seq)
        hold.set()
        self.assertEqual(self.a.metric("stream_hub_dropped_frames_total"), drops0 + 1)
        try:
            wait_until(lambda: any(m.HasField("live") and m.live.seq == seq for m in slow.msgs),
                       15, "the kept frame")
            # a frame after it, once the client reads again: no gap either
            self.pub("tokens", org=org, run=run, node="coder", session="s1", count=1, size=1024,
                     rate=0, **{"from": seq + 1})
            wait_until(lambda: any(m.HasField("live") and m.live.seq == seq + 1
                                   for m in slow.msgs), 10, "the frame after it")
            time.sleep(0.2)
        finally:
            slow.cancel()
        kinds = [m.WhichOneof("frame") for m in slow.msgs]
        self.assertEqual(kinds.count("gap"), 0, [(m.WhichOneof("frame"), m.live.seq, m.gap.to_seq)
                                                 for m in slow.msgs[-4:]])
        self.assertEqual([m.live.seq for m in slow.msgs if m.HasField("live")],
                         list(range(1, seq + 2)))

    def test_stalled_subscriber_gets_a_gap_or_is_ended_while_a_fast_one_gets_everything(self):
        org = uid()
        run = self.new_run(org)
        self.projected(run, 1)
        req = W.StreamNodeIORequest(run_id=run)
        fast = self.read(self.a, "StreamNodeIO", req, org)
        rpc = self.small_window_node_io(self.a, "small")
        # (at 200 frames/s the slow one's 1.2 s pause brings ~240 frames, well past its 64 KiB
        # window and 64-frame queue, while the fast one may lag ~120 frames, 0.6 s, before it
        # would lose one: at 500/s a loaded 2-core machine could starve this process's reader
        # thread for the 0.25 s that took, and the hub rightly gave the "fast" one a gap)
        slow = Reader(rpc, req, self.md(org), pause_after_first=1.2)
        dead = rpc(req, metadata=self.md(org), timeout=60)
        wait_until(lambda: any(m.snapshot_done for m in fast.msgs) and slow.msgs, 10,
                   "snapshot_done")
        n = 800
        drops0 = self.a.metric("stream_hub_dropped_frames_total")
        stalled0 = self.a.metric("stream_hub_stalled_total")
        self.pub("tokens", org=org, run=run, node="coder", session="s1", count=n, size=1024,
                 rate=200)
        try:
            wait_until(lambda: sum(1 for m in fast.msgs if m.HasField("live")) >= n, 30,
                       "the fast subscriber's frames")
        except AssertionError:
            print([m.WhichOneof("frame") for m in fast.msgs][:10], len(fast.msgs), fast.code,
                  [m.gap for m in fast.msgs if m.HasField("gap")][:5],
                  self.a.metric("stream_hub_frames_total"),
                  self.a.metric("stream_hub_dropped_frames_total"), file=sys.stderr)
            raise
        seqs = [m.live.seq for m in fast.msgs if m.HasField("live")]
        self.assertEqual(seqs, list(range(1, n + 1)))
        self.assertFalse(any(m.HasField("gap") for m in fast.msgs))
        self.pub("tokens", org=org, run=run, node="coder", session="s1", **{"from": n + 1},
                 count=1, size=16)  # a frame after the drops: the gap and the last one dropped may come first
        wait_until(lambda: any(m.HasField("live") and m.live.seq == n + 1 for m in slow.msgs), 20,
                   "the slow subscriber to drain")
        gaps = [m.gap for m in slow.msgs if m.HasField("gap")]
        self.assertGreaterEqual(len(gaps), 1)
        lives = [m.live.seq for m in slow.msgs if m.HasField("live")]
        self.assertEqual(lives, sorted(lives))
        self.assertLess(len(lives), n + 1)
        for g in gaps:
            self.assertLess(g.from_seq, g.to_seq)
            self.assertIn(g.to_seq, lives)  # to_seq is the next frame delivered
        # accounted: every frame is either delivered or inside a gap
        covered = set(lives)
        for g in gaps:
            covered.update(range(g.from_seq + 1, g.to_seq))
        self.assertEqual(covered, set(range(1, n + 2)))
        self.assertGreater(self.a.metric("stream_hub_dropped_frames_total"), drops0)
        # the one that never reads is ended so its memory is returned
        wait_until(lambda: self.a.metric("stream_hub_stalled_total") > stalled0, STALL_MS / 1000 + 10,
                   "the stalled subscriber to be ended")
        fast.cancel()
        slow.cancel()
        with self.assertRaises(grpc.RpcError) as e:
            for _ in dead:
                pass
        self.assertEqual(e.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertGreaterEqual(self.a.metric("stream_hub_gaps_total"), 1)

    def test_a_burst_shares_writes_and_a_filtered_subscriber_gets_its_last_frame_promptly(self):
        # A burst (messages waiting on the run's subscription) is queued to the subscribers
        # before its sends start; the burst's last message starts them for every subscriber,
        # those its own frame skipped too. A subscriber filtered to a node whose frames stop
        # mid-burst must get its last frame at once, not keep it queued (or held in the
        # transport behind a write-buffer hint) until a frame of its node that never comes.
        org = uid()
        run = self.new_run(org)
        self.projected(run, 1)
        everything = [self.read(self.a, "StreamNodeIO", W.StreamNodeIORequest(run_id=run), org)
                      for _ in range(40)]
        coder = self.read(self.a, "StreamNodeIO",
                          W.StreamNodeIORequest(run_id=run, node_id="coder"), org)
        reviewer = self.read(self.a, "StreamNodeIO",
                             W.StreamNodeIORequest(run_id=run, node_id="reviewer"), org)
        readers = everything + [coder, reviewer]
        for r in readers:
            wait_until(lambda: any(m.snapshot_done for m in r.msgs), 10, "snapshot_done")
        deferred0 = self.a.metric("stream_hub_fanout_deferred_total")

        def live(r):
            return [(m.live.session_id, m.live.seq) for m in r.msgs if m.HasField("live")]

        def arrived(r, want, timeout, what):
            try:
                wait_until(lambda: len(live(r)) >= want, timeout, what)
            except AssertionError:
                print(len(live(r)), live(r)[-3:], file=sys.stderr)
                raise
            return time.time()

        # bursts of 60 frames (within the subscribers' queues of QUEUE: no drops): every fifth
        # frame is the coder's, its last one followed by 4 reviewer frames, and the next coder
        # frame comes only after the coder subscriber got this one (or never, after the last)
        n, bursts, took = 60, 5, []
        for b in range(bursts):
            self.pub("tokens", org=org, run=run, nodes=["coder"] + ["reviewer"] * 4,
                     session="b%d" % b, count=n, size=256, rate=0)
            sent = time.time()
            took.append(arrived(coder, (b + 1) * n // 5, 5, "the coder's last frame") - sent)
            arrived(reviewer, (b + 1) * (n - n // 5), 10, "the reviewer's frames")
            for r in everything:
                arrived(r, (b + 1) * n, 10, "every frame to an unfiltered subscriber")
        for r in readers:
            r.cancel()
        self.assertEqual(live(coder), [("b%d-coder" % b, i) for b in range(bursts)
                                       for i in range(1, n // 5 + 1)])
        self.assertEqual(live(reviewer), [("b%d-reviewer" % b, i) for b in range(bursts)
                                          for i in range(1, n - n // 5 + 1)])
        for r in everything:
            self.assertEqual(sorted(live(r)), sorted(live(coder) + live(reviewer)))
            self.assertFalse(any(m.HasField("gap") for m in r.msgs))
        # the case under test happened: frames of the bursts waited for their ends
        self.assertGreater(self.a.metric("stream_hub_fanout_deferred_total"), deferred0)
        print("burst to the node-filtered subscriber: last frame after %.0f ms at most"
              % (1000 * max(took)), file=sys.stderr)

    def test_a_client_that_stops_reading_its_snapshot_is_ended_at_the_stall_limit(self):
        # The snapshot is sent from a stream worker: a client that stops reading it would hold
        # that worker (and its queued frames) until its deadline. The stall limit holds there
        # too: RESOURCE_EXHAUSTED, counted, and the worker serves the next subscriber.
        org = uid()
        run = self.new_run(org)
        self.pub("log", org=org, run=run, seq=2, message="x" * 2000, repeat=600)
        self.projected(run, 601)
        small = grpc.insecure_channel(self.a.addr, options=[("grpc.http2.bdp_probe", 0),
                                                            ("grpc.use_local_subchannel_pool", 1)])
        self.channels["small-snapshot"] = small
        rpc = small.unary_stream(SVC + "StreamRunLogs",
                                  request_serializer=W.StreamRunLogsRequest.SerializeToString,
                                  response_deserializer=W.StreamRunLogsResponse.FromString)
        stalled0 = self.a.metric("stream_hub_stalled_total")
        dead = rpc(W.StreamRunLogsRequest(run_id=run), metadata=self.md(org), timeout=60)
        wait_until(lambda: self.a.metric("stream_hub_stalled_total") > stalled0,
                   STALL_MS / 1000 + 10, "the client stalled in its snapshot to be ended")
        with self.assertRaises(grpc.RpcError) as e:
            for _ in dead:
                pass
        self.assertEqual(e.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertIn("snapshot", e.exception.details())
        r = self.read(self.a, "StreamRunLogs", W.StreamRunLogsRequest(run_id=run), org)
        wait_until(lambda: len(r.msgs) >= 600, 15, "a reading subscriber's snapshot")
        r.cancel()

    # ---- many subscriptions, mixed orgs ----
    def test_many_mixed_org_subscriptions_see_no_foreign_frame(self):
        orgs = [uid() for _ in range(10)]
        runs = {}
        for o in orgs:
            runs[o] = self.new_run(o)
        for o in orgs:
            self.projected(runs[o], 1)
        got = {}
        codes = {}

        async def main():
            # libcommon serves at most 256 concurrent streams per HTTP/2 connection: one
            # connection per 200 subscriptions (a local subchannel pool each)
            nch = max(2, 2 * ((MANY + 399) // 400))
            chans = [grpc.aio.insecure_channel((self.a, self.b)[k % 2].addr,
                                               options=[("grpc.use_local_subchannel_pool", 1)])
                     for k in range(nch)]
            tokens = {o: self.token(o) for o in orgs}

            async def sub(i):
                o = orgs[i % len(orgs)]
                ch = chans[i % len(chans)]
                call = ch.unary_stream(SVC + "StreamRunLogs",
                                       request_serializer=W.StreamRunLogsRequest.SerializeToString,
                                       response_deserializer=W.StreamRunLogsResponse.FromString)
                stream = call(W.StreamRunLogsRequest(run_id=runs[o]),
                              metadata=(("authorization", "Bearer " + tokens[o]),), timeout=60)
                got[i] = []
                try:
                    first = True
                    async for m in stream:
                        got[i].append((o, m.line.message))
                        if first:
                            first = False
                    codes[i] = "OK"
                except grpc.aio.AioRpcError as e:
                    codes[i] = e.code().name

            async def foreign(i):
                o, victim = orgs[i % len(orgs)], orgs[(i + 1) % len(orgs)]
                call = chans[i % 2].unary_stream(
                    SVC + "StreamRunLogs", request_serializer=W.StreamRunLogsRequest.SerializeToString,
                    response_deserializer=W.StreamRunLogsResponse.FromString)
                msgs = []
                try:
                    async for m in call(W.StreamRunLogsRequest(run_id=runs[victim]),
                                        metadata=(("authorization", "Bearer " + tokens[o]),),
                                        timeout=20):
                        msgs.append(m)
                    return ("OK", msgs)
                except grpc.aio.AioRpcError as e:
                    return (e.code().name, msgs)

            tasks = [asyncio.ensure_future(sub(i)) for i in range(MANY)]
            t0 = time.time()
            wait = self.a.metric, self.b.metric
            while time.time() - t0 < 60:
                n = sum(m("stream_hub_subscribers", 'rpc="StreamRunLogs"') for m in wait)
                if n >= MANY:
                    break
                await asyncio.sleep(0.1)
            self.__class__.subscribe_secs = time.time() - t0
            bad = await asyncio.gather(*[foreign(i) for i in range(20)])
            for k, o in enumerate(orgs):
                await asyncio.get_event_loop().run_in_executor(
                    None, lambda o=o: self.pub("log", org=o, run=runs[o], seq=2,
                                               message="for " + o))
            t1 = time.time()
            while time.time() - t1 < 30:
                if all(len(got.get(i, [])) >= 1 for i in range(MANY)):
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.3)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for ch in chans:
                await ch.close()
            return bad

        bad = asyncio.new_event_loop().run_until_complete(main())
        for code, msgs in bad:
            self.assertEqual(code, "NOT_FOUND")
            self.assertEqual(msgs, [])
        foreign_frames = sum(1 for i in got for (o, msg) in got[i] if msg != "for " + o)
        self.assertEqual(foreign_frames, 0)
        self.assertEqual([(i, got.get(i), codes.get(i)) for i in range(MANY)
                          if len(got.get(i, [])) != 1][:5], [])
        print("  %d subscriptions over 2 replicas opened in %.2f s" % (MANY, self.subscribe_secs),
              file=sys.stderr)

    # ---- visible runs ----
    def test_visible_runs_snapshot_entry_and_exit(self):
        org, team, other_team, me, someone = uid(), uid(), uid(), uid(), uid()
        r1 = self.new_run(org, team=team, name="team-running")
        r2 = self.new_run(org, team=other_team, name="not-my-team")
        r3 = self.new_run(org, visibility="private", owner=me, status="completed", name="mine")
        r4 = self.new_run(org, visibility="private", owner=someone, name="not-mine")
        for r in (r1, r2, r3, r4):
            self.projected(r, 1)
        kw = dict(teams=(team,), sub=me, clearance=1)
        active = self.read(self.a, "StreamVisibleRuns", W.StreamVisibleRunsRequest(status_filter=1),
                           org, **kw)
        every = self.read(self.b, "StreamVisibleRuns", W.StreamVisibleRunsRequest(status_filter=4),
                          org, **kw)
        for r in (active, every):
            wait_until(lambda: any(m.snapshot_done for m in r.msgs), 10, "snapshot_done")
        self.assertEqual([(m.run_id, m.is_snapshot) for m in active.msgs[:-1]], [(r1, True)])
        self.assertEqual(active.msgs[0].workflow_name, "team-running")
        self.assertEqual({m.run_id for m in every.msgs[:-1]}, {r1, r3})
        r5 = self.new_run(org, team=team, name="new")            # enters
        self.pub("node", org=org, run=r1, seq=2, node_id="x", status="blocked", team=team,
                 run_status="running", needs_approval=True, prompt_id="p1")
        self.pub("run", org=org, run=r1, seq=3, status="completed", team=team)  # leaves ACTIVE
        self.pub("run", org=org, run=r2, seq=2, status="completed", team=other_team)
        self.pub("run", org=org, run=r4, seq=2, status="failed", visibility="private",
                 owner=someone)
        wait_until(lambda: len(active.msgs) >= 5 and len(every.msgs) >= 6, 10, "live deltas")
        time.sleep(0.3)
        active.cancel()
        every.cancel()
        live = [(m.run_id, m.status, m.leaving, m.is_snapshot) for m in active.msgs[2:]]
        self.assertEqual(live, [(r5, "running", False, False), (r1, "running", False, False),
                                (r1, "completed", True, False)])
        self.assertTrue(active.msgs[3].needs_approval)
        self.assertEqual(active.msgs[3].last_action_status, "blocked")
        self.assertEqual(active.msgs[3].prompt_id, "p1")
        live_all = [(m.run_id, m.status, m.leaving) for m in every.msgs[3:]]
        self.assertEqual(live_all, [(r5, "running", False), (r1, "running", False),
                                    (r1, "completed", False)])

    def test_visible_runs_leave_out_a_deleted_workflows_runs(self):
        """DeleteWorkflow: the workflow's runs "become UNDISCOVERABLE through the workflow"
        (RunScope.workflow_deleted on every event from the delete on): a live subscriber gets
        `leaving` for each, a later event of such a run (it may still be running) does not bring
        it back, a new snapshot leaves it out; by id it stays readable."""
        org, team, me = uid(), uid(), uid()
        wf = uid()
        r1 = self.new_run(org, team=team, name="doomed")
        r2 = self.new_run(org, team=team, name="kept")
        for r in (r1, r2):
            self.projected(r, 1)
        kw = dict(teams=(team,), sub=me, clearance=1)
        live = self.read(self.a, "StreamVisibleRuns", W.StreamVisibleRunsRequest(status_filter=4), org, **kw)
        wait_until(lambda: any(m.snapshot_done for m in live.msgs), 10, "snapshot_done")
        self.assertEqual({m.run_id for m in live.msgs[:-1]}, {r1, r2})
        self.pub("run", org=org, run=r1, seq=2, status="running", team=team, workflow_id=wf,
                 workflow_deleted=True)
        self.pub("node", org=org, run=r1, seq=3, node_id="x", status="running", team=team,
                 run_status="running", workflow_id=wf, workflow_deleted=True)
        self.pub("run", org=org, run=r2, seq=2, status="completed", team=team)
        wait_until(lambda: any(m.run_id == r2 for m in live.msgs[3:]), 10, "r2's delta")
        self.projected(r1, 3)
        time.sleep(0.3)
        live.cancel()
        self.assertEqual([(m.run_id, m.leaving) for m in live.msgs[3:]], [(r1, True), (r2, False)])
        again = self.read(self.b, "StreamVisibleRuns", W.StreamVisibleRunsRequest(status_filter=4), org, **kw)
        wait_until(lambda: any(m.snapshot_done for m in again.msgs), 10, "snapshot_done")
        again.cancel()
        self.assertEqual([m.run_id for m in again.msgs[:-1]], [r2])
        st = self.read(self.b, "StreamRunStatus", W.StreamRunStatusRequest(run_id=r1), org, **kw)
        wait_until(lambda: st.msgs, 10, "r1 by id")
        st.cancel()
        self.assertEqual(st.msgs[0].update.node_id, "x")

    def test_visible_runs_snapshot_rows_describe_the_whole_run(self):
        # spec VisibleRunEvent: a snapshot row carries the run's action count and the actions in
        # a terminal status, is_waiting is the run-level roll-up (a node parked on a wait), and
        # prompt_kind/prompt_id/needs_* describe the FRESHEST open gate, all as of the snapshot:
        # not whatever the run's newest transition (about one action) or its last run-level
        # event happened to say.
        org, team = uid(), uid()
        run = self.new_run(org, team=team, name="rollup")     # a run event: nodes_total 3
        node = dict(org=org, run=run, team=team, run_status="running")
        self.pub("node", seq=2, node_id="a", status="done", **node)
        self.pub("node", seq=3, node_id="b", status="blocked", needs_approval=True,
                 prompt_id="gate-b", **node)
        self.pub("node", seq=4, node_id="c", status="blocked", raw_status="waiting",
                 is_waiting=True, **node)
        self.pub("node", seq=5, node_id="d", status="running", **node)   # a parallel branch
        self.pub("node", seq=6, node_id="e", status="running", iteration=1, **node)
        self.pub("node", seq=7, node_id="e", status="failed", iteration=1, **node)
        every_seq = lambda n: wait_until(  # noqa: E731 (two replicas project in parallel)
            lambda: psql(self.admin, "SELECT count(*) FROM stream_hub.run_events WHERE run_id = "
                         "'%s'" % run) == str(n), 15, "seqs 1..%d of run %s projected" % (n, run))
        every_seq(7)

        def row():
            r = self.read(self.a, "StreamVisibleRuns", W.StreamVisibleRunsRequest(), org,
                          teams=(team,))
            wait_until(lambda: any(m.snapshot_done for m in r.msgs), 10, "snapshot_done")
            r.cancel()
            rows = [m for m in r.msgs if m.run_id == run]
            self.assertEqual(len(rows), 1)
            self.assertTrue(rows[0].is_snapshot)
            return rows[0]

        m = row()
        self.assertEqual((m.nodes_total, m.nodes_done), (5, 2))   # a, b, c, d, e@1; a and e@1
        self.assertTrue(m.is_waiting)
        self.assertEqual((m.needs_approval, m.needs_input, m.prompt_id), (True, False, "gate-b"))
        self.assertEqual(m.last_action_status, "")                 # live deltas only
        self.assertTrue(m.HasField("open_prompt_count"))          # snapshot rows: present
        self.assertEqual(m.open_prompt_count, 1)
        # a second gate opens: the freshest one is described, co-derived from that one row
        self.pub("node", seq=8, node_id="f", status="blocked", needs_input=True,
                 prompt_id="prompt-f", **node)
        every_seq(8)
        m = row()
        self.assertEqual((m.needs_approval, m.needs_input, m.prompt_id), (False, True, "prompt-f"))
        self.assertEqual(m.nodes_total, 6)
        self.assertEqual(m.open_prompt_count, 2)
        # it is answered and the wait resolves: the older gate is the open one again
        self.pub("node", seq=9, node_id="f", status="done", **node)
        self.pub("node", seq=10, node_id="c", status="done", **node)
        every_seq(10)
        m = row()
        self.assertEqual((m.needs_approval, m.needs_input, m.prompt_id), (True, False, "gate-b"))
        self.assertFalse(m.is_waiting)
        self.assertEqual((m.nodes_total, m.nodes_done), (6, 4))
        self.assertEqual(m.open_prompt_count, 1)

    def test_visible_runs_open_prompt_count_is_0_for_a_run_without_nodes(self):
        # spec VisibleRunEvent.open_prompt_count: "POPULATED ON SNAPSHOT ROWS"; "ABSENT = not
        # determined on this message; PRESENT = authoritative, including present-and-0". A run
        # no node transition was projected for yet has no gate open: 0, present. Absent only
        # where the store cannot count: a node of unknown state (migration 004's backfill) or
        # a gate the run row has from a transition naming no node.
        org, team = uid(), uid()
        fresh = self.new_run(org, team=team, status="pending", name="fresh")
        unknown = self.new_run(org, team=team, name="backfilled")
        nameless = self.new_run(org, team=team, name="nameless")
        node = dict(org=org, team=team, run_status="running")
        self.pub("node", run=unknown, seq=2, node_id="a", status="running", **node)
        self.pub("node", run=nameless, seq=2, node_id="", status="blocked", needs_approval=True,
                 prompt_id="g1", **node)
        for run, seq in ((fresh, 1), (unknown, 2), (nameless, 2)):
            self.projected(run, seq)
        wait_until(lambda: psql(self.admin, "SELECT count(*) FROM stream_hub.runs WHERE run_id "
                                "= '%s' AND last_seq = 2" % nameless) == "1", 15, "the run row")
        psql(self.admin, "UPDATE stream_hub.run_nodes SET status = '' WHERE run_id = '%s'"
             % unknown)
        r = self.read(self.a, "StreamVisibleRuns", W.StreamVisibleRunsRequest(), org,
                      teams=(team,), clearance=1)
        wait_until(lambda: any(m.snapshot_done for m in r.msgs), 10, "snapshot_done")
        r.cancel()
        rows = {m.run_id: m for m in r.msgs if m.is_snapshot}
        self.assertEqual(set(rows), {fresh, unknown, nameless})
        self.assertTrue(rows[fresh].HasField("open_prompt_count"))
        self.assertEqual(rows[fresh].open_prompt_count, 0)
        self.assertEqual((rows[fresh].prompt_kind, rows[fresh].needs_input,
                          rows[fresh].needs_approval), (0, False, False))
        self.assertFalse(rows[unknown].HasField("open_prompt_count"))
        self.assertTrue(rows[nameless].needs_approval)
        self.assertFalse(rows[nameless].HasField("open_prompt_count"))

    def test_visible_runs_overflow_is_repaired_by_a_resnapshot(self):
        org, team, me = uid(), uid(), uid()
        r1 = self.new_run(org, team=team, name="busy")
        self.projected(r1, 1)
        small = grpc.insecure_channel(self.b.addr, options=[("grpc.http2.bdp_probe", 0),
                                                            ("grpc.use_local_subchannel_pool", 1)])
        self.channels["small-b"] = small
        rpc = small.unary_stream(SVC + "StreamVisibleRuns",
                                  request_serializer=W.StreamVisibleRunsRequest.SerializeToString,
                                  response_deserializer=W.VisibleRunEvent.FromString)
        gaps0 = self.b.metric("stream_hub_gaps_total")
        r = Reader(rpc, W.StreamVisibleRunsRequest(status_filter=1),
                   self.md(org, teams=(team,), sub=me), pause_after_first=1.2)
        wait_until(lambda: r.msgs, 10, "the first snapshot row")
        # four times what its queue (64 frames) and HTTP/2 window (about 32 of these 2 KB
        # frames) hold, published while it does not read: its pause (1.2 s) stays under the
        # stall limit (1.5 s), and 1,200 frames once took 1.23 s to publish under ASan on a
        # loaded machine
        n = 400
        t0 = time.time()
        self.pub("node", org=org, run=r1, seq=2, repeat=n, node_id="x", status="running",
                 run_status="running", team=team, workflow_name="w" * 2000)
        self.assertLess(time.time() - t0, 1.2, "publishing was too slow to overflow anything")
        self.pub("run", org=org, run=r1, seq=n + 2, status="completed", team=team)
        r2 = self.new_run(org, team=team, name="new")
        try:
            wait_until(lambda: any(m.run_id == r2 for m in r.msgs), 20, "the new run")
        except AssertionError:
            print(r.code, r.details, len(r.msgs), [(m.run_id[:4], m.leaving, m.is_snapshot)
                                                  for m in r.msgs[-5:]],
                  self.b.metric("stream_hub_gaps_total"), self.b.metric("stream_hub_stalled_total"),
                  self.b.metric("stream_hub_queue_depth_max"), file=sys.stderr)
            print(self.b.log_text()[-3000:], file=sys.stderr)
            raise
        time.sleep(0.3)
        r.cancel()
        self.assertGreater(self.b.metric("stream_hub_gaps_total"), gaps0)
        # whatever was dropped, the set the client ends up with is right: r1 left, r2 entered
        inset = set()
        for m in r.msgs:
            if m.snapshot_done:
                continue
            if m.leaving:
                inset.discard(m.run_id)
            else:
                inset.add(m.run_id)
        self.assertEqual(inset, {r2})
        self.assertLess(len(r.msgs), n + 4)  # frames were dropped, not queued without bound

    # ---- lifetime: subscribe, cancel, stall, end of run and shutdown racing each other ----
    def test_churn_subscribers_cancel_while_frames_flow_the_run_ends_and_the_hub_stops(self):
        # Many subscribers of one run (all three run-scoped streams) connect and go away in every
        # way while frames flow: cancelled at once (racing the handler's snapshot and the
        # detach), after a few frames, or never reading (their queues fill: drops, repairs,
        # gaps, the stall limit's abort); the run ends meanwhile (status streams finish), and the
        # replica is stopped (SIGTERM) with streams open. Run under the ASan build (BUILD=
        # build-asan) this is the subscriber lifetime's stress test: the replica must exit 0
        # with nothing on stderr from a sanitizer, and no subscriber may be left behind.
        org = uid()
        run = self.new_run(org)
        c = self.start(UPSQUAD_HUB_PROJECTION_DURABLE="hub-it-%s-churn-events" % TAG,
                       UPSQUAD_HUB_TRANSCRIPT_DURABLE="hub-it-%s-churn-io" % TAG,
                       UPSQUAD_RPC_STREAM_QUEUE="8", UPSQUAD_HUB_STALL_LIMIT="300ms",
                       UPSQUAD_HUB_REPAIR_BATCH="4")
        toks = Publisher()
        stop = threading.Event()
        seq = [1]
        errors = []

        events_done = threading.Event()

        def run_events():
            while not stop.is_set() and not events_done.is_set():
                seq[0] += 1
                s = seq[0]
                if s % 2:
                    self.pub("log", org=org, run=run, seq=s, message="line %d" % s)
                else:
                    self.pub("node", org=org, run=run, seq=s, node_id="n%d" % (s % 7),
                             status="running", run_status="running", elapsed_ms=s)
        ch = [grpc.insecure_channel(c.addr) for _ in range(3)]
        openers = []
        for i, (m, req) in enumerate((
                ("StreamRunStatus", W.StreamRunStatusRequest(run_id=run)),
                ("StreamRunLogs", W.StreamRunLogsRequest(run_id=run)),
                ("StreamNodeIO", W.StreamNodeIORequest(run_id=run)))):
            rq, rs = METHODS[m]
            openers.append((ch[i].unary_stream(SVC + m, request_serializer=rq.SerializeToString,
                                               response_deserializer=rs.FromString), req))
        md = self.md(org)
        held = []  # streams nobody reads, cancelled later or left open for the shutdown
        held_mu = threading.Lock()
        opened = []

        def churn(k):
            rnd = __import__("random").Random(k)
            n = 0
            while not stop.is_set():
                opener, req = openers[n % 3]
                n += 1
                opened.append(1)
                call = opener(req, metadata=md, timeout=30)
                way = rnd.randrange(4)
                try:
                    if way == 0:
                        time.sleep(rnd.random() * 0.005)
                        call.cancel()
                    elif way == 1:  # a few frames, for at most a moment
                        timer = threading.Timer(0.05 + rnd.random() * 0.4, call.cancel)
                        timer.start()
                        want = rnd.randrange(1, 20)
                        for i, _ in enumerate(call):
                            if i >= want:
                                break
                        timer.cancel()
                        call.cancel()
                    else:
                        with held_mu:
                            held.append(call)
                            if len(held) > 60:
                                held.pop(rnd.randrange(len(held))).cancel()
                        time.sleep(0.01)
                except grpc.RpcError as e:
                    if e.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.OK,
                                        grpc.StatusCode.RESOURCE_EXHAUSTED):
                        errors.append("%s: %s" % (e.code(), e.details()))
        pubs = [threading.Thread(target=run_events)]
        workers = [threading.Thread(target=churn, args=(k,)) for k in range(6)]
        try:
            for t in pubs + workers:
                t.start()
            toks("tokens", org=org, run=run, node="coder", session="s1", **{"from": 1},
                 count=1500, size=512, rate=600)
            # the run ends while subscribers keep coming: status streams finish
            events_done.set()
            pubs[0].join(30)
            end = seq[0] + 1
            self.pub("run", org=org, run=run, seq=end, status="completed", nodes_total=7,
                     nodes_done=7)
            toks("tokens", org=org, run=run, node="coder", session="s1", **{"from": 1501},
                 count=600, size=512, rate=600)
            stop.set()
            for t in pubs + workers:
                t.join(30)
            if errors and c.proc.poll() is not None:
                self.fail("the replica died: %s" % c.log_text(wait=10)[-6000:])
            self.assertEqual(errors, [])
            self.assertGreater(len(opened), 100, "too little churn to mean anything")
            print("churn: %d streams opened" % len(opened), file=sys.stderr)
            if c.proc.poll() is not None:
                self.fail("the replica died: %s" % c.log_text(wait=10)[-3000:])
            # a subscriber after all that is served (the fold and the end: the run is over)
            wait_until(lambda: psql(self.admin, "SELECT count(*) FROM stream_hub.run_events "
                                    "WHERE run_id = '%s'" % run) == str(end), 15,
                       "every event of the run in the projection")
            r = self.read(c, "StreamRunStatus", W.StreamRunStatusRequest(run_id=run), org)
            r.join(15)
            self.assertEqual(r.code, grpc.StatusCode.OK, r.details)
            self.assertEqual(len(r.msgs), 7)
            for call in held:
                call.cancel()

            def subscribers():
                return sum(c.metric("stream_hub_subscribers", 'rpc="%s"' % m)
                           for m in ("StreamRunStatus", "StreamRunLogs", "StreamNodeIO"))
            try:
                wait_until(lambda: subscribers() == 0, 20, "every subscriber gone")
            except AssertionError:
                if os.environ.get("HUB_TEST_PAUSE"):
                    print("leak: pid %d" % c.proc.pid, file=sys.stderr, flush=True)
                    time.sleep(int(os.environ["HUB_TEST_PAUSE"]))
                self.fail("subscribers left on the replica: %s, streams %s" % (
                    [c.metric("stream_hub_subscribers", 'rpc="%s"' % m)
                     for m in ("StreamRunStatus", "StreamRunLogs", "StreamNodeIO")],
                    c.metric("rpc_server_inflight_calls")))
            # streams open at the shutdown, some read, some not
            keep = [openers[i % 3][0](openers[i % 3][1], metadata=md, timeout=30) for i in range(30)]
            wait_until(lambda: subscribers() >= 20, 10, "subscribers for the shutdown")
            toks("tokens", org=org, run=run, node="coder", session="s1", **{"from": 2101},
                 count=100, size=512, rate=0)
            c.signal(signal.SIGTERM)
            rc = c.wait(30)
            err = c.log_text(wait=10)
            for bad in ("AddressSanitizer", "LeakSanitizer", "ThreadSanitizer", "runtime error",
                        "double free"):
                self.assertNotIn(bad, err)
            self.assertEqual(rc, 0, err[-3000:])
            for call in keep:
                call.cancel()
        finally:
            stop.set()
            for t in pubs + workers:
                t.join(30)
            toks.close()
            for x in ch:
                x.close()
            c.stop()
            self.retire(c)

    # ---- restart and shutdown ----
    def test_zz_replica_restart_loses_nothing_and_shutdown_ends_streams_unavailable(self):
        org = uid()
        run = self.new_run(org)
        self.projected(run, 1)
        live = self.read(self.b, "StreamRunLogs", W.StreamRunLogsRequest(run_id=run), org)
        time.sleep(0.3)
        for s in self.servers:
            s.stop()  # every replica down: nobody projects
        live.join(10)
        self.assertEqual(live.code, grpc.StatusCode.UNAVAILABLE, live.details)
        for s in range(2, 52):
            self.pub("log", org=org, run=run, seq=s, message="line %d" % s)
        self.__class__.servers = []
        for ch in self.channels.values():
            ch.close()
        self.channels.clear()
        self.__class__.b = self.start()  # the backlog is projected from the durable consumer
        self.projected(run, 51)
        r = self.read(self.b, "StreamRunLogs", W.StreamRunLogsRequest(run_id=run), org)
        wait_until(lambda: len(r.msgs) >= 50, 10, "the backlog")
        r.cancel()
        self.assertEqual([m.line.message for m in r.msgs], ["line %d" % s for s in range(2, 52)])


if __name__ == "__main__":
    unittest.main(verbosity=2)
