# cython: language_level=3, freethreading_compatible=True, binding=False, embedsignature=True, embedsignature.format=clinic
# cython: cdivision=True, initializedcheck=False
# boundscheck and wraparound come from setup.py: off, but on in the debug build.
# binding=False: methods are builtin methods, which CPython calls directly;
# a cyfunction costs ~100 more instructions a call (-13 % per decision).
# The clinic-format signature keeps inspect.signature() working.
"""The native twin: Decision, the striped in-memory table and the six limiters.

Twin of ``nanolimit.reference``; the kernels are in ``_kernels.pxd`` and the
table in ``_table.pxd``. Hot paths hold the GIL (a decision is cheaper than
releasing it) but only one stripe lock; ``allow_many`` releases the GIL for
the whole batch. No Python object is touched while a stripe lock is held.

One extension module, split by layer into include files (textual includes:
one module, so calls across layers stay direct C calls and inline):

    _core_validation.pxi   key, cost and clock checks on the hot path
    _core_decision.pxi     Decision and its pool
    _core_table.pxi        table operations over one stripe (nogil)
    _core_storage.pxi      InMemoryStorage
    _core_zone_table.pxi   the zone's table operations (nogil, _zone.pxd)
    _core_zone.pxi         SharedMemoryStorage (the table in shared memory)
    _core_zone_segment.pxi its segment: create or attach, check the header
    _core_gateway.pxi      EventCounter, AdmittedRequests
    _core_leases.pxi       LeaseGate, LeaseBook (two-tier leases)
    _core_limiters.pxi     _Limiter and the six limiters
"""

cimport cython
from cpython.array cimport array, clone
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_GetItemWithError, PyDict_SetItem
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.object cimport PyTypeObject
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_DecodeUTF8
from libc.math cimport INFINITY, ceil, fabs, floor, isfinite
from libc.stdint cimport INT64_MIN, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.stdio cimport snprintf
from libc.string cimport memcmp, memcpy, memmove, memset

from nanolimit._kernels cimport (
    add_clock_lead, clock_rebase, init_state, log_at, log_drop_oldest, log_expire, log_free, log_reserve,
    log_ring_size, log_run_of, refund_kernel, run_kernel,
)
from nanolimit._zone cimport *  # the zone layout and its nogil table (_core_zone_table.pxi)
from nanolimit._evict cimport (
    TableRoom, ZoneRoom, evict_could_make_room, evict_make_room, evict_room_for_new_key, table_room, zone_room,
)
from nanolimit._table cimport (
    NAMESPACE_CHUNK, NS_ALGORITHM_MASK, Bounds, CompoundKeys, ObjectList, Stripe, entry_hash, entry_key, prefetch_entry,
    prefetch_slot, stripe_clear, stripe_delete, stripe_evict, stripe_find, stripe_reclaim,
    BatchReaders, IndexHeader, batch_join, batch_leave,
    stripe_insert, MAX_STRIPE_ENTRIES,
)
from nanolimit._types cimport (
    ALG_APPLY, ALG_FIXED_WINDOW, ALG_GCRA, ALG_LEAKY_BUCKET, ALG_SLIDING_COUNTER,
    ALG_SLIDING_LOG, ALG_TOKEN_BUCKET, NL_CORRUPT, NL_NOMEM, NL_OK, NL_REENTRANT,
    NL_TABLE_FULL, Entry, LogState, Params, Verdict, nl_hash_seeded, nl_lock_spin, nl_mum,
    BatchBlock, batch_alloc, batch_begin, batch_take,
    nl_namespace_seed, nl_set_secrets, nl_add_u64_relaxed, nl_load_u64_relaxed,
    nl_cas_u64, nl_floor_i64, nl_load_pointer_relaxed, nl_load_u64_seq,
    nl_trylock, nl_unlock, nl_wall_now, nl_prefetch,
)

import errno as errno_module
import os
import threading
import time as time_module
import weakref

from nanolimit import reference as _reference
from nanolimit._clocks import MAX_CLOCK_LEAD, MAX_TIME, SystemClock, check_now
from nanolimit._decision_py import BatchResult, CompoundDecision, render_headers
from nanolimit._limiter_config import Algorithm, LimiterConfig, LimiterState, storage_key
from nanolimit._protocols import KernelStorage, Storage, check_at, decide_async, refund_async
from nanolimit._validation import (
    DUPLICATE_COMPOUND,
    MAX_KEY_BYTES,
    batch_keys,
    check_cost,
    check_cutoff,
    check_key,
    check_storage_options,
    compound_items,
)
from nanolimit.errors import StorageFullError, ValidationError

cdef extern from "Python.h":
    bint PyUnicode_IS_COMPACT_ASCII(object o)
    void* PyUnicode_DATA(object o)
    Py_ssize_t PyUnicode_GET_LENGTH(object o)

IMPLEMENTATION = "native"

# Per-process hash secrets: keys chosen offline cannot collide on purpose.
_seed = os.urandom(24)
nl_set_secrets(int.from_bytes(_seed[:8], "little"), int.from_bytes(_seed[8:16], "little"),
               int.from_bytes(_seed[16:], "little"))
del _seed

cdef double MAX_TIME_C = MAX_TIME
cdef double MAX_CLOCK_LEAD_C = MAX_CLOCK_LEAD
cdef double MAX_HEADER_SECONDS = 4.611686018427388e18    # 2**62: ceil() of it fits int64
cdef str REASON_NONE = ""
cdef str REASON_STORAGE_FULL = "storage_full"

cdef dict ALGORITHM_IDS = {
    Algorithm.TOKEN_BUCKET: ALG_TOKEN_BUCKET,
    Algorithm.LEAKY_BUCKET: ALG_LEAKY_BUCKET,
    Algorithm.FIXED_WINDOW: ALG_FIXED_WINDOW,
    Algorithm.SLIDING_LOG: ALG_SLIDING_LOG,
    Algorithm.SLIDING_COUNTER: ALG_SLIDING_COUNTER,
    Algorithm.GCRA: ALG_GCRA,
}

cdef array _U8 = array("B")
cdef array _I64 = array("q")
cdef array _F64 = array("d")


cdef void raise_status(int status) except *:
    if status == NL_NOMEM:
        raise MemoryError("nanolimit: out of memory for rate-limit state")
    if status == NL_TABLE_FULL:
        raise MemoryError("nanolimit: a table stripe is full (16,777,214 keys)")
    if status == NL_REENTRANT:
        raise RuntimeError(
            "InMemoryStorage.apply() called from inside a mutate function of the same "
            "storage; a mutate function must not call apply() of its storage"
        )
    if status == NL_CORRUPT:
        raise RuntimeError("nanolimit: a shared-memory zone's stripe was corrupt; it was repaired")
    raise RuntimeError(f"nanolimit: internal status {status}")


# ============================================================== validation
include "_core_validation.pxi"


# ============================================================== Decision
include "_core_decision.pxi"


# ============================================================== table ops
include "_core_table.pxi"


# ============================================================== storage
include "_core_storage.pxi"


# ============================================================== shared-memory zone
include "_core_zone_table.pxi"
include "_core_zone.pxi"
include "_core_zone_segment.pxi"


# ============================================================== gateway
include "_core_gateway.pxi"


# ============================================================== two-tier leases
include "_core_leases.pxi"


# ============================================================== limiters
include "_core_limiters.pxi"
