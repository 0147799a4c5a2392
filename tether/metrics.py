"""Worker-side metrics: the Prometheus endpoint, Tether's activity metrics, optional tracing.

The worker's Temporal runtime serves Prometheus metrics (``worker.py --metrics-port 9000``):
Temporal's SDK metrics (``temporal_*``: task latencies, pollers, schedule-to-start, ...) and
Tether's own (``tether_*``):

=================================  =========  =====================================  ============
metric                             type       labels                                 emitted by
=================================  =========  =====================================  ============
tether_runs_started                counter    namespace, task_queue, workflow_type   workflow
tether_runs_ended                  counter    + state (terminal state)               workflow
tether_approval_wait_seconds       histogram  + outcome (state after the wait)       workflow
tether_decisions_refused           counter    + kind, rule                           workflow
tether_tool_calls                  counter    tool, effect, outcome (ok/error/       activity
                                              permanent_error) + activity labels
tether_tool_retries                counter    tool, effect + activity labels         activity
tether_key_missing                 counter    key_id, what + activity labels         activity
tether_audit_sink_failures         counter    sink + activity labels                 activity
tether_policy_info                 gauge (1)  policy (the file), hash (its sha256)   worker start
=================================  =========  =====================================  ============

Workflow-side metrics live in ``workflows/metrics.py`` (replay-safe ``workflow.metric_meter()``).
Tracing: install the ``otel`` extra and set ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``TETHER_OTEL=1``): the worker and the CLI then add Temporal's OpenTelemetry interceptor.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

TOOL_CALLS = "tether_tool_calls"
TOOL_RETRIES = "tether_tool_retries"
POLICY_INFO = "tether_policy_info"

# Seconds a person took to decide: from a minute to a day. Prometheus defaults are for latencies.
APPROVAL_WAIT_BUCKETS = [1, 10, 30, 60, 300, 900, 1800, 3600, 4 * 3600, 8 * 3600, 24 * 3600, 72 * 3600]


def prometheus_runtime(bind_address: str) -> Runtime:
    """A Temporal runtime whose metrics (SDK and ours) are served at http://bind_address/metrics."""
    return Runtime(
        telemetry=TelemetryConfig(
            metrics=PrometheusConfig(
                bind_address=bind_address,
                # Seconds, like the rest of Prometheus; and our histogram gets human buckets.
                durations_as_seconds=True,
                histogram_bucket_overrides={"tether_approval_wait_seconds": APPROVAL_WAIT_BUCKETS},
            ),
        )
    )


def policy_info(runtime: Runtime, source: str, digest: str) -> None:
    """``tether_policy_info{policy, hash} 1``: which policy file this process reads, and its
    sha256 (``refs.policy_hash`` of the runs it starts): one value across the fleet, or a
    worker that reads another file."""
    runtime.metric_meter.create_gauge(
        POLICY_INFO, "The policy file this worker reads (label policy) and its sha256 (label hash); always 1", "1"
    ).set(1, {"policy": source, "hash": digest})


def tracing_interceptors() -> list[Any]:
    """Temporal's OpenTelemetry interceptor when tracing is configured, else nothing."""
    wanted = os.environ.get("TETHER_OTEL", "").lower() in ("1", "true", "yes") or bool(
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )
    if not wanted:
        return []
    try:
        from temporalio.contrib.opentelemetry import TracingInterceptor
    except ImportError:
        raise SystemExit(
            "tracing is configured but OpenTelemetry is not installed: pip install 'tether[otel]'"
        ) from None
    _configure_otel_exporter()
    return [TracingInterceptor()]


def _configure_otel_exporter() -> None:
    """Export spans over OTLP when the exporter package is there; otherwise keep the app's setup."""
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        return
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return  # already configured by the embedding application
    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", "tether-worker")})
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


@contextmanager
def tool_call_metrics(tool: str, effect: str, attempt: int) -> Iterator[None]:
    """Count one tool call (and a retry when attempt > 1) with its outcome. Activity code only."""
    meter = activity.metric_meter().with_additional_attributes({"tool": tool, "effect": effect})
    if attempt > 1:
        meter.create_counter(TOOL_RETRIES, "Tool calls the workflow retried", "1").add(1)
    outcome = "error"
    try:
        yield
        outcome = "ok"
    except ApplicationError as e:
        outcome = "permanent_error" if e.non_retryable else "error"
        raise
    finally:
        meter.create_counter(TOOL_CALLS, "Tool calls by outcome", "1").add(1, {"outcome": outcome})
