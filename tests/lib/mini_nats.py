"""A minimal NATS client over the text protocol (no Python NATS package on Debian): publish
with headers (JetStream Nats-Msg-Id), subscribe, and read messages with a timeout. For tests."""
import socket
import time
import urllib.parse


class MiniNats:
    def __init__(self, url, timeout=5):
        u = urllib.parse.urlsplit(url)
        self.sock = socket.create_connection((u.hostname, u.port or 4222), timeout=timeout)
        self.buf = b""
        self._line()  # INFO
        self.sock.sendall(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"no_responders":true}\r\nPING\r\n')
        while self._line() != b"PONG":
            pass
        self.sid = 0
        self.pending = []

    def close(self):
        self.sock.close()

    def _fill(self, deadline):
        self.sock.settimeout(max(0.01, deadline - time.time()))
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("nats closed")
        self.buf += data

    def _line(self, deadline=None):
        deadline = deadline or time.time() + 5
        while b"\r\n" not in self.buf:
            self._fill(deadline)
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _take(self, n, deadline):
        while len(self.buf) < n + 2:
            self._fill(deadline)
        data, self.buf = self.buf[:n], self.buf[n + 2:]
        return data

    def subscribe(self, subject):
        self.sid += 1
        self.sock.sendall(b"SUB %s %d\r\n" % (subject.encode(), self.sid))
        self.flush()
        return self.sid

    def flush(self):
        self.sock.sendall(b"PING\r\n")
        deadline = time.time() + 5
        while True:
            line = self._line(deadline)
            if line == b"PONG":
                return
            self._handle(line, deadline)

    def _handle(self, line, deadline):
        parts = line.split()
        if parts[0] == b"PING":
            self.sock.sendall(b"PONG\r\n")
        elif parts[0] == b"MSG":
            n = int(parts[-1])
            self.pending.append((parts[1].decode(), {}, self._take(n, deadline)))
        elif parts[0] == b"HMSG":
            hl, tl = int(parts[-2]), int(parts[-1])
            raw = self._take(tl, deadline)
            hdrs = {}
            for h in raw[:hl].split(b"\r\n")[1:]:
                if b":" in h:
                    k, v = h.split(b":", 1)
                    hdrs[k.decode().strip()] = v.decode().strip()
            self.pending.append((parts[1].decode(), hdrs, raw[hl:]))
        elif parts[0] == b"-ERR":
            raise RuntimeError(line.decode())

    def publish(self, subject, data, headers=None, reply=None):
        r = (b" " + reply.encode()) if reply else b""
        if headers:
            h = b"NATS/1.0\r\n" + b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in headers.items()) + b"\r\n"
            self.sock.sendall(b"HPUB %s%s %d %d\r\n%s%s\r\n" % (subject.encode(), r, len(h), len(h) + len(data), h, data))
        else:
            self.sock.sendall(b"PUB %s%s %d\r\n%s\r\n" % (subject.encode(), r, len(data), data))

    def js_publish(self, subject, data, msg_id=None):
        """Publishes to a JetStream stream and waits for its ack (returns the ack JSON)."""
        inbox = "_INBOX.mini.%d" % time.time_ns()
        self.subscribe(inbox)
        self.publish(subject, data, headers={"Nats-Msg-Id": msg_id} if msg_id else None, reply=inbox)
        for subj, _, payload in self.next(timeout=5, subject=inbox):
            return payload
        raise TimeoutError("no JetStream ack for " + subject)

    def next(self, timeout=5, subject=None):
        """Yields messages (subject, headers, data) until timeout passes without one."""
        deadline = time.time() + timeout
        while True:
            for i, m in enumerate(self.pending):
                if subject is None or m[0] == subject:
                    del self.pending[i]
                    yield m
                    deadline = time.time() + timeout
                    break
            else:
                if time.time() >= deadline:
                    return
                try:
                    line = self._line(deadline)
                except (socket.timeout, TimeoutError):
                    return
                self._handle(line, deadline)
