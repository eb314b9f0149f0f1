# Included by _core.pyx (one extension module, nanolimit._core): its cimports,
# imports and shared constants are in scope here.
#
# Validation helpers: a key's UTF-8 bytes, a cost and a clock reading,
# checked in C on the hot path; every error defers to ``_validation``'s message.

cdef inline const char* key_bytes(object key, Py_ssize_t max_bytes, Py_ssize_t* size) except NULL:
    """UTF-8 bytes of a valid key, borrowed from the str (cached there by
    CPython). Only the compact-ASCII case is inline: it is every hot call,
    and the rest (with its exception handling) would keep the compiler from
    inlining this into the callers."""
    if type(key) is str and PyUnicode_IS_COMPACT_ASCII(key):
        # ASCII str: its characters are its UTF-8 bytes, no call needed.
        size[0] = PyUnicode_GET_LENGTH(key)
        if 0 < size[0] <= max_bytes:
            return <const char*>PyUnicode_DATA(key)
    return key_bytes_general(key, max_bytes, size)


cdef const char* key_bytes_general(object key, Py_ssize_t max_bytes, Py_ssize_t* size) except NULL:
    """``key_bytes`` for every other key; the error path defers to the shared
    ``check_key`` message."""
    cdef const char* data = NULL
    if isinstance(key, str):
        try:
            data = PyUnicode_AsUTF8AndSize(key, size)
        except UnicodeEncodeError:
            data = NULL
        if data != NULL and 0 < size[0] <= max_bytes:
            return data
    check_key(key, max_bytes)
    raise ValidationError(f"invalid key {key!r}")


cdef object ONE = 1                   # CPython caches small ints: the default cost is this object


cdef inline int64_t cost_value(object cost, int64_t capacity) except -1:
    if cost is ONE:                     # the default: no conversion call (capacity >= 1 always)
        return 1
    return cost_value_general(cost, capacity)


cdef int64_t cost_value_general(object cost, int64_t capacity) except -1:
    cdef int overflow = 0
    cdef long long value
    if type(cost) is int:
        value = PyLong_AsLongLongAndOverflow(cost, &overflow)
        if overflow == 0 and 1 <= value <= capacity:
            return value
    return <int64_t>check_cost(cost, capacity)   # converted once, by operator.index


cdef inline double clock_value(object value) except? -1.0:
    cdef double t
    if type(value) is float:
        t = value
        if isfinite(t) and -MAX_TIME_C < t < MAX_TIME_C:
            return t
    return check_now(value)
