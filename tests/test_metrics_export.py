"""The gateway's metrics leaving the process: the ``prometheus_client``
Collector, the storages' own numbers, the OpenTelemetry bridge and the
``/metrics`` apps (docs/metrics.md).

Every export is read back the way its consumer reads it: the Collector
through a registry's text output and ``prometheus_client``'s parser, the
bridge through the OpenTelemetry SDK's in-memory reader, the apps through
Starlette's and Werkzeug's test clients. Decisions are real ones, made by
``RateLimitPipeline`` on the twin under test.
"""

from __future__ import annotations

import threading
import time
import types
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from _helpers import DictStorage, needs_shared_memory
from gateway_helpers import gateway, get, ok_handler, rule
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from nanolimit import FakeClock, ValidationError
from nanolimit.gateway import Metrics, instrument, metrics_app, metrics_wsgi_app
from nanolimit.gateway.factory import LimiterFactory
from nanolimit.gateway.middleware import RateLimitPipeline
from nanolimit.gateway.registry import RuleRegistry

pytest_plugins = ["redis_servers"]  # the server fixtures

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parsed(text: str) -> tuple[Samples, dict[str, str]]:
    """``text`` as prometheus_client's parser reads it: every sample by
    (name, labels), and every family's type."""
    samples: Samples = {}
    kinds: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        kinds[family.name] = family.type
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in samples, key  # no sample twice
            samples[key] = s.value
    return samples, kinds


def scrape(metrics: Metrics) -> tuple[Samples, dict[str, str]]:
    """A scrape through prometheus_client: a fresh registry holding the
    Collector, its own text output, parsed."""
    registry = CollectorRegistry()
    registry.register(metrics)
    return parsed(generate_latest(registry).decode("utf-8"))


def assert_same_exports(metrics: Metrics) -> Samples:
    """prometheus_client's output of the Collector and render_prometheus()
    parse to the same samples and types; the samples, for more checks."""
    via_client = scrape(metrics)
    by_hand = parsed(metrics.render_prometheus())
    assert via_client == by_hand
    return via_client[0]


def key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return (name, frozenset(labels.items()))


def rule_samples(snapshot: dict[str, dict[str, int]]) -> Samples:
    """The rule families' samples a snapshot should give."""
    out: Samples = {}
    for name, counts in snapshot.items():
        for outcome in ("allowed", "denied", "shadow_denied"):
            out[key("nanolimit_requests_total", rule=name, outcome=outcome)] = counts[outcome]
        out[key("nanolimit_near_limit_total", rule=name)] = counts["near_limit"]
    return out


# -- the Collector ---------------------------------------------------------------------


def test_the_collector_exports_every_outcome_of_real_decisions(backend: types.SimpleNamespace) -> None:
    mw = gateway(
        backend,
        [
            rule("api", 5, 60.0, path_prefix="/api"),
            rule("shadow", 2, 60.0, path_prefix="/shadow", dry_run=True),
        ],
    )
    api = [mw.check(get("/api")) for _ in range(7)]
    assert [o.allowed for o in api] == [True] * 5 + [False] * 2  # type: ignore[union-attr]
    shadow = [mw.check(get("/shadow")) for _ in range(4)]
    assert all(o is not None and o.allowed for o in shadow)  # a dry run never refuses
    assert mw.check(get("/elsewhere")) is None  # no rule: not counted anywhere

    samples = assert_same_exports(mw.metrics)
    # near_limit: admitted with under 20 % of the limit left, i.e. the last one of each
    assert samples == {
        key("nanolimit_requests_total", rule="api", outcome="allowed"): 5,
        key("nanolimit_requests_total", rule="api", outcome="denied"): 2,
        key("nanolimit_requests_total", rule="api", outcome="shadow_denied"): 0,
        key("nanolimit_near_limit_total", rule="api"): 1,
        key("nanolimit_requests_total", rule="shadow", outcome="allowed"): 2,
        key("nanolimit_requests_total", rule="shadow", outcome="denied"): 0,
        key("nanolimit_requests_total", rule="shadow", outcome="shadow_denied"): 2,
        key("nanolimit_near_limit_total", rule="shadow"): 1,
    }
    kinds = scrape(mw.metrics)[1]
    assert kinds == {"nanolimit_requests": "counter", "nanolimit_near_limit": "counter"}


def test_a_rule_name_that_needs_escaping_survives_both_exports(backend: types.SimpleNamespace) -> None:
    metrics = Metrics(near_ratio=0.5, namespace="edge")
    mw = gateway(backend, [rule("a/b:c@d", 4, 60.0)], metrics=metrics)
    for _ in range(3):
        mw(get(), ok_handler)
    samples = assert_same_exports(metrics)
    assert samples[key("edge_requests_total", rule="a/b:c@d", outcome="allowed")] == 3
    assert samples[key("edge_near_limit_total", rule="a/b:c@d")] == 1  # only the third left under half
    assert "Admitted requests left under 50% of the limit." in metrics.render_prometheus()


class _CountingMetrics(Metrics):
    """Metrics that count how often their families are read."""

    reads = 0

    def families(self) -> Any:
        self.reads += 1
        return super().families()


def test_registering_reads_nothing_and_each_scrape_reads_once() -> None:
    metrics = _CountingMetrics()
    registry = CollectorRegistry(auto_describe=True)  # as prometheus_client.REGISTRY is
    registry.register(metrics)
    assert metrics.reads == 0
    generate_latest(registry)
    assert metrics.reads == 1
    registry.unregister(metrics)


@pytest.mark.usefixtures("steady_heap")  # a scrape allocates: full collections of the run's heap
def test_eight_threads_count_exactly_while_a_scraper_reads(backend: types.SimpleNamespace) -> None:
    mw = gateway(
        backend, [rule("hot", 10**6, 60.0, scope="global", path_prefix="/hot"), rule("tight", 10, 60.0)]
    )
    workers, per_thread = 8, 1500
    start = threading.Barrier(workers + 1)
    done = threading.Event()
    failures: list[BaseException] = []
    seen: list[float] = []

    def work(i: int) -> None:
        start.wait()
        for _ in range(per_thread):
            mw.check(get("/hot", client=f"192.0.2.{i}"))
        for _ in range(50):
            mw.check(get("/t", client=f"192.0.2.{i}"))

    def scraper() -> None:
        start.wait()
        while not done.is_set():
            try:
                samples = scrape(mw.metrics)[0]
                seen.append(samples.get(key("nanolimit_requests_total", rule="hot", outcome="allowed"), 0.0))
            except BaseException as exc:  # any failure of a scrape fails the test
                failures.append(exc)
                return
            # a scraper polls, it does not spin
            time.sleep(0.002)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    watcher = threading.Thread(target=scraper)
    for t in [*threads, watcher]:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    assert failures == []
    assert seen, "the scraper never completed a scrape"
    assert seen == sorted(seen)  # a counter never goes backwards between scrapes
    samples = assert_same_exports(mw.metrics)
    assert samples == rule_samples(
        {
            "hot": {"allowed": workers * per_thread, "denied": 0, "shadow_denied": 0, "near_limit": 0},
            # per client: 10 admitted (the last two with under 20 % left), 40 refused
            "tight": {
                "allowed": workers * 10,
                "denied": workers * 40,
                "shadow_denied": 0,
                "near_limit": workers * 2,
            },
        }
    )


# -- storages ----------------------------------------------------------------------------


def storage_samples(samples: Samples, name: str) -> dict[str, float]:
    """The samples labelled ``storage=name``, by sample name."""
    out: dict[str, float] = {}
    for (sample, labels), value in samples.items():
        labels_ = dict(labels)
        if labels_.get("storage") == name and "state" not in labels_:
            out[sample] = value
    return out


def test_an_in_memory_storage_exports_its_stats(backend: types.SimpleNamespace) -> None:
    store = backend.InMemoryStorage(stripes=1, max_keys=2)
    mw = RateLimitPipeline(RuleRegistry([rule("api", 5, 60.0)]), LimiterFactory(store, FakeClock(0.0)))
    mw.metrics.watch_storage(store, name="memory")
    for i in range(5):
        mw.check(get(client=f"192.0.2.{i}"))
    samples = assert_same_exports(mw.metrics)
    labels = {"storage": "memory", "storage_type": "InMemoryStorage"}
    stats = store.stats()
    assert stats["keys"] == 2  # bounded: three keys had to go
    assert storage_samples(samples, "memory") == {
        "nanolimit_storage_keys": 2,
        "nanolimit_storage_evicted_at_rest_total": stats["evicted_at_rest"],
        "nanolimit_storage_evicted_active_total": stats["evicted_active"],
        "nanolimit_storage_evicted_idle_total": stats["evicted_idle"],
        "nanolimit_storage_denied_new_total": stats["denied_new"],
        "nanolimit_storage_scrape_errors_total": 0,
    }
    assert stats["evicted_at_rest"] + stats["evicted_active"] == 3
    assert samples[key("nanolimit_storage_keys", **labels)] == 2
    kinds = scrape(mw.metrics)[1]
    assert kinds["nanolimit_storage_keys"] == "gauge"
    assert kinds["nanolimit_storage_evicted_active"] == "counter"
    assert kinds["nanolimit_storage_scrape_errors"] == "counter"


class _FutureStorage(DictStorage):
    """A user-written storage with numbers of its own (a storage nanolimit
    has never heard of), whose reads can be made to fail."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = False

    def metrics(self) -> dict[str, Any]:
        if self.broken:
            raise ConnectionError("the backing service is down")
        return {"widgets": 3, "ratio": 0.25, "healthy": True, "mode": "eager", "errors": self.calls}


def test_unknown_fields_are_gauges_strings_are_skipped_and_a_failing_read_is_counted(
    backend: types.SimpleNamespace,
) -> None:
    store = _FutureStorage()
    mw = RateLimitPipeline(RuleRegistry([rule("api", 5, 60.0)]), LimiterFactory(store, FakeClock(0.0)))
    memory = backend.InMemoryStorage()
    mw.metrics.watch_storage(store)  # named after its type
    mw.metrics.watch_storage(memory, "memory")
    mw.check(get())
    samples = assert_same_exports(mw.metrics)
    assert storage_samples(samples, "_FutureStorage") == {
        "nanolimit_storage_widgets": 3,
        "nanolimit_storage_ratio": 0.25,
        "nanolimit_storage_healthy": 1,
        "nanolimit_storage_errors_total": store.calls,  # a field nanolimit knows: a counter
        "nanolimit_storage_scrape_errors_total": 0,
    }
    kinds = scrape(mw.metrics)[1]
    assert kinds["nanolimit_storage_widgets"] == "gauge" and kinds["nanolimit_storage_errors"] == "counter"

    store.broken = True
    text = mw.metrics.render_prometheus()  # the scrape goes on
    samples = parsed(text)[0]
    assert storage_samples(samples, "_FutureStorage") == {"nanolimit_storage_scrape_errors_total": 1}
    assert samples[key("nanolimit_requests_total", rule="api", outcome="allowed")] == 1
    assert storage_samples(samples, "memory")["nanolimit_storage_keys"] == 0
    registry = CollectorRegistry()
    registry.register(mw.metrics)
    again = parsed(generate_latest(registry).decode())[0]  # the Collector too
    assert storage_samples(again, "_FutureStorage") == {"nanolimit_storage_scrape_errors_total": 2}

    store.broken = False
    assert storage_samples(scrape(mw.metrics)[0], "_FutureStorage")["nanolimit_storage_widgets"] == 3
    assert mw.metrics.unwatch_storage(store) is True
    assert mw.metrics.unwatch_storage(store) is False
    assert storage_samples(scrape(mw.metrics)[0], "_FutureStorage") == {}


def test_bad_watches_are_refused_and_change_nothing(backend: types.SimpleNamespace) -> None:
    metrics = Metrics()
    store = backend.InMemoryStorage()
    metrics.watch_storage(store, "memory")
    before = metrics.render_prometheus()
    with pytest.raises(ValidationError, match="neither metrics"):
        metrics.watch_storage(object())
    with pytest.raises(ValidationError, match="already watched"):
        metrics.watch_storage(store, "again")
    with pytest.raises(ValidationError, match=r"name=\.\.\."):
        metrics.watch_storage(backend.InMemoryStorage(), "memory")
    for bad in ("", "x" * 129, "line\nbreak", 7):
        with pytest.raises(ValidationError, match="storage name"):
            metrics.watch_storage(backend.InMemoryStorage(), bad)  # type: ignore[arg-type]
    assert metrics.render_prometheus() == before
    for namespace in ("", "9lives", "has-dash", "spa ce"):
        with pytest.raises(ValidationError, match="namespace"):
            Metrics(namespace=namespace)


@pytest.fixture
def zone_name() -> Iterator[str]:
    name = f"nltest-{uuid.uuid4().hex[:16]}"
    yield name
    from nanolimit import SharedMemoryStorage

    SharedMemoryStorage.unlink_segment(name)


@pytest.mark.native
@needs_shared_memory
def test_a_shared_memory_zone_exports_its_metrics_and_a_closed_one_counts_a_scrape_error(
    zone_name: str,
) -> None:
    from nanolimit import SharedMemoryStorage

    zone = SharedMemoryStorage(zone_name, max_keys=1000)
    mw = RateLimitPipeline(RuleRegistry([rule("api", 5, 60.0)]), LimiterFactory(zone, FakeClock(0.0)))
    mw.metrics.watch_storage(zone, name="zone")
    for i in range(3):
        mw.check(get(client=f"192.0.2.{i}"))
    want = zone.metrics()
    samples = storage_samples(assert_same_exports(mw.metrics), "zone")
    assert samples["nanolimit_storage_keys"] == 3
    assert samples["nanolimit_storage_processes"] == 1
    assert samples["nanolimit_storage_max_keys"] == want["max_keys"]
    assert samples["nanolimit_storage_segment_bytes"] == want["segment_bytes"] > 0
    assert samples["nanolimit_storage_lock_recoveries_total"] == 0
    # every field of the zone's metrics() is there, and nothing else
    names = {n.removeprefix("nanolimit_storage_").removesuffix("_total") for n in samples}
    assert names == {*want, "scrape_errors"}

    zone.close()  # its reads raise from now on
    collected = scrape(mw.metrics)[0]  # the scrape succeeds
    assert storage_samples(collected, "zone") == {"nanolimit_storage_scrape_errors_total": 1}
    assert collected[key("nanolimit_requests_total", rule="api", outcome="allowed")] == 3
    rendered = parsed(mw.metrics.render_prometheus())[0]
    assert storage_samples(rendered, "zone") == {"nanolimit_storage_scrape_errors_total": 2}


def breaker_states(samples: Samples, labels: dict[str, str]) -> list[float]:
    """The breaker gauge of one storage: closed, half-open, open."""
    return [
        samples[key("nanolimit_storage_breaker_state", **labels, state=s)]
        for s in ("closed", "half-open", "open")
    ]


@pytest.fixture
def dying_server(request: pytest.FixtureRequest, server_kind: str) -> Any:
    """A server of its own for the test, which kills it. The wheel builds
    install [test-core], without the redis client: there, and only there,
    this skips before a server binary is looked for."""
    pytest.importorskip("redis", reason="the redis client comes with the [test] extra, not [test-core]")
    return request.getfixturevalue("own_server")


def test_a_redis_storage_whose_server_dies_still_scrapes_with_its_breaker_open(dying_server: Any) -> None:
    from nanolimit.storage.redis import RedisStorage

    own_server = dying_server

    client = own_server.client()
    store = RedisStorage(client, timeout=0.05, on_error="allow", breaker_threshold=2, breaker_cooldown=60.0)
    mw = RateLimitPipeline(RuleRegistry([rule("api", 100, 60.0)]), LimiterFactory(store))
    mw.metrics.watch_storage(store, name="shared")
    for _ in range(3):
        mw.check(get())
    before = storage_samples(assert_same_exports(mw.metrics), "shared")
    assert before["nanolimit_storage_decisions_total"] == 3
    assert before["nanolimit_storage_errors_total"] == 0
    breaker = {"storage": "shared", "storage_type": "RedisStorage"}
    assert breaker_states(scrape(mw.metrics)[0], breaker) == [1, 0, 0]

    own_server.kill()  # mid-test: the server is gone
    for _ in range(5):
        outcome = mw.check(get())
        assert outcome is not None and outcome.allowed  # on_error="allow"
    samples = assert_same_exports(mw.metrics)  # the scrape still succeeds
    after = storage_samples(samples, "shared")
    assert after["nanolimit_storage_decisions_total"] == 3
    assert after["nanolimit_storage_degraded_total"] == 5
    assert after["nanolimit_storage_errors_total"] == 2  # then the breaker stopped asking
    assert after["nanolimit_storage_breaker_open_skips_total"] == 3
    assert after["nanolimit_storage_breaker_opened_total"] == 1
    assert after["nanolimit_storage_scrape_errors_total"] == 0
    assert breaker_states(samples, breaker) == [0, 0, 1]
    assert samples[key("nanolimit_requests_total", rule="api", outcome="allowed")] == 8
    client.close()


# -- OpenTelemetry ------------------------------------------------------------------------


def otel_points(reader: Any) -> tuple[dict[tuple[str, frozenset[tuple[str, Any]]], float], dict[str, Any]]:
    """What the SDK's in-memory reader collected: every point by (name,
    attributes), and every metric's data."""
    points: dict[tuple[str, frozenset[tuple[str, Any]]], float] = {}
    data: dict[str, Any] = {}
    for resource in reader.get_metrics_data().resource_metrics:
        for scope in resource.scope_metrics:
            assert scope.scope.name == "nanolimit"
            for metric in scope.metrics:
                data[metric.name] = metric.data
                for point in metric.data.data_points:
                    points[(metric.name, frozenset(point.attributes.items()))] = point.value
    return points, data


def test_the_otel_bridge_observes_the_same_numbers(backend: types.SimpleNamespace) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics._internal.point import Gauge, Sum
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics = _CountingMetrics()
    mw = gateway(
        backend,
        [rule("api", 3, 60.0), rule("dry", 1, 60.0, path_prefix="/dry", dry_run=True)],
        metrics=metrics,
    )
    bridge = instrument(metrics, provider)
    for _ in range(4):
        mw.check(get())
    mw.check(get("/dry"))
    mw.check(get("/dry"))

    reads = metrics.reads
    points, data = otel_points(reader)
    assert metrics.reads == reads + 1  # one read of the families for every instrument
    assert points == {
        ("nanolimit_requests", frozenset({("rule", "api"), ("outcome", "allowed")})): 3,
        ("nanolimit_requests", frozenset({("rule", "api"), ("outcome", "denied")})): 1,
        ("nanolimit_requests", frozenset({("rule", "api"), ("outcome", "shadow_denied")})): 0,
        ("nanolimit_near_limit", frozenset({("rule", "api")})): 1,
        ("nanolimit_requests", frozenset({("rule", "dry"), ("outcome", "allowed")})): 1,
        ("nanolimit_requests", frozenset({("rule", "dry"), ("outcome", "denied")})): 0,
        ("nanolimit_requests", frozenset({("rule", "dry"), ("outcome", "shadow_denied")})): 1,
        ("nanolimit_near_limit", frozenset({("rule", "dry")})): 1,
    }
    assert isinstance(data["nanolimit_requests"], Sum) and data["nanolimit_requests"].is_monotonic

    # a storage watched after instrument() gets its instruments too
    store = backend.InMemoryStorage()
    metrics.watch_storage(store, "memory")
    mw.check(get())
    points, data = otel_points(reader)
    labels = frozenset({("storage", "memory"), ("storage_type", "InMemoryStorage")})
    assert points[("nanolimit_storage_keys", labels)] == 0
    assert isinstance(data["nanolimit_storage_keys"], Gauge)
    assert points[("nanolimit_storage_scrape_errors", labels)] == 0
    assert points[("nanolimit_requests", frozenset({("rule", "api"), ("outcome", "denied")}))] == 2
    assert set(bridge.instruments) == {f.name for f in metrics.families()}
    # the Prometheus families and the OTel instruments are one description
    prom = scrape(metrics)[0]
    for (name, attrs), value in points.items():
        counter = data[name].__class__ is Sum
        assert prom[(name + "_total" if counter else name, frozenset(attrs))] == value
    provider.shutdown()


def test_instrument_takes_only_a_metrics() -> None:
    with pytest.raises(ValidationError, match="Metrics"):
        instrument(object())  # type: ignore[arg-type]


# -- the /metrics apps ----------------------------------------------------------------------

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def test_the_asgi_app_serves_the_text_format_under_starlette(backend: types.SimpleNamespace) -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount
    from starlette.testclient import TestClient

    mw = gateway(backend, [rule("api", 2, 60.0)])
    for _ in range(3):
        mw.check(get())
    app = Starlette(routes=[Mount("/metrics", app=metrics_app(mw.metrics))])
    with TestClient(app) as client:
        response = client.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"] == CONTENT_TYPE
        assert response.text == mw.metrics.render_prometheus()
        samples = parsed(response.text)[0]
        assert samples[key("nanolimit_requests_total", rule="api", outcome="denied")] == 1
        head = client.head("/metrics")
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == str(len(response.content))
        for method in ("POST", "PUT", "DELETE"):
            refused = client.request(method, "/metrics")
            assert refused.status_code == 405
            assert refused.headers["allow"] == "GET, HEAD"


def test_the_asgi_app_runs_alone_with_its_lifespan() -> None:
    from starlette.testclient import TestClient

    metrics = Metrics()
    metrics.record("r", True, 5, 10)
    with TestClient(metrics_app(metrics)) as client:  # drives lifespan startup and shutdown
        assert (
            parsed(client.get("/").text)[0][key("nanolimit_requests_total", rule="r", outcome="allowed")] == 1
        )


def test_the_wsgi_app_serves_the_text_format_under_werkzeug(backend: types.SimpleNamespace) -> None:
    from werkzeug.test import Client

    mw = gateway(backend, [rule("api", 2, 60.0)])
    for _ in range(3):
        mw.check(get())
    client = Client(metrics_wsgi_app(mw.metrics))
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["Content-Type"] == CONTENT_TYPE
    assert response.get_data(as_text=True) == mw.metrics.render_prometheus()
    assert client.head("/metrics").get_data() == b""
    refused = client.post("/metrics")
    assert refused.status_code == 405 and refused.headers["Allow"] == "GET, HEAD"


def test_the_apps_take_only_a_metrics() -> None:
    for make in (metrics_app, metrics_wsgi_app):
        with pytest.raises(ValidationError, match="Metrics"):
            make(object())  # type: ignore[arg-type]
