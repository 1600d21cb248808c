"""A raw HTTP/2 gRPC client (python3-h2) for requests no gRPC library will send: a unary call
without a message, with a truncated length prefix, with two messages, with two authorization
headers. Plain TCP on loopback only."""
import socket
import struct
import time
import urllib.parse

import h2.config
import h2.connection
import h2.events


def frame(msg, declared=None):
    """A gRPC length-prefixed message; `declared` overrides the length in the prefix."""
    return b"\x00" + struct.pack(">I", len(msg) if declared is None else declared) + msg


class Conn:
    def __init__(self, port, timeout=5.0, source=None):
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                             source_address=(source, 0) if source else None)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True,
                                                                       header_encoding="utf-8"))
        self.h2.initiate_connection()
        self.flush()
        self.closed = False
        self.goaway = False

    def flush(self):
        data = self.h2.data_to_send()
        if data:
            self.sock.sendall(data)

    def call(self, path, messages=(b"",), headers=(), end=True, timeout=5.0):
        """Sends one call: HEADERS, each element of `messages` as raw DATA bytes (use frame()),
        END_STREAM when `end`. Returns (grpc-status or None, grpc-message, response bytes)."""
        sid = self.h2.get_next_available_stream_id()
        hdrs = [(":method", "POST"), (":scheme", "http"), (":path", path),
                (":authority", "127.0.0.1:%d" % self.port), ("content-type", "application/grpc"),
                ("te", "trailers")] + list(headers)
        self.h2.send_headers(sid, hdrs, end_stream=end and not messages)
        for i, m in enumerate(messages):
            self.h2.send_data(sid, m, end_stream=end and i == len(messages) - 1)
        self.flush()
        return self.read_until_end(sid, timeout)

    def read_until_end(self, sid, timeout):
        status, message, body = None, "", b""
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.sock.settimeout(max(0.05, deadline - time.time()))
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                break
            if not data:
                self.closed = True
                break
            for ev in self.h2.receive_data(data):
                if isinstance(ev, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    if ev.stream_id != sid:
                        continue
                    for k, v in ev.headers:
                        if k == "grpc-status":
                            status = int(v)
                        elif k == "grpc-message":
                            message = urllib.parse.unquote(v)
                elif isinstance(ev, h2.events.DataReceived):
                    self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    if ev.stream_id == sid:
                        body += ev.data
                elif isinstance(ev, h2.events.ConnectionTerminated):
                    self.goaway = True
                elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)):
                    if ev.stream_id == sid:
                        self.flush()
                        return status, message, body
            self.flush()
        return status, message, body

    def wait_closed(self, timeout):
        """True once the server sent GOAWAY or closed the socket within `timeout` seconds."""
        deadline = time.time() + timeout
        while time.time() < deadline and not (self.closed or self.goaway):
            self.sock.settimeout(max(0.05, deadline - time.time()))
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                break
            except OSError:
                self.closed = True
                break
            if not data:
                self.closed = True
                break
            for ev in self.h2.receive_data(data):
                if isinstance(ev, h2.events.ConnectionTerminated):
                    self.goaway = True
            self.flush()
        return self.closed or self.goaway

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass
