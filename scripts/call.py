#!/usr/bin/python3
"""Calls one gRPC method of a running service with a JSON request, printing JSON responses.

    scripts/call.py ADDR Package.Service/Method '{"field": "value"}' [--token T] [--timeout S]

The request and response types come from the generated Python modules in build/py (`make py`);
a server-streaming method prints one JSON document per message. The token defaults to
$UPSQUAD_TOKEN. Uses Debian's python3-grpcio.
"""
import argparse
import importlib
import importlib.util
import json
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PY = os.path.join(ROOT, os.environ.get("BUILD", "build"), "py")
sys.path.insert(0, PY)

import grpc  # noqa: E402
from google.protobuf import descriptor_pool, json_format, symbol_database  # noqa: E402


def load_upsquad_modules():
    """Imports every generated upsquad module, and the health service, so the descriptor pool
    knows all services (health by file path: `grpc.health` would collide with grpcio)."""
    spec = importlib.util.spec_from_file_location("health_pb2", os.path.join(PY, "grpc/health/v1/health_pb2.py"))
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    for dirpath, _, files in os.walk(os.path.join(PY, "upsquad")):
        for f in sorted(files):
            if f.endswith("_pb2.py"):
                rel = os.path.relpath(os.path.join(dirpath, f[:-3]), PY)
                importlib.import_module(rel.replace(os.sep, "."))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("addr")
    ap.add_argument("method", help="Package.Service/Method")
    ap.add_argument("request", nargs="?", default="{}")
    ap.add_argument("--token", default=os.environ.get("UPSQUAD_TOKEN"))
    ap.add_argument("--timeout", type=float, default=30)
    a = ap.parse_args()

    load_upsquad_modules()
    service_name, _, method_name = a.method.partition("/")
    try:
        svc = descriptor_pool.Default().FindServiceByName(service_name)
    except KeyError:
        sys.exit("unknown service %s" % service_name)
    m = svc.methods_by_name.get(method_name)
    if m is None:
        sys.exit("unknown method %s of %s" % (method_name, service_name))
    db = symbol_database.Default()
    req_cls = db.GetPrototype(m.input_type)
    resp_cls = db.GetPrototype(m.output_type)
    req = json_format.Parse(a.request, req_cls())
    md = (("authorization", "Bearer " + a.token),) if a.token else ()
    path = "/%s/%s" % (service_name, method_name)
    with grpc.insecure_channel(a.addr) as ch:
        try:
            if m.server_streaming:
                call = ch.unary_stream(path, request_serializer=req_cls.SerializeToString,
                                       response_deserializer=resp_cls.FromString)
                for r in call(req, metadata=md, timeout=a.timeout):
                    print(json_format.MessageToJson(r), flush=True)
            else:
                call = ch.unary_unary(path, request_serializer=req_cls.SerializeToString,
                                      response_deserializer=resp_cls.FromString)
                print(json_format.MessageToJson(call(req, metadata=md, timeout=a.timeout)))
        except grpc.RpcError as e:
            print("%s: %s" % (e.code().name, e.details()), file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    main()
