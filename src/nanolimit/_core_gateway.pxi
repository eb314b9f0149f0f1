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


cdef inline bytes int_bytes(int64_t value):
    cdef char buf[32]
    cdef int n = snprintf(buf, sizeof(buf), "%lld", <long long>value)
    return PyBytes_FromStringAndSize(buf, n)


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
    cdef readonly str rule

    def __cinit__(self, str rule not None):
        self.rule = rule

    @property
    def allowed(self):
        return nl_load_u64_relaxed(&self.allowed_count)

    @property
    def near_limit(self):
        return nl_load_u64_relaxed(&self.near_count)

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
        # Every rule inside the documented ranges stays below 2**62 s
        # (capacity * window / limit <= (2**32 - 1) * 1e9), so this refuses
        # only a Decision built by hand with nonsense, before anything is set.
        if not (fabs(wall_now) < MAX_TIME_C and 0.0 <= reset < MAX_HEADER_SECONDS):
            raise ValidationError(f"cannot write headers for wall_now={wall_now!r}, reset_after={reset!r}")
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

    def record_pairs(self, decision, tuple limit_pair not None, tuple policy_pair not None,
                     bytes r_prefix_b not None, double near, double wall_now):
        """``record`` for ASGI: count an admitted request and return its five
        headers as the list of ``(name, value)`` bytes an ASGI server writes
        (lower-case names), formatted in C. The two constant pairs come
        prebuilt (``(b"x-ratelimit-limit", b"10")``, the policy's): a request
        makes three values and one list, no header dict, no encoding pass."""
        cdef int64_t left
        cdef double reset
        cdef Decision d
        cdef char buf[320]
        cdef int n
        if type(decision) is Decision:
            d = <Decision>decision
            left = d.remaining
            reset = d.reset_after
        else:
            left = decision.remaining
            reset = decision.reset_after
        if not (fabs(wall_now) < MAX_TIME_C and 0.0 <= reset < MAX_HEADER_SECONDS):
            raise ValidationError(f"cannot write headers for wall_now={wall_now!r}, reset_after={reset!r}")
        if PyBytes_GET_SIZE(r_prefix_b) > 256:
            raise ValidationError("the RateLimit prefix is longer than any rule name makes it")
        n = snprintf(buf, sizeof(buf), "%s%lld;t=%lld", PyBytes_AS_STRING(r_prefix_b), <long long>left,
                     <long long>ceil(reset))
        pairs = [limit_pair, (B_REMAINING, int_bytes(left)), (B_RESET, int_bytes(<int64_t>ceil(wall_now + reset))),
                 policy_pair, (B_RATELIMIT, PyBytes_FromStringAndSize(buf, n))]
        nl_add_u64_relaxed(&self.allowed_count, 1)
        if left < near:
            nl_add_u64_relaxed(&self.near_count, 1)
        return pairs

    def refusal_pairs(self, decision, tuple limit_pair not None, tuple policy_pair not None,
                      bytes r_prefix_b not None, double retry_after, double wall_now):
        """``refusal`` for ASGI: ``(Retry-After seconds, the six headers as
        ASGI's lower-case bytes pairs)``, formatted in C. Counts nothing."""
        cdef int64_t left
        cdef double reset
        cdef int64_t retry
        cdef Decision d
        cdef char buf[320]
        cdef int n
        if type(decision) is Decision:
            d = <Decision>decision
            left = d.remaining
            reset = d.reset_after
        else:
            left = decision.remaining
            reset = decision.reset_after
        if not (fabs(wall_now) < MAX_TIME_C and 0.0 <= reset < MAX_HEADER_SECONDS
                and retry_after < MAX_HEADER_SECONDS and retry_after == retry_after):
            raise ValidationError(f"cannot write headers for wall_now={wall_now!r}, reset_after={reset!r}, "
                                  f"retry_after={retry_after!r}")
        if PyBytes_GET_SIZE(r_prefix_b) > 256:
            raise ValidationError("the RateLimit prefix is longer than any rule name makes it")
        retry = <int64_t>ceil(retry_after)
        if retry < 1:
            retry = 1
        n = snprintf(buf, sizeof(buf), "%s%lld;t=%lld", PyBytes_AS_STRING(r_prefix_b), <long long>left,
                     <long long>ceil(reset))
        pairs = [limit_pair, (B_REMAINING, int_bytes(left)), (B_RESET, int_bytes(<int64_t>ceil(wall_now + reset))),
                 policy_pair, (B_RATELIMIT, PyBytes_FromStringAndSize(buf, n)), (B_RETRY, int_bytes(retry))]
        return retry, pairs

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
        if not (fabs(wall_now) < MAX_TIME_C and 0.0 <= reset < MAX_HEADER_SECONDS
                and retry_after < MAX_HEADER_SECONDS and retry_after == retry_after):
            raise ValidationError(f"cannot write headers for wall_now={wall_now!r}, reset_after={reset!r}, "
                                  f"retry_after={retry_after!r}")
        retry = <int64_t>ceil(retry_after)
        if retry < 1:
            retry = 1
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
