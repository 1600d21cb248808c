"""libcommon's RPC server, called by the official Python client (grpcio) over real gRPC.

The test service is tests/support/echo-server (EchoService + health), started per test class
on a free loopback port and stopped by pid.
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
import upsquad_testlib as T  # noqa: E402

import grpc  # noqa: E402
from upsquad.test.v1 import echo_pb2  # noqa: E402

status_pb2 = T.load_generated("google/rpc/status_pb2.py", "status_pb2")
health_pb2 = T.load_generated("grpc/health/v1/health_pb2.py", "health_pb2")

SVC = "/upsquad.test.v1.EchoService/"


def methods(channel):
    def unary(name, resp=echo_pb2.EchoResponse):
        return channel.unary_unary(SVC + name, request_serializer=echo_pb2.EchoRequest.SerializeToString,
                                   response_deserializer=resp.FromString)

    def stream(name):
        return channel.unary_stream(SVC + name, request_serializer=echo_pb2.EchoRequest.SerializeToString,
                                    response_deserializer=echo_pb2.EchoResponse.FromString)

    return {"Echo": unary("Echo"), "PublicEcho": unary("PublicEcho"), "Stream": stream("Stream"),
            "PublicStream": stream("PublicStream"),
            "Check": channel.unary_unary("/grpc.health.v1.Health/Check",
                                         request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                         response_deserializer=health_pb2.HealthCheckResponse.FromString),
            "Watch": channel.unary_stream("/grpc.health.v1.Health/Watch",
                                          request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                          response_deserializer=health_pb2.HealthCheckResponse.FromString)}


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7f
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def auth(token):
    return (("authorization", "Bearer " + token),)


class EchoBase(unittest.TestCase):
    env = {}

    @classmethod
    def setUpClass(cls):
        cls.srv = T.Server("echo-server", env=cls.env)
        cls.ch = grpc.insecure_channel(cls.srv.addr)
        cls.s = methods(cls.ch)
        cls.tok = cls.srv.token(sub="member-7", org="org-42", clearance=4)

    @classmethod
    def tearDownClass(cls):
        cls.ch.close()
        cls.srv.stop()

    def assertCode(self, ctx, code):
        self.assertEqual(ctx.exception.code(), code, ctx.exception.details())


class UnaryTest(EchoBase):
    def test_echo_carries_identity_from_token(self):
        r = self.s["Echo"](echo_pb2.EchoRequest(text="héllo ✓"), metadata=auth(self.tok), timeout=5)
        self.assertEqual(r.text, "héllo ✓")
        self.assertEqual((r.sub, r.org_id), ("member-7", "org-42"))

    def test_public_method_needs_no_token(self):
        r = self.s["PublicEcho"](echo_pb2.EchoRequest(text="x", payload_bytes=1000), timeout=5)
        self.assertEqual(len(r.payload), 1000)
        self.assertEqual(r.sub, "")

    def test_missing_token(self):
        with self.assertRaises(grpc.RpcError) as ctx:
            self.s["Echo"](echo_pb2.EchoRequest(text="x"), timeout=5)
        self.assertCode(ctx, grpc.StatusCode.UNAUTHENTICATED)
        self.assertIn("missing bearer token", ctx.exception.details())

    def test_forged_tokens(self):
        cases = {
            "other secret": T.mint("not-the-secret"),
            "alg none": T.mint(self.srv.secret, alg="none"),
            "expired": T.mint(self.srv.secret, now=int(time.time()) - 3600, ttl=60),
            "wrong audience": T.mint(self.srv.secret, aud="someone-else"),
            "clearance out of range": T.mint(self.srv.secret, clearance=9),
            "garbage": "abc.def",
            "tampered": self.tok[:-4] + ("AAAA" if not self.tok.endswith("AAAA") else "BBBB"),
        }
        for what, tok in cases.items():
            with self.subTest(what):
                with self.assertRaises(grpc.RpcError) as ctx:
                    self.s["Echo"](echo_pb2.EchoRequest(text="x"), metadata=auth(tok), timeout=5)
                self.assertCode(ctx, grpc.StatusCode.UNAUTHENTICATED)
                self.assertNotIn(tok, ctx.exception.details())

    def test_repeated_token_still_expires(self):
        # the server remembers verified tokens; a remembered one must still expire on time
        srv = T.Server("echo-server", env={"UPSQUAD_JWT_LEEWAY": "0s"})
        try:
            with grpc.insecure_channel(srv.addr) as ch:
                echo = methods(ch)["Echo"]
                tok = srv.token(sub="short-lived", ttl=2)
                for _ in range(3):
                    self.assertEqual(echo(echo_pb2.EchoRequest(text="a"), metadata=auth(tok),
                                          timeout=5).sub, "short-lived")
                time.sleep(2.2)
                with self.assertRaises(grpc.RpcError) as ctx:
                    echo(echo_pb2.EchoRequest(text="b"), metadata=auth(tok), timeout=5)
                self.assertCode(ctx, grpc.StatusCode.UNAUTHENTICATED)
                self.assertIn("expired", ctx.exception.details())
        finally:
            srv.stop()

    def test_deadline_exceeded(self):
        labels = 'method="/upsquad.test.v1.EchoService/Echo",code="DEADLINE_EXCEEDED"'
        before = self.srv.metric("rpc_server_handled_total", labels)
        t0 = time.time()
        with self.assertRaises(grpc.RpcError) as ctx:
            self.s["Echo"](echo_pb2.EchoRequest(text="slow", delay_ms=3000), metadata=auth(self.tok),
                           timeout=0.3)
        self.assertCode(ctx, grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertLess(time.time() - t0, 2.0)
        # The server noticed too, its handler stopped early, and the status it sent is
        # DEADLINE_EXCEEDED although the handler returned CANCELLED: on a loaded machine the
        # server's status can reach the client before the client's own timer fires, so the
        # wire status must not depend on which one wins.
        deadline = time.time() + 3
        while time.time() < deadline and (
                self.srv.metric("rpc_server_inflight_calls") > 0 or
                self.srv.metric("rpc_server_handled_total", labels) <= before):
            time.sleep(0.05)
        self.assertEqual(self.srv.metric("rpc_server_inflight_calls"), 0)
        self.assertEqual(self.srv.metric("rpc_server_handled_total", labels), before + 1)

    def test_status_details_read_back(self):
        with self.assertRaises(grpc.RpcError) as ctx:
            self.s["Echo"](echo_pb2.EchoRequest(text="bad-input", fail_code=3), metadata=auth(self.tok),
                           timeout=5)
        e = ctx.exception
        self.assertCode(ctx, grpc.StatusCode.INVALID_ARGUMENT)
        raw = dict(e.trailing_metadata()).get("grpc-status-details-bin")
        self.assertIsNotNone(raw, "no grpc-status-details-bin trailer")
        st = status_pb2.Status.FromString(raw)
        self.assertEqual(st.code, 3)
        self.assertEqual(st.message, e.details())
        self.assertEqual(len(st.details), 1)
        detail = echo_pb2.EchoError()
        self.assertTrue(st.details[0].Unpack(detail))
        self.assertEqual(st.details[0].type_url, "type.googleapis.com/upsquad.test.v1.EchoError")
        self.assertEqual((detail.field, detail.reason), ("text", "bad-input"))

    def test_message_size_limits(self):
        ok = self.s["PublicEcho"](echo_pb2.EchoRequest(text="x" * (3 << 20)), timeout=10)
        self.assertEqual(len(ok.text), 3 << 20)
        with self.assertRaises(grpc.RpcError) as ctx:  # over the 4 MiB the server accepts
            self.s["PublicEcho"](echo_pb2.EchoRequest(text="x" * (5 << 20)), timeout=10)
        self.assertCode(ctx, grpc.StatusCode.RESOURCE_EXHAUSTED)

    def test_bad_argument_names_field(self):
        with self.assertRaises(grpc.RpcError) as ctx:
            self.s["PublicEcho"](echo_pb2.EchoRequest(payload_bytes=-1), timeout=5)
        self.assertCode(ctx, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertTrue(ctx.exception.details().startswith("payload_bytes:"))

    def test_undecodable_request(self):
        raw = self.ch.unary_unary(SVC + "PublicEcho", request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)
        with self.assertRaises(grpc.RpcError) as ctx:
            raw(b"\xff\xff\xff", timeout=5)
        self.assertCode(ctx, grpc.StatusCode.INVALID_ARGUMENT)

    def test_nesting_limit(self):
        def nested(depth):
            req = echo_pb2.EchoRequest(text="deep")
            v = req.meta.fields["k"]
            for _ in range(depth):
                v = v.list_value.values.add()
            v.string_value = "bottom"
            return req

        r = self.s["PublicEcho"](nested(20), timeout=5)
        self.assertEqual(r.meta, nested(20).meta)
        raw = self.ch.unary_unary(SVC + "PublicEcho", request_serializer=lambda b: b,
                                  response_deserializer=echo_pb2.EchoResponse.FromString)
        # 100,000 levels: enough to overflow the unpacker's stack were it not refused first.
        # Built inside out, prefixes collected and joined once (linear time).
        core = b"\x1a\x00"  # Value{string_value: ""}
        size, prefixes = len(core), []
        for _ in range(100000):
            p = b"\x0a" + varint(size)           # ListValue.values
            size += len(p)
            q = b"\x32" + varint(size)           # Value.list_value
            size += len(q)
            prefixes.append(p)
            prefixes.append(q)
        inner = b"".join(reversed(prefixes)) + core
        entry = b"\x0a\x01k\x12" + varint(len(inner)) + inner    # Struct.fields entry {k: value}
        struct = b"\x0a" + varint(len(entry)) + entry
        req = b"\x32" + varint(len(struct)) + struct               # EchoRequest.meta
        with self.assertRaises(grpc.RpcError) as ctx:
            raw(req, timeout=10)
        self.assertCode(ctx, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("deeper than 64", ctx.exception.details())

    def test_unknown_method(self):
        m = self.ch.unary_unary("/upsquad.test.v1.EchoService/Nope",
                                request_serializer=echo_pb2.EchoRequest.SerializeToString,
                                response_deserializer=echo_pb2.EchoResponse.FromString)
        with self.assertRaises(grpc.RpcError) as ctx:
            m(echo_pb2.EchoRequest(), timeout=5)
        self.assertCode(ctx, grpc.StatusCode.UNIMPLEMENTED)

    def test_health(self):
        for svc in ("", "upsquad.test.v1.EchoService", "grpc.health.v1.Health"):
            r = self.s["Check"](health_pb2.HealthCheckRequest(service=svc), timeout=5)
            self.assertEqual(r.status, health_pb2.HealthCheckResponse.SERVING, svc)
        with self.assertRaises(grpc.RpcError) as ctx:
            self.s["Check"](health_pb2.HealthCheckRequest(service="no.Such"), timeout=5)
        self.assertCode(ctx, grpc.StatusCode.NOT_FOUND)
        w = self.s["Watch"](health_pb2.HealthCheckRequest(service="no.Such"), timeout=5)
        self.assertEqual(next(w).status, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        w.cancel()

    def test_metrics_count_calls(self):
        labels = 'method="/upsquad.test.v1.EchoService/PublicEcho",code="OK"'
        before = self.srv.metric("rpc_server_handled_total", labels)
        for _ in range(5):
            self.s["PublicEcho"](echo_pb2.EchoRequest(text="m"), timeout=5)
        # a call is counted when the server's reply batch completes, which may be a moment
        # after the client has its answer
        deadline = time.time() + 5
        while (self.srv.metric("rpc_server_handled_total", labels) < before + 5 and
               time.time() < deadline):
            time.sleep(0.02)
        time.sleep(0.1)  # and no more than 5
        self.assertEqual(self.srv.metric("rpc_server_handled_total", labels), before + 5)


class StreamTest(EchoBase):
    def test_hundred_thousand_messages(self):
        n = 100000
        seen = 0
        for r in self.s["Stream"](echo_pb2.EchoRequest(text="s", count=n), metadata=auth(self.tok),
                                  timeout=120):
            self.assertEqual(r.seq, seen)
            seen += 1
        self.assertEqual(seen, n)

    def test_stream_requires_token(self):
        with self.assertRaises(grpc.RpcError) as ctx:
            list(self.s["Stream"](echo_pb2.EchoRequest(count=3), timeout=5))
        self.assertCode(ctx, grpc.StatusCode.UNAUTHENTICATED)

    def test_stream_error_status_with_details(self):
        with self.assertRaises(grpc.RpcError) as ctx:
            list(self.s["PublicStream"](echo_pb2.EchoRequest(count=3, fail_code=9, text="nope"),
                                        timeout=5))
        self.assertCode(ctx, grpc.StatusCode.FAILED_PRECONDITION)
        st = status_pb2.Status.FromString(dict(ctx.exception.trailing_metadata())["grpc-status-details-bin"])
        self.assertEqual(st.code, 9)

    def test_client_cancel_stops_the_stream(self):
        labels = 'method="/upsquad.test.v1.EchoService/PublicStream",code="CANCELLED"'
        before = self.srv.metric("rpc_server_handled_total", labels)
        it = self.s["PublicStream"](echo_pb2.EchoRequest(text="c", count=10000000), timeout=60)
        for i, r in enumerate(it):
            if i == 1000:
                break
        it.cancel()
        # the server's handler must notice within a short time and the call must end
        deadline = time.time() + 3
        while time.time() < deadline and self.srv.metric("rpc_server_handled_total", labels) <= before:
            time.sleep(0.02)
        self.assertEqual(self.srv.metric("rpc_server_handled_total", labels), before + 1)
        while time.time() < deadline and self.srv.metric("rpc_server_inflight_calls") > 0:
            time.sleep(0.02)
        self.assertEqual(self.srv.metric("rpc_server_inflight_calls"), 0)

    def test_unary_calls_flow_while_streams_run(self):
        streams = [self.s["PublicStream"](echo_pb2.EchoRequest(count=1000, delay_ms=2), timeout=30)
                   for _ in range(4)]
        t0 = time.time()
        for _ in range(20):
            self.s["PublicEcho"](echo_pb2.EchoRequest(text="u"), timeout=2)
        self.assertLess(time.time() - t0, 2.0)
        for st in streams:
            st.cancel()


class LimitsTest(EchoBase):
    env = {"UPSQUAD_RPC_MAX_STREAMS": "2"}

    def test_too_many_streams_refused(self):
        held = [self.s["PublicStream"](echo_pb2.EchoRequest(count=100000, delay_ms=10), timeout=30)
                for _ in range(2)]
        for h in held:
            next(h)
        with self.assertRaises(grpc.RpcError) as ctx:
            list(self.s["PublicStream"](echo_pb2.EchoRequest(count=1), timeout=5))
        self.assertCode(ctx, grpc.StatusCode.RESOURCE_EXHAUSTED)
        for h in held:
            h.cancel()
        # capacity comes back once they are gone
        deadline = time.time() + 3
        while True:
            try:
                self.assertEqual(len(list(self.s["PublicStream"](echo_pb2.EchoRequest(count=2), timeout=5))), 2)
                break
            except grpc.RpcError:
                if time.time() > deadline:
                    raise
                time.sleep(0.05)


class ShutdownTest(unittest.TestCase):
    def test_graceful_shutdown_finishes_inflight_calls(self):
        srv = T.Server("echo-server", env={"UPSQUAD_SHUTDOWN_GRACE": "5s"})
        ch = grpc.insecure_channel(srv.addr)
        s = methods(ch)
        try:
            self.assertEqual(s["PublicEcho"](echo_pb2.EchoRequest(text="warm"), timeout=5).text, "warm")
            watch = s["Watch"](health_pb2.HealthCheckRequest(service=""), timeout=30)
            self.assertEqual(next(watch).status, health_pb2.HealthCheckResponse.SERVING)
            results = {}

            def slow():
                try:
                    results["r"] = s["PublicEcho"](echo_pb2.EchoRequest(text="inflight", delay_ms=1500),
                                                   timeout=10)
                except grpc.RpcError as e:
                    results["e"] = e

            t = threading.Thread(target=slow)
            t.start()
            time.sleep(0.3)
            t0 = time.time()
            srv.signal(signal.SIGTERM)
            # health watchers hear NOT_SERVING, then their stream ends
            statuses = []
            try:
                for r in watch:
                    statuses.append(r.status)
            except grpc.RpcError as e:
                self.assertEqual(e.code(), grpc.StatusCode.UNAVAILABLE)
            self.assertIn(health_pb2.HealthCheckResponse.NOT_SERVING, statuses)
            t.join(10)
            self.assertNotIn("e", results, results.get("e"))
            self.assertEqual(results["r"].text, "inflight")
            self.assertEqual(srv.wait(10), 0)
            self.assertLess(time.time() - t0, 5)
        finally:
            ch.close()
            srv.stop()

    def test_start_failures_exit_1_with_a_reason(self):
        base = dict(os.environ, UPSQUAD_JWT_SECRET="k" * 32, UPSQUAD_GRPC_ADDR="127.0.0.1:0")
        cases = {
            "cannot listen on 256.0.0.1:1": {"UPSQUAD_GRPC_ADDR": "256.0.0.1:1"},
            "UPSQUAD_JWT_SECRET or UPSQUAD_JWT_PUBLIC_KEY_FILE is required": {"UPSQUAD_JWT_SECRET": ""},
            "UPSQUAD_RPC_MAX_STREAMS": {"UPSQUAD_RPC_MAX_STREAMS": "lots"},
            "UPSQUAD_LOG_LEVEL": {"UPSQUAD_LOG_LEVEL": "loud"},
        }
        for reason, env in cases.items():
            with self.subTest(reason):
                p = subprocess.run([os.path.join(T.BUILD, "bin", "echo-server")], env=dict(base, **env),
                                   capture_output=True, text=True, timeout=20)
                self.assertEqual(p.returncode, 1, p.stderr[-500:])
                self.assertIn(reason, p.stderr)
                self.assertNotIn("k" * 32, p.stderr)  # the secret is never logged

    def test_grace_period_bounds_shutdown(self):
        srv = T.Server("echo-server", env={"UPSQUAD_SHUTDOWN_GRACE": "300ms"})
        ch = grpc.insecure_channel(srv.addr)
        s = methods(ch)
        try:
            it = s["PublicStream"](echo_pb2.EchoRequest(count=1000000, delay_ms=5), timeout=60)
            next(it)
            t0 = time.time()
            srv.signal(signal.SIGTERM)
            with self.assertRaises(grpc.RpcError):
                for _ in it:
                    pass
            self.assertEqual(srv.wait(10), 0)
            self.assertLess(time.time() - t0, 3)
        finally:
            ch.close()
            srv.stop()


def openssl(*args, cwd):
    subprocess.run(["openssl"] + list(args), cwd=cwd, check=True, capture_output=True)


class MutualTLSTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="upsquad-tls-")
        d = cls.dir
        openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test-ca", cwd=d)
        for name, cn in (("server", "localhost"), ("client", "gateway")):
            openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", name + ".key", "-out", name + ".csr", "-subj", "/CN=" + cn, cwd=d)
            with open(os.path.join(d, name + ".ext"), "w") as f:
                f.write("subjectAltName=DNS:localhost\n" if name == "server" else "extendedKeyUsage=clientAuth\n")
            openssl("x509", "-req", "-in", name + ".csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                    "-CAcreateserial", "-out", name + ".pem", "-days", "1", "-extfile", name + ".ext", cwd=d)
        openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                "-keyout", "rogue.key", "-out", "rogue.pem", "-days", "1", "-subj", "/CN=rogue", cwd=d)
        cls.srv = T.Server("echo-server", env={
            "UPSQUAD_TLS_CERT_FILE": os.path.join(d, "server.pem"),
            "UPSQUAD_TLS_KEY_FILE": os.path.join(d, "server.key"),
            "UPSQUAD_TLS_CLIENT_CA_FILE": os.path.join(d, "ca.pem")})

    @classmethod
    def tearDownClass(cls):
        cls.srv.stop()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def read(self, name):
        with open(os.path.join(self.dir, name), "rb") as f:
            return f.read()

    def call(self, creds):
        opts = (("grpc.ssl_target_name_override", "localhost"),)
        ch = grpc.secure_channel("127.0.0.1:%d" % self.srv.port, creds, options=opts) if creds \
            else grpc.insecure_channel("127.0.0.1:%d" % self.srv.port)
        try:
            return methods(ch)["PublicEcho"](echo_pb2.EchoRequest(text="tls"), timeout=3)
        finally:
            ch.close()

    def test_client_certificate_accepted(self):
        creds = grpc.ssl_channel_credentials(self.read("ca.pem"), self.read("client.key"), self.read("client.pem"))
        self.assertEqual(self.call(creds).text, "tls")

    def test_rejected_without_valid_client_certificate(self):
        for what, creds in (
                ("no client cert", grpc.ssl_channel_credentials(self.read("ca.pem"))),
                ("untrusted client cert", grpc.ssl_channel_credentials(
                    self.read("ca.pem"), self.read("rogue.key"), self.read("rogue.pem"))),
                ("plaintext", None)):
            with self.subTest(what):
                with self.assertRaises(grpc.RpcError) as ctx:
                    self.call(creds)
                self.assertEqual(ctx.exception.code(), grpc.StatusCode.UNAVAILABLE)


if __name__ == "__main__":
    unittest.main(verbosity=1)
