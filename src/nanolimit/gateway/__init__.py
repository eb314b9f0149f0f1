"""The gateway layer: requests, rules, keys, the pipeline and its ASGI and
WSGI adapters, metrics and rules files. It sits above the storages and the
core, and below the command line (docs/architecture.md)."""

from .exposition import metrics_app, metrics_wsgi_app
from .metrics import Family, Metrics
from .otel import OtelInstruments, instrument

__all__ = ["Family", "Metrics", "OtelInstruments", "instrument", "metrics_app", "metrics_wsgi_app"]
