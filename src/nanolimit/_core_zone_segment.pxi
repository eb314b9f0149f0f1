# Included by _core.pyx (one extension module, nanolimit._core): its cimports,
# imports and shared constants are in scope here.
#
# A SharedMemoryStorage's segment (``_core_zone.pxi``): creating it or
# attaching to the one there, waiting on a creator or a retired segment's
# unlinker within bounds, and checking a header against the layout of its
# parameters before any offset in it is followed.

cdef void zone_open(SharedMemoryStorage self, uint32_t stripes, bint reset_stale, bint attach_only) except *:
    """Create the segment, or attach to the one there; a half-made one
    whose creator died, and with ``reset_stale`` one no live process is
    attached to, are removed and made again. ``attach_only``: never
    create (``attach``). Every wait here is bounded: a segment left
    retired (its unlinker killed before it removed the name) has its
    name removed here, and a zone not attached within the bounds is an
    error that says what it waited on."""
    cdef void* base = NULL
    cdef uint64_t mapped = 0, ident = 0, retired_ident = 0
    cdef int err
    cdef ZoneHeader* header
    cdef bytes segment = self.segment_name.encode()
    per_stripe, slots, namespaces, stripes_at, entries_at, index_at, arena_at, total = self.layout(stripes)
    started = time_module.monotonic()
    deadline = started + ZONE_ATTACH_SECONDS
    give_up = started + ZONE_ATTACH_SECONDS + ZONE_SETUP_SECONDS + ZONE_LOCK_SECONDS
    retired_since = 0.0
    waited_on = "the segment"
    while True:
        if time_module.monotonic() > give_up:
            raise ValidationError(
                f"shared-memory zone {self.name!r} ({self.segment_name}): not attached in "
                f"{give_up - started:g} s; it waited on {waited_on}")
        err = errno_module.EEXIST if attach_only else nlz_open(segment, 1, total, nlz_self_token(),
                                                                &base, &mapped, &ident)
        if err == 0:
            self.is_created = True
            self.mapped_bytes = mapped
            self.ident = ident
            self.initialise(<char*>base, stripes, per_stripe, slots, namespaces, stripes_at,
                            entries_at, index_at, arena_at, total)
            return
        if err != errno_module.EEXIST:
            raise _zone_error(err, self.segment_name, total)
        err = nlz_open(segment, 0, 0, 0, &base, &mapped, &ident)
        if err == errno_module.ENOENT and attach_only:
            raise ValidationError(f"there is no shared-memory zone called {self.name!r}")
        if err == errno_module.ENOENT:
            continue                                # unlinked meanwhile: create it
        if err == errno_module.EAGAIN:              # its creator has not sized it yet
            waited_on = "its creator to size the segment"
            if time_module.monotonic() > deadline:
                nlz_unlink_if(segment, ident)       # a creator that died before sizing it
                deadline = time_module.monotonic() + ZONE_ATTACH_SECONDS
            time_module.sleep(0.001)
            continue
        if err != 0:
            raise _zone_error(err, self.segment_name, total)
        header = <ZoneHeader*>base
        if mapped < ZONE_HEADER_BYTES:
            nlz_unmap(base, mapped)
            raise ValidationError(
                f"{self.segment_name} is not a nanolimit shared-memory zone ({mapped} bytes): "
                "left untouched; remove it or choose another name")
        magic = nlz_load_u64_acquire(&header.magic)
        if magic == 0:
            # Being set up: wait for a live creator (reserving a large
            # zone takes a while), start over when it died, or when none
            # wrote its token within the bound (it died just after creating).
            creator = nlz_load_u64_acquire(&header.creator_token)
            nlz_unmap(base, mapped)
            waited_on = f"its creator (pid {creator >> 32}) to set it up"
            if creator != 0 and nlz_token_alive(creator):
                if time_module.monotonic() > deadline + ZONE_SETUP_SECONDS:
                    raise ValidationError(
                        f"shared-memory zone {self.name!r}: its creator (pid {creator >> 32}) has not "
                        f"finished setting it up in {ZONE_SETUP_SECONDS:g} s")
            elif creator != 0 or time_module.monotonic() > deadline:
                nlz_unlink_if(segment, ident)
                deadline = time_module.monotonic() + ZONE_ATTACH_SECONDS
                continue
            time_module.sleep(0.001)
            continue
        if magic == ZONE_RETIRED:
            # Unlinked or reset: its unlinker removes the name next. One
            # killed in between left it here for good: after a grace,
            # the name is removed here, under the retired segment's
            # registry lock, and only while it still names this segment.
            waited_on = "a retired segment's name to be removed"
            if ident != retired_ident:
                retired_ident = ident
                retired_since = time_module.monotonic()
            try:
                if time_module.monotonic() - retired_since >= ZONE_RETIRED_GRACE:
                    zone_remove_retired(self, header, ident)
            finally:
                nlz_unmap(base, mapped)
            time_module.sleep(0.001)
            continue
        if magic != ZONE_MAGIC:
            nlz_unmap(base, mapped)
            raise ValidationError(
                f"{self.segment_name} is not a nanolimit shared-memory zone (magic {magic:#x}): "
                "left untouched; remove it or choose another name")
        self.mapped_bytes = mapped
        self.ident = ident
        self.bind(<char*>base)
        problem = zone_mismatch(self, stripes)
        if problem:
            self.z.base = NULL
            nlz_unmap(base, mapped)
            raise ValidationError(f"shared-memory zone {self.name!r} exists with other parameters: "
                                  f"{problem}; use its parameters, or unlink it first")
        problem = zone_corruption(self, per_stripe, slots, namespaces, stripes_at, entries_at, index_at,
                                  arena_at, total)
        if problem:
            self.z.base = NULL
            nlz_unmap(base, mapped)
            raise ValidationError(
                f"shared-memory zone {self.name!r} ({self.segment_name}) is corrupt: {problem}; left "
                f"untouched: remove it (SharedMemoryStorage.unlink_segment({self.name!r}), or "
                f"nanolimit zone {self.name} --unlink) and the next process makes it afresh")
        try:
            joined = self.join(reset_stale)
        except BaseException:
            self.z.base = NULL
            nlz_unmap(base, mapped)
            raise
        if joined:
            return
        # a stale zone, reset (retired and unlinked by join), or one
        # retired while we waited: make it again, or attach to the new one
        waited_on = "a zone retired while this process attached to it"
        self.z.base = NULL
        nlz_unmap(base, mapped)


cdef void zone_remove_retired(SharedMemoryStorage self, ZoneHeader* h, uint64_t ident) except *:
    """Remove the name of a retired segment whose unlinker did not (it
    was killed between the two steps): under the segment's registry
    lock, which every remover of a name it did not make holds (so two
    cannot race), and only while the name still names this segment (a
    newer zone made under it is left alone)."""
    cdef int got
    with nogil:
        got = nlz_lock_timed(&h.registry_lock, ZONE_LOCK_SECONDS)
    if got < 0:
        raise ValidationError(
            f"shared-memory zone {self.name!r} ({self.segment_name}) was retired (unlinked or reset) and "
            f"its name is still there: waited {ZONE_LOCK_SECONDS:g} s on its registry lock, held by pid "
            f"{nlz_lock_owner(&h.registry_lock) >> 32}, which is alive (stopped?); remove the name with "
            f"SharedMemoryStorage.unlink_segment({self.name!r}) once that process is gone")
    if got == 1:
        h.lock_recoveries += 1
    nlz_unlink_if(self.segment_name.encode(), ident)
    nlz_unlock(&h.registry_lock)


cdef str zone_mismatch(SharedMemoryStorage self, uint32_t stripes):
    """What differs between the zone there and what this process asks for."""
    cdef ZoneHeader* h = self.z.header
    problems = []
    if h.layout_version != ZONE_LAYOUT_VERSION:
        problems.append(f"layout version {h.layout_version} (this nanolimit writes {ZONE_LAYOUT_VERSION})")
    else:
        there = PyUnicode_DecodeUTF8(h.name, min(h.name_len, <uint32_t>ZONE_NAME_BYTES), NULL)
        if there != self.name:
            problems.append(f"its name is {there!r}")
        if h.max_keys != self.max_keys:
            problems.append(f"max_keys={h.max_keys} (asked {self.max_keys})")
        if h.stripes != stripes:
            problems.append(f"stripes={h.stripes} (asked {stripes})")
        policy = "evict" if h.on_full == ON_FULL_EVICT else "deny_new"
        if policy != self.on_full:
            problems.append(f"on_full={policy!r} (asked {self.on_full!r})")
        idle = None if h.idle_after == 0.0 else h.idle_after
        if idle != self.evict_idle_after:
            problems.append(f"evict_idle_after={idle!r} (asked {self.evict_idle_after!r})")
        if h.max_key_bytes != self.max_key_bytes:
            problems.append(f"max_key_bytes={h.max_key_bytes} (asked {self.max_key_bytes})")
        if h.arena_bytes != self.arena_bytes:
            problems.append(f"arena_bytes={h.arena_bytes} (asked {self.arena_bytes})")
        if h.pid_namespace != nlz_pid_namespace():
            problems.append(
                f"it was created in another PID namespace (pid:[{h.pid_namespace}], this process is in "
                f"pid:[{nlz_pid_namespace()}]): its locks name pids this process cannot see, so a dead "
                "holder could not be told from a live one; share the PID namespace between the "
                "containers (shareProcessNamespace, --pid=container:...) or use RedisStorage")
    return "; ".join(problems)


cdef str zone_corruption(SharedMemoryStorage self, uint64_t per_stripe, uint64_t slots, uint64_t namespaces,
                         uint64_t stripes_at, uint64_t entries_at, uint64_t index_at, uint64_t arena_at,
                         uint64_t total):
    """What the header (and the arena's header) says that the layout of
    its parameters does not: every offset, size and count a process
    follows is checked here, before any is followed (its parameters are
    the ones asked for: ``zone_mismatch`` found none that differ)."""
    cdef ZoneHeader* h = self.z.header
    cdef ZoneArena* a
    problems = []
    for field, there, laid_out in (
            ("header_bytes", h.header_bytes, ZONE_HEADER_BYTES),
            ("total_bytes", h.total_bytes, total),
            ("stripe_entries", h.stripe_entries, per_stripe),
            ("index_slots", h.index_slots, slots),
            ("namespaces_offset", h.namespaces_offset, namespaces),
            ("stripes_offset", h.stripes_offset, stripes_at),
            ("entries_offset", h.entries_offset, entries_at),
            ("index_offset", h.index_offset, index_at),
            ("arena_offset", h.arena_offset, arena_at)):
        if there != laid_out:
            problems.append(f"its header says {field}={there}, the layout has {laid_out}")
    if self.mapped_bytes < total:
        problems.append(f"its segment is {self.mapped_bytes} bytes, the layout {total}")
    if h.name_len > ZONE_NAME_BYTES:
        problems.append(f"its header says name_len={h.name_len} (at most {ZONE_NAME_BYTES})")
    if problems:
        return "; ".join(problems)
    a = self.z.arena
    if a.end != total:
        problems.append(f"its arena ends at {a.end}, the segment at {total}")
    if not (arena_at + ARENA_HEADER_BYTES <= a.top <= total) or a.top % 64 != 0:
        problems.append(f"its arena's next block is at {a.top}, outside the arena "
                        f"[{arena_at + ARENA_HEADER_BYTES}, {total}]")
    return "; ".join(problems)
