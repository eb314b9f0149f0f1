/* A pool of dead Decision objects for the hot path to reuse.
 *
 * Why: allocating a Decision through its type (Cython's freelist pop, a
 * memset of the object, PyObject_Init, two None fields set and then
 * overwritten) and deallocating it (two fields cleared) is ~120 instructions,
 * a fifth of a whole decision. A pooled object keeps its type and its two
 * str fields; reusing one is a pop and a reference count of 1, and the
 * caller overwrites every field. Deallocation pushes it back with its fields
 * still set (their strings stay alive until the object is reused or the
 * pool overflows, at most NL_DECISION_POOL of them).
 *
 * The pool is process-global and unlocked, so it only exists where the GIL
 * guards it (not on free-threaded CPython), and not where an object must be
 * counted or registered on creation (debug builds) or the type is opaque
 * (the limited API). There, and for a type the garbage collector tracks
 * (a pooled object would come back untracked), nl_decision_new() is the
 * type's own tp_new. */
#ifndef NANOLIMIT_DECISION_POOL_H
#define NANOLIMIT_DECISION_POOL_H

#include <Python.h>

#if !defined(Py_GIL_DISABLED) && !defined(Py_REF_DEBUG) && !defined(Py_LIMITED_API)
#  define NL_HAVE_DECISION_POOL 1
#else
#  define NL_HAVE_DECISION_POOL 0
#endif

#define NL_DECISION_POOL 64

static PyTypeObject *nl_decision_type = NULL;
static PyObject *nl_decision_no_args = NULL;

#if NL_HAVE_DECISION_POOL
static destructor nl_decision_base_dealloc = NULL;
static PyObject *nl_decision_pool[NL_DECISION_POOL];
static int nl_decision_pooled = 0;

static void nl_decision_dealloc(PyObject *o)
{
    /* The type is final, so every instance is exactly a Decision. */
    if (nl_decision_pooled < NL_DECISION_POOL) {
        nl_decision_pool[nl_decision_pooled++] = o;
        return;
    }
    nl_decision_base_dealloc(o);
}
#endif

/* Called once at import, after the type is ready: -1 with an exception set
 * on failure. */
static int nl_decision_pool_install(PyTypeObject *type)
{
    nl_decision_no_args = PyTuple_New(0);
    if (nl_decision_no_args == NULL)
        return -1;
    Py_INCREF(type);
    nl_decision_type = type;
#if NL_HAVE_DECISION_POOL
    if (!PyType_HasFeature(type, Py_TPFLAGS_HAVE_GC) && type->tp_itemsize == 0
        && type->tp_dealloc != nl_decision_dealloc) {  /* never wrap ourselves */
        nl_decision_base_dealloc = type->tp_dealloc;
        type->tp_dealloc = nl_decision_dealloc;
    }
#endif
    return 0;
}

/* A new reference to a Decision whose every field the caller sets, or NULL
 * with an exception set. */
static inline PyObject *nl_decision_new(void)
{
#if NL_HAVE_DECISION_POOL
    if (nl_decision_pooled > 0) {
        PyObject *o = nl_decision_pool[--nl_decision_pooled];
        Py_SET_REFCNT(o, 1);
        return o;
    }
#endif
    return nl_decision_type->tp_new(nl_decision_type, nl_decision_no_args, NULL);
}

/* How many dead objects the pool holds; -1 where there is no pool (tests). */
static inline int nl_decision_pool_size(void)
{
#if NL_HAVE_DECISION_POOL
    if (nl_decision_base_dealloc != NULL)
        return nl_decision_pooled;
#endif
    return -1;
}

#endif
