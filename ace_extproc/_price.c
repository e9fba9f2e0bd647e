/* The cost pipeline's pricing of every candidate pod, in one call.
 *
 * price(slots, depths, rooms, load, n, tokens, params, keep) -> (near, deepest, order)
 *     routing/pipeline.py's price_pure, which is the reference (its docstring says
 *     what each argument is); both give the same result for the same input, bit for
 *     bit (tests/test_price.py). In Python the loop over the candidates, a tuple
 *     per pod and the sort were the largest part of a pick (bench/RESULTS.md).
 *
 *       slots    tuple of candidate slots (ints), in any order
 *       depths   {slot: leading blocks held}
 *       rooms    (slot -> LRU, slot -> capacity, default capacity): BlockIndex
 *                (an LRU is read for its length alone: a BlockLRU or a dict)
 *       load     list of PodLoad, indexed by slot (reads queued_prefill_tokens)
 *       n        the prompt's blocks; tokens: its tokens
 *       params   PriceParams (7 floats)
 *       keep     how many of the cheapest slots ``order`` holds (>= 1)
 *
 * The arithmetic follows the Python expressions operation by operation, so the
 * doubles are the same; ties in price break by slot, as Python's tuple sort does.
 * Nothing is sorted: the near-best set does not depend on order, and ``order`` is
 * the ``keep`` cheapest, found in one pass (a pick wants two or three for Envoy's
 * retries; with hundreds of pods, sorting them all was most of the pick).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_price.h"


/* A dict's int value for ``key``, or ``fallback`` when absent; -1 with an error set. */
static int lookup_int(PyObject *dict, PyObject *key, long long fallback, long long *out)
{
    PyObject *value = PyDict_GetItemWithError(dict, key);
    if (value == NULL) {
        if (PyErr_Occurred())
            return -1;
        *out = fallback;
        return 0;
    }
    *out = PyLong_AsLongLong(value);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static PyObject *queued_name; /* "queued_prefill_tokens", interned once */

/* mask | 1 << slot, for a slot past a machine word (a fleet of over 64 pods). */
static PyObject *or_bit(PyObject *mask, PyObject *slot)
{
    PyObject *one = PyLong_FromLong(1);
    if (one == NULL)
        return NULL;
    PyObject *bit = PyNumber_Lshift(one, slot);
    Py_DECREF(one);
    if (bit == NULL)
        return NULL;
    PyObject *out = PyNumber_Or(mask, bit);
    Py_DECREF(bit);
    return out;
}

Py_ssize_t ace_cheapest(const Priced *priced, Py_ssize_t count, Py_ssize_t keep,
                        const Priced **best)
{
    /* An insertion into a short sorted list: nothing else is sorted. */
    Py_ssize_t held = 0;
    for (Py_ssize_t i = 0; i < count && keep > 0; i++) {
        const Priced *p = &priced[i];
        if (held == keep && !ace_before(p, best[held - 1]))
            continue;
        Py_ssize_t at = held < keep ? held++ : keep - 1;
        while (at > 0 && ace_before(p, best[at - 1])) {
            best[at] = best[at - 1];
            at--;
        }
        best[at] = p;
    }
    return held;
}

/* (near, deepest, order) from the priced slots: ``cheapest`` is the lowest cost. */
static PyObject *choose(const Priced *priced, Py_ssize_t count, double cheapest,
                        double slack_ratio, double slack_ms, Py_ssize_t keep)
{
    double limit = cheapest * (1 + slack_ratio) + slack_ms;
    long long deepest = -1;
    for (Py_ssize_t i = 0; i < count; i++)
        if (!(priced[i].cost > limit) && priced[i].depth > deepest)
            deepest = priced[i].depth;
    uint64_t low = 0; /* the near-best's bits below 64 */
    for (Py_ssize_t i = 0; i < count; i++)
        if (!(priced[i].cost > limit) && priced[i].depth == deepest && priced[i].slot < 64)
            low |= (uint64_t)1 << priced[i].slot;
    PyObject *near = PyLong_FromUnsignedLongLong(low);
    for (Py_ssize_t i = 0; near != NULL && i < count; i++) {
        if (priced[i].slot >= 64 && !(priced[i].cost > limit) && priced[i].depth == deepest) {
            PyObject *next = or_bit(near, priced[i].obj);
            Py_DECREF(near);
            near = next;
        }
    }
    if (near == NULL)
        return NULL;
    if (keep > count)
        keep = count;
    const Priced **best = PyMem_New(const Priced *, (size_t)keep);
    if (best == NULL) {
        Py_DECREF(near);
        return PyErr_NoMemory();
    }
    ace_cheapest(priced, count, keep, best);
    PyObject *order = PyTuple_New(keep);
    if (order != NULL) {
        for (Py_ssize_t i = 0; i < keep; i++) {
            Py_INCREF(best[i]->obj);
            PyTuple_SET_ITEM(order, i, best[i]->obj);
        }
    }
    PyMem_Free(best);
    if (order == NULL) {
        Py_DECREF(near);
        return NULL;
    }
    return Py_BuildValue("(NLN)", near, deepest, order);
}

int ace_pricing(PyObject *params, PyObject *rooms, const char *function, Pricing *out)
{
    if (!PyTuple_Check(rooms) || PyTuple_GET_SIZE(rooms) != 3 ||
        !PyDict_Check(PyTuple_GET_ITEM(rooms, 0)) || !PyDict_Check(PyTuple_GET_ITEM(rooms, 1))) {
        PyErr_Format(PyExc_TypeError, "%s: rooms must be (dict, dict, int)", function);
        return -1;
    }
    if (!PyTuple_Check(params) || PyTuple_GET_SIZE(params) != 7) {
        PyErr_Format(PyExc_TypeError, "%s: params must be a PriceParams", function);
        return -1;
    }
    double p[7];
    for (int i = 0; i < 7; i++) {
        p[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(params, i));
        if (p[i] == -1.0 && PyErr_Occurred())
            return -1;
    }
    *out = (Pricing){p[0], p[1], p[2], p[3], p[4], p[5], p[6], PyTuple_GET_ITEM(rooms, 0),
                     PyTuple_GET_ITEM(rooms, 1), 0};
    out->default_capacity = PyLong_AsLongLong(PyTuple_GET_ITEM(rooms, 2));
    if (out->default_capacity == -1 && PyErr_Occurred())
        return -1;
    if (queued_name == NULL && (queued_name = PyUnicode_InternFromString(
                                    "queued_prefill_tokens")) == NULL)
        return -1;
    return 0;
}

int ace_cost(const Pricing *pr, PyObject *obj, PyObject *load_item, long long depth,
             long long n, long long tokens, double *cost_out)
{
    long long cached = 0;
    if (depth) {
        cached = (long long)((double)depth * pr->tpb);
        if (cached > tokens - 1)
            cached = tokens - 1;
    }
    long long fresh = tokens - cached > 0 ? tokens - cached : 0;
    double x = pr->a_ms * (double)fresh +
               pr->b_ms * (double)fresh * ((double)cached + (double)fresh / 2);
    double cost = x > pr->t_step_ms ? x : pr->t_step_ms;
    if (pr->evict_ms != 0.0) {
        long long capacity, held = 0;
        if (lookup_int(pr->capacities, obj, pr->default_capacity, &capacity) < 0)
            return -1;
        PyObject *lru = PyDict_GetItemWithError(pr->lrus, obj);
        if (lru != NULL && lru != Py_None) { /* None: held nothing, as in Python */
            held = PyObject_Length(lru);
            if (held < 0)
                return -1;
        } else if (PyErr_Occurred()) {
            return -1;
        }
        long long overflow = n - depth - (capacity - held);
        if (overflow > 0)
            cost += pr->evict_ms * (double)(overflow < n - depth ? overflow : n - depth);
    }
    PyObject *queued_obj = PyObject_GetAttr(load_item, queued_name);
    if (queued_obj == NULL)
        return -1;
    long long queued = PyLong_AsLongLong(queued_obj);
    Py_DECREF(queued_obj);
    if (queued == -1 && PyErr_Occurred())
        return -1;
    if (queued > 0)
        cost += pr->a_ms * (double)queued;
    *cost_out = cost;
    return 0;
}

PyObject *ace_price(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "price(slots, depths, rooms, load, n, tokens, params, "
                                         "keep) takes 8 arguments");
        return NULL;
    }
    PyObject *slots = args[0], *depths = args[1], *load = args[3];
    if (!PyTuple_Check(slots) || PyTuple_GET_SIZE(slots) == 0) {
        PyErr_SetString(PyExc_TypeError, "price: slots must be a non-empty tuple");
        return NULL;
    }
    if (!PyDict_Check(depths)) {
        PyErr_SetString(PyExc_TypeError, "price: depths must be a dict");
        return NULL;
    }
    if (!PyList_Check(load)) {
        PyErr_SetString(PyExc_TypeError, "price: load must be a list");
        return NULL;
    }
    Pricing pr;
    if (ace_pricing(args[6], args[2], "price", &pr) < 0)
        return NULL;
    long long n = PyLong_AsLongLong(args[4]);
    long long tokens = PyLong_AsLongLong(args[5]);
    Py_ssize_t keep = PyLong_AsSsize_t(args[7]);
    if (PyErr_Occurred())
        return NULL;
    if (keep < 1) {
        PyErr_SetString(PyExc_ValueError, "price: keep must be at least 1");
        return NULL;
    }

    Py_ssize_t count = PyTuple_GET_SIZE(slots);
    Priced small[64];
    Priced *priced = count <= 64 ? small : PyMem_New(Priced, (size_t)count);
    if (priced == NULL)
        return PyErr_NoMemory();
    PyObject *result = NULL;
    double cheapest = 0.0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *obj = PyTuple_GET_ITEM(slots, i);
        long long slot = PyLong_AsLongLong(obj), depth;
        double cost;
        if (slot == -1 && PyErr_Occurred())
            goto done;
        if (slot < 0 || slot >= PyList_GET_SIZE(load)) {
            PyErr_Format(PyExc_IndexError, "price: slot %lld has no load", slot);
            goto done;
        }
        if (lookup_int(depths, obj, 0, &depth) < 0 ||
            ace_cost(&pr, obj, PyList_GET_ITEM(load, slot), depth, n, tokens, &cost) < 0)
            goto done;
        priced[i] = (Priced){cost, slot, depth, obj};
        if (i == 0 || cost < cheapest)
            cheapest = cost;
    }
    result = choose(priced, count, cheapest, pr.slack_ratio, pr.slack_ms, keep);
done:
    if (priced != small)
        PyMem_Free(priced);
    return result;
}
