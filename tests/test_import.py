"""Which twin ``import nanolimit`` gives, the env switch, and API parity.

Like test_equivalence, this module imports the twins directly: it is about
the import itself. The parity checks run in both directions (cytoolz style).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import inspect
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import ALGORITHM_CLASSES, TWIN_NAMES, native_skip_reason

LIMITER_NAMES = tuple(ALGORITHM_CLASSES.values())

# Arguments by the reference's parameter names, for the constructor checks.
LIMITER_ARGS = {
    "limit": 5,
    "window_seconds": 60.0,
    "storage": None,
    "clock": None,
    "rule": "r",
    "burst": None,
}
STORAGE_ARGS = {
    "stripes": 4,
    "max_key_bytes": 100,
    "max_keys": 1000,
    "on_full": "evict",
    "evict_idle_after": 60.0,
}
DECISION_ARGS = {
    "allowed": True,
    "limit": 5,
    "remaining": 4,
    "retry_after": 0.0,
    "reset_after": 1.0,
    "rule": "r",
    "window": 60.0,
    "delay": 0.0,
    "degraded": False,
    "reason": "",
    "at": 2.5,
}


@pytest.fixture
def need_native(request):
    reason = native_skip_reason(request.config)
    if reason is not None:
        pytest.skip(reason)


def package_root() -> str:
    import nanolimit

    return str(Path(nanolimit.__file__).resolve().parent.parent)


def run_python(code: str, **env_changes: str | None) -> list[str]:
    env = dict(os.environ)
    for name, value in env_changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root(), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


# --------------------------------------------------------------------------
# the C module really loaded (yarl style): CI cannot test the Python twin twice


@pytest.mark.native
def test_native_is_the_default(need_native):
    import nanolimit
    import nanolimit._core as core

    assert nanolimit.IMPLEMENTATION == "native"
    assert core.IMPLEMENTATION == "native"
    for name in TWIN_NAMES:
        if name != "IMPLEMENTATION":
            assert getattr(nanolimit, name) is getattr(core, name), name
    # compiled, not a Python module standing in for it
    assert core.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)), core.__file__
    assert not isinstance(core.TokenBucket.allow, types.FunctionType)


@pytest.mark.native
def test_native_is_the_default_in_a_fresh_interpreter(need_native):
    out = run_python(
        "import nanolimit; print(nanolimit.IMPLEMENTATION, nanolimit.TokenBucket.__module__)",
        NANOLIMIT_NO_EXTENSIONS=None,
    )
    assert out == ["native", "nanolimit._core"]


def test_env_switch_in_a_fresh_interpreter():
    out = run_python(
        "import nanolimit; print(nanolimit.IMPLEMENTATION, nanolimit.NO_EXTENSIONS,"
        " nanolimit.TokenBucket.__module__, nanolimit.Decision.__module__)",
        NANOLIMIT_NO_EXTENSIONS="1",
    )
    assert out == ["reference", "True", "nanolimit.reference", "nanolimit._decision_py"]


def test_env_switch_after_reimport(monkeypatch):
    # frozenlist style: the switch is read when the selector (nanolimit._select,
    # the one place that chooses) is imported, so a re-import obeys it.
    import nanolimit
    import nanolimit._select as select

    original = nanolimit.IMPLEMENTATION
    try:
        monkeypatch.setenv("NANOLIMIT_NO_EXTENSIONS", "1")
        importlib.reload(select)
        importlib.reload(nanolimit)
        reference = importlib.import_module("nanolimit.reference")
        assert nanolimit.IMPLEMENTATION == "reference"
        assert select.twin is reference and not select.NATIVE
        assert nanolimit.TokenBucket is reference.TokenBucket
        assert nanolimit.Decision is reference.Decision
    finally:
        monkeypatch.undo()
        importlib.reload(select)
        importlib.reload(nanolimit)
    assert original == nanolimit.IMPLEMENTATION


def test_import_leaves_the_frameworks_and_optional_layers_unloaded() -> None:
    # ``import nanolimit`` is paid by every worker and every tool that
    # counts instructions from a fresh interpreter: no web framework, no
    # Redis client and no two-tier store comes with it.
    out = run_python(
        "import sys, nanolimit; print(sorted({m.split('.')[0] for m in sys.modules}"
        " & {'starlette', 'fastapi', 'flask', 'django', 'aiohttp', 'redis'}) or 'none',"
        " 'nanolimit.storage.two_tier' in sys.modules)"
    )
    assert out == ["none", "False"]


def test_a_fastapi_dependency_still_names_starlettes_request() -> None:
    # FastAPI injects the request by its annotation, read when the route is
    # added: the annotation is set when the first dependency is made.
    out = run_python(
        "from nanolimit import RouteLimits; from starlette.requests import Request;"
        " dep = RouteLimits().depends('5/minute');"
        " print(type(dep).__call__.__annotations__['request'] is Request)"
    )
    assert out == ["True"]


def test_shared_names_are_the_same_objects():
    import nanolimit
    import nanolimit.reference as reference

    for name, home in (
        ("Algorithm", "nanolimit._limiter_config"),
        ("BatchResult", "nanolimit._decision_py"),
        ("FakeClock", "nanolimit._clocks"),
        ("SystemClock", "nanolimit._clocks"),
        ("LimiterState", "nanolimit._limiter_config"),
        ("ValidationError", "nanolimit.errors"),
        ("UnknownAlgorithmError", "nanolimit.errors"),
        ("Storage", "nanolimit._protocols"),
        ("RateLimiter", "nanolimit._protocols"),
        ("Clock", "nanolimit._clocks"),
    ):
        module = importlib.import_module(home)
        assert getattr(nanolimit, name) is getattr(module, name) is getattr(reference, name), name
    assert set(nanolimit.__all__) <= set(dir(nanolimit))


# --------------------------------------------------------------------------
# API parity between the twins, both directions


@pytest.fixture(scope="module")
def twins(request):
    reason = native_skip_reason(request.config)
    if reason is not None:
        pytest.skip(reason)
    return importlib.import_module("nanolimit._core"), importlib.import_module("nanolimit.reference")


def public(obj) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")}


def method_parameters(func):
    """(name, keyword-only, default) of a method, without ``self``.

    Methods of the native twin are builtin methods (binding=False, which
    saves ~100 instructions a call); the clinic-format embedded signature
    must make theirs visible all the same."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError) as exc:
        pytest.fail(f"no signature for {func!r}: {exc} (build with embedsignature.format=clinic)")
    params = [p for p in sig.parameters.values() if p.name != "self"]
    return [(p.name, p.kind == inspect.Parameter.KEYWORD_ONLY, p.default) for p in params]


def constructor_parameters(cls):
    """Like ``method_parameters`` for a class, or None where Python cannot
    see it: a cdef class's ``__init__``/``__cinit__`` is a slot wrapper
    without a signature."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return None
    return [
        (p.name, p.kind == inspect.Parameter.KEYWORD_ONLY, p.default)
        for p in sig.parameters.values()
        if not p.name.startswith("_")
    ]


def assert_same_constructor(n_cls, r_cls, sample):
    """The native constructor takes the reference's parameters the same way.

    Where the native signature is visible it must equal the reference's;
    either way the calls below prove the names and which are keyword-only.
    """
    r_params = constructor_parameters(r_cls)
    assert r_params is not None
    n_params = constructor_parameters(n_cls)
    if n_params is not None:
        assert n_params == r_params
    names = [name for name, _, _ in r_params]
    assert set(names) == set(sample), "update the sample arguments of this test"
    kwargs = {name: sample[name] for name in names}
    positional = [sample[name] for name, kw_only, _ in r_params if not kw_only]
    built = []
    for cls in (n_cls, r_cls):
        by_name = cls(**kwargs)
        by_position = cls(*positional)
        built.append((by_name, by_position))
        for name, kw_only, _ in r_params:
            if kw_only:
                with pytest.raises(TypeError):
                    cls(*positional, sample[name])
        with pytest.raises(TypeError):
            cls(**kwargs, not_a_parameter=1)
    return built


@pytest.mark.native
def test_both_twins_export_the_same_names(twins):
    core, reference = twins
    for name in TWIN_NAMES:
        assert hasattr(core, name), f"_core lacks {name}"
        assert hasattr(reference, name), f"reference lacks {name}"
    assert core.IMPLEMENTATION == "native"
    assert reference.IMPLEMENTATION == "reference"


@pytest.mark.native
@pytest.mark.parametrize("name", LIMITER_NAMES)
def test_limiter_surfaces_match(twins, name):
    core, reference = twins
    n_cls, r_cls = getattr(core, name), getattr(reference, name)
    n_obj, r_obj = n_cls(5, 60.0, rule="r"), r_cls(5, 60.0, rule="r")
    assert public(n_obj) == public(r_obj)
    assert public(n_cls) == public(r_cls)
    for attr in sorted(public(r_obj)):
        r_attr = getattr(r_cls, attr)
        if isinstance(r_attr, property):
            if attr not in ("storage", "clock"):  # objects of each twin's own
                assert getattr(n_obj, attr) == getattr(r_obj, attr), attr
        elif callable(r_attr):
            assert method_parameters(getattr(n_cls, attr)) == method_parameters(r_attr), attr
        else:
            assert getattr(n_obj, attr) == getattr(r_obj, attr), attr


@pytest.mark.native
@pytest.mark.parametrize("name", LIMITER_NAMES)
def test_limiter_constructors_match(twins, name):
    core, reference = twins
    r_cls = getattr(reference, name)
    assert constructor_parameters(r_cls) == [
        ("limit", False, inspect.Parameter.empty),
        ("window_seconds", False, inspect.Parameter.empty),
        ("storage", False, None),
        ("clock", False, None),
        ("rule", False, ""),
        ("burst", True, None),
    ]
    (n_named, n_pos), (r_named, r_pos) = assert_same_constructor(getattr(core, name), r_cls, LIMITER_ARGS)
    for attr in ("limit", "capacity", "window_seconds", "burst", "rule"):
        assert getattr(n_named, attr) == getattr(r_named, attr) == getattr(n_pos, attr), attr


@pytest.mark.native
def test_storage_surfaces_match(twins):
    core, reference = twins
    assert public(core.InMemoryStorage()) == public(reference.InMemoryStorage())
    for method in ("apply", "evict_idle", "keys"):
        assert method_parameters(getattr(core.InMemoryStorage, method)) == method_parameters(
            getattr(reference.InMemoryStorage, method)
        ), method
    assert_same_constructor(core.InMemoryStorage, reference.InMemoryStorage, STORAGE_ARGS)


@pytest.mark.native
def test_decision_surfaces_match(twins):
    core, reference = twins
    args = tuple(DECISION_ARGS.values())
    assert public(core.Decision(*args)) == public(reference.Decision(*args))
    assert method_parameters(core.Decision.headers) == method_parameters(reference.Decision.headers)
    (n_named, n_pos), (r_named, _) = assert_same_constructor(core.Decision, reference.Decision, DECISION_ARGS)
    assert n_named.headers(wall_now=0.0) == r_named.headers(wall_now=0.0) == n_pos.headers(wall_now=0.0)


def test_the_zone_without_the_extension_says_why() -> None:
    # The pure twin has no zone: the name imports, and making one says why.
    script = (
        "import nanolimit\n"
        "try:\n"
        "    nanolimit.SharedMemoryStorage('x', max_keys=10)\n"
        "except nanolimit.ValidationError as exc:\n"
        "    print(nanolimit.IMPLEMENTATION, exc)\n"
    )
    env = {**os.environ, "NANOLIMIT_NO_EXTENSIONS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("reference ") and "native extension" in out.stdout, out.stderr


@pytest.mark.skipif(sys.platform != "win32", reason="the refusal is Windows's; elsewhere the zone works")
def test_the_zone_refuses_windows_with_the_reason() -> None:
    import nanolimit._core as core
    from nanolimit.errors import ValidationError

    with pytest.raises(ValidationError, match="POSIX shared memory"):
        core.SharedMemoryStorage("x", max_keys=10)
