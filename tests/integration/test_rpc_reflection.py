"""gRPC server reflection (grpc.reflection.v1 and v1alpha) over real gRPC (grpcio), the calls
grpcurl makes: `grpcurl list` (list_services), `grpcurl describe SERVICE.METHOD`
(file_containing_symbol, then the descriptors are assembled into a pool exactly as a client
does), file_by_filename, and the error answers for what does not exist. Served by the shared
service runtime (libcommon/service.c), so devworker (a real service, no database needed) and the
test echo-server both answer; no token is needed (docs/rpc.md, "Reflection").
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
import upsquad_testlib as T  # noqa: E402

import grpc  # noqa: E402
from google.protobuf import descriptor_pb2, descriptor_pool  # noqa: E402
R1 = T.load_generated("grpc/reflection/v1/reflection_pb2.py", "reflection_v1_pb2")
RA = T.load_generated("grpc/reflection/v1alpha/reflection_pb2.py", "reflection_v1alpha_pb2")

TIMEOUT = 10


def info(ch, reqs, version="v1"):
    """One ServerReflectionInfo stream carrying every request; the answers, in order."""
    R = R1 if version == "v1" else RA
    rpc = ch.stream_stream("/grpc.reflection.%s.ServerReflection/ServerReflectionInfo" % version,
                           request_serializer=R.ServerReflectionRequest.SerializeToString,
                           response_deserializer=R.ServerReflectionResponse.FromString)
    return list(rpc(iter(reqs), timeout=TIMEOUT))


def pool_of(resp):
    """The files of a file_descriptor_response in a fresh pool (dependencies come along)."""
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in resp.file_descriptor_response.file_descriptor_proto]
    pool = descriptor_pool.DescriptorPool()
    pending = {f.name: f for f in files}
    while pending:  # dependencies first
        for name, f in list(pending.items()):
            if all(d not in pending for d in f.dependency):
                pool.Add(f)
                del pending[name]
    return pool, files


class Reflection(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.worker = T.Server("devworker", env={"UPSQUAD_ORCHESTRATOR_ADDR": "",
                                                "UPSQUAD_SHUTDOWN_GRACE": "1s"})
        cls.echo = T.Server("echo-server")
        cls.wch = grpc.insecure_channel(cls.worker.addr)
        cls.ech = grpc.insecure_channel(cls.echo.addr)

    @classmethod
    def tearDownClass(cls):
        cls.wch.close()
        cls.ech.close()
        cls.worker.stop()
        cls.echo.stop()

    def test_list_services(self):
        for version, R in (("v1", R1), ("v1alpha", RA)):
            [r] = info(self.wch, [R.ServerReflectionRequest(host="h", list_services="*")], version)
            names = sorted(s.name for s in r.list_services_response.service)
            self.assertEqual(names, ["grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                                     "grpc.reflection.v1alpha.ServerReflection",
                                     "upsquad.runtime.v1.RuntimeService"], version)
            self.assertEqual(r.valid_host, "h")
            self.assertEqual(r.original_request.list_services, "*")
        [r] = info(self.ech, [R1.ServerReflectionRequest(list_services="")])
        self.assertIn("upsquad.test.v1.EchoService",
                      [s.name for s in r.list_services_response.service])

    def test_describe_a_method_as_grpcurl_does(self):
        reqs = [R1.ServerReflectionRequest(file_containing_symbol="upsquad.runtime.v1.RuntimeService"),
                R1.ServerReflectionRequest(
                    file_containing_symbol="upsquad.runtime.v1.RuntimeService.ExecuteStep")]
        by_service, by_method = info(self.wch, reqs)  # two requests, one stream, two answers
        self.assertEqual(by_service.original_request.file_containing_symbol,
                         "upsquad.runtime.v1.RuntimeService")
        pool, files = pool_of(by_method)
        self.assertEqual(files[0].name, "upsquad/runtime/v1/runtime.proto")
        self.assertEqual(by_service.file_descriptor_response, by_method.file_descriptor_response)
        m = pool.FindMethodByName("upsquad.runtime.v1.RuntimeService.ExecuteStep")
        self.assertTrue(m.input_type.full_name.startswith("upsquad.runtime.v1."))
        self.assertEqual(m.containing_service.full_name, "upsquad.runtime.v1.RuntimeService")
        # the request type's fields resolve (its imports came along)
        self.assertGreater(len(m.input_type.fields), 0)
        for f in m.input_type.fields:
            if f.message_type is not None:
                self.assertTrue(f.message_type.full_name)

    def test_symbols_nested_enums_and_files(self):
        [r] = info(self.wch, [R1.ServerReflectionRequest(
            file_containing_symbol="grpc.health.v1.HealthCheckResponse.ServingStatus")])
        pool, files = pool_of(r)
        self.assertEqual(files[0].name, "grpc/health/v1/health.proto")
        self.assertEqual(pool.FindEnumTypeByName(
            "grpc.health.v1.HealthCheckResponse.ServingStatus").values_by_name["SERVING"].number, 1)
        [r] = info(self.wch, [R1.ServerReflectionRequest(
            file_by_filename="upsquad/workflow/v1/workflow.proto")])
        pool, files = pool_of(r)
        names = [f.name for f in files]
        self.assertEqual(names[0], "upsquad/workflow/v1/workflow.proto")
        self.assertEqual(len(names), len(set(names)))
        for dep in files[0].dependency:  # transitively: each import is there
            self.assertIn(dep, names)
        self.assertTrue(pool.FindServiceByName("upsquad.workflow.v1.WorkflowService"))

    def test_unknown_names_answer_not_found_and_the_stream_goes_on(self):
        reqs = [R1.ServerReflectionRequest(file_containing_symbol="no.such.Service"),
                R1.ServerReflectionRequest(file_containing_symbol="upsquad.runtime.v1.RuntimeService.Nope"),
                R1.ServerReflectionRequest(file_by_filename="no/such.proto"),
                R1.ServerReflectionRequest(file_containing_extension=R1.ExtensionRequest(
                    containing_type="grpc.health.v1.HealthCheckRequest", extension_number=100)),
                R1.ServerReflectionRequest(),
                R1.ServerReflectionRequest(list_services="")]
        rs = info(self.wch, reqs)
        self.assertEqual(len(rs), 6)
        for r in rs[:4]:
            self.assertEqual(r.WhichOneof("message_response"), "error_response")
            self.assertEqual(r.error_response.error_code, grpc.StatusCode.NOT_FOUND.value[0])
        self.assertIn("no.such.Service", rs[0].error_response.error_message)
        self.assertIn("no/such.proto", rs[2].error_response.error_message)
        self.assertEqual(rs[4].error_response.error_code, grpc.StatusCode.INVALID_ARGUMENT.value[0])
        self.assertIn("message_request", rs[4].error_response.error_message)
        self.assertTrue(rs[5].list_services_response.service)
        [r] = info(self.wch, [R1.ServerReflectionRequest(
            all_extension_numbers_of_type="grpc.health.v1.HealthCheckRequest")])
        self.assertEqual(r.all_extension_numbers_response.base_type_name,
                         "grpc.health.v1.HealthCheckRequest")
        self.assertEqual(list(r.all_extension_numbers_response.extension_number), [])

    def test_an_empty_stream_ends_ok_and_a_bad_message_is_invalid_argument(self):
        self.assertEqual(info(self.wch, []), [])
        rpc = self.wch.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                     request_serializer=lambda b: b,
                                     response_deserializer=R1.ServerReflectionResponse.FromString)
        with self.assertRaises(grpc.RpcError) as e:
            list(rpc(iter([b"\xff\xff\xff"]), timeout=TIMEOUT))
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)

    def test_reflection_streams_have_their_own_budget(self):
        rpc = self.wch.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                     request_serializer=R1.ServerReflectionRequest.SerializeToString,
                                     response_deserializer=R1.ServerReflectionResponse.FromString)
        import queue
        qs, calls = [], []
        try:
            for _ in range(16):  # the default budget, each stream held open
                q = queue.Queue()
                q.put(R1.ServerReflectionRequest(list_services=""))
                c = rpc(iter(q.get, None), timeout=TIMEOUT)
                next(c)
                qs.append(q)
                calls.append(c)
            with self.assertRaises(grpc.RpcError) as e:
                list(rpc(iter([R1.ServerReflectionRequest(list_services="")]), timeout=TIMEOUT))
            self.assertEqual(e.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
        finally:
            for q in qs:
                q.put(None)
            for c in calls:
                list(c)
        [r] = info(self.wch, [R1.ServerReflectionRequest(list_services="")])  # released
        self.assertTrue(r.list_services_response.service)


if __name__ == "__main__":
    unittest.main(verbosity=2)
