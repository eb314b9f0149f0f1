"""The gateway's metrics as OpenTelemetry observable instruments.

``instrument(metrics)`` registers one observable counter or gauge per family
of :meth:`Metrics.families` on a ``Meter``. Their callbacks read the same
families the Prometheus exposition does, when the SDK collects, so the
request path does no more work and the two exports cannot disagree on names
or values. Instruments are named like the Prometheus families, a counter
without its ``_total`` (OpenTelemetry's Prometheus exporter adds it back).

``opentelemetry-api`` is imported inside :func:`instrument`: installing
nanolimit never needs it (``pip install nanolimit[otel]``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .._version import __version__
from ..errors import ValidationError
from .metrics import Family, Metrics

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation

__all__ = ["OtelInstruments", "instrument"]


class OtelInstruments:
    """What :func:`instrument` registered: ``meter`` and ``instruments``
    (family name -> instrument).

    One read of ``metrics.families()`` serves every instrument of a
    collection: an instrument whose callback finds that it has already
    observed the current reading takes a new one, so each collection reads
    once, whatever order the SDK calls the callbacks in."""

    def __init__(self, metrics: Metrics, meter: Any) -> None:
        self.metrics = metrics
        self.meter = meter
        self.instruments: dict[str, Any] = {}
        self._lock = threading.Lock()  # the reading; never held while the SDK's own lock is taken
        self._add_lock = threading.Lock()  # the instruments
        self._reading: dict[str, Family] = {}
        self._seen: set[str] = set()  # the instruments that have observed _reading

    def _read(self, name: str) -> Family | None:
        with self._lock:
            if name in self._seen or not self._reading:
                self._reading = {f.name: f for f in self.metrics.families()}
                self._seen = set()
            self._seen.add(name)
            return self._reading.get(name)

    def _add(self) -> None:
        """An instrument for every family not yet observed (called at
        :func:`instrument` and when the Metrics watches another storage)."""
        from opentelemetry.metrics import Observation

        with self._add_lock:
            families = [f for f in self.metrics.families() if f.name not in self.instruments]
            for family in families:

                def observe(options: CallbackOptions, name: str = family.name) -> Iterable[Observation]:
                    found = self._read(name)
                    if found is None:  # a storage whose read failed this time
                        return []
                    return [
                        Observation(value, dict(zip(found.labels, values))) for values, value in found.samples
                    ]

                make = (
                    self.meter.create_observable_counter
                    if family.kind == "counter"
                    else self.meter.create_observable_gauge
                )
                self.instruments[family.name] = make(
                    family.name, callbacks=[observe], description=family.help
                )


def instrument(metrics: Metrics, meter_provider: MeterProvider | None = None) -> OtelInstruments:
    """Register ``metrics``' families as observable instruments on the
    ``nanolimit`` meter of ``meter_provider`` (default: the global one).

    The families are those present now, plus every storage watched later
    with :meth:`Metrics.watch_storage`. Rules decided for the first time
    later need nothing: they are samples (``rule`` attributes) of the
    existing instruments."""
    if not isinstance(metrics, Metrics):
        raise ValidationError(f"instrument() takes a nanolimit Metrics, got {type(metrics).__name__}")
    from opentelemetry.metrics import get_meter_provider

    provider = meter_provider if meter_provider is not None else get_meter_provider()
    bridge = OtelInstruments(metrics, provider.get_meter("nanolimit", __version__))
    bridge._add()
    with metrics._lock:
        metrics._on_watch.append(bridge._add)
    return bridge
