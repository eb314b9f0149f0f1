# Included by _core.pyx (one extension module, nanolimit._core): its cimports,
# imports and shared constants are in scope here.
#
# The Decision (docs/spec.md §2) and the pool its hot-path instances come
# from (``_decision_pool.h``).

@cython.final
cdef class Decision:
    """The answer to one request (docs/spec.md §2). Frozen: a Decision is a fact.

    ``degraded`` is true when the store could not decide normally and a policy
    answered instead; ``reason`` then says which ("storage_full",
    "store_unavailable"); it is "" for an ordinary decision.

    ``at`` is the limiter-clock time the decision was made at (the key's own
    time, which a sliding log stamps): the name a ``refund`` gives the charge
    back by. 0.0 when a policy answered or the Decision was built by hand.
    It is a receipt, not part of the answer: equality, hashing and repr
    leave it out, pickling keeps it.
    """

    cdef readonly bint allowed
    cdef readonly int64_t limit
    cdef readonly int64_t remaining
    cdef readonly double retry_after
    cdef readonly double reset_after
    cdef readonly str rule
    cdef readonly double window
    cdef readonly double delay
    cdef readonly bint degraded
    cdef readonly str reason
    cdef readonly double at

    def __init__(self, allowed, limit, remaining, retry_after, reset_after,
                 rule="", window=0.0, delay=0.0, degraded=False, reason="", at=0.0):
        self.allowed = bool(allowed)
        self.limit = limit
        self.remaining = remaining
        self.retry_after = retry_after
        self.reset_after = reset_after
        self.rule = str(rule)
        self.window = window
        self.delay = delay
        self.degraded = bool(degraded)
        self.reason = str(reason)
        self.at = at

    def _astuple(self):
        return (self.allowed, self.limit, self.remaining, self.retry_after,
                self.reset_after, self.rule, self.window, self.delay, self.degraded, self.reason)

    def __eq__(self, other):
        if not hasattr(other, "_astuple") or not hasattr(other, "retry_after"):
            return NotImplemented
        return self._astuple() == other._astuple()

    def __hash__(self):
        return hash(self._astuple())

    def __repr__(self):
        return (
            f"Decision(allowed={self.allowed!r}, limit={self.limit!r}, "
            f"remaining={self.remaining!r}, retry_after={self.retry_after!r}, "
            f"reset_after={self.reset_after!r}, rule={self.rule!r}, "
            f"window={self.window!r}, delay={self.delay!r}, degraded={self.degraded!r}, "
            f"reason={self.reason!r})"
        )

    def __reduce__(self):
        return (Decision, self._astuple() + (self.at,))

    def headers(self, wall_now=None):
        """HTTP headers for this decision; ``wall_now`` defaults to ``time.time()``."""
        return render_headers(self.allowed, self.limit, self.remaining, self.retry_after,
                              self.reset_after, self.rule, self.window, wall_now)


cdef inline int64_t whole_units(double remaining) noexcept nogil:
    """``max(0, floor(remaining))`` (docs/spec.md §2's remaining): for values of at
    least 1 truncation is the floor, and it needs no libm call."""
    return <int64_t>remaining if remaining >= 1.0 else 0


cdef extern from "_decision_pool.h":
    Decision nl_decision_new()
    int nl_decision_pool_install(PyTypeObject* decision_type) except -1
    int nl_decision_pool_size()

nl_decision_pool_install(<PyTypeObject*>Decision)


def _decision_pool_size():
    """Dead Decisions held for reuse; -1 where this build has no pool (tests)."""
    return nl_decision_pool_size()


cdef inline Decision make_decision(const Verdict* v, int64_t limit, str rule, double window):
    # Every field is set below: a pooled Decision still holds its last values.
    cdef Decision d = nl_decision_new()
    d.allowed = v.allowed
    d.limit = limit
    d.remaining = whole_units(v.remaining)
    d.retry_after = v.retry_after
    d.reset_after = v.reset_after
    d.rule = rule
    d.window = window
    d.delay = v.delay
    d.at = v.at
    if v.storage_full:
        d.degraded = True
        d.reason = REASON_STORAGE_FULL
    else:
        d.degraded = False
        d.reason = REASON_NONE
    return d
