# Included by _core.pyx (one extension module, nanolimit._core): its cimports,
# imports and shared constants are in scope here.
#
# The gateway's hot-path counters: lock-free atomic counts, and one
# rule's admitted requests counted and given their headers in one C call.

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


cdef inline bytes int_bytes(int64_t value):
    cdef char buf[24]
    return PyBytes_FromStringAndSize(buf, put_i64(buf, value))


cdef inline object rate_value(const char* prefix, Py_ssize_t plen, int64_t left, double reset, bint as_bytes):
    """``RateLimit``: the rule's prefix (``"name";r=``, at most 256 bytes),
    the remaining count and ``;t=`` the reset in whole seconds."""
    cdef char buf[320]
    cdef Py_ssize_t n
    memcpy(buf, prefix, plen)
    n = plen + put_i64(buf + plen, left)
    buf[n] = 59      # ';'
    buf[n + 1] = 116 # 't'
    buf[n + 2] = 61  # '='
    n += 3
    n += put_i64(buf + n, <int64_t>ceil(reset))
    return ascii_text(buf, n, as_bytes)


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


cdef inline list five_pairs(tuple limit_pair, tuple policy_pair, bytes prefix, int64_t left, double reset,
                            double wall_now):
    """The five headers as ASGI's lower-case bytes pairs (checked inputs)."""
    return [limit_pair, (B_REMAINING, int_bytes(left)), (B_RESET, int_bytes(<int64_t>ceil(wall_now + reset))),
            policy_pair, (B_RATELIMIT, rate_value(PyBytes_AS_STRING(prefix), PyBytes_GET_SIZE(prefix),
                                                  left, reset, True))]


cdef inline dict five_dict(str limit_str, str policy, bytes prefix, int64_t left, double reset, double wall_now):
    """The five headers as the str dict every other front end writes."""
    cdef char buf[24]
    return {
        H_LIMIT: limit_str,
        H_REMAINING: ascii_text(buf, put_i64(buf, left), False),
        H_RESET: ascii_text(buf, put_i64(buf, <int64_t>ceil(wall_now + reset)), False),
        H_POLICY: policy,
        H_RATELIMIT: rate_value(PyBytes_AS_STRING(prefix), PyBytes_GET_SIZE(prefix), left, reset, False),
    }


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
        cdef Decision d
        if type(decision) is Decision:
            d = <Decision>decision
            left = d.remaining
            reset = d.reset_after
        else:
            left = decision.remaining
            reset = decision.reset_after
        check_header_times(wall_now, reset)
        text = f"{left}"
        reset_at = f"{<int64_t>ceil(wall_now + reset)}"
        rate = f"{r_prefix}{text};t={<int64_t>ceil(reset)}"
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
        cdef Decision d
        if type(decision) is Decision:
            d = <Decision>decision
            left = d.remaining
            reset = d.reset_after
        else:
            left = decision.remaining
            reset = decision.reset_after
        retry = retry_value(wall_now, reset, retry_after)
        text = f"{left}"
        PyDict_SetItem(headers, H_LIMIT, limit_str)
        PyDict_SetItem(headers, H_REMAINING, text)
        PyDict_SetItem(headers, H_RESET, f"{<int64_t>ceil(wall_now + reset)}")
        PyDict_SetItem(headers, H_POLICY, policy)
        PyDict_SetItem(headers, H_RATELIMIT, f"{r_prefix}{text};t={<int64_t>ceil(reset)}")
        PyDict_SetItem(headers, H_RETRY, f"{retry}")
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
    cdef str limit_str
    cdef str policy
    cdef tuple limit_pair
    cdef tuple policy_pair
    cdef bytes prefix                   # '"name";r=' (ASCII, at most 256 bytes)
    cdef bytes body_head                # the 429 body up to its retry seconds
    cdef double near
    cdef object wall
    cdef readonly object count_when     # None, a frozenset of statuses, or a callable

    def __cinit__(self, limiter, AdmittedRequests counts not None, outcome_type, str limit_str not None,
                  str policy not None, str r_prefix not None, double near, wall=None, count_when=None):
        if not isinstance(limiter, _Limiter):
            raise TypeError(f"a RuleLane decides on a native limiter, got {type(limiter).__name__}")
        if not (isinstance(outcome_type, type) and issubclass(outcome_type, tuple)
                and len(getattr(outcome_type, "_fields", ())) == 7):
            raise TypeError("outcome_type must be the pipeline's 7-field Outcome")
        if wall is not None and not callable(wall):
            raise TypeError(f"wall must be callable or None, got {wall!r}")
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
        self.limit_str = limit_str
        self.policy = policy
        self.limit_pair = (b"x-ratelimit-limit", limit_str.encode("ascii"))
        self.policy_pair = (b"ratelimit-policy", policy.encode("ascii"))
        self.prefix = prefix
        self.body_head = deny_body_head(counts.rule)
        self.near = near
        self.wall = wall
        self.count_when = count_when

    cdef Decision decide(self, object key, double* wall_now):
        """The limiter's ``allow(key)``; ``wall_now``: the wall clock the
        headers are written at (the decision's own reading when it can be)."""
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
            return make_decision(&v, lim.p.capacity, lim._rule, lim.p.window)
        d = lim.decide(key, ONE, True)
        wall_now[0] = nl_wall_now() if self.wall is None else clock_value(self.wall())
        return d

    def admit(self, key, bint asgi):
        """Decide ``key`` at cost 1 and answer the pipeline's Outcome: its
        headers as a str dict, or (``asgi``) as ASGI's lower-case bytes
        pairs; admitted, counted (with a :class:`Charge` under
        ``count_when``); denied, counted as a denial, with ``Retry-After``."""
        cdef double wall_now
        cdef Decision d = self.decide(key, &wall_now)
        cdef int64_t left = d.remaining
        cdef double reset = d.reset_after
        cdef int64_t retry
        if d.allowed:
            check_header_times(wall_now, reset)
            if asgi:
                headers = five_pairs(self.limit_pair, self.policy_pair, self.prefix, left, reset, wall_now)
            else:
                headers = five_dict(self.limit_str, self.policy, self.prefix, left, reset, wall_now)
            nl_add_u64_relaxed(&self.counts.allowed_count, 1)
            if left < self.near:
                nl_add_u64_relaxed(&self.counts.near_count, 1)
            charge = None if self.count_when is None else Charge.__new__(Charge, self, key, d.at)
            return new_outcome(self.outcome_type, True, headers, self.rule, INT_ZERO, d, charge)
        retry = retry_value(wall_now, reset, d.retry_after)
        if asgi:
            headers = five_pairs(self.limit_pair, self.policy_pair, self.prefix, left, reset, wall_now)
            headers.append((B_RETRY, int_bytes(retry)))
        else:
            headers = five_dict(self.limit_str, self.policy, self.prefix, left, reset, wall_now)
            PyDict_SetItem(headers, H_RETRY, f"{retry}")
        nl_add_u64_relaxed(&self.counts.denied_count, 1)
        return new_outcome(self.outcome_type, False, headers, self.rule, retry, d, None)

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

    cdef int give_back(self, object key, double at) except -1:
        """``limiter.refund(key, 1, at=at)``, in C on an in-memory store."""
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
        h = lim.store.hash_key(lim.seed, data, klen)
        lim.store.refund(h, lim.ns, data, klen, now, 1, at, False, &lim.p)
        return 0

    def __repr__(self):
        return f"<RuleLane {self.rule!r}>"


cdef bytes deny_body_head(str rule):
    """``{"error": "rate_limit_exceeded", "rule": "<rule>", "retry_after": ``:
    rule names need no JSON escaping (``RateLimitRule`` checks them), so
    the 429 body is this and the seconds."""
    return b'{"error": "rate_limit_exceeded", "rule": "' + rule.encode("ascii") + b'", "retry_after": '


@cython.final
@cython.auto_pickle(False)
cdef class Charge:
    """What an admitted request under a ``count_when`` rule spent: given
    back by :meth:`settle` when its response status does not count, at most
    once, in one call (the refund runs in C on an in-memory store)."""

    cdef RuleLane lane
    cdef object key
    cdef double at
    cdef bint open

    def __cinit__(self, RuleLane lane not None, key, double at):
        self.lane = lane
        self.key = key
        self.at = at
        self.open = True

    def settle(self, status):
        """The response was ``status``: refund the request unless its rule
        counts it. Returns the units given back (0 or 1); a second call
        gives back nothing."""
        if not self.open:
            return 0
        self.open = False
        if self.lane.counted(status):
            return 0
        self.lane.give_back(self.key, self.at)
        return 1

    async def settle_async(self, status):
        """:meth:`settle` for async front ends (the store is in process)."""
        return self.settle(status)

    def __repr__(self):
        return f"<Charge {self.lane.rule!r} {'open' if self.open else 'settled'}>"


def rule_lane(limiter, AdmittedRequests counts not None, outcome_type, str limit_str not None, str policy not None,
              str r_prefix not None, double near, wall=None, count_when=None):
    """A :class:`RuleLane` for ``limiter``, or None when it is not a native
    limiter (a reference-twin one decides through the pipeline's Python path)."""
    if not isinstance(limiter, _Limiter):
        return None
    return RuleLane(limiter, counts, outcome_type, limit_str, policy, r_prefix, near, wall, count_when)
