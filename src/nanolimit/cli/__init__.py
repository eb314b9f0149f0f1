"""The command line (``nanolimit`` / ``python -m nanolimit``): demo,
check-config, replay and bench. The top layer: nothing in the library
imports it (docs/architecture.md)."""
