"""A RuntimeService worker in-process (python3-grpcio) for tests that need exact control of
what a worker sends: hostile payloads, a failure before or after the first event, a hang.

The behaviour of a turn is picked by the user message's first line:
  #!fake <json list of ExecuteStepEvent dicts (json_format)>   sent in order ({"sleepMs": N}
                                                                in the list pauses N ms)
  #!fail-before                                                 abort UNAVAILABLE at once
  #!fail-after                                                  one token, then abort
  #!hang                                                        one token, then wait for cancel
anything else: "echo: <message>" word by word and a completion.
Every request is recorded in .requests (the ExecuteStepRequest), cancellations in .cancelled.
"""
import json
import threading
import time
from concurrent import futures

import grpc
from google.protobuf import json_format

from upsquad.runtime.v1 import runtime_pb2 as R

SVC = "upsquad.runtime.v1.RuntimeService"
FAILED_ONCE = set()  # sessions whose first attempt already failed (#!fail-once), all workers


class FakeWorker:
    def __init__(self):
        self.requests = []
        self.inits = []
        self.terminated = []
        self.cancelled = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        handlers = {
            "ExecuteStep": grpc.unary_stream_rpc_method_handler(
                self.execute, request_deserializer=R.ExecuteStepRequest.FromString,
                response_serializer=R.ExecuteStepEvent.SerializeToString),
            "InitWorkerSession": grpc.unary_unary_rpc_method_handler(
                self.init, request_deserializer=R.InitWorkerSessionRequest.FromString,
                response_serializer=R.InitWorkerSessionResponse.SerializeToString),
            "TerminateSession": grpc.unary_unary_rpc_method_handler(
                self.terminate, request_deserializer=R.TerminateSessionRequest.FromString,
                response_serializer=R.TerminateSessionResponse.SerializeToString),
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SVC, handlers),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.addr = "127.0.0.1:%d" % self.port
        self.server.start()

    def stop(self):
        self.server.stop(0)

    def init(self, req, ctx):
        self.inits.append(req)
        return R.InitWorkerSessionResponse(success=True)

    def terminate(self, req, ctx):
        self.terminated.append(req.session_id)
        return R.TerminateSessionResponse(success=True)

    def execute(self, req, ctx):
        self.requests.append(req)
        msg = req.user_message
        first, _, rest = msg.partition("\n")
        if first.startswith("#!fake"):
            for ev in json.loads(first[len("#!fake"):].strip() or rest):
                if "sleepMs" in ev:
                    time.sleep(ev["sleepMs"] / 1000)
                    continue
                yield json_format.ParseDict(ev, R.ExecuteStepEvent())
            return
        if first == "#!fail-once":
            if req.session_id not in FAILED_ONCE:
                FAILED_ONCE.add(req.session_id)
                ctx.abort(grpc.StatusCode.UNAVAILABLE, "worker going away")
            msg = rest or "retried"
        if first == "#!fail-before":
            ctx.abort(grpc.StatusCode.UNAVAILABLE, "worker going away")
        if first.startswith("#!fail-after"):
            yield R.ExecuteStepEvent(token=R.TokenEvent(text="partial", index=0))
            ctx.abort(grpc.StatusCode.INTERNAL, "worker crashed")
        if first == "#!hang":
            yield R.ExecuteStepEvent(token=R.TokenEvent(text="waiting", index=0))
            deadline = time.time() + 20
            while ctx.is_active() and time.time() < deadline:
                time.sleep(0.02)
            if not ctx.is_active():
                self.cancelled.set()
            return
        words = ("echo: " + msg).split(" ")
        for i, w in enumerate(words):
            yield R.ExecuteStepEvent(token=R.TokenEvent(text=w + (" " if i < len(words) - 1 else ""), index=i))
        yield R.ExecuteStepEvent(completion=R.CompletionEvent(
            final_response="echo: " + msg, loop_iterations=1,
            token_usage=R.TokenUsage(input_tokens=len(msg.split()), output_tokens=len(words),
                                     model=req.snapshot.model_id, cost_usd=0.0001)))
