"""Every code block of README.md and docs/*.md runs here, so the docs cannot
show code that does not work.

The conventions (CONTRIBUTING.md says the same, for whoever writes docs):

- A ```python block runs in a fresh namespace, as a module named
  ``docs_example``: ``if __name__ == "__main__":`` parts do not run (that is
  where a block puts ``uvicorn.run(app)`` or ``app.run()``, as a real module
  would). Top-level ``await`` is allowed; such a block runs on a new event
  loop.
- ``<!-- continues -->`` on the line before a block: it runs in the
  namespace the previous python block of the same file left, instead of a
  fresh one.
- ``<!-- serves: NAME [METHOD] [PATH] -->`` on the line before a block: after
  it runs, one request (``GET /`` unless told) goes to the ASGI or WSGI app
  bound to NAME through an in-process test client (httpx's ASGI transport,
  Werkzeug's test client), and must come back below 500 with a
  ``RateLimit-Policy`` header: the limiter is wired in.
- A block that builds a Redis client (``Redis(host="...")`` or a
  ``redis://`` URL) talks to the suite's own Redis server: those addresses
  are pointed at it, and a Redis client written any other way fails the
  test (it would talk to whatever listens on the default port).
- A block that makes a ``SharedMemoryStorage("name", ...)`` gets a fresh zone
  name, unlinked afterwards. Where the native core is not live, the block
  must fail with the zone's own "needs nanolimit's native extension" error.
- A ```toml block is a rules file: it is written to a file, loaded with
  ``nanolimit.gateway.config.load_rules``, and its registry and factory are built. A
  block that is a ``[storage]`` section alone is loaded as a file with that
  section and one rule.
- Other fences are shown, not run: ``sh``, ``bash``, ``console``, ``text``
  and unlabelled ones (formulas, header samples). Any other language fails
  the test, so Python cannot hide under another label.

The blocks found in each file are counted and so are the blocks run: the two
numbers must agree. New files under docs/ are picked up by the glob.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import inspect
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import nanolimit
from nanolimit.gateway.config import load_rules

pytest_plugins = ["redis_servers"]  # the server fixtures

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
_IDS = [str(p.relative_to(ROOT)) for p in DOCS]
RUN = ("python", "toml")
SHOWN = ("sh", "bash", "console", "text", "")
# Blocks known to fail, by (file, first line of code): each still runs and
# must fail as recorded, so the entry goes when the file is fixed (the test
# then says so). Each is a file whose owner has the fix to make.
KNOWN_BROKEN: dict[tuple[str, int], tuple[type[BaseException], str]] = {
    ("docs/proxies.md", 13): (
        NameError,
        "DefaultKeyExtractor is used without its import: add `from nanolimit import DefaultKeyExtractor`",
    ),
}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<body>.*?)\s*-->\s*$")
_SERVES = re.compile(r"^serves:\s*(?P<name>[A-Za-z_]\w*)(?:\s+(?P<method>[A-Z]+))?(?:\s+(?P<path>/\S*))?$")
_REDIS_HOST = re.compile(r'(Redis\()host="[^"]*"')
_REDIS_URL = re.compile(r"redis://[^/\"'\s]+")
_ZONE_NAME = re.compile(r'(SharedMemoryStorage\()"(?P<name>[^"]+)"')
_TOML_ZONE_NAME = re.compile(r'^(name\s*=\s*)"[^"]*"', re.M)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the first line of code, 1-based
    lang: str
    code: str
    markers: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{_rel(self.path)}:{self.line}"


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, with the marker comments on the
    lines right above each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, lang = m["indent"], m["lang"]
        markers: list[str] = []
        j = i - 1
        while j >= 0 and (marker := _MARKER.match(lines[j])):
            markers.insert(0, marker["body"])
            j -= 1
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        assert end < len(lines), f"{_rel(path)}:{i + 1}: a fence that never closes"
        body = [line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end]]
        found.append(Block(path, i + 2, lang, "\n".join(body) + "\n", tuple(markers)))
        i = end + 1
    return found


def _check_markers(block: Block) -> None:
    for marker in block.markers:
        if marker == "continues":
            assert block.lang == "python", f"{block.where}: only python blocks continue"
        elif _SERVES.match(marker):
            assert block.lang == "python", f"{block.where}: only python blocks serve"
        else:
            raise AssertionError(
                f"{block.where}: unknown marker <!-- {marker} --> right above a block "
                "(known: <!-- continues -->, <!-- serves: NAME [METHOD] [PATH] -->)"
            )


class Resources:
    """What the blocks of one file use: the suite's Redis server and fresh
    zone names, each started or made on first use and cleaned up after."""

    def __init__(self) -> None:
        self.redis_port: int | None = None
        self.zones: list[str] = []

    def redis(self) -> int:
        from redis_servers import shared_server

        server = shared_server("redis")
        client = server.client()
        client.flushall()
        client.script_flush()
        client.close()
        self.redis_port = server.port
        return server.port

    def zone_name(self) -> str:
        name = f"nl-docs-{secrets.token_hex(4)}"
        self.zones.append(name)
        return name

    def close(self) -> None:
        if nanolimit.IMPLEMENTATION == "native":
            for name in self.zones:
                nanolimit.SharedMemoryStorage.unlink_segment(name)


def _point_at_resources(block: Block, res: Resources) -> tuple[str, bool]:
    """The block's code with its Redis addresses and zone names replaced;
    and whether it makes a zone."""
    code = block.code
    if "Redis(" in code or "redis://" in code:
        clients = code.count("Redis(") + code.count("Redis.from_url(")
        addresses = len(_REDIS_HOST.findall(code)) + len(_REDIS_URL.findall(code))
        assert addresses >= clients, (
            f'{block.where}: write each Redis client with host="..." or a redis:// URL, '
            "so the test can point it at its own server"
        )
        port = res.redis()
        code = _REDIS_HOST.sub(rf'\1host="127.0.0.1", port={port}', code)
        code = _REDIS_URL.sub(f"redis://127.0.0.1:{port}", code)
    makes_zone = False
    if "SharedMemoryStorage(" in code:
        code, zones = _ZONE_NAME.subn(lambda m: f'{m[1]}"{res.zone_name()}"', code)
        assert zones == code.count("SharedMemoryStorage("), (
            f'{block.where}: name each zone with a string literal, SharedMemoryStorage("name", ...)'
        )
        makes_zone = True
    return code, makes_zone


def _run_python(block: Block, code: str, namespace: dict[str, Any]) -> None:
    # padded so a traceback names the line of the Markdown file
    source = "\n" * (block.line - 1) + code
    compiled = compile(source, str(block.path), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    if compiled.co_flags & inspect.CO_COROUTINE:
        asyncio.run(eval(compiled, namespace))
    else:
        exec(compiled, namespace)


def _serve(block: Block, marker: str, namespace: dict[str, Any]) -> None:
    m = _SERVES.match(marker)
    assert m is not None
    app = namespace.get(m["name"])
    assert app is not None, f"{block.where}: serves {m['name']!r}, which the block does not define"
    method, path = m["method"] or "GET", m["path"] or "/"
    is_asgi = inspect.iscoroutinefunction(app) or inspect.iscoroutinefunction(type(app).__call__)
    if is_asgi:
        import httpx

        async def one() -> tuple[int, dict[str, str]]:
            transport = httpx.ASGITransport(app=app, client=("192.0.2.1", 1))
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
                r = await http.request(method, path)
                return r.status_code, dict(r.headers)

        status, headers = asyncio.run(one())
    else:
        from werkzeug.test import Client

        r = Client(app).open(path, method=method, environ_base={"REMOTE_ADDR": "192.0.2.1"})
        status, headers = r.status_code, dict(r.headers)
    lowered = {k.lower(): v for k, v in headers.items()}
    assert status < 500, f"{block.where}: {method} {path} answered {status}"
    assert "ratelimit-policy" in lowered, f"{block.where}: {method} {path}: no rate-limit headers: {headers}"


def _run_toml(block: Block, res: Resources, tmp_path: Path) -> None:
    from nanolimit.gateway.config import tomllib  # or the tomli backport on 3.10

    code = block.code
    data = tomllib.loads(code)
    storage = data.get("storage")
    zone = isinstance(storage, dict) and storage.get("type") == "shared_memory"
    if zone:
        code, n = _TOML_ZONE_NAME.subn(lambda m: f'{m[1]}"{res.zone_name()}"', code)
        assert n == 1, f"{block.where}: a shared_memory section names its zone once"
    if set(data) == {"storage"}:
        code += '\n[[rules]]\nname = "docs-example"\nrate = "1/second"\n'
    path = tmp_path / f"rules-{block.line}.toml"
    path.write_text(code, encoding="utf-8")
    loaded = load_rules(path)
    loaded.registry()
    if zone and nanolimit.IMPLEMENTATION != "native":
        with pytest.raises(nanolimit.ConfigError, match="native extension"):
            loaded.factory()
        return
    factory = loaded.factory()
    if zone:
        factory.storage.close()


def _missing_package(block: Block, exc: ModuleNotFoundError) -> None:
    """A block imports a package this environment lacks (the wheel builds
    install the test-core extras only): a loud skip, a failure under
    ``CI=true``, where it means the docs were not tested."""
    root = (exc.name or "").partition(".")[0]
    if not root or importlib.util.find_spec(root) is not None:
        raise exc
    message = f"!!! {block.where}: needs {root!r}, not installed: the blocks of this file did NOT run !!!"
    if os.environ.get("CI") == "true":
        pytest.fail(message + " — CI=true, so this is a failure", pytrace=False)
    pytest.skip(message)


def _run_block(block: Block, res: Resources, tmp_path: Path, namespace: dict[str, Any]) -> None:
    if block.lang == "toml":
        _run_toml(block, res, tmp_path)
        return
    code, makes_zone = _point_at_resources(block, res)
    broken = KNOWN_BROKEN.get((_rel(block.path), block.line))
    if broken is not None:
        with pytest.raises(broken[0]):  # fixed? then drop its KNOWN_BROKEN entry
            _run_python(block, code, namespace)
        return
    if makes_zone and nanolimit.IMPLEMENTATION != "native":
        with pytest.raises(nanolimit.ValidationError, match="native extension"):
            _run_python(block, code, namespace)
        return
    _run_python(block, code, namespace)
    # a store the block could not reach answers "degraded" rather than failing
    degraded = [k for k, v in namespace.items() if isinstance(v, nanolimit.Decision) and v.degraded]
    assert not degraded, f"{block.where}: {degraded} answered degraded: was the store reached?"
    for marker in block.markers:
        if marker.startswith("serves:"):
            _serve(block, marker, namespace)


def run_file(path: Path, tmp_path: Path) -> tuple[int, int]:
    """Run every block of ``path`` in order: (blocks to run found, blocks run)."""
    found = blocks(path)
    for block in found:
        _check_markers(block)
        assert block.lang in RUN or block.lang in SHOWN, (
            f"{block.where}: ```{block.lang} is neither run ({', '.join(RUN)}) nor shown "
            f"({', '.join(s or 'unlabelled' for s in SHOWN)}); see tests/test_docs_examples.py"
        )
    to_run = [b for b in found if b.lang in RUN]
    res = Resources()
    ran = 0
    namespace: dict[str, Any] = {}
    try:
        for i, block in enumerate(to_run):
            if "continues" in block.markers:
                assert i > 0 and to_run[i - 1].lang == "python", (
                    f"{block.where}: continues, but the block before it is not python"
                )
            elif block.lang == "python":
                namespace = {"__name__": "docs_example"}
            try:
                _run_block(block, res, tmp_path, namespace)
            except ModuleNotFoundError as exc:
                _missing_package(block, exc)
            ran += 1
    finally:
        res.close()
    return len(to_run), ran


@pytest.mark.parametrize("path", DOCS, ids=_IDS)
def test_every_block_of_the_file_runs(path: Path, tmp_path: Path) -> None:
    found, ran = run_file(path, tmp_path)
    # counted apart from the reader too: its bugs (two blocks read as one) must show
    opening = len(re.findall(r"^[ \t]*```(?:python|toml)[ \t]*$", path.read_text(encoding="utf-8"), re.M))
    assert ran == found == opening, f"{_rel(path)}: {opening} fences, {found} blocks to run, {ran} ran"


def test_the_docs_are_found_and_hold_blocks() -> None:
    names = {str(p.relative_to(ROOT)) for p in DOCS}
    assert {"README.md", "docs/gateway.md", "docs/migrating.md", "docs/spec.md"} <= names
    assert sum(1 for p in DOCS for b in blocks(p) if b.lang == "python") >= 20


def test_the_block_reader_sees_markers_fences_and_languages(tmp_path: Path) -> None:
    """The reader itself: a marker binds the block right below it, an
    indented fence is dedented, and a block hiding under another label fails."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "text\n\n```python\nx = 1\n```\n<!-- continues -->\n<!-- serves: app POST /login -->\n"
        "```python\ny = x + 1\n```\n\n- item\n\n  ```toml\n  a = 1\n  ```\n\n```py\nz = 1\n```\n"
    )
    found = blocks(doc)
    assert [(b.lang, b.line, b.markers) for b in found] == [
        ("python", 4, ()),
        ("python", 9, ("continues", "serves: app POST /login")),
        ("toml", 15, ()),
        ("py", 19, ()),
    ]
    assert found[2].code == "a = 1\n"
    with pytest.raises(AssertionError, match="```py is neither run"):
        run_file(doc, tmp_path)
    doc.write_text("<!-- continue -->\n```python\nx = 1\n```\n")
    with pytest.raises(AssertionError, match="unknown marker"):
        run_file(doc, tmp_path)
    doc.write_text("```python\nimport redis\nredis.Redis()\n```\n")
    with pytest.raises(AssertionError, match=re.escape('host="..."')):
        run_file(doc, tmp_path)
