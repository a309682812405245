"""OpenTelemetry traces of requests across nodes (`--otlp-endpoint URL`; off by default).

Life cycle: a node process's start-up calls `configure(endpoint, role, instance)` once (the edge's HTTP process,
its engine process, the core): an SDK `TracerProvider` whose resource names the node (`service.name`
`edgecore-edge` or `edgecore-core`, `service.instance.id` the node's name, `service.version`) with a batching
OTLP/HTTP (protobuf) exporter, flushed by `shutdown()` at exit. Without it `tracer()` is None and nothing else
here runs or is imported: a request pays one `is None` test per place it could record.

A request's trace crosses processes as a W3C `traceparent` string (`00-<trace id>-<span id>-<flags>`): an
inbound HTTP header (honoured when well formed, `parse_traceparent`; else a new trace starts), the edge's HTTP
span → its engine process (edge/ipc.py `Generate.traceparent`) → the core (PrefillRequest.traceparent) and the
core's spans under it. Spans take explicit times (`time.perf_counter()` seconds, put on the epoch clock with one
offset taken at `configure`), so what records a request can open a span when a phase begins and end it when the
phase ends, or make it afterwards from times it kept. Sampling is the SDK's default: parent-based, always on for
a new trace (an inbound `traceparent` whose sampled flag is off records nothing downstream either).
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

from edgecore.shared.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span as OtelSpan

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
TRACEPARENT_LEN = 55
_tracer: Tracer | None = None


def parse_traceparent(value: str | None) -> str | None:
    """A W3C version-00 `traceparent` as given (lower-case hex, trace and span ids not all zero), else None."""
    if not value or len(value) != TRACEPARENT_LEN:
        return None
    m = _TRACEPARENT.match(value)
    if m is None or int(m.group(1), 16) == 0 or int(m.group(2), 16) == 0:
        return None
    return value


def tracer() -> Tracer | None:
    """This process's tracer, or None when traces are off (the default)."""
    return _tracer


def configure(endpoint: str, role: str, instance: str, exporter: SpanExporter | None = None) -> Tracer:
    """Turn traces on for this process: spans of `role` ("edge", "core") on node `instance` go to the OTLP/HTTP
    collector at `endpoint` (`http://host:4318`, `/v1/traces` added unless the URL has a path), or to `exporter`
    (tests: the SDK's in-memory exporter, exported span by span). A ConfigError without the SDK installed."""
    global _tracer
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        raise ConfigError("--otlp-endpoint needs OpenTelemetry's SDK and OTLP exporter: "
                          "pip install 'edgecore[otel]'") from None
    from importlib.metadata import PackageNotFoundError, version
    try:
        release = version("edgecore")
    except PackageNotFoundError:
        release = "unknown"
    resource = Resource.create({"service.name": f"edgecore-{role}", "service.instance.id": instance,
                                "service.namespace": "edgecore", "service.version": release})
    provider = TracerProvider(resource=resource)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ConfigError("--otlp-endpoint needs the OTLP exporter: pip install 'edgecore[otel]'") from None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint), timeout=5)))
    _tracer = Tracer(provider)
    return _tracer


def start(endpoint: str | None, role: str, instance: str) -> None:
    """A node's `--otlp-endpoint`: traces on for this process when it is given (`configure`), else nothing."""
    if endpoint:
        configure(endpoint, role, instance)


def traces_url(endpoint: str) -> str:
    """The collector's traces URL: `endpoint` itself when it has a path, else `endpoint` + `/v1/traces`."""
    from urllib.parse import urlsplit
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"--otlp-endpoint {endpoint!r}: expected an http(s) URL such as http://collector:4318")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


def shutdown() -> None:
    """Export what is buffered and stop (a node's exit); traces are off afterwards."""
    global _tracer
    if _tracer is not None:
        _tracer.provider.force_flush(timeout_millis=2000)    # an unreachable collector: seconds, not its retries
        _tracer.provider.shutdown()
        _tracer = None


class Span:
    """One span, open until `end`. Times are `time.perf_counter()` seconds (None: now)."""

    def __init__(self, span: OtelSpan, offset_ns: int):
        self._span, self._offset = span, offset_ns
        self.ended = False

    @property
    def traceparent(self) -> str:
        """The W3C `traceparent` naming this span as the parent of spans elsewhere."""
        ctx = self._span.get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    def _ns(self, at: float | None) -> int:
        return (time.perf_counter_ns() if at is None else int(at * 1e9)) + self._offset

    def set(self, **attributes: Any) -> None:
        """Attributes under their names, `edgecore.` prefixed unless the name is dotted already."""
        for key, value in attributes.items():
            if value is not None:
                self._span.set_attribute(_key(key), value)

    def event(self, name: str, at: float | None = None, **attributes: Any) -> None:
        self._span.add_event(name, {_key(k): v for k, v in attributes.items() if v is not None}, self._ns(at))

    def fail(self, message: str) -> None:
        from opentelemetry.trace import Status, StatusCode
        self._span.set_status(Status(StatusCode.ERROR, message))

    def end(self, at: float | None = None, **attributes: Any) -> None:
        """End the span (once; later calls do nothing), with last attributes."""
        if not self.ended:
            self.ended = True
            self.set(**attributes)
            self._span.end(self._ns(at))


class Tracer:
    """Opens spans of this node, under a parent given as a `traceparent` (None: a new trace)."""

    def __init__(self, provider: TracerProvider):
        self.provider = provider
        self._tracer = provider.get_tracer("edgecore")
        self._offset = time.time_ns() - time.perf_counter_ns()     # perf_counter → epoch, once

    def start(self, name: str, parent: str | Span | None, at: float | None = None, kind: str = "internal",
              **attributes: Any) -> Span:
        from opentelemetry import trace
        from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
        if isinstance(parent, Span):
            context = trace.set_span_in_context(parent._span)
        elif parent is not None and (m := _TRACEPARENT.match(parent)) is not None:
            remote = SpanContext(int(m.group(1), 16), int(m.group(2), 16), is_remote=True,
                                 trace_flags=TraceFlags(int(m.group(3), 16)))
            context = trace.set_span_in_context(NonRecordingSpan(remote))
        else:
            context = None
        start_ns = (time.perf_counter_ns() if at is None else int(at * 1e9)) + self._offset   # one clock
        span = Span(self._tracer.start_span(name, context, getattr(SpanKind, kind.upper()), start_time=start_ns),
                    self._offset)
        span.set(**attributes)
        return span


def _key(name: str) -> str:
    return name if "." in name else f"edgecore.{name}"
