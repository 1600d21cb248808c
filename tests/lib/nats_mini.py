"""A minimal NATS client over the text protocol (core pub/sub, request/reply, JetStream pull)
for the Python integration tests: Debian's python3 has no NATS library."""
import itertools
import json
import queue
import socket
import threading


class Nats:
    def __init__(self, url, timeout=5):
        host, port = url.replace("nats://", "").split(",")[0].split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.settimeout(None)
        self.rf = self.sock.makefile("rb")
        self.wlock = threading.Lock()
        self.subs = {}
        self.ids = itertools.count(1)
        self.rf.readline()  # INFO
        self._send(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,'
                   b'"no_responders":true,"name":"test"}\r\nPING\r\n')
        self.pong = threading.Event()
        self.closed = False
        threading.Thread(target=self._read, daemon=True).start()
        self.pong.wait(timeout)

    def _send(self, data):
        with self.wlock:
            self.sock.sendall(data)

    def _read(self):
        try:
            while True:
                line = self.rf.readline()
                if not line:
                    return
                parts = line.decode().split()
                if not parts:
                    continue
                op = parts[0].upper()
                if op == "PING":
                    self._send(b"PONG\r\n")
                elif op == "PONG":
                    self.pong.set()
                elif op in ("MSG", "HMSG"):
                    subj, sid = parts[1], int(parts[2])
                    if op == "MSG":
                        reply = parts[3] if len(parts) == 5 else None
                        n = int(parts[-1])
                        hdr, data = b"", self.rf.read(n + 2)[:n]
                    else:
                        reply = parts[3] if len(parts) == 6 else None
                        hl, tl = int(parts[-2]), int(parts[-1])
                        blob = self.rf.read(tl + 2)[:tl]
                        hdr, data = blob[:hl], blob[hl:]
                    q = self.subs.get(sid)
                    if q is not None:
                        q.put((subj, reply, hdr, data))
        except OSError:
            return

    def subscribe(self, subject, queue_group=None):
        sid = next(self.ids)
        q = queue.Queue()
        self.subs[sid] = q
        qg = (" " + queue_group) if queue_group else ""
        self._send(("SUB %s%s %d\r\n" % (subject, qg, sid)).encode())
        return sid, q

    def unsubscribe(self, sid):
        self._send(("UNSUB %d\r\n" % sid).encode())
        self.subs.pop(sid, None)

    def flush(self, timeout=5):
        self.pong.clear()
        self._send(b"PING\r\n")
        self.pong.wait(timeout)

    def publish(self, subject, data=b"", reply=None):
        r = (" " + reply) if reply else ""
        self._send(("PUB %s%s %d\r\n" % (subject, r, len(data))).encode() + data + b"\r\n")

    def request(self, subject, data=b"", timeout=5):
        inbox = "_INBOX.t%d" % next(self.ids)
        sid, q = self.subscribe(inbox)
        try:
            self.publish(subject, data, inbox)
            subj, reply, hdr, body = q.get(timeout=timeout)
            return body
        finally:
            self.unsubscribe(sid)

    # ---- JetStream pull consumer ----
    def js_consumer(self, stream, durable, filter_subject, ack_wait_s=30):
        cfg = {"stream_name": stream,
               "config": {"durable_name": durable, "ack_policy": "explicit",
                          "ack_wait": ack_wait_s * 10**9, "filter_subject": filter_subject}}
        return json.loads(self.request("$JS.API.CONSUMER.DURABLE.CREATE.%s.%s" % (stream, durable),
                                       json.dumps(cfg).encode()))

    def js_fetch(self, stream, durable, wait_s=0.5):
        """One message (subject, ack_subject, data) or None."""
        inbox = "_INBOX.f%d" % next(self.ids)
        sid, q = self.subscribe(inbox)
        try:
            req = {"batch": 1, "expires": int(wait_s * 1e9)}
            self.publish("$JS.API.CONSUMER.MSG.NEXT.%s.%s" % (stream, durable),
                         json.dumps(req).encode(), inbox)
            try:
                subj, reply, hdr, body = q.get(timeout=wait_s + 1)
            except queue.Empty:
                return None
            if reply and reply.startswith("$JS.ACK"):
                return subj, reply, body
            return None
        finally:
            self.unsubscribe(sid)

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass
