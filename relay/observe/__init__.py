"""What operators see of a running relay: structured logs, Prometheus metrics and the
HTTP server for /metrics, /healthz and /readyz, OpenTelemetry traces, the lag sampler.
"""
