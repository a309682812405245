"""A small OTLP/HTTP traces collector for tests and benchmarks: it decodes what nodes export (`--otlp-endpoint`)
with OpenTelemetry's own protobuf classes and keeps every span as a plain dict."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Collector:
    """An OTLP/HTTP traces endpoint: every span received, with its resource's attributes."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
        self.spans: list[dict] = []
        spans, lock = self.spans, threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                with lock:
                    for rs in req.resource_spans:
                        resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            for s in ss.spans:
                                spans.append(_span(s, resource))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def named(self, name: str) -> list[dict]:
        return [s for s in list(self.spans) if s["name"] == name]

    def stop(self) -> None:
        self.server.shutdown()


def _span(s, resource: dict) -> dict:
    def value(v):
        kind = v.WhichOneof("value")
        return getattr(v, kind) if kind else None
    return {"name": s.name, "trace": s.trace_id.hex(), "id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
            "start": s.start_time_unix_nano, "end": s.end_time_unix_nano, "status": s.status.code,
            "attrs": {a.key: value(a.value) for a in s.attributes},
            "events": [(e.name, e.time_unix_nano) for e in s.events], "resource": resource}
