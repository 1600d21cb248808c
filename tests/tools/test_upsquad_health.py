"""upsquad-health, the image's gRPC health probe, against a real server (build/bin/echo-server,
the rpc library's health service) started on a free loopback port, plaintext and mTLS with
certificates made here: grpc_health_probe's flags and exit codes (0 serving, 1 arguments,
2 connection, 3 RPC error, 4 not serving)."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
import upsquad_testlib as T  # noqa: E402

PROBE = os.path.join(T.BUILD, "bin", "upsquad-health")
ECHO = "upsquad.test.v1.EchoService"


def openssl(*args, cwd):
    subprocess.run(["openssl"] + list(args), cwd=cwd, check=True, capture_output=True)


def probe(*args):
    p = subprocess.run([PROBE] + list(args), capture_output=True, text=True, timeout=20)
    return p.returncode, p.stdout + p.stderr


class Plaintext(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = T.Server("echo-server")
        cls.addr = "-addr=" + cls.srv.addr

    @classmethod
    def tearDownClass(cls):
        cls.srv.stop()

    def test_serving_overall_and_per_service(self):
        self.assertEqual(probe(self.addr)[0], 0)
        rc, out = probe(self.addr, "-service=" + ECHO)
        self.assertEqual((rc, out.strip()), (0, "status: SERVING"))

    def test_unknown_service_is_an_rpc_error(self):
        rc, out = probe(self.addr, "-service=no.such.Service")
        self.assertEqual(rc, 3, out)
        self.assertIn("status 5", out)  # NOT_FOUND

    def test_nothing_listening_is_a_connection_failure(self):
        rc, out = probe("-addr=127.0.0.1:1", "-timeout=500")
        self.assertEqual(rc, 2, out)

    def test_bad_arguments(self):
        for args in ((), ("-addr",), (self.addr, "-timeout=0"), (self.addr, "-bogus"),
                     (self.addr, "-tls"), (self.addr, "-tls-ca-cert=/x"), (self.addr, "extra")):
            with self.subTest(args):
                self.assertEqual(probe(*args)[0], 1)

    def test_draining_server_is_not_serving_or_gone(self):
        srv = T.Server("echo-server", env={"UPSQUAD_SHUTDOWN_GRACE": "3s"})
        try:
            self.assertEqual(probe("-addr=" + srv.addr)[0], 0)
            srv.signal(signal.SIGTERM)  # health NOT_SERVING first, then the listener closes
            srv.wait(15)
            self.assertIn(probe("-addr=" + srv.addr, "-timeout=500")[0], (2, 4))
        finally:
            srv.stop()


class MutualTLS(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = d = tempfile.mkdtemp(prefix="upsquad-health-")
        openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test-ca", cwd=d)
        openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                "-keyout", "pod.key", "-out", "pod.csr", "-subj", "/CN=svc", cwd=d)
        with open(os.path.join(d, "pod.ext"), "w") as f:  # as deployed: one cert, both usages
            f.write("subjectAltName=DNS:svc.upsquad.svc\nextendedKeyUsage=serverAuth,clientAuth\n")
        openssl("x509", "-req", "-in", "pod.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", "pod.pem", "-days", "1", "-extfile", "pod.ext", cwd=d)
        cls.srv = T.Server("echo-server", env={
            "UPSQUAD_TLS_CERT_FILE": os.path.join(d, "pod.pem"),
            "UPSQUAD_TLS_KEY_FILE": os.path.join(d, "pod.key"),
            "UPSQUAD_TLS_CLIENT_CA_FILE": os.path.join(d, "ca.pem")})

    @classmethod
    def tearDownClass(cls):
        cls.srv.stop()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def f(self, name):
        return os.path.join(self.dir, name)

    def test_the_pods_own_certificate_probes_as_the_manifests_do(self):
        rc, out = probe("-addr=" + self.srv.addr, "-service=" + ECHO, "-tls", "-tls-ca-cert=" + self.f("ca.pem"),
                        "-tls-client-cert=" + self.f("pod.pem"), "-tls-client-key=" + self.f("pod.key"),
                        "-tls-server-name=svc.upsquad.svc")
        self.assertEqual(rc, 0, out)

    def test_without_a_client_certificate_or_with_the_wrong_name_it_fails(self):
        rc, out = probe("-addr=" + self.srv.addr, "-timeout=2000", "-tls", "-tls-ca-cert=" + self.f("ca.pem"),
                        "-tls-server-name=svc.upsquad.svc")
        self.assertEqual(rc, 2, out)
        rc, out = probe("-addr=" + self.srv.addr, "-timeout=2000", "-tls", "-tls-ca-cert=" + self.f("ca.pem"),
                        "-tls-client-cert=" + self.f("pod.pem"), "-tls-client-key=" + self.f("pod.key"),
                        "-tls-server-name=other.upsquad.svc")
        self.assertEqual(rc, 2, out)
        rc, out = probe("-addr=" + self.srv.addr, "-timeout=2000")  # plaintext to a TLS port
        self.assertEqual(rc, 2, out)


if __name__ == "__main__":
    unittest.main(verbosity=2)
