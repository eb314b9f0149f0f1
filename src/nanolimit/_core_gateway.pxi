# Included by _core.pyx (one extension module, nanolimit._core): its cimports,
# imports and shared constants are in scope here.
#
# The gateway's hot-path counters: lock-free atomic counts, and one
# rule's admitted requests counted and given their headers in one C call.

from cpython.dict cimport PyDict_Copy
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE

import json as json_module

cdef str H_LIMIT = "X-RateLimit-Limit"
cdef str H_REMAINING = "X-RateLimit-Remaining"
cdef str H_RESET = "X-RateLimit-Reset"
cdef str H_POLICY = "RateLimit-Policy"
cdef str H_RATELIMIT = "RateLimit"
cdef str H_RETRY = "Retry-After"
# the same names as ASGI writes them: lower case, bytes
cdef bytes B_REMAINING = b"x-ratelimit-remaining"
cdef bytes B_RESET = b"x-ratelimit-reset"
cdef bytes B_RATELIMIT = b"ratelimit"
cdef bytes B_RETRY = b"retry-after"


cdef extern from *:
    """
    /* A tuple subtype's instance of n items, as tuple.__new__ allocates one
       (the items are set by the caller before anything else runs). */
    static PyObject* nl_tuple_alloc(PyTypeObject* t, Py_ssize_t n) { return t->tp_alloc(t, n); }
    """
    PyObject* nl_tuple_alloc(PyTypeObject* t, Py_ssize_t n) except NULL
    object PyUnicode_New(Py_ssize_t size, Py_UCS4 maxchar)
    void PyTuple_SET_ITEM_PTR "PyTuple_SET_ITEM"(PyObject* p, Py_ssize_t pos, PyObject* o)


cdef extern from *:
    """
    static const char NL_DIGIT_PAIRS[] =
        "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
        "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
        "8081828384858687888990919293949596979899";

    /* value in decimal at out (room for 20 bytes); returns the length.
       Two digits a step: snprintf costs ~900 instructions a number, this ~40. */
    static inline Py_ssize_t nl_put_i64(char* out, int64_t value) {
        char tmp[20];
        int n = 20;
        Py_ssize_t sign = 0;
        uint64_t u = (uint64_t)value;
        unsigned r;
        if (value < 0) {
            u = (uint64_t)0 - u;
            out[0] = '-';
            sign = 1;
        }
        while (u >= 100) {
            r = (unsigned)(u % 100);
            u /= 100;
            n -= 2;
            memcpy(tmp + n, NL_DIGIT_PAIRS + 2 * r, 2);
        }
        if (u >= 10) {
            n -= 2;
            memcpy(tmp + n, NL_DIGIT_PAIRS + 2 * u, 2);
        } else {
            tmp[--n] = (char)('0' + u);
        }
        memcpy(out + sign, tmp + n, (size_t)(20 - n));
        return sign + 20 - n;
    }
    """
    Py_ssize_t put_i64 "nl_put_i64"(char* out, int64_t value) noexcept nogil


cdef inline object ascii_text(const char* data, Py_ssize_t n, bint as_bytes):
    """ASCII ``data`` as bytes (ASGI) or as a str (every other front end)."""
    if as_bytes:
        return PyBytes_FromStringAndSize(data, n)
    text = PyUnicode_New(n, 127)
    memcpy(PyUnicode_DATA(text), data, n)
    return text


# The five rate-limit headers' values (docs/spec.md §2), formatted in this
# one place for every container the native twin writes them into: ASGI's
# bytes pairs and WSGI's str pairs (lane_pairs), a str dict (lane_dict) and
# a caller's header mapping (AdmittedRequests.record and refusal). The
# Python twin's one place is nanolimit._decision_py.five_headers.
ctypedef struct HeaderValues:
    char remaining[24]              # X-RateLimit-Remaining: the count left
    char reset_at[24]               # X-RateLimit-Reset: ceil(wall_now + reset)
    char rate[48]                   # RateLimit after the rule's prefix: "<left>;t=<ceil(reset)>"
    char retry[24]                  # Retry-After, when asked (n_retry 0: none)
    Py_ssize_t n_remaining
    Py_ssize_t n_reset
    Py_ssize_t n_rate
    Py_ssize_t n_retry


cdef inline void header_values(HeaderValues* v, int64_t left, double reset, double wall_now,
                               int64_t retry) noexcept nogil:
    """Checked inputs (check_header_times / retry_value): ``retry`` >= 1
    adds ``Retry-After``."""
    cdef Py_ssize_t n
    v.n_remaining = put_i64(v.remaining, left)
    v.n_reset = put_i64(v.reset_at, <int64_t>ceil(wall_now + reset))
    memcpy(v.rate, v.remaining, v.n_remaining)
    n = v.n_remaining
    v.rate[n] = 59      # ';'
    v.rate[n + 1] = 116 # 't'
    v.rate[n + 2] = 61  # '='
    n += 3
    v.n_rate = n + put_i64(v.rate + n, <int64_t>ceil(reset))
    v.n_retry = put_i64(v.retry, retry) if retry >= 1 else 0


cdef inline object prefixed_rate(bytes prefix, const HeaderValues* v, bint as_bytes):
    """``RateLimit``: a lane's prefix (``"name";r=``, ASCII, at most 256
    bytes) and the values' tail, as one bytes or str."""
    cdef char buf[320]
    cdef Py_ssize_t plen = PyBytes_GET_SIZE(prefix)
    memcpy(buf, PyBytes_AS_STRING(prefix), plen)
    memcpy(buf + plen, v.rate, v.n_rate)
    return ascii_text(buf, plen + v.n_rate, as_bytes)


cdef inline int check_header_times(double wall_now, double reset) except -1:
    # Every rule inside the documented ranges stays below 2**62 s
    # (capacity * window / limit <= (2**32 - 1) * 1e9), so this refuses
    # only a Decision built by hand with nonsense, before anything is set.
    if not (fabs(wall_now) < MAX_TIME_C and 0.0 <= reset < MAX_HEADER_SECONDS):
        raise ValidationError(f"cannot write headers for wall_now={wall_now!r}, reset_after={reset!r}")
    return 0


cdef inline int64_t retry_value(double wall_now, double reset, double retry_after) except? -1:
    """``Retry-After``: ``max(1, ceil(retry_after))``, or an error for
    inputs no header holds."""
    cdef int64_t retry
    if not (fabs(wall_now) < MAX_TIME_C and 0.0 <= reset < MAX_HEADER_SECONDS
            and retry_after < MAX_HEADER_SECONDS and retry_after == retry_after):
        raise ValidationError(f"cannot write headers for wall_now={wall_now!r}, reset_after={reset!r}, "
                              f"retry_after={retry_after!r}")
    retry = <int64_t>ceil(retry_after)
    return retry if retry >= 1 else 1


cdef inline list lane_pairs(tuple limit_pair, tuple policy_pair, bytes prefix, int64_t left, double reset,
                            double wall_now, int64_t retry, bint as_bytes):
    """The headers as a list of ``(name, value)`` pairs: ASGI's lower-case
    bytes, or WSGI's str; ``Retry-After`` too when ``retry`` >= 1."""
    cdef HeaderValues v
    header_values(&v, left, reset, wall_now, retry)
    cdef list pairs = [
        limit_pair,
        (B_REMAINING if as_bytes else H_REMAINING, ascii_text(v.remaining, v.n_remaining, as_bytes)),
        (B_RESET if as_bytes else H_RESET, ascii_text(v.reset_at, v.n_reset, as_bytes)),
        policy_pair,
        (B_RATELIMIT if as_bytes else H_RATELIMIT, prefixed_rate(prefix, &v, as_bytes)),
    ]
    if v.n_retry:
        pairs.append((B_RETRY if as_bytes else H_RETRY, ascii_text(v.retry, v.n_retry, as_bytes)))
    return pairs


cdef inline dict lane_dict(dict template, bytes prefix, int64_t left, double reset, double wall_now,
                           int64_t retry):
    """The headers as the str dict every other front end writes: a copy of
    the lane's template (its constant values set, in wire order; a clean
    dict copies in one block, with no inserts or resize) with the
    remaining count, the reset time, ``RateLimit`` and (``retry`` >= 1)
    ``Retry-After`` filled in."""
    cdef HeaderValues v
    header_values(&v, left, reset, wall_now, retry)
    cdef dict headers = PyDict_Copy(template)
    PyDict_SetItem(headers, H_REMAINING, ascii_text(v.remaining, v.n_remaining, False))
    PyDict_SetItem(headers, H_RESET, ascii_text(v.reset_at, v.n_reset, False))
    PyDict_SetItem(headers, H_RATELIMIT, prefixed_rate(prefix, &v, False))
    if v.n_retry:
        PyDict_SetItem(headers, H_RETRY, ascii_text(v.retry, v.n_retry, False))
    return headers


@cython.final
@cython.auto_pickle(False)
cdef class EventCounter:
    """A counter threads bump without a lock (atomic add): for counts taken
    on a hot path, such as a storage's near-cache hits."""

    cdef uint64_t n

    def add(self, uint64_t amount=1):
        nl_add_u64_relaxed(&self.n, amount)

    @property
    def value(self):
        return nl_load_u64_relaxed(&self.n)

    def __repr__(self):
        return f"<EventCounter {self.value}>"


@cython.final
cdef class AdmittedRequests:
    """One gateway rule's admitted requests: counted, and given their
    rate-limit headers, in one C call from the middleware's hot path. The
    counters are atomic, so threads share them without a lock or a shard."""

    cdef uint64_t allowed_count
    cdef uint64_t near_count
    cdef uint64_t denied_count          # denials a RuleLane answered
    cdef readonly str rule

    def __cinit__(self, str rule not None):
        self.rule = rule

    @property
    def allowed(self):
        return nl_load_u64_relaxed(&self.allowed_count)

    @property
    def near_limit(self):
        return nl_load_u64_relaxed(&self.near_count)

    @property
    def denied(self):
        return nl_load_u64_relaxed(&self.denied_count)

    def count(self, decision, double near):
        """Count an admitted request whose response never came (the handler raised)."""
        nl_add_u64_relaxed(&self.allowed_count, 1)
        if decision.remaining < near:
            nl_add_u64_relaxed(&self.near_count, 1)

    def record(self, decision, headers, str limit_str not None, str policy not None, str r_prefix not None,
               double near, double wall_now):
        """Count an admitted request and set its five rate-limit headers
        (docs/spec.md §2) on ``headers``, exactly as ``nanolimit.gateway.headers.rate_headers``
        writes them."""
        cdef int64_t left
        cdef double reset
        cdef HeaderValues v
        cdef Decision d
        if type(decision) is Decision:
            d = <Decision>decision
            left = d.remaining
            reset = d.reset_after
        else:
            left = decision.remaining
            reset = decision.reset_after
        check_header_times(wall_now, reset)
        header_values(&v, left, reset, wall_now, 0)
        text = ascii_text(v.remaining, v.n_remaining, False)
        reset_at = ascii_text(v.reset_at, v.n_reset, False)
        rate = r_prefix + ascii_text(v.rate, v.n_rate, False)
        if type(headers) is dict:
            PyDict_SetItem(headers, H_LIMIT, limit_str)
            PyDict_SetItem(headers, H_REMAINING, text)
            PyDict_SetItem(headers, H_RESET, reset_at)
            PyDict_SetItem(headers, H_POLICY, policy)
            PyDict_SetItem(headers, H_RATELIMIT, rate)
        else:
            headers[H_LIMIT] = limit_str
            headers[H_REMAINING] = text
            headers[H_RESET] = reset_at
            headers[H_POLICY] = policy
            headers[H_RATELIMIT] = rate
        nl_add_u64_relaxed(&self.allowed_count, 1)  # counted once the headers are written
        if left < near:
            nl_add_u64_relaxed(&self.near_count, 1)

    def refusal(self, decision, dict headers not None, str limit_str not None, str policy not None,
                str r_prefix not None, double retry_after, double wall_now):
        """Set a denied request's five rate-limit headers and ``Retry-After``
        (``max(1, ceil(retry_after))``) on ``headers``, and return that
        ``Retry-After``: the 429's headers in one C call, exactly as
        ``rate_headers`` and ``retry_seconds`` write them. Counts nothing
        (denials are counted where they are told apart: shadow or not)."""
        cdef int64_t left
        cdef double reset
        cdef int64_t retry
        cdef HeaderValues v
        cdef Decision d
        if type(decision) is Decision:
            d = <Decision>decision
            left = d.remaining
            reset = d.reset_after
        else:
            left = decision.remaining
            reset = decision.reset_after
        retry = retry_value(wall_now, reset, retry_after)
        header_values(&v, left, reset, wall_now, retry)
        PyDict_SetItem(headers, H_LIMIT, limit_str)
        PyDict_SetItem(headers, H_REMAINING, ascii_text(v.remaining, v.n_remaining, False))
        PyDict_SetItem(headers, H_RESET, ascii_text(v.reset_at, v.n_reset, False))
        PyDict_SetItem(headers, H_POLICY, policy)
        PyDict_SetItem(headers, H_RATELIMIT, r_prefix + ascii_text(v.rate, v.n_rate, False))
        PyDict_SetItem(headers, H_RETRY, ascii_text(v.retry, v.n_retry, False))
        return retry

    def __repr__(self):
        return f"<AdmittedRequests {self.rule!r} allowed={self.allowed} near_limit={self.near_limit}>"


cdef object FLOAT_ZERO = 0.0
cdef object INT_ZERO = 0


cdef inline void put_item(PyObject* o, Py_ssize_t i, object value) noexcept:
    Py_INCREF(value)
    PyTuple_SET_ITEM_PTR(o, i, <PyObject*>value)


cdef inline object new_outcome(PyTypeObject* t, object allowed, object headers, object rule, object retry,
                               object decision, object charge):
    """The pipeline's Outcome (a 7-field named tuple: allowed, headers,
    delay, rule, retry_after, decision, charge) made in C, with no delay:
    what ``tuple.__new__(Outcome, ...)`` makes, without the argument tuple."""
    cdef PyObject* o = nl_tuple_alloc(t, 7)
    put_item(o, 0, allowed)
    put_item(o, 1, headers)
    put_item(o, 2, FLOAT_ZERO)
    put_item(o, 3, rule)
    put_item(o, 4, retry)
    put_item(o, 5, decision)
    put_item(o, 6, charge)
    result = <object>o
    Py_DECREF(result)  # tp_alloc's reference: the cast above took one of its own
    return result


@cython.final
@cython.auto_pickle(False)
cdef class RuleLane:
    """One bound rule's whole request path in C (the pipeline's lane): decide
    on its native limiter, count, and write the headers of the answer, in
    one call and one clock read, into the pipeline's Outcome.

    For a plain enforced rule (cost 1, no dry run, no shaping, headers on
    and not renamed); ``count_when`` keeps a :class:`Charge`. The constant
    header pieces are the binding's, formatted once. ``wall`` is the
    pipeline's wall clock, None for ``time.time``: the system clock, which a
    limiter on ``SystemClock`` and an in-memory store then reads once for
    the decision and its headers."""

    cdef _Limiter limiter
    cdef AdmittedRequests counts
    cdef PyTypeObject* outcome_type
    cdef object outcome_ref             # holds the type alive
    cdef str rule
    cdef tuple limit_pair               # ASGI's constant pairs
    cdef tuple policy_pair
    cdef tuple limit_item               # WSGI's
    cdef tuple policy_item
    cdef dict admitted_headers          # the dict headers' templates: constants set, in wire order
    cdef dict denied_headers
    cdef bytes prefix                   # '"name";r=' (ASCII, at most 256 bytes)
    cdef bytes body_head                # the 429 body up to its retry seconds
    cdef double near
    cdef object wall
    cdef readonly object count_when     # None, a frozenset of statuses, or a callable
    # denials the pipeline hears of: breach(outcome, native, factory, log_due, more) for
    # each (breach_always: an on_breach hook) or for those a log record is due for, at
    # most one per log_interval seconds (< 0: no log); the others are counted for it
    cdef object breach
    cdef bint breach_always
    cdef double log_interval
    cdef double quiet_until             # a monotonic time
    cdef uint64_t quieted

    def __cinit__(self, limiter, AdmittedRequests counts not None, outcome_type, str limit_str not None,
                  str policy not None, str r_prefix not None, double near, wall=None, count_when=None,
                  breach=None, bint breach_always=False, double log_interval=-1.0):
        if not isinstance(limiter, _Limiter):
            raise TypeError(f"a RuleLane decides on a native limiter, got {type(limiter).__name__}")
        if not (isinstance(outcome_type, type) and issubclass(outcome_type, tuple)
                and len(getattr(outcome_type, "_fields", ())) == 7):
            raise TypeError("outcome_type must be the pipeline's 7-field Outcome")
        if wall is not None and not callable(wall):
            raise TypeError(f"wall must be callable or None, got {wall!r}")
        if breach is not None and not callable(breach):
            raise TypeError(f"breach must be callable or None, got {breach!r}")
        if count_when is not None and type(count_when) is not frozenset and not callable(count_when):
            raise TypeError(f"count_when must be a frozenset of statuses, a callable or None, got {count_when!r}")
        prefix = r_prefix.encode("ascii")
        if len(prefix) > 256:
            raise ValidationError("the RateLimit prefix is longer than any rule name makes it")
        self.limiter = <_Limiter>limiter
        self.counts = counts
        self.outcome_ref = outcome_type
        self.outcome_type = <PyTypeObject*>outcome_type
        self.rule = counts.rule
        self.limit_pair = (b"x-ratelimit-limit", limit_str.encode("ascii"))
        self.policy_pair = (b"ratelimit-policy", policy.encode("ascii"))
        self.limit_item = (H_LIMIT, limit_str)
        self.policy_item = (H_POLICY, policy)
        self.admitted_headers = {H_LIMIT: limit_str, H_REMAINING: "", H_RESET: "", H_POLICY: policy, H_RATELIMIT: ""}
        self.denied_headers = {**self.admitted_headers, H_RETRY: ""}
        self.prefix = prefix
        self.body_head = deny_body_head(counts.rule)
        self.near = near
        self.wall = wall
        self.count_when = count_when
        self.breach = breach
        self.breach_always = breach_always and breach is not None
        self.log_interval = log_interval if log_interval == log_interval else -1.0

    cdef Decision decide(self, object key, double* wall_now, uint64_t* hashed):
        """The limiter's ``allow(key)``; ``wall_now``: the wall clock the
        headers are written at (the decision's own reading when it can be);
        ``hashed``: the key's hash in the in-memory store (0: not hashed)."""
        cdef _Limiter lim = self.limiter
        cdef Verdict v
        cdef Py_ssize_t klen
        cdef const char* data
        cdef uint64_t h
        cdef double now
        cdef int status
        if self.wall is None and lim.system_clock and lim.store is not None:
            # _Limiter.decide for an in-memory store at cost 1, with the
            # clock read kept for the headers
            now = nl_wall_now()
            data = key_bytes(key, lim.max_key_bytes, &klen)
            h = lim.store.hash_key(lim.seed, data, klen)
            prefetch_slot(lim.store.stripe_for(h), h)
            status = lim.store.decide(h, lim.ns, data, klen, now, 1, &lim.p, True, &v)
            if status != NL_OK:
                raise_status(status)
            wall_now[0] = now
            hashed[0] = h
            return make_decision(&v, lim.p.capacity, lim._rule, lim.p.window)
        d = lim.decide(key, ONE, True)
        if self.wall is not None:
            wall_now[0] = clock_value(self.wall())
        elif lim.system_clock and d.at > 0.0:
            wall_now[0] = d.at      # a shared-memory zone's or a lease's own reading of the clock
        else:
            wall_now[0] = nl_wall_now()
        return d

    def admit(self, key, int form, native=None, factory=None):
        """Decide ``key`` at cost 1 and answer the pipeline's Outcome, its
        headers in ``form``: 0 a str dict, 1 ASGI's lower-case bytes pairs,
        2 WSGI's str pairs (a list, fresh for the caller to extend).
        Admitted: counted (with a :class:`Charge` under ``count_when``).
        Denied: counted as a denial, with ``Retry-After``, and told to
        ``breach`` with ``native`` and ``factory`` (what builds its Request)
        when a hook or a log record is due (its headers a dict for a hook)."""
        return self.admit_c(key, form, native, factory)

    cdef object admit_c(self, object key, int form, object native, object factory):
        cdef double wall_now
        cdef uint64_t hashed = 0
        cdef Decision d = self.decide(key, &wall_now, &hashed)
        cdef int64_t left = d.remaining
        cdef double reset = d.reset_after
        cdef int64_t retry
        if d.allowed:
            check_header_times(wall_now, reset)
            if form == 1:
                headers = lane_pairs(self.limit_pair, self.policy_pair, self.prefix, left, reset, wall_now, 0, True)
            elif form == 2:
                headers = lane_pairs(self.limit_item, self.policy_item, self.prefix, left, reset, wall_now, 0, False)
            else:
                headers = lane_dict(self.admitted_headers, self.prefix, left, reset, wall_now, 0)
            nl_add_u64_relaxed(&self.counts.allowed_count, 1)
            if left < self.near:
                nl_add_u64_relaxed(&self.counts.near_count, 1)
            charge = None if self.count_when is None else new_charge(self, key, d.at, hashed)
            return new_outcome(self.outcome_type, True, headers, self.rule, INT_ZERO, d, charge)
        retry = retry_value(wall_now, reset, d.retry_after)
        if self.breach_always:
            form = 0
        if form == 1:
            headers = lane_pairs(self.limit_pair, self.policy_pair, self.prefix, left, reset, wall_now, retry, True)
        elif form == 2:
            headers = lane_pairs(self.limit_item, self.policy_item, self.prefix, left, reset, wall_now, retry, False)
        else:
            headers = lane_dict(self.denied_headers, self.prefix, left, reset, wall_now, retry)
        nl_add_u64_relaxed(&self.counts.denied_count, 1)
        outcome = new_outcome(self.outcome_type, False, headers, self.rule, retry, d, None)
        if self.breach is not None:
            self.breached(outcome, native, factory)
        return outcome

    cdef int breached(self, outcome, native, factory) except -1:
        """A denial: a log record is due if none was in the last
        ``log_interval`` seconds (a flood's others only counted, for the next
        record to say), and the pipeline hears of it if one is, or always
        with an on_breach hook."""
        cdef bint due = False
        cdef double now
        cdef uint64_t more = 0
        if self.log_interval >= 0.0:
            now = nlz_monotonic()
            # a deadline further off than the interval: the clock stepped back
            if now >= self.quiet_until or self.quiet_until - now > self.log_interval:
                due = True
                self.quiet_until = now + self.log_interval
                more = self.quieted
                self.quieted = 0
            else:
                nl_add_u64_relaxed(&self.quieted, 1)
        if due or self.breach_always:
            self.breach(outcome, native, factory, due, more)
        return 0

    def body(self, int64_t retry):
        """The 429 body for ``retry`` seconds, as ``deny_body`` writes it."""
        cdef char buf[24]
        cdef Py_ssize_t n = put_i64(buf, retry)
        buf[n] = 125  # '}'
        return self.body_head + PyBytes_FromStringAndSize(buf, n + 1)

    cdef bint counted(self, object status) except -1:
        when = self.count_when
        if type(when) is frozenset:
            return status in <frozenset>when
        return bool(when(status))

    cdef int give_back(self, object key, double at, uint64_t hashed) except -1:
        """``limiter.refund(key, 1, at=at)``, in C on an in-memory store;
        ``hashed``: the key's hash from its decision (0: hash it again)."""
        cdef _Limiter lim = self.limiter
        cdef Py_ssize_t klen
        cdef const char* data
        cdef uint64_t h
        cdef double now
        if lim.store is None:
            lim.refund(key, 1, at=at)
            return 0
        data = key_bytes(key, lim.max_key_bytes, &klen)
        now = lim.read_clock()
        h = hashed if hashed != 0 else lim.store.hash_key(lim.seed, data, klen)
        lim.store.refund(h, lim.ns, data, klen, now, 1, at, False, &lim.p)
        return 0

    def __repr__(self):
        return f"<RuleLane {self.rule!r}>"


cdef bytes BODY_HEAD = b'{"error": "rate_limit_exceeded", "rule": "'
cdef bytes BODY_MID = b'", "retry_after": '


cdef inline bint safe_name(const char* data, Py_ssize_t n) noexcept:
    """``[A-Za-z0-9_.:@/+-]*``: a name JSON writes as it is."""
    cdef Py_ssize_t i
    cdef char c
    for i in range(n):
        c = data[i]
        if not ((c >= 97 and c <= 122) or (c >= 65 and c <= 90) or (c >= 48 and c <= 58)
                or c == 95 or c == 46 or c == 64 or c == 47 or c == 43 or c == 45):
            return False
    return True


def deny_body(rule, retry_after):
    """``nanolimit.gateway.headers.deny_body`` in C: the same bytes, with no
    cache to look up (a 429's body is formatted in ~300 instructions)."""
    cdef char buf[400]
    cdef Py_ssize_t n, rlen
    cdef const char* data
    cdef int overflow = 0
    cdef long long retry = 0
    if (type(rule) is str and PyUnicode_IS_COMPACT_ASCII(rule) and type(retry_after) is int
            and PyUnicode_GET_LENGTH(rule) <= 200):
        data = <const char*>PyUnicode_DATA(rule)
        rlen = PyUnicode_GET_LENGTH(rule)
        retry = PyLong_AsLongLongAndOverflow(retry_after, &overflow)
        if safe_name(data, rlen) and not overflow:
            n = PyBytes_GET_SIZE(BODY_HEAD)
            memcpy(buf, PyBytes_AS_STRING(BODY_HEAD), n)
            memcpy(buf + n, data, rlen)
            n += rlen
            memcpy(buf + n, PyBytes_AS_STRING(BODY_MID), PyBytes_GET_SIZE(BODY_MID))
            n += PyBytes_GET_SIZE(BODY_MID)
            n += put_i64(buf + n, <int64_t>retry)
            buf[n] = 125  # '}'
            return PyBytes_FromStringAndSize(buf, n + 1)
    # a name JSON must escape, or numbers no C integer holds: as json writes them
    return json_module.dumps({"error": "rate_limit_exceeded", "rule": rule, "retry_after": retry_after}).encode()


cdef bytes deny_body_head(str rule):
    """``{"error": "rate_limit_exceeded", "rule": "<rule>", "retry_after": ``:
    rule names need no JSON escaping (``RateLimitRule`` checks them), so
    the 429 body is this and the seconds."""
    return b'{"error": "rate_limit_exceeded", "rule": "' + rule.encode("ascii") + b'", "retry_after": '


cdef inline Charge new_charge(RuleLane lane, object key, double at, uint64_t hashed):
    cdef Charge charge = Charge.__new__(Charge)
    charge.lane = lane
    charge.key = key
    charge.at = at
    charge.hashed = hashed
    charge.open = True
    return charge


@cython.final
@cython.freelist(64)
@cython.auto_pickle(False)
cdef class Charge:
    """What an admitted request under a ``count_when`` rule spent: given
    back by :meth:`settle` when its response status does not count, at most
    once, in one call (the refund runs in C on an in-memory store). Only a
    RuleLane makes one that can refund: one made by hand is settled."""

    cdef RuleLane lane
    cdef object key
    cdef double at
    cdef uint64_t hashed
    cdef readonly bint open  # not settled yet: a lazy WSGI app's response still owes it

    def settle(self, status):
        """The response was ``status``: refund the request unless its rule
        counts it. Returns the units given back (0 or 1); a second call
        gives back nothing."""
        return self.settle_c(status)

    cdef int settle_c(self, status) except -1:
        if not self.open:
            return 0
        self.open = False
        if self.lane.counted(status):
            return 0
        self.lane.give_back(self.key, self.at, self.hashed)
        return 1

    async def settle_async(self, status):
        """:meth:`settle` for async front ends (the store is in process)."""
        return self.settle(status)

    def __repr__(self):
        return f"<Charge {'open' if self.open else 'settled'}>"


cdef str S_START = "http.response.start"
cdef str S_STATUS = "status"
cdef str S_HEADERS = "headers"
cdef str S_TYPE = "type"


@cython.final
@cython.freelist(16)
@cython.auto_pickle(False)
cdef class HeaderSend:
    """An ASGI ``send`` that appends the rate-limit headers to the response
    start and, under ``count_when``, settles the charge by its status. A
    plain callable that hands back the inner send's awaitable: ``await
    send(m)`` works the same, and no coroutine is made per message."""

    cdef object send
    cdef list pairs
    cdef object charge

    def __call__(self, message):
        cdef object charge
        if message[S_TYPE] == S_START:
            charge = self.charge
            if charge is not None:
                status = message.get(S_STATUS, 200)
                if type(status) is not int:
                    status = int(status)
                if type(charge) is Charge:
                    (<Charge>charge).settle_c(status)
                else:
                    charge.settle(status)
            if self.pairs:
                message[S_HEADERS] = [*message.get(S_HEADERS, ()), *self.pairs]
        return self.send(message)


def header_send(send, list pairs not None, charge=None):
    """``send`` with ``pairs`` added to the response start (and ``charge``,
    if any, settled by its status): see :class:`HeaderSend`."""
    cdef HeaderSend wrapped = HeaderSend.__new__(HeaderSend)
    wrapped.send = send
    wrapped.pairs = pairs
    wrapped.charge = charge
    return wrapped


cdef dict STATUS_CODES = {}


cdef object status_code(object status):
    """The code of a WSGI status line (``"200 OK"``); 500 for one that has
    none. Three ASCII digits are read in C; anything else as Python's
    ``int(status[:3])`` reads it (the reference twin's rule, however large)."""
    cdef Py_UCS4 a, b, c
    if type(status) is str and len(<str>status) >= 3:
        a = (<str>status)[0]
        b = (<str>status)[1]
        c = (<str>status)[2]
        if u'0' <= a <= u'9' and u'0' <= b <= u'9' and u'0' <= c <= u'9':
            return (<int>a - 48) * 100 + (<int>b - 48) * 10 + (<int>c - 48)
    code = STATUS_CODES.get(status) if type(status) is str else None
    if code is None:
        try:
            code = int(status[:3])
        except (TypeError, ValueError):
            code = 500
        if type(status) is str and len(STATUS_CODES) < 1024 and len(<str>status) <= 64:
            STATUS_CODES[status] = code
    return code


@cython.final
@cython.freelist(16)
@cython.auto_pickle(False)
cdef class HeaderStart:
    """A WSGI ``start_response`` that appends the rate-limit headers and,
    under ``count_when``, settles the charge by the status line: the WSGI
    twin of :class:`HeaderSend`, so no closure is made per request."""

    cdef object start_response
    cdef list pairs
    cdef object charge

    def __call__(self, status, response_headers, exc_info=None):
        cdef object charge = self.charge
        cdef list headers
        if charge is not None:
            if type(charge) is Charge:
                (<Charge>charge).settle_c(status_code(status))
            else:
                charge.settle(status_code(status))
        headers = list(response_headers)
        headers.extend(self.pairs)
        if exc_info is not None:
            return self.start_response(status, headers, exc_info)
        return self.start_response(status, headers)


def header_start(start_response, list pairs not None, charge=None):
    """``start_response`` with ``pairs`` added to the headers (and
    ``charge``, if any, settled by the status): see :class:`HeaderStart`."""
    cdef HeaderStart wrapped = HeaderStart.__new__(HeaderStart)
    wrapped.start_response = start_response
    wrapped.pairs = pairs
    wrapped.charge = charge
    return wrapped


def wsgi_status_code(status):
    """The code :class:`HeaderStart` settles a charge by: see ``status_code``."""
    return status_code(status)


cdef str S_PATH = "path"
cdef str S_ROOT = "root_path"
cdef str S_METHOD = "method"
cdef str S_CLIENT = "client"
cdef str S_SLASH = "/"
cdef str S_GET = "GET"


@cython.final
@cython.auto_pickle(False)
cdef class PipelineLanes:
    """``RateLimitPipeline.decide`` (and ``decide_scope``) of the native
    twin: the same lookups as the Python methods in gateway/middleware.py
    (which document them), reading the pipeline's state through C fields
    and an ASGI scope with dict lookups, so that no interpreter frame and
    few attribute reads run between an adapter and a rule's lane."""

    cdef object pipeline
    cdef object registry
    cdef object peer_keys               # the stock extractor's live dict, or None
    cdef object unlimited               # the route cache's "no rule applies"

    def __cinit__(self, pipeline, registry, peer_keys, unlimited):
        if peer_keys is not None and type(peer_keys) is not dict:
            raise TypeError("peer_keys must be a dict or None")
        self.pipeline = pipeline
        self.registry = registry
        self.peer_keys = peer_keys
        self.unlimited = unlimited

    def decide(self, native, method, path, client, route, request_factory, int form=0):
        """:meth:`RateLimitPipeline.decide`."""
        return self.lookup(native, method, path, client, route, request_factory, form)

    def decide_scope(self, scope, context, request_factory, int form=0):
        """:meth:`RateLimitPipeline.decide_scope`."""
        if type(scope) is not dict:  # a Mapping, or a dict subclass with its own get()
            return self.pipeline.__class__.decide_scope(self.pipeline, scope, context, request_factory, form)
        cdef PyObject* item = PyDict_GetItemWithError(scope, S_PATH)
        path = S_SLASH if item == NULL or not (<object>item) else <object>item
        item = PyDict_GetItemWithError(scope, S_ROOT)
        if item != NULL and <object>item:
            root = <object>item
            if not (path.startswith(root) and (len(path) == len(root) or path[len(root)] == S_SLASH
                                              or root.endswith(S_SLASH))):
                path = root + path if path[:1] == S_SLASH else f"{root}/{path}"   # public_path
            if context is not None:
                context = f"{context}\x00{root}"
        item = PyDict_GetItemWithError(scope, S_METHOD)
        method = S_GET if item == NULL else <object>item
        item = PyDict_GetItemWithError(scope, S_CLIENT)
        client = None if item == NULL or not (<object>item) else (<object>item)[0]
        return self.lookup(scope, method, path, client, context, request_factory, form)

    cdef object lookup(self, native, method, path, client, route, request_factory, int form):
        cdef PyObject* hit
        cdef PyObject* key
        cdef RuleLane lane
        pipeline = self.pipeline
        ruleset = self.registry.ruleset
        cdef tuple routes = pipeline._routes
        if routes[0] is ruleset and not ruleset.has_tiers:
            if not ruleset.routed:
                hit = PyDict_GetItemWithError(<dict>routes[1], (method, path, None))
            elif route is not None:
                hit = PyDict_GetItemWithError(<dict>routes[1], (method, path, None, route))
            else:
                hit = NULL
            if hit != NULL:
                b = <object>hit
                found = b.lane
                if found is not None:
                    lane = <RuleLane?>found
                    if b.peer:
                        key = NULL if client is None else PyDict_GetItemWithError(<dict>self.peer_keys, client)
                        if key != NULL:
                            return lane.admit_c(<object>key, form, native, request_factory)
                    else:
                        fixed = b.fixed_key
                        if fixed is not None:
                            return lane.admit_c(fixed, form, native, request_factory)
                    request = request_factory(native)
                    return lane.admit_c(pipeline._key(request, b.scope), form, request, None)
                if b is self.unlimited:
                    return None
        return pipeline.check(request_factory(native))


def rule_lane(limiter, AdmittedRequests counts not None, outcome_type, str limit_str not None, str policy not None,
              str r_prefix not None, double near, wall=None, count_when=None, breach=None,
              bint breach_always=False, double log_interval=-1.0):
    """A :class:`RuleLane` for ``limiter``, or None when it is not a native
    limiter (a reference-twin one decides through the pipeline's Python path)."""
    if not isinstance(limiter, _Limiter):
        return None
    return RuleLane(limiter, counts, outcome_type, limit_str, policy, r_prefix, near, wall, count_when, breach,
                    breach_always, log_interval)


def settle_outcome(outcome, status):
    """``RateLimitPipeline.settle`` in C: the outcome's charge (its last
    field) settled by ``status``; 0 for None or an outcome without one."""
    if outcome is None:
        return 0
    if not isinstance(outcome, tuple) or PyTuple_GET_SIZE(outcome) != 7:
        charge = outcome.charge
    else:
        charge = <object>PyTuple_GET_ITEM(outcome, 6)
    if charge is None:
        return 0
    if type(charge) is Charge:
        return (<Charge>charge).settle_c(status)
    return charge.settle(status)
