"""How the gateway's modules depend on each other, read from their source.

``lint-imports`` holds the layers between packages; inside the gateway these
tests hold what it cannot: no import cycle (counting imports under
``TYPE_CHECKING`` and inside functions, which a cycle hides in), ``Request``
at the bottom, and no module choosing the twin itself (``_select`` is the one
place that does).
"""

from __future__ import annotations

import ast
import importlib
import typing
from pathlib import Path

import nanolimit.gateway

GATEWAY = Path(nanolimit.gateway.__file__).parent
MODULES = sorted(p.stem for p in GATEWAY.glob("*.py") if p.stem != "__init__")


def _tree(module: str) -> ast.Module:
    return ast.parse((GATEWAY / f"{module}.py").read_text(encoding="utf-8"))


def _gateway_imports(module: str) -> set[str]:
    """The gateway modules ``module`` imports, anywhere in its source."""
    found: set[str] = set()
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found.update(alias.name for alias in node.names)
            elif node.level == 0 and (node.module or "").startswith("nanolimit.gateway."):
                found.add(node.module.split(".")[2])  # type: ignore[union-attr]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nanolimit.gateway."):
                    found.add(alias.name.split(".")[2])
    return found & set(MODULES)


def test_the_gateway_has_no_import_cycle() -> None:
    graph = {m: _gateway_imports(m) for m in MODULES}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path, module))
        if module in done:
            return
        for dep in sorted(graph[module]):
            visit(dep, (*path, module))
        done.add(module)

    for module in MODULES:
        visit(module, ())
    assert graph["keys"] >= {"request"} and "middleware" not in graph["keys"]


def test_request_sits_below_keys_and_the_pipeline() -> None:
    request = importlib.import_module("nanolimit.gateway.request")
    assert _gateway_imports("request") == set()
    for module in ("keys", "middleware", "asgi", "wsgi"):
        assert "request" in _gateway_imports(module), module
    # one class under every documented name, and keys.py's annotations name
    # it at run time too (not only for a type checker)
    from nanolimit import Request
    from nanolimit.gateway.middleware import Request as PipelineRequest

    assert Request is PipelineRequest is request.Request
    keys = importlib.import_module("nanolimit.gateway.keys")
    assert typing.get_type_hints(keys.bearer_or_api_key)["request"] is request.Request
    assert typing.get_type_hints(keys.DefaultKeyExtractor.storage_key_for)["request"] is request.Request


def test_no_gateway_module_chooses_the_twin() -> None:
    """By module name, by ``IMPLEMENTATION`` or by an import attempt: every
    module asks ``nanolimit._select`` instead."""
    for module in MODULES:
        for node in ast.walk(_tree(module)):
            if isinstance(node, ast.ImportFrom):
                target = node.module or ""
                assert target.split(".")[-1] not in ("_core", "reference"), (module, target)
                assert not any(alias.name in ("_core", "reference") for alias in node.names), module
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name not in ("nanolimit._core", "nanolimit.reference"), module
            elif isinstance(node, ast.Name | ast.Attribute):
                name = node.id if isinstance(node, ast.Name) else node.attr
                assert name != "IMPLEMENTATION", module
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in ("nanolimit._core", "nanolimit.reference"), module
