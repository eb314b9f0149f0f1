"""The gateway layer: requests, rules, keys, the pipeline and its ASGI and
WSGI adapters, metrics and rules files. It sits above the storages and the
core, and below the command line (docs/architecture.md)."""
