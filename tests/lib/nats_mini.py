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

    def subscribe(self, subject, queue_group=None, q=None):
        """(sid, queue of (subject, reply, header bytes, data)); q: share one queue."""
        sid = next(self.ids)
        q = q if q is not None else queue.Queue()
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

    def publish(self, subject, data=b"", reply=None, headers=None):
        r = (" " + reply) if reply else ""
        if headers:
            h = ("NATS/1.0\r\n" + "".join("%s: %s\r\n" % kv for kv in headers.items()) +
                 "\r\n").encode()
            self._send(("HPUB %s%s %d %d\r\n" % (subject, r, len(h), len(h) + len(data))).encode()
                       + h + data + b"\r\n")
        else:
            self._send(("PUB %s%s %d\r\n" % (subject, r, len(data))).encode() + data + b"\r\n")

    @staticmethod
    def headers(hdr):
        """Header bytes of a message -> dict."""
        out = {}
        for line in hdr.split(b"\r\n")[1:]:
            if b":" in line:
                k, v = line.split(b":", 1)
                out[k.decode().strip()] = v.decode().strip()
        return out

    def request(self, subject, data=b"", timeout=5, headers=None):
        inbox = "_INBOX.t%d" % next(self.ids)
        sid, q = self.subscribe(inbox)
        try:
            self.publish(subject, data, inbox, headers)
            subj, reply, hdr, body = q.get(timeout=timeout)
            return body
        finally:
            self.unsubscribe(sid)

    # ---- JetStream ----
    def js_publish(self, subject, data, msg_id=None, timeout=5):
        """Publishes into a stream and waits for its ack (the ack JSON)."""
        return json.loads(self.request(subject, data, timeout,
                                       {"Nats-Msg-Id": msg_id} if msg_id else None))


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
