"""Helpers shared by the Python integration tests: generated modules, tokens, processes.

Tests run with Debian's /usr/bin/python3 (python3-grpcio, python3-protobuf). Generated
modules come from `make py` (build/py); BUILD overrides the build folder.
"""
import base64
import hashlib
import hmac
import importlib.util
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.path.join(ROOT, os.environ.get("BUILD", "build"))
PY = os.path.join(BUILD, "py")
if PY not in sys.path:
    sys.path.insert(0, PY)


def load_generated(relpath, name):
    """Loads a generated module by file path: `google.rpc` and `grpc.health` would otherwise
    collide with the installed google and grpc packages."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(PY, relpath))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_events(data, E):
    """The RunEvents of one WF_EVENTS message (E: the run_events_pb2 module): a RunEventBatch's
    (the engine's shape; its first field is events, 16: bytes 0x82 0x01), or one bare RunEvent
    (the earlier shape, still accepted by readers)."""
    if data[:2] == b"\x82\x01":
        return list(E.RunEventBatch.FromString(data).events)
    return [E.RunEvent.FromString(data)]


def b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def mint(secret, sub="user-1", org="org-1", clearance=3, teams=(), aud="upsquad", ttl=600,
         alg="HS256", extra=None, now=None):
    """An HS256 JWT as the gateway forwards it."""
    now = int(time.time()) if now is None else now
    header = {"alg": alg, "typ": "JWT"}
    claims = {"sub": sub, "org_id": org, "clearance": clearance, "teams": list(teams),
              "aud": aud, "iat": now, "exp": now + ttl}
    if extra:
        claims.update(extra)
    signing = b64url(json.dumps(header).encode()) + "." + b64url(json.dumps(claims).encode())
    if alg == "none":
        return signing + "."
    sig = hmac.new(secret.encode(), signing.encode(), hashlib.sha256).digest()
    return signing + "." + b64url(sig)


class Server:
    """A service executable started on a free loopback port; stopped by pid."""

    def __init__(self, binary, env=None, ready_timeout=15):
        self.secret = secrets.token_hex(16)
        e = dict(os.environ)
        e.update({"UPSQUAD_GRPC_ADDR": "127.0.0.1:0", "UPSQUAD_METRICS_ADDR": "127.0.0.1:0",
                  "UPSQUAD_JWT_SECRET": self.secret, "UPSQUAD_LOG_LEVEL": "warn"})
        e.update(env or {})
        self.secret = e["UPSQUAD_JWT_SECRET"]
        path = binary if os.path.isabs(binary) else os.path.join(BUILD, "bin", binary)
        self.proc = subprocess.Popen([path], env=e, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.port = None
        deadline = time.time() + ready_timeout
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("port="):
                self.port = int(line.strip()[5:])
                m = self.proc.stdout.readline()
                self.metrics = int(m.strip()[13:]) if m.startswith("metrics_port=") else 0
                break
        if self.port is None:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            why = self.proc.stderr.read()[-2000:]  # before stop() closes the pipe
            self.stop()
            raise RuntimeError("%s did not start: %s" % (binary, why))
        self.addr = "127.0.0.1:%d" % self.port
        # its log (stderr) is read as it is written, into self.log: a pipe nobody reads fills
        # at 64 KiB and blocks whichever thread of the server logs next
        self.log = []
        self._drain = threading.Thread(
            target=lambda: [self.log.append(l) for l in iter(self.proc.stderr.readline, "")],
            daemon=True)
        self._drain.start()

    def log_text(self, wait=0):
        """What it has logged; with wait, once it has exited, all of it (up to wait seconds)."""
        if wait:
            self._drain.join(wait)
        return "".join(self.log)

    def token(self, **kw):
        return mint(self.secret, **kw)

    def metric(self, name, labels=""):
        """The value of one series on /metrics, 0.0 when absent."""
        text = http_get("http://127.0.0.1:%d/metrics" % self.metrics)
        key = name + ("{" + labels + "}" if labels else "")
        for line in text.splitlines():
            if line.startswith(key + " "):
                return float(line.split()[-1])
        return 0.0

    def signal(self, sig):
        os.kill(self.proc.pid, sig)

    def wait(self, timeout):
        return self.proc.wait(timeout=timeout)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_drain", None):
            self._drain.join(5)  # at the pipe's end now: the reader is not cut mid-line
        for f in (self.proc.stdout, self.proc.stderr):
            if f:
                f.close()


# The one redaction rule of node data (libcommon redaction.h), as the tests check it on every
# read: the workflow-engine's (payload keys against the classification floor) and the
# stream-hub's (free text from clearance 4).
SENSITIVE_WORDS = ("password", "secret", "token", "api_key", "apikey", "authorization",
                   "credential", "private_key")
FREE_TEXT_CLEARANCE = 4


def redact_visible(clearance, floor, kind, key=None):
    """kind: "structural", "payload" or "free_text"."""
    if kind == "structural":
        return True
    if kind == "free_text":
        return clearance >= floor and clearance >= FREE_TEXT_CLEARANCE
    if clearance < floor:
        return False
    return clearance >= FREE_TEXT_CLEARANCE or not any(w in (key or "").lower()
                                                        for w in SENSITIVE_WORDS)


def redacted(obj, clearance, floor, kind_of=lambda k: "payload"):
    """obj's top-level keys a caller of clearance sees under the rule."""
    return {k: v for k, v in obj.items() if redact_visible(clearance, floor, kind_of(k), k)}


def psql(dsn, sql):
    """Runs one statement with psql; its unaligned output. Raises on failure."""
    out = subprocess.run(["psql", dsn, "-X", "-Atq", "-v", "ON_ERROR_STOP=1", "-c", sql],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError("psql: " + out.stderr)
    return out.stdout.strip()


def with_database(dsn, dbname):
    """The same DSN naming another database."""
    u = urllib.parse.urlsplit(dsn)
    return urllib.parse.urlunsplit((u.scheme, u.netloc, "/" + dbname, u.query, u.fragment))


def require(env, bins=()):
    """The values of the environment variables env (a list of names), in order; a missing one,
    or a program of bins not built in build/bin, skips the whole test file (SKIP, exit 0)."""
    vals = [os.environ.get(n) for n in env]
    if not all(vals):
        print("SKIP: %s are required" % ", ".join(env))
        sys.exit(0)
    for b in bins:
        if not os.path.exists(os.path.join(BUILD, "bin", b)):
            print("SKIP: build/bin/%s is not built" % b)
            sys.exit(0)
    return vals


def until_served(call, timeout=15):
    """call() once it answers without a gRPC error (a service just started may not yet see its
    worker or datastore), tried every 0.2 s for up to timeout s, then once more letting the
    error through."""
    import grpc
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            return call()
        except grpc.RpcError:
            time.sleep(0.2)
    return call()


def drain(server):
    """server, whose log every Server drains into server.log (kept for the callers that say so)."""
    return server


def apply_agent(org, definition, dsn, kek):
    """Provisions an agent definition (a dict: role, display_name, model, ...) in org with
    upsquad-agents, against the orchestrator's database dsn and key-encryption key kek."""
    path = "/tmp/agent-%s.json" % secrets.token_hex(8)
    with open(path, "w") as f:
        json.dump(definition, f)
    try:
        env = dict(os.environ, UPSQUAD_PG_DSN=dsn, UPSQUAD_KEK=kek, UPSQUAD_LOG_LEVEL="warn")
        out = subprocess.run([os.path.join(BUILD, "bin", "upsquad-agents"), "--org", org, "apply", path],
                             env=env, capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(out.stderr)
    finally:
        os.unlink(path)


def wait_run(test, client, run, pred, timeout=30, logs=()):
    """Polls GetWorkflowStatus of run through client until pred(status) holds; fails the test
    with the last status (and the tail of logs, lists of lines) when timeout passes."""
    from upsquad.workflow.v1 import workflow_pb2 as W
    end = time.time() + timeout
    s = None
    while time.time() < end:
        s = client("GetWorkflowStatus", W.GetWorkflowStatusRequest(run_id=run))
        if pred(s):
            return s
        time.sleep(0.1)
    tail = [l.strip()[:250] for log in logs for l in log if "heartbeat" not in l]
    test.fail("timed out; last: %s %s\n%s" % (s.run.status, [(a.step_name, a.status) for a in s.actions],
                                              "\n".join(tail[-25:])))


def engine_env(dsn, nats, secret, **overrides):
    """The environment of a test workflow-engine: its Postgres, NATS and token secret, the
    tree's migrations, schema and catalogue, a fresh page key, a short lease and idle poll, and
    per-org admission limits out of the way (tests trigger bursts from one org; the admission
    test sets its own); overrides={"UPSQUAD_...": value} replaces or adds variables."""
    env = {
        "UPSQUAD_PG_DSN": dsn, "UPSQUAD_NATS_URL": nats, "UPSQUAD_JWT_SECRET": secret,
        "UPSQUAD_MIGRATIONS_DIR": os.path.join(ROOT, "services/workflow-engine/migrations"),
        "UPSQUAD_WF_SCHEMA_FILE": os.path.join(
            ROOT, "services/workflow-engine/schema/workflow-definition.schema.json"),
        "UPSQUAD_WF_CATALOG_FILE": os.path.join(ROOT, "services/workflow-engine/catalog/tools.json"),
        "UPSQUAD_WF_PAGE_KEY": secrets.token_hex(16), "UPSQUAD_WF_LEASE": "1500ms",
        "UPSQUAD_WF_IDLE_POLL": "50ms", "UPSQUAD_LOG_LEVEL": "error", "UPSQUAD_WF_WORKERS": "2",
        "UPSQUAD_WF_ORG_MAX_ACTIVE_RUNS": "1000000", "UPSQUAD_WF_ORG_TRIGGERS_PER_SEC": "100000",
    }
    env.update(overrides)
    return env


def rpc_error(test, code, fn, *args, contains=None):
    """Asserts fn(*args) fails with gRPC status `code` (and `contains` in its message); the
    error."""
    import grpc
    with test.assertRaises(grpc.RpcError) as ctx:
        fn(*args)
    test.assertEqual(ctx.exception.code(), code, ctx.exception.details())
    if contains:
        test.assertIn(contains, ctx.exception.details())
    return ctx.exception


def concurrently(n, fn):
    """Runs fn(i) for i in 0..n-1 on n threads at once; (results, grpc errors)."""
    import grpc
    out, errs, lock = [], [], threading.Lock()

    def one(i):
        try:
            r = fn(i)
            with lock:
                out.append(r)
        except grpc.RpcError as x:
            with lock:
                errs.append(x)
    ths = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    [t.start() for t in ths]
    [t.join() for t in ths]
    return out, errs


def struct(d):
    """A google.protobuf.Struct of a dict."""
    from google.protobuf import struct_pb2
    s = struct_pb2.Struct()
    s.update(d)
    return s


class WorkflowClient:
    """Unary calls of WorkflowService (and ApprovalService: RecordDecision, GetApproval,
    OpenApproval) as a bearer of `token`: client("GetWorkflowStatus", request) -> response."""
    APPROVAL = ("RecordDecision", "GetApproval", "OpenApproval")

    def __init__(self, addr, token, timeout=15):
        import grpc
        self.ch = grpc.insecure_channel(addr)
        self.md = [("authorization", "Bearer " + token)]
        self.timeout = timeout

    def __call__(self, method, req, timeout=None, metadata=()):
        from upsquad.approval.v1 import approval_pb2 as AP
        from upsquad.workflow.v1 import workflow_pb2 as W
        if method in self.APPROVAL:
            svc, resp = "/upsquad.approval.v1.ApprovalService/", getattr(AP, method + "Response")
        else:
            svc, resp = "/upsquad.workflow.v1.WorkflowService/", getattr(W, method + "Response")
        f = self.ch.unary_unary(svc + method, request_serializer=req.SerializeToString,
                                response_deserializer=resp.FromString)
        return f(req, metadata=self.md + list(metadata), timeout=timeout or self.timeout)

    def close(self):
        self.ch.close()


def agent_dispatch(nc, run, timeout=15):
    """The next AgentStepDispatch of `run` taken from the orchestrator's durable consumer on
    AGENT_STEPS (others are acked and skipped), playing the orchestrator; None after timeout."""
    from upsquad.internal.v1 import agent_step_pb2 as AS
    end = time.time() + timeout
    while time.time() < end:
        m = nc.js_fetch("AGENT_STEPS", "orchestrator-steps", 0.3)
        if not m:
            continue
        _, ack, data = m
        nc.publish(ack, b"")
        d = AS.AgentStepDispatch.FromString(data)
        if d.run_id == run:
            return d
    return None


def free_port():
    """A loopback port free now (for a process that must be told its address in advance).
    Taken from 20000-29999, below the kernel's ephemeral range (32768 and up) and the
    runtimes' PORT_BASE blocks: a port bound to 0 is an ephemeral one, which any outgoing
    connection made before the process listens (a service dialling Postgres or NATS) may be
    given, and the listen then fails with "Address already in use"."""
    import random
    for _ in range(200):
        port = random.randrange(20000, 30000)
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
        finally:
            s.close()
    raise RuntimeError("no free loopback port in 20000-29999")


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()
