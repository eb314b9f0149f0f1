"""Redis (and Valkey) storage: the docs/spec.md §4 kernels as Lua scripts, one atomic
``EVALSHA`` per decision, shared by every gateway instance.

Why a script: read, decide and write must be one atomic step per key (docs/spec.md §5).
A script runs next to the data, alone on the server, so two gateway processes
deciding the same key can never both spend its last unit. Each of the six
scripts is the reference kernel (``nanolimit.reference``) transcribed line by
line: the same IEEE-double operations in the same order, so a decision on
Redis equals a decision in memory (the equivalence tests hold them to it).

Wire conventions (see docs/redis.md): floats go in as ``repr(float)`` strings and
come back as ``%.17g`` strings, because a Lua number in a reply is truncated
to an integer; numbers are stored as Lua numbers, which Redis and Valkey write
with 17 significant digits and read back exactly (the token bucket's level,
which is in the reply too, is stored as the script's own ``%.17g`` string:
the same bytes Redis 7.0 writes for the number, the same value everywhere).

State per key, only what its algorithm needs:

==================  ==============================================
token/leaky bucket  hash ``l`` (level), ``u`` (the key's own time)
fixed window        hash ``k`` (window index), ``n`` (count), ``u``
sliding counter     hash ``k``, ``n``, ``p`` (previous), ``u``
GCRA                string ``"<tat µs> <u>"``
sliding log         list: ``u`` at index 0, then the timestamps,
                    oldest first (capped at the capacity)
==================  ==============================================

``u`` (updated_at) is kept because docs/spec.md §4 says per-key time never runs
backwards: ``now = max(clock, u)``. Without it a clock stepping back would
judge a key differently than the in-memory store does.

Every write sets ``PEXPIRE`` to the time until the state is back to "never
seen" (``reset_after``), rounded up to whole milliseconds plus 1 ms of slack,
never below 1 ms — so idle keys disappear on their own and ``evict_idle`` has
nothing to do. With an injected clock (tests, replays) the expiry has a floor
of an hour of real time, so a slow fake clock never meets a real expiry.

The package's modules, by what they hold: ``_scripts`` (the Lua, read from
``lua/*.lua`` once at import, and its SHA1s), ``_resilience`` (errors, error
classification, the circuit breaker), ``_local`` (the local store of
``on_error="local"`` during an outage), ``_connections`` (the derived client,
kept connections, hiredis packing: the redis-py internals), ``_base`` (what
both storages share), and this module: the two storages and the public names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from ..._clocks import MAX_CLOCK_LEAD, check_now
from ..._decision_py import (
    REASON_STORE_ERROR,  # noqa: F401 (the name tests and callers import from here)
    REASON_STORE_UNAVAILABLE,
    CompoundDecision,
    KernelVerdict,
)
from ..._limiter_config import LimiterConfig, LimiterState
from ..._validation import DUPLICATE_COMPOUND, check_batch, check_cost, check_key, compound_items
from ...errors import ValidationError
from ._base import _BatchRun, _Call, _RedisBase, decision_maker, kernel_now, limiter_config
from ._connections import _refused_connect, client_package, connect_timeout, derive_client
from ._local import REASON_STORE_UNAVAILABLE_LOCAL
from ._resilience import ON_ERROR_POLICIES, _Breaker, is_noscript
from ._scripts import (
    _ALGO_IDS,
    BATCH_SCRIPTS,
    COMPOUND_SCRIPT,
    REFUND_SCRIPTS,
    SCRIPTS,
    LuaScript,
    _params,
    _parse_verdict,
)

__all__ = [
    "MAX_CLOCK_LEAD",
    "ON_ERROR_POLICIES",
    "REASON_STORE_UNAVAILABLE_LOCAL",
    "AsyncRedisStorage",
    "LuaScript",
    "RedisStorage",
    # what the other storages (two_tier, uri) build on
    "client_package",
    "connect_timeout",
    "derive_client",
    "is_noscript",
]


class RedisStorage(_RedisBase):
    """Per-key limiter state in Redis/Valkey, decided by Lua scripts.

    ``client`` is your redis-py client (``redis.Redis``, ``redis.RedisCluster``)
    or a valkey-py one (duck typed). Decisions go through a *derived* client:
    the same connection settings with ``timeout`` seconds of socket timeout
    and no retries (``derive=False`` uses yours unchanged — then the timeouts
    and retries are your responsibility).

    Keys: ``<prefix><algorithm>:<rule>:{<identity>}``. The identity is the
    cluster hash tag, so every limit on one identity lives in one slot (and a
    compound request on one identity is one script on one node). An identity
    is replaced by ``#`` + a BLAKE2b digest (keyed with ``key_salt``) when it
    is longer than ``max_identity_bytes``, contains ``{``/``}``, starts with
    ``#``, or belongs to a rule named in ``secret_rules`` (API keys must not
    show in ``SCAN``/``MONITOR``); ``hash_identities=True`` hashes them all.
    Rule names with braces, a leading ``#`` or over 128 bytes are hashed too.

    ``clock``: ``"server"`` (default) — a limiter on the default SystemClock
    is judged by Redis's ``TIME``, one clock for every gateway instance; an
    injected clock (FakeClock, replays) is always passed through.
    ``"client"`` sends the local wall clock instead (not recommended: clients
    disagree).

    Failures (``on_error``, overridable per rule with ``rule_on_error``):
    ``"allow"`` answers allowed, ``"deny"`` answers denied with
    ``deny_retry_after`` seconds, both marked ``degraded``; ``"raise"`` raises
    :class:`RedisUnavailableError`. After ``breaker_threshold`` consecutive
    failures of the server or the connection the breaker opens for
    ``breaker_cooldown`` seconds (no round trips), then lets one probe
    through; after it, ``breaker_threshold`` answers in a row close it (one
    failure before that opens it again). On a cluster each master has its
    own breaker and decisions go straight to the owning node's connection,
    never through the cluster client's retry-and-refresh loop (docs/redis.md,
    "Cluster failures"). An error reply about one key (``WRONGTYPE`` from a foreign
    value, the scripts' ``BADSTATE``, ``OOM``) answers that key alone by its
    policy (``reason="store_error"``, :class:`RedisKeyError` under
    ``"raise"``), is counted in ``key_errors`` and never feeds the breaker;
    the value is left as it is (docs/redis.md, "Failures").

    ``"local"`` keeps enforcing limits through an outage: every decision the
    store cannot make (a failure that feeds the breaker, or the open
    breaker) is made in a bounded in-process ``InMemoryStorage``
    (``local_max_keys`` keys, default 100,000) at ``local_share`` of each
    limit (and burst), default ``1 / local_instances`` (the gateway
    processes sharing this Redis, default 1): a share of 1 lets N instances
    admit N times the limit between them during an outage, ``1 / N`` keeps
    the fleet within it. Such decisions are ``degraded`` with
    ``reason="store_unavailable_local"``. The server's breaker closed
    again (once it opened, after ``breaker_threshold`` answers in a row,
    the probe's the first; before it opened, at the first answer) hands
    decisions back to Redis; the units admitted locally are not replayed
    there and the local state is dropped (the next outage starts a fresh
    one). A key's error reply is denied under ``"local"``.

    ``batch``: ``"script"`` (default) decides an ``allow_many`` with one
    batch script per node/slot (about twice the throughput), ``"pipeline"``
    with one ``EVALSHA`` per key; both are one round trip.
    ``near_cache=True`` denies a key the store has just denied locally until
    its ``retry_after`` (see :class:`_NearCache`).

    ``keep_connections`` (default 8): how many connections decisions may
    keep out of the derived client's pool between calls, instead of taking
    one and giving it back each time, which costs more than the server
    spends on the decision (see :class:`_SpareConnections`). ``0`` borrows
    from the pool on every call, as does ``derive=False`` (your pool may
    have other users to serve). A blocking pool, or one whose
    ``max_connections`` is below twice this, keeps fewer or none.
    """

    # -- script calls -------------------------------------------------------------
    def load_scripts(self) -> None:
        """``SCRIPT LOAD`` every script (on every primary of a cluster)."""
        for script in (*SCRIPTS.values(), *BATCH_SCRIPTS.values(), COMPOUND_SCRIPT, *REFUND_SCRIPTS.values()):
            self._load(script)

    def _load(self, script: LuaScript, node: Any = None) -> None:
        if node is not None and self._routes is not None:  # that node alone: another may be down
            self._loaded(script, self._routes.call(node, ("SCRIPT", "LOAD", script.source)))
            return
        self._loaded(script, self.client.script_load(script.source))

    def _call(self, *args: Any, node: Any = None) -> Any:
        """One command, one attempt. A socket error or timeout disconnects
        the connection (redis-py's ``read_response`` does it) before it goes
        back to the pool, so the next call starts on a fresh socket. On a
        cluster ``node`` is the key's node: the command goes to its own
        connection (``_cluster``), never through the client's retry loop."""
        if node is not None and self._routes is not None:
            return self._routes.call(node, args)
        spares = self._spares
        if spares is not None:
            return spares.call(args)
        pool = self._pool
        if pool is None:
            return self.client.execute_command(*args)
        try:
            conn = pool.get_connection(*self._conn_args)
        except self._reply_errors as exc:
            raise _refused_connect(exc, self._connect_error) from exc
        try:
            conn.send_command(*args)
            return conn.read_response()
        finally:
            pool.release(conn)

    def _evalsha(self, script: LuaScript, keys: Sequence[str], args: Sequence[str], node: Any = None) -> Any:
        """One ``EVALSHA``; on ``NOSCRIPT`` load and retry once (safe: the
        script did not run). Never retried otherwise."""
        try:
            return self._call("EVALSHA", script.sha, len(keys), *keys, *args, node=node)
        except self._errors as exc:
            if not is_noscript(exc):
                raise
            lacking = getattr(exc, "answered_by", node)  # a redirect's target, or the key's node
        self._load(script, lacking)
        return self._call("EVALSHA", script.sha, len(keys), *keys, *args, node=node)

    # -- KernelStorage --------------------------------------------------------------
    def run_kernel(
        self, config: LimiterConfig, key: str, cost: int, now: float | None, commit: bool
    ) -> KernelVerdict:
        """One decision: one ``EVALSHA`` (two after a ``SCRIPT FLUSH``)."""
        if self._routes is not None:
            return self._run_kernel_node(config, key, cost, now, commit)
        early = self._early(config, key, cost, now, commit)
        if early is not None:
            return early
        keys, args = self._single_args(config, key, cost, now, commit)
        try:
            reply = self._evalsha(SCRIPTS[config.algorithm], keys, args)
        except self._errors as exc:
            return self._error_verdict(config, exc, key, cost, now, commit)
        return self._answered(config, key, cost, now, reply)

    def _run_kernel_node(
        self, config: LimiterConfig, key: str, cost: int, now: float | None, commit: bool
    ) -> KernelVerdict:
        """A cluster's decision: the key's node, behind that node's breaker."""
        rkey = self.redis_key(config, key)
        breaker, node = self._route(rkey)
        early = self._early(config, key, cost, now, commit, breaker)
        if early is not None:
            return early
        keys, args = self._single_args(config, key, cost, now, commit, rkey)
        try:
            if node is None:
                raise self._routes.uncovered()  # type: ignore[union-attr]
            reply = self._evalsha(SCRIPTS[config.algorithm], keys, args, node)
        except self._errors as exc:
            return self._error_verdict(config, exc, key, cost, now, commit, breaker)
        return self._answered(config, key, cost, now, reply, breaker)

    def run_kernel_many(
        self, config: LimiterConfig, keys: Sequence[str], costs: Sequence[int], now: float | None
    ) -> list[KernelVerdict]:
        """A batch in one round trip: one pipeline (``transaction=False``).

        ``batch="script"`` (default) sends one batch script per node — per
        slot on a cluster, at most ``BATCH_CHUNK`` keys each — which runs the
        kernel key after key with one clock reading, as the in-memory batch
        does; ``batch="pipeline"`` sends one ``EVALSHA`` per key (each reads
        the server clock itself). Either way keys are decided in order, a
        repeated key sees its earlier charge, and a script that hit
        ``NOSCRIPT`` (it did not run) is sent again after a load; nothing
        else is retried.
        """
        run = self._batch_start(config, keys, costs, now)
        if isinstance(run, list):
            return run
        if self._routes is not None:
            return self._run_many_nodes(run)
        try:
            for attempt in range(2):
                pipe = self.client.pipeline(transaction=False)
                run.queue(pipe)
                reload = run.absorb(pipe.execute(raise_on_error=False), attempt)
                if reload is None:
                    break
                self._load(reload)
        except self._errors as exc:
            return run.abort(exc)
        return run.result()

    def _run_many_nodes(self, run: _BatchRun) -> list[KernelVerdict]:
        """A cluster's batch: one pipeline per node, each on the node's own
        connection; a node that fails answers its keys by policy alone."""
        routes = self._routes
        assert routes is not None
        for breaker, node, calls in run.by_node():
            self._node_batch(run, breaker, node, calls, False)
        for breaker, node, asking, calls in run.follow_redirects(routes):
            self._node_batch(run, breaker, node, calls, asking)
        return run.result()

    def _node_batch(
        self, run: _BatchRun, breaker: _Breaker, node: Any, calls: list[_Call], asking: bool
    ) -> None:
        """One node's part of a cluster's batch: one pipeline (a second
        after a script load)."""
        routes = self._routes
        assert routes is not None
        try:
            for attempt in range(2):
                commands = [("EVALSHA", c[0].sha, len(c[1]), *c[1], *c[2]) for c in calls]
                replies = routes.pipeline(node, commands, asking)
                calls = run.absorb_calls(calls, replies, attempt, breaker)
                if not calls:
                    break
                for script in {c[0] for c in calls}:
                    self._load(script, node)
        except self._errors as exc:
            run.node_failed(breaker, calls, exc)

    def run_kernel_all(
        self, items: Sequence[tuple[LimiterConfig, str, int]], now: float | None
    ) -> list[KernelVerdict]:
        """All-or-nothing over several (config, key, cost) with one ``now``."""
        return self._run_all([(cfg, key, cost, now) for cfg, key, cost in items])

    def _run_all(self, items: Sequence[tuple[LimiterConfig, str, int, float | None]]) -> list[KernelVerdict]:
        if not items:
            return []
        cfg0 = items[0][0]
        keys = [self.redis_key(cfg, key) for cfg, key, _, _ in items]
        if len(set(keys)) != len(keys):
            raise ValidationError(DUPLICATE_COMPOUND)
        if self.cluster:
            self._check_one_slot(keys)
        breaker, node = self._route(keys[0])
        if not breaker.allow_call():
            self._count("breaker_open_skips")
            return self._all_unavailable(items, None, breaker)
        args: list[str] = [str(len(items))]
        for cfg, _key, cost, now in items:
            p1, p2 = _params(cfg)
            args += [
                str(_ALGO_IDS[cfg.algorithm]),
                self._now_arg(now),
                str(cost),
                self._floor_ms(now),
                p1,
                p2,
                "1" if self._policy(cfg.rule) == "allow" else "0",
            ]
        try:
            if self._routes is not None and node is None:
                raise self._routes.uncovered()
            reply = self._evalsha(COMPOUND_SCRIPT, keys, args, node)
        except self._errors as exc:
            if self._local is not None and self._key_error(exc) is None:
                self._failed(exc, breaker)
                return self._all_unavailable(items, exc, breaker)
            first = self._error_verdict(cfg0, exc, *items[0][1:], True, breaker)
            reason = first[6] if len(first) > 6 else REASON_STORE_UNAVAILABLE
            return [first] + [self._fallback(cfg, exc, reason) for cfg, _, _, _ in items[1:]]
        # Each limit's answer; a key that erred was answered by its own
        # policy inside the script too (allowed only under "allow", never
        # written), so the others were charged or not exactly as shown here.
        out: list[KernelVerdict] = []
        down = False
        for (cfg, _, _, _), part in zip(items, reply):
            try:
                out.append(_parse_verdict(part))
            except ValueError:
                verdict, failed = self._part_error(cfg, part, None, breaker)
                out.append(verdict)
                down = down or failed
        if not down:
            self._up(breaker)
        self._count("decisions", sum(1 for v in out if not v[5]))  # not answered by a policy
        return out

    def _all_unavailable(
        self,
        items: Sequence[tuple[LimiterConfig, str, int, float | None]],
        exc: BaseException | None,
        breaker: _Breaker | None = None,
    ) -> list[KernelVerdict]:
        """A compound the store could not decide: each limit by its policy,
        the ``"local"`` ones together in the local store, all-or-nothing —
        charged only when no other policy denied."""
        local = self._local
        if local is None:
            return [self._fallback(cfg, exc) for cfg, _, _, _ in items]
        mine = [i for i, (cfg, _, _, _) in enumerate(items) if self._policy(cfg.rule) == "local"]
        out: list[KernelVerdict | None] = [None] * len(items)
        for i, (cfg, _, _, _) in enumerate(items):
            if out[i] is None and i not in mine:
                out[i] = self._fallback(cfg, exc)
        if mine:
            commit = all(v is None or v[0] for v in out)
            self._count("degraded", len(mine))
            route = breaker or self._breaker
            for i, v in zip(mine, local.decide_all([items[i] for i in mine], commit, route)):
                out[i] = v
        return [v for v in out if v is not None]

    def _check_one_slot(self, keys: Sequence[str]) -> None:
        slot = client_package(self.user_client).crc.key_slot
        slots = {slot(k.encode("utf-8")) for k in keys}
        if len(slots) > 1:
            raise ValidationError(
                "on a Redis Cluster a compound request must bind one identity: its keys are routed by "
                "the identity's hash tag and must share one slot (a global key cannot join a per-user "
                "compound on a cluster; decide it separately)"
            )

    def refund_kernel(
        self, config: LimiterConfig, key: str, units: int, at: float | None, now: float | None
    ) -> None:
        """Give back ``units`` that a decision made at ``at`` (its
        ``Decision.at``; None: the key's latest decision) charged: one
        ``EVALSHA`` (two after a ``SCRIPT FLUSH``), read, give back and write
        atomically, at ``now`` (None: the server's ``TIME``, as decisions).
        A key that does not exist is left unmade. A failure is classified and
        counted as a decision's; under ``"allow"``/``"deny"`` the refund is
        then dropped (``refunds_dropped``), never raised into a request;
        ``"raise"`` raises as a decision would (docs/redis.md, "Refunds")."""
        call = self._refund_start(config, key, units, at, now)
        if call is None:
            return
        script, keys, args, breaker, node = call
        try:
            if self._routes is not None and node is None:
                raise self._routes.uncovered()
            self._evalsha(script, keys, args, node)
        except self._errors as exc:
            self._refund_failed(config, exc, breaker)
            return
        self._refunded(breaker)

    def forget(self, config: LimiterConfig, key: str) -> None:
        """``DEL`` the key (a reset is an admin action: errors raise)."""
        self.client.delete(self._forget_local(config, key))

    def snapshot(self, config: LimiterConfig, key: str, now: float | None) -> LimiterState | None:
        """The raw stored state (not brought up to ``now``), or ``None``."""
        return self._parse_snapshot(
            config.algorithm, self.client.execute_command(*self._snapshot_command(config, key))
        )

    def keys(self) -> list[str]:
        """Every limiter key under the prefix (``SCAN``; every primary of a
        cluster): a key of another shape there is not the limiter's."""
        out = []
        for raw in self.client.scan_iter(match=self._scan_match(), count=1000):
            name = self._limiter_key(raw)
            if name is not None:
                out.append(name)
        return out

    def __len__(self) -> int:
        """Keys under the prefix, counted with ``SCAN`` (O(keys): not for a hot path)."""
        return len(self.keys())

    def clear(self) -> int:
        """Delete every limiter key under the prefix (see :meth:`keys`); returns how many."""
        names = self.keys()
        for name in names:
            self.client.delete(name)
        return len(names)

    # -- compound limits ------------------------------------------------------------
    def allow_all(self, requests: Sequence[tuple[Any, ...]]) -> CompoundDecision:
        """All-or-nothing over several limiters of this storage (docs/spec.md §5), in
        one script: every limit is decided without writing, and only if all
        allow is each one charged. Works with limiters of either twin.

        On a cluster every key must share one slot — i.e. one identity (the
        hash tag); see :meth:`_check_one_slot`.
        """
        items = compound_items(requests)
        plan: list[tuple[LimiterConfig, str, int, float | None]] = []
        makers: list[Callable[[KernelVerdict], Any]] = []
        for limiter, key, cost in items:
            if getattr(limiter, "storage", None) is not self:
                raise ValidationError("every limiter of a compound request must use this storage")
            cfg = limiter_config(limiter)
            check_key(key, self.max_key_bytes)
            cost = check_cost(cost, cfg.capacity)  # converted once: charge what was checked
            plan.append((cfg, key, cost, None))
            makers.append(decision_maker(limiter, cfg))
        keys = {(cfg.algorithm, cfg.rule, key) for cfg, key, _, _ in plan}
        if len(keys) != len(plan):
            raise ValidationError(DUPLICATE_COMPOUND)
        plan = [
            (cfg, key, cost, kernel_now(limiter)) for (cfg, key, cost, _), (limiter, _, _) in zip(plan, items)
        ]
        verdicts = self._run_all(plan)
        return CompoundDecision([make(v) for make, v in zip(makers, verdicts)])

    def close(self) -> None:
        """Give kept connections back to the pool and close the derived
        client's connections (never the caller's client)."""
        if self._spares is not None:
            self._spares.release_all()
        if self.client is not self.user_client:
            self.client.close()


_ASYNC_ONLY = (
    "AsyncRedisStorage answers coroutines only: use `await limiter.allow_async(key, cost)` / "
    "`await limiter.peek_async(key, cost)` (and the storage's *_async methods), or RedisStorage "
    "with a synchronous client"
)


class AsyncRedisStorage(_RedisBase):
    """:class:`RedisStorage` for ``asyncio``: the same scripts, keys, options,
    failure policy, breaker, near-cache and metrics, over a ``redis.asyncio``
    client (``redis.asyncio.Redis``, ``redis.asyncio.RedisCluster``, or the
    valkey-py equivalents), so a decision never blocks the event loop::

        storage = AsyncRedisStorage(redis.asyncio.Redis(host="10.0.0.5"))
        limiter = TokenBucket(100, 60.0, storage, rule="api-user")
        decision = await limiter.allow_async("user:42")

    Limiters reach it through ``allow_async``/``peek_async``
    (:meth:`run_kernel_async`). The synchronous entry points (``allow``,
    ``peek``, ``allow_many``, ``reset``, ``state``, ``len()``) raise a
    ``TypeError`` that names the async one to use; batches, resets, reads
    and counts are :meth:`run_kernel_many_async`, :meth:`forget_async`,
    :meth:`snapshot_async` and :meth:`count`. The derived client (short
    timeout, no retries) is bound to the event loop that first uses it:
    build the storage per loop, and ``await storage.close()`` at the end.
    ``keep_connections`` works as in :class:`RedisStorage`.
    """

    _asyncio: ClassVar[bool] = True

    # -- script calls -------------------------------------------------------------
    async def load_scripts(self) -> None:
        """``SCRIPT LOAD`` every script (on every primary of a cluster)."""
        for script in (*SCRIPTS.values(), *BATCH_SCRIPTS.values(), *REFUND_SCRIPTS.values()):
            await self._load(script)

    async def _load(self, script: LuaScript, node: Any = None) -> None:
        if node is not None and self._routes is not None:  # that node alone: another may be down
            self._loaded(script, await self._routes.call_async(node, ("SCRIPT", "LOAD", script.source)))
            return
        self._loaded(script, await self.client.script_load(script.source))

    async def _call(self, *args: Any, node: Any = None) -> Any:
        """One command, one attempt. A timeout, a socket error or a
        cancellation disconnects the connection (redis-py's ``send_command``
        and ``read_response`` do it) before it goes back to the pool, so no
        late reply is ever read by the next caller. On a cluster ``node``
        is the key's node (see ``RedisStorage._call``)."""
        if node is not None and self._routes is not None:
            return await self._routes.call_async(node, args)
        spares = self._spares
        if spares is not None:
            return await spares.call(args)
        pool = self._pool
        if pool is None:
            return await self.client.execute_command(*args)
        try:
            conn = await pool.get_connection(*self._conn_args)
        except self._reply_errors as exc:
            raise _refused_connect(exc, self._connect_error) from exc
        try:
            await conn.send_command(*args)
            return await conn.read_response()
        finally:
            await pool.release(conn)

    async def _evalsha(
        self, script: LuaScript, keys: Sequence[str], args: Sequence[str], node: Any = None
    ) -> Any:
        """One ``EVALSHA``; on ``NOSCRIPT`` load and retry once (safe: the
        script did not run). Never retried otherwise."""
        try:
            return await self._call("EVALSHA", script.sha, len(keys), *keys, *args, node=node)
        except self._errors as exc:
            if not is_noscript(exc):
                raise
            lacking = getattr(exc, "answered_by", node)  # a redirect's target, or the key's node
        await self._load(script, lacking)
        return await self._call("EVALSHA", script.sha, len(keys), *keys, *args, node=node)

    async def _ready(self) -> None:
        """An asyncio cluster learns its slot map before its first decision
        (not while its breaker is open, at most once per ``REFRESH_INTERVAL``:
        ``NodeRoutes.initialize``)."""
        routes = self._routes
        if routes is not None and not routes.ready:
            # no node answered: the decision fails on an uncovered slot, by policy
            with contextlib.suppress(*self._errors):
                await routes.initialize()

    # -- decisions ------------------------------------------------------------------
    async def run_kernel_async(
        self, config: LimiterConfig, key: str, cost: int, now: float | None, commit: bool
    ) -> KernelVerdict:
        """One decision (what ``allow_async``/``peek_async`` await): one
        ``EVALSHA``, two after a ``SCRIPT FLUSH``; a near-cache denial or an
        open breaker answers without a round trip (on a cluster, the breaker
        of the key's node)."""
        if self._routes is None:
            early = self._early(config, key, cost, now, commit)
            if early is not None:
                return early
            keys, args = self._single_args(config, key, cost, now, commit)
            try:
                reply = await self._evalsha(SCRIPTS[config.algorithm], keys, args)
            except self._errors as exc:
                return self._error_verdict(config, exc, key, cost, now, commit)
            return self._answered(config, key, cost, now, reply)
        if not self._routes.ready:
            await self._ready()
        rkey = self.redis_key(config, key)
        breaker, node = self._route(rkey)
        early = self._early(config, key, cost, now, commit, breaker)
        if early is not None:
            return early
        keys, args = self._single_args(config, key, cost, now, commit, rkey)
        try:
            if node is None:
                raise self._routes.uncovered()
            reply = await self._evalsha(SCRIPTS[config.algorithm], keys, args, node)
        except self._errors as exc:
            return self._error_verdict(config, exc, key, cost, now, commit, breaker)
        return self._answered(config, key, cost, now, reply, breaker)

    async def run_kernel_many_async(
        self, config: LimiterConfig, keys: Sequence[str], costs: Sequence[int], now: float | None
    ) -> list[KernelVerdict]:
        """A batch in one round trip, as ``RedisStorage.run_kernel_many``
        (``now``: ``None`` for the server's clock, else the injected reading).
        Called directly (it is the async ``allow_many``), so it checks every
        key, cost and the clock first, as a limiter would, and sends nothing
        if one is bad."""
        costs = check_batch(keys, costs, config.capacity, self.max_key_bytes)  # the converted costs
        if now is not None:
            check_now(now)
        if self._routes is not None and not self._routes.ready:
            await self._ready()
        run = self._batch_start(config, keys, costs, now)
        if isinstance(run, list):
            return run
        if self._routes is not None:
            return await self._run_many_nodes(run)
        try:
            for attempt in range(2):
                pipe = self.client.pipeline(transaction=False)
                run.queue(pipe)
                reload = run.absorb(await pipe.execute(raise_on_error=False), attempt)
                if reload is None:
                    break
                await self._load(reload)
        except self._errors as exc:
            return run.abort(exc)
        return run.result()

    async def _run_many_nodes(self, run: _BatchRun) -> list[KernelVerdict]:
        """``RedisStorage._run_many_nodes``, awaited: one pipeline per node."""
        routes = self._routes
        assert routes is not None
        for breaker, node, calls in run.by_node():
            await self._node_batch(run, breaker, node, calls, False)
        if run.redirects:
            await routes.learn_redirects_async(run.redirects)  # move_slot is a coroutine here
        for breaker, node, asking, calls in run.follow_redirects(routes):
            await self._node_batch(run, breaker, node, calls, asking)
        return run.result()

    async def _node_batch(
        self, run: _BatchRun, breaker: _Breaker, node: Any, calls: list[_Call], asking: bool
    ) -> None:
        """``RedisStorage._node_batch``, awaited."""
        routes = self._routes
        assert routes is not None
        try:
            for attempt in range(2):
                commands = [("EVALSHA", c[0].sha, len(c[1]), *c[1], *c[2]) for c in calls]
                replies = await routes.pipeline_async(node, commands, asking)
                calls = run.absorb_calls(calls, replies, attempt, breaker)
                if not calls:
                    break
                for script in {c[0] for c in calls}:
                    await self._load(script, node)
        except self._errors as exc:
            run.node_failed(breaker, calls, exc)

    async def refund_kernel_async(
        self, config: LimiterConfig, key: str, units: int, at: float | None, now: float | None
    ) -> None:
        """``RedisStorage.refund_kernel``, awaited (what ``refund_async``
        awaits): one ``EVALSHA``, two after a ``SCRIPT FLUSH``."""
        if self._routes is not None and not self._routes.ready:
            await self._ready()
        call = self._refund_start(config, key, units, at, now)
        if call is None:
            return
        script, keys, args, breaker, node = call
        try:
            if self._routes is not None and node is None:
                raise self._routes.uncovered()
            await self._evalsha(script, keys, args, node)
        except self._errors as exc:
            self._refund_failed(config, exc, breaker)
            return
        self._refunded(breaker)

    async def forget_async(self, config: LimiterConfig, key: str) -> None:
        """``DEL`` the key (a reset is an admin action: errors raise)."""
        await self.client.delete(self._forget_local(config, key))

    async def snapshot_async(self, config: LimiterConfig, key: str) -> LimiterState | None:
        """The raw stored state (not brought up to now), or ``None``."""
        raw = await self.client.execute_command(*self._snapshot_command(config, key))
        return self._parse_snapshot(config.algorithm, raw)

    async def keys(self) -> list[str]:
        """Every limiter key under the prefix (``SCAN``; every primary of a
        cluster): a key of another shape there is not the limiter's."""
        out = []
        async for raw in self.client.scan_iter(match=self._scan_match(), count=1000):
            name = self._limiter_key(raw)
            if name is not None:
                out.append(name)
        return out

    async def count(self) -> int:
        """Keys under the prefix, counted with ``SCAN`` (O(keys): not for a hot path)."""
        return len(await self.keys())

    async def clear(self) -> int:
        """Delete every limiter key under the prefix (see :meth:`keys`); returns how many."""
        names = await self.keys()
        for name in names:
            await self.client.delete(name)
        return len(names)

    async def close(self) -> None:
        """Give kept connections back and close the derived client's
        connections (never the caller's client)."""
        if self._spares is not None:
            await self._spares.release_all()
        if self.client is not self.user_client:
            closer = getattr(self.client, "aclose", None) or self.client.close
            await closer()

    # -- the synchronous protocols: present, so limiters accept the storage ----------
    def run_kernel(
        self, config: LimiterConfig, key: str, cost: int, now: float | None, commit: bool
    ) -> KernelVerdict:
        """Refused: a synchronous decision would block the event loop."""
        raise TypeError(_ASYNC_ONLY)

    def run_kernel_many(
        self, config: LimiterConfig, keys: Sequence[str], costs: Sequence[int], now: float | None
    ) -> list[KernelVerdict]:
        """Refused: ``await storage.run_kernel_many_async(limiter.config, keys, costs, None)``."""
        raise TypeError(_ASYNC_ONLY + "; a batch: `await storage.run_kernel_many_async(...)`")

    def run_kernel_all(
        self, items: Sequence[tuple[LimiterConfig, str, int]], now: float | None
    ) -> list[KernelVerdict]:
        """Refused: compound limits are synchronous only (``RedisStorage.allow_all``)."""
        raise TypeError("AsyncRedisStorage has no compound decisions yet; use RedisStorage.allow_all")

    def refund_kernel(
        self, config: LimiterConfig, key: str, units: int, at: float | None, now: float | None
    ) -> None:
        """Refused: ``await limiter.refund_async(key, cost, at=at)``."""
        raise TypeError(_ASYNC_ONLY + "; a refund: `await limiter.refund_async(key, cost, at=at)`")

    def forget(self, config: LimiterConfig, key: str) -> None:
        """Refused: ``await storage.forget_async(limiter.config, key)``."""
        raise TypeError(_ASYNC_ONLY + "; a reset: `await storage.forget_async(limiter.config, key)`")

    def snapshot(self, config: LimiterConfig, key: str, now: float | None) -> LimiterState | None:
        """Refused: ``await storage.snapshot_async(limiter.config, key)``."""
        raise TypeError(_ASYNC_ONLY + "; a state: `await storage.snapshot_async(limiter.config, key)`")

    def __len__(self) -> int:
        """Refused: counting keys is I/O; ``await storage.count()``."""
        raise TypeError("use await storage.count()")

    def __bool__(self) -> bool:
        return True  # ``__len__`` refuses: truthiness must not ask it
