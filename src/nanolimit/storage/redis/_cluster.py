"""A cluster's decisions, node by node: which node owns a key, that node's
circuit breaker, one call sent straight to its connection, and the topology
refresh, kept off the decision path.

Why not the cluster client's ``execute_command``: on a connection error
redis-py's ``RedisCluster`` re-initialises its node map inside the call, and
on ``CLUSTERDOWN`` it sleeps 0.25 s first (valkey-py alike), so a decision's
``timeout`` did not bound it: probes that met ``CLUSTERDOWN`` took 258-299 ms
with a 50 ms timeout, and every decision for a dead master's key paid a
refused connection plus a refresh (p50 4-13 ms). Here the script goes to the
owning node's own connection (one attempt, the derived socket timeout), a
failure feeds that node's breaker alone, and the node map is refreshed in the
background, at most once per ``REFRESH_INTERVAL`` (docs/redis.md, "Cluster
failures").

What is kept from the client: its slot map (``nodes_manager.slots_cache``),
its nodes and their connection pools. ``MOVED`` updates the map the way the
client would (``move_slot``, else a refresh) and the call is sent once more
to the new owner (the script did not run: nothing is charged twice); ``ASK``
is sent once to the importing node after ``ASKING``, on the same connection.
An error reply from the node a redirect named carries it as ``answered_by``:
a ``NOSCRIPT`` there (an importing node that never ran the script) is loaded
on that node, not on the key's old owner.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

from ._connections import client_package, connection_args
from ._resilience import _Breaker

log = logging.getLogger("nanolimit.storage.redis")

#: The breaker of keys whose slot no node owns in the client's map.
UNCOVERED = "(uncovered)"
SLOTS = 16384  # a cluster's hash slots


class NodeRoutes:
    """The nodes of one cluster client, each with its own breaker."""

    REFRESH_INTERVAL: ClassVar[float] = 1.0

    def __init__(self, client: Any, threshold: int, cooldown: float, asyncio_client: bool) -> None:
        self.client = client
        self.threshold = threshold
        self.cooldown = cooldown
        self.asyncio = asyncio_client
        pkg = client_package(client)
        self._slot = pkg.crc.key_slot
        self._exceptions = pkg.exceptions
        self._breakers: dict[str, _Breaker] = {}
        self._lock = threading.Lock()
        self._last_refresh = -1e18
        self._refreshing = False
        self._task: Any = None  # the asyncio refresh in flight (a reference keeps it alive)
        self._init_task: asyncio.Task[Any] | None = None  # an asyncio first slot map in flight
        self._last_init = -1e18
        self.refreshes = 0
        # a synchronous client's node -> its own client (redis-py: ``redis_connection``)
        self._node_client: Any = getattr(client, "get_redis_connection", None) or getattr(
            client, "get_valkey_connection", None
        )
        self._conn_args: tuple[str, ...] | None = None  # what a pool's get_connection wants
        # told the name of a node that left the map (its outage is over: the
        # slots have a new owner), after a refresh; the storage ends its local episode
        self.on_gone: Callable[[str], None] | None = None
        self.pruned = 0

    # -- routing -----------------------------------------------------------------
    def breaker(self, name: str) -> _Breaker:
        found = self._breakers.get(name)
        if found is None:
            with self._lock:
                found = self._breakers.get(name)
                if found is None:
                    found = self._breakers[name] = _Breaker(self.threshold, self.cooldown, name)
        return found

    @property
    def ready(self) -> bool:
        """Whether the client has a slot map (an asyncio cluster not used
        yet has none: ``await initialize()`` first)."""
        return bool(self.client.nodes_manager.slots_cache)

    def route(self, rkey: str) -> tuple[_Breaker, Any]:
        """The breaker and the node (None: no node owns the slot) of ``rkey``."""
        owners = self.client.nodes_manager.slots_cache.get(self._slot(rkey.encode("utf-8")))
        if not owners:
            return self.breaker(UNCOVERED), None
        node = owners[0]
        return self.breaker(node.name), node

    def breakers(self) -> list[_Breaker]:
        with self._lock:
            return list(self._breakers.values())

    def uncovered(self) -> BaseException:
        """What a decision on a slot that no node owns fails with."""
        error = getattr(self._exceptions, "SlotNotCoveredError", None) or self._exceptions.ClusterDownError
        return error("no node of the cluster's map owns this key's slot")  # type: ignore[no-any-return]

    def _moved(self, exc: BaseException) -> bool:
        return isinstance(exc, getattr(self._exceptions, "MovedError", ()))

    def _asked(self, exc: BaseException) -> bool:
        return isinstance(exc, getattr(self._exceptions, "AskError", ())) and not self._moved(exc)

    def _target(self, exc: Any) -> Any:
        """The node a redirect names, if the client knows it."""
        return self.client.get_node(host=exc.host, port=exc.port)

    # -- synchronous calls ---------------------------------------------------------
    def call(self, node: Any, args: tuple[Any, ...]) -> Any:
        """One command on ``node``'s own connection, one attempt (a
        redirect is followed once: the script did not run)."""
        try:
            return self._send(node, args, False)
        except self._exceptions.ResponseError as exc:
            if not (self._moved(exc) or self._asked(exc)):
                raise
            target = self._redirected(exc)
            if target is None:
                raise
            try:
                return self._send(target, args, self._asked(exc))
            except self._exceptions.ResponseError as answer:
                answer.answered_by = target  # a NOSCRIPT: load it there
                raise

    def _redirected(self, exc: Any) -> Any:
        """Learn a redirect: a ``MOVED`` updates the slot map (as the client
        would), and a refresh is asked for; the node to send to once more."""
        if self._moved(exc):
            mover = getattr(self.client.nodes_manager, "move_slot", None)
            if callable(mover) and not inspect.iscoroutinefunction(mover):
                try:
                    mover(exc)
                except Exception:
                    log.debug("nanolimit: move_slot failed", exc_info=True)
            self.refresh_soon()
        return self._target(exc)

    def _send(self, node: Any, args: tuple[Any, ...], asking: bool) -> Any:
        client = getattr(node, "redis_connection", None) or getattr(node, "valkey_connection", None)
        if client is None:
            client = self._node_client(node)
        pool = client.connection_pool
        conn_args = self._conn_args
        if conn_args is None:
            conn_args = self._conn_args = connection_args(pool) or ()
        conn = pool.get_connection(*conn_args)
        try:
            if asking:
                conn.send_command("ASKING")
                conn.read_response()
            conn.send_command(*args)
            return conn.read_response()  # a socket error disconnects the connection itself
        finally:
            pool.release(conn)

    def pipeline(self, node: Any, commands: list[tuple[Any, ...]], asking: bool = False) -> list[Any]:
        """Commands on ``node``'s own connection, one round trip; each reply
        or error reply in order (the round trip's own failure raises).
        ``asking``: each command after an ``ASKING`` (an ``ASK`` redirect)."""
        client = getattr(node, "redis_connection", None) or getattr(node, "valkey_connection", None)
        if client is None:
            client = self._node_client(node)
        pipe = client.pipeline(transaction=False)
        for command in commands:
            if asking:
                pipe.execute_command("ASKING")
            pipe.execute_command(*command)
        replies = pipe.execute(raise_on_error=False)
        return list(replies[1::2] if asking else replies)

    def redirect_groups(
        self, redirects: list[tuple[Any, BaseException]]
    ) -> tuple[list[tuple[_Breaker, Any, bool, list[Any]]], list[tuple[Any, BaseException]]]:
        """A batch's redirected calls by the node to send them to: (its
        breaker, the node, whether ``ASKING``, the calls); and the calls
        whose redirect names a node the client does not know. A ``MOVED``
        is learnt as :meth:`call` learns it."""
        groups: dict[tuple[str, bool], tuple[_Breaker, Any, bool, list[Any]]] = {}
        lost = []
        for call, exc in redirects:
            target = self._redirected(exc)
            if target is None:
                lost.append((call, exc))
                continue
            asking = self._asked(exc)
            group = groups.get((target.name, asking))
            if group is None:
                group = groups[(target.name, asking)] = (self.breaker(target.name), target, asking, [])
            group[3].append(call)
        return list(groups.values()), lost

    # -- asyncio calls ---------------------------------------------------------------
    async def initialize(self) -> None:
        """An asyncio cluster's first slot map, before its first decision.
        Not while the breaker of unmapped keys is open, and tried at most
        once per ``REFRESH_INTERVAL``: each try connects to every startup
        node, so a cluster that did not answer cost every decision 155-311
        ms with a 50 ms timeout, breaker open or not. Meanwhile a decision
        fails on the uncovered slot, by policy. Decisions that come while a
        try is in flight await that one."""
        loop = asyncio.get_running_loop()
        task = self._init_task
        if task is None or task.get_loop() is not loop:
            unmapped = self._breakers.get(UNCOVERED)  # not made here: a healthy start has none
            if unmapped is not None and unmapped.state == "open":
                return
            now = time.monotonic()
            if now - self._last_init < self.REFRESH_INTERVAL:
                return
            self._last_init = now
            task = self._init_task = loop.create_task(self._first_map())
            task.add_done_callback(self._initialized)
        await asyncio.shield(task)  # a cancelled decision leaves the try to the others

    async def _first_map(self) -> None:
        await self.client.initialize()
        self._prune()  # the unmapped keys' outage, if any, is over

    def _initialized(self, task: asyncio.Task[Any]) -> None:
        if self._init_task is task:
            self._init_task = None
        if not task.cancelled():
            task.exception()  # retrieved: its awaiters (if any) see it too

    async def call_async(self, node: Any, args: tuple[Any, ...]) -> Any:
        """:meth:`call` on an asyncio cluster node (its own connections)."""
        try:
            return await node.execute_command(*args)
        except self._exceptions.ResponseError as exc:
            if not (self._moved(exc) or self._asked(exc)):
                raise
            await self._learn_async(exc)
            target = self._target(exc)
            if target is None:
                raise
            try:
                if not self._asked(exc):
                    return await target.execute_command(*args)
                replies = await self.pipeline_async(target, [("ASKING",), args])
            except self._exceptions.ResponseError as answer:
                answer.answered_by = target  # a NOSCRIPT: load it there
                raise
            if isinstance(replies[1], BaseException):
                replies[1].answered_by = target  # type: ignore[attr-defined]
                raise replies[1] from None
            return replies[1]

    async def _learn_async(self, exc: Any) -> None:
        """Learn a ``MOVED`` on an asyncio client, whose ``move_slot`` is a
        coroutine (:meth:`_redirected` cannot await it): a node the map did
        not know yet, a newly added master, is known after it."""
        if not self._moved(exc):
            return
        mover = getattr(self.client.nodes_manager, "move_slot", None)
        if callable(mover) and inspect.iscoroutinefunction(mover):
            try:
                await mover(exc)
            except Exception:
                log.debug("nanolimit: move_slot failed", exc_info=True)
        self.refresh_soon()

    async def learn_redirects_async(self, redirects: list[tuple[Any, BaseException]]) -> None:
        """An asyncio batch's ``MOVED`` replies learnt (each slot once) before
        :meth:`redirect_groups`: else a call moved to a node the map did not
        know yet was lost, answered by policy although its new node is up."""
        seen = set()
        for _, exc in redirects:
            slot = getattr(exc, "slot_id", None)
            if slot in seen:
                continue
            seen.add(slot)
            await self._learn_async(exc)

    async def pipeline_async(
        self, node: Any, commands: list[tuple[Any, ...]], asking: bool = False
    ) -> list[Any]:
        """:meth:`pipeline` on an asyncio cluster node. The node stores a
        failed read as each command's result: the first such connection or
        timeout error is raised, so a failed round trip is one failure of
        the node's breaker (as on a synchronous client), not one per command."""
        command_type = inspect.getmodule(type(self.client))
        if asking:
            commands = [c for command in commands for c in (("ASKING",), command)]
        made = [command_type.PipelineCommand(i, *c) for i, c in enumerate(commands)]  # type: ignore[union-attr]
        await node.execute_pipeline(made)
        replies = [c.result for c in made]
        lost = (self._exceptions.ConnectionError, self._exceptions.TimeoutError, OSError)
        for reply in replies:
            if isinstance(reply, lost):
                raise reply
        return replies[1::2] if asking else replies

    # -- the topology, off the decision path -----------------------------------------
    def refresh_soon(self) -> None:
        """Ask for a fresh node map: in the background (a thread, or a task
        on the running loop), at most once per ``REFRESH_INTERVAL``, never
        two at once. A decision never waits for it."""
        now = time.monotonic()
        if self._refreshing or now - self._last_refresh < self.REFRESH_INTERVAL:
            return
        with self._lock:
            if self._refreshing or now - self._last_refresh < self.REFRESH_INTERVAL:
                return
            self._refreshing = True
            self._last_refresh = now
        if self.asyncio:
            try:
                self._task = asyncio.get_running_loop().create_task(self._refresh_async())
            except RuntimeError:  # no running loop: nothing to refresh on
                self._refreshing = False
            return
        threading.Thread(target=self._refresh, name="nanolimit-cluster-refresh", daemon=True).start()

    def _refresh(self) -> None:
        try:
            self.client.nodes_manager.initialize()
            self.refreshes += 1
            self._prune()
        except Exception:
            log.debug("nanolimit: cluster topology refresh failed", exc_info=True)
        finally:
            self._last_refresh = time.monotonic()
            self._refreshing = False

    async def _refresh_async(self) -> None:
        try:
            await self.client.nodes_manager.initialize()
            self.refreshes += 1
            self._prune()
        except Exception:
            log.debug("nanolimit: cluster topology refresh failed", exc_info=True)
        finally:
            self._last_refresh = time.monotonic()
            self._refreshing = False
            self._task = None

    def _prune(self) -> None:
        """Forget the breakers of nodes that own no slot in the new map (a
        replica took over a dead master's slots, or a node was removed):
        their keys have a new owner and breaker, and ``metrics()`` must not
        report an outage that no key meets any more. So with ``(uncovered)``
        once every slot has an owner: no key is routed to it any more, and
        its breaker and local episode had stayed for good."""
        owned = [nodes[0].name for nodes in list(self.client.nodes_manager.slots_cache.values()) if nodes]
        owners = set(owned)
        if not owners:
            return
        covered = len(owned) == SLOTS
        with self._lock:
            gone = [name for name in self._breakers if name not in owners and (name != UNCOVERED or covered)]
            for name in gone:
                # retired before the storage hands the episode over: a decision
                # that took this route before the new map must see it
                self._breakers.pop(name).retired = True
        for name in gone:
            self.pruned += 1
            if name == UNCOVERED:
                log.info("nanolimit: every cluster slot has an owner again; the %s breaker is dropped", name)
            else:
                log.info("nanolimit: cluster node %s owns no slot any more; its breaker is dropped", name)
            if self.on_gone is not None:
                self.on_gone(name)

    # -- metrics ------------------------------------------------------------------------
    def metrics(self) -> dict[str, dict[str, Any]]:
        """Each node's breaker: ``{"host:port": {"breaker_state",
        "breaker_opened", "recovering"}}``."""
        return {
            b.name: {"breaker_state": b.state, "breaker_opened": b.opened, "recovering": b.recovering}
            for b in self.breakers()
        }
