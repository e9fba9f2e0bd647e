/* The cost pipeline's whole pick in one call.
 *
 * pick(blocks, slots, rooms, roots, load, seeds, params, fallbacks, max_kv_usage,
 *      tokens, route_key, home, min_match, steer) -> (chosen, held, action, backups)
 *
 *     routing/pipeline.py's Pipeline._choose, which is the reference (its docstring
 *     says what each argument and result is), for the default pipeline: the
 *     saturation filter, each holder's match depth, the session and shallow-match
 *     rules, the pricing of every candidate (_price.c's), the session's pod or the
 *     rendezvous order among the near-best, and the chosen pod's LRU record
 *     (_lru.c's). Both give the same result and leave the index alike
 *     (tests/test_pick.py). Done as one call because, priced step by step, the
 *     Python between the C steps (a dict of depths, the filter's comprehension, the
 *     rendezvous loop) cost more than the steps themselves (bench/RESULTS.md).
 *
 *       blocks     list of the prompt's block hashes (ints)
 *       slots      tuple of candidate slots, ascending
 *       rooms      (slot -> BlockLRU, slot -> capacity, default capacity): BlockIndex
 *       roots      {first block: bitmask of the pods holding it}: BlockIndex
 *       load       list of PodLoad by slot (kv_usage, queued_prefill_tokens)
 *       seeds      list of (rendezvous seed, weight) by slot: FleetState.seeds
 *       params     PriceParams; fallbacks: how many backups to name (>= 0)
 *       tokens     the prompt's tokens; route_key: what places a new prefix
 *       home       the session's pod, or -1; min_match: the shallow-match share
 *       steer      False for a session this replica never routed: no match steers
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

#include "_lru.h"
#include "_pick.h"
#include "_price.h"

#define XXH_INLINE_ALL
#include "xxhash.h"

static PyObject *kv_usage_name; /* "kv_usage", interned once */
static PyObject *hit_str, *miss_str, *spill_str; /* the actions, interned once */

/* The rendezvous score of ``key`` on a pod (rendezvous.py's score, operation by
 * operation, so the doubles are the same). */
static int score(uint64_t key, PyObject *seed_weight, double *out)
{
    if (!PyTuple_Check(seed_weight) || PyTuple_GET_SIZE(seed_weight) != 2) {
        PyErr_SetString(PyExc_TypeError, "pick: a seed must be a (seed, weight) tuple");
        return -1;
    }
    unsigned long long seed = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(seed_weight, 0));
    double weight = PyFloat_AsDouble(PyTuple_GET_ITEM(seed_weight, 1));
    if (PyErr_Occurred())
        return -1;
    uint8_t data[8]; /* key.to_bytes(8, "little") */
    for (int i = 0; i < 8; i++)
        data[i] = (uint8_t)(key >> (8 * i));
    uint64_t h = XXH3_64bits_withSeed(data, 8, seed);
    *out = -weight / log(((double)h + 0.5) * (1.0 / 18446744073709551616.0));
    return 0;
}

/* The int ``mask``'s bits as ``count`` 64-bit words, lowest first. */
static int mask_words(PyObject *mask, uint64_t *words, Py_ssize_t count)
{
    PyObject *rest = mask, *shift = NULL;
    Py_INCREF(rest);
    for (Py_ssize_t w = 0; w < count; w++) {
        words[w] = PyLong_AsUnsignedLongLongMask(rest);
        if (words[w] == (uint64_t)-1 && PyErr_Occurred())
            goto fail;
        if (w + 1 < count) {
            if (shift == NULL && (shift = PyLong_FromLong(64)) == NULL)
                goto fail;
            PyObject *next = PyNumber_Rshift(rest, shift);
            Py_DECREF(rest);
            if ((rest = next) == NULL)
                goto fail;
        }
    }
    Py_XDECREF(shift);
    Py_DECREF(rest);
    return 0;
fail:
    Py_XDECREF(shift);
    Py_XDECREF(rest);
    return -1;
}

/* Per candidate: what ``Priced`` holds, and what its pod really holds. */
typedef struct {
    Priced p; /* p.depth: the depth that steers */
    long long held;
} Candidate;

static PyObject *pick_among(Candidate *c, Py_ssize_t count, PyObject *const *args,
                            PyObject **items, Py_ssize_t n);

PyObject *ace_pick(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 14) {
        PyErr_SetString(PyExc_TypeError,
                        "pick(blocks, slots, rooms, roots, load, seeds, params, fallbacks, "
                        "max_kv_usage, tokens, route_key, home, min_match, steer) takes 14 "
                        "arguments");
        return NULL;
    }
    PyObject *blocks = args[0], *slots = args[1], *roots = args[3], *load = args[4];
    if (!PyList_CheckExact(blocks) || !PyTuple_Check(slots) || PyTuple_GET_SIZE(slots) == 0 ||
        !PyDict_Check(roots) || !PyList_Check(load) || !PyList_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "pick: blocks must be a list, slots a non-empty "
                                         "tuple, roots a dict, load and seeds lists");
        return NULL;
    }
    double limit = PyFloat_AsDouble(args[8]);
    if (limit == -1.0 && PyErr_Occurred())
        return NULL;
    if (kv_usage_name == NULL &&
        ((kv_usage_name = PyUnicode_InternFromString("kv_usage")) == NULL ||
         (hit_str = PyUnicode_InternFromString("hit")) == NULL ||
         (miss_str = PyUnicode_InternFromString("miss")) == NULL ||
         (spill_str = PyUnicode_InternFromString("spill")) == NULL)) {
        Py_CLEAR(kv_usage_name);
        return NULL;
    }
    Py_ssize_t count = PyTuple_GET_SIZE(slots), kept = 0;
    Candidate small[64];
    Candidate *c = count <= 64 ? small : PyMem_New(Candidate, (size_t)count);
    if (c == NULL)
        return PyErr_NoMemory();
    PyObject *result = NULL;
    /* NotSaturated: drop pods whose KV cache is nearly full, unless that is all. */
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *obj = PyTuple_GET_ITEM(slots, i);
        long long slot = PyLong_AsLongLong(obj);
        if (slot == -1 && PyErr_Occurred())
            goto done;
        if (slot < 0 || slot >= PyList_GET_SIZE(load) || slot >= PyList_GET_SIZE(args[5])) {
            PyErr_Format(PyExc_IndexError, "pick: slot %lld has no load or seed", slot);
            goto done;
        }
        PyObject *usage_obj = PyObject_GetAttr(PyList_GET_ITEM(load, slot), kv_usage_name);
        if (usage_obj == NULL)
            goto done;
        double usage = PyFloat_AsDouble(usage_obj);
        Py_DECREF(usage_obj);
        if (usage == -1.0 && PyErr_Occurred())
            goto done;
        c[i].p = (Priced){0.0, slot, 0, obj};
        c[i].held = usage >= limit; /* for now: saturated */
        kept += usage < limit;
    }
    if (kept > 0 && kept < count) {
        Py_ssize_t k = 0;
        for (Py_ssize_t i = 0; i < count; i++)
            if (!c[i].held)
                c[k++] = c[i];
        count = k;
    }
    result = pick_among(c, count, args, PySequence_Fast_ITEMS(blocks), PyList_GET_SIZE(blocks));
done:
    if (c != small)
        PyMem_Free(c);
    return result;
}

/* The pick among the filtered candidates ``c`` (the rest of ace_pick). */
static PyObject *pick_among(Candidate *c, Py_ssize_t count, PyObject *const *args,
                            PyObject **items, Py_ssize_t n)
{
    PyObject *rooms = args[2], *roots = args[3], *load = args[4], *seeds = args[5];
    Pricing pr;
    if (ace_pricing(args[6], rooms, "pick", &pr) < 0)
        return NULL;
    Py_ssize_t fallbacks = PyLong_AsSsize_t(args[7]), keep = fallbacks + 1;
    long long tokens = PyLong_AsLongLong(args[9]);
    unsigned long long route_key = PyLong_AsUnsignedLongLong(args[10]);
    long long home = PyLong_AsLongLong(args[11]);
    double min_match = PyFloat_AsDouble(args[12]);
    int steer = PyObject_IsTrue(args[13]);
    if (PyErr_Occurred() || steer < 0)
        return NULL;
    if (fallbacks < 0) {
        PyErr_SetString(PyExc_ValueError, "pick: fallbacks must not be negative");
        return NULL;
    }
    /* Each holder's depth: only pods holding the first block hold any. */
    long long max_held = 0;
    int any_held = 0;
    if (n > 0) {
        PyObject *holders = PyDict_GetItemWithError(roots, items[0]);
        if (holders == NULL && PyErr_Occurred())
            return NULL;
        if (holders != NULL) {
            long long top_slot = 0;
            for (Py_ssize_t i = 0; i < count; i++)
                if (c[i].p.slot > top_slot)
                    top_slot = c[i].p.slot;
            Py_ssize_t nwords = (Py_ssize_t)(top_slot >> 6) + 1;
            uint64_t one_word, *words = nwords == 1 ? &one_word : PyMem_New(uint64_t, nwords);
            if (words == NULL)
                return PyErr_NoMemory();
            int rc = mask_words(holders, words, nwords);
            for (Py_ssize_t i = 0; rc == 0 && i < count; i++) {
                long long slot = c[i].p.slot;
                c[i].held = 0;
                if (!((words[slot >> 6] >> (slot & 63)) & 1))
                    continue;
                PyObject *lru = PyDict_GetItemWithError(pr.lrus, c[i].p.obj);
                Py_ssize_t depth;
                if (lru == NULL) {
                    if (!PyErr_Occurred())
                        PyErr_SetObject(PyExc_KeyError, c[i].p.obj);
                    rc = -1;
                } else if ((rc = ace_lru_depth(lru, items, n, &depth)) == 0) {
                    c[i].held = depth;
                    any_held = 1;
                    if (depth > max_held)
                        max_held = depth;
                }
            }
            if (words != &one_word)
                PyMem_Free(words);
            if (rc < 0)
                return NULL;
        }
    }
    if (!any_held)
        for (Py_ssize_t i = 0; i < count; i++)
            c[i].held = 0;
    /* What steers: nothing for a new session; past a shallow match, only deep matches
     * and the session's own pod, and if none is left the prompt's own key places it. */
    double shallow = min_match * (double)n;
    int steering = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        long long d = c[i].held;
        if (!steer || (min_match != 0.0 && any_held && !((double)d >= shallow) &&
                       c[i].p.slot != home))
            d = 0;
        c[i].p.depth = d;
        steering |= d != 0;
    }
    if (steer && min_match != 0.0 && any_held && !steering) {
        route_key = PyLong_AsUnsignedLongLong(items[max_held < n - 1 ? max_held : n - 1]);
        if (route_key == (unsigned long long)-1 && PyErr_Occurred())
            return NULL;
    }
    /* Price every candidate; the near-best hold the deepest match among them. */
    double cheapest = 0.0;
    for (Py_ssize_t i = 0; i < count; i++) {
        double cost;
        if (ace_cost(&pr, c[i].p.obj, PyList_GET_ITEM(load, c[i].p.slot), c[i].p.depth, n,
                     tokens, &cost) < 0)
            return NULL;
        c[i].p.cost = cost;
        if (i == 0 || cost < cheapest)
            cheapest = cost;
    }
    double limit = cheapest * (1 + pr.slack_ratio) + pr.slack_ms;
    long long deepest = -1, best = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!(c[i].p.cost > limit) && c[i].p.depth > deepest)
            deepest = c[i].p.depth;
        if (c[i].p.depth > best)
            best = c[i].p.depth;
    }
    /* The session's pod among equals, else the best of the rendezvous order among the
     * near-best (on equal scores the lowest slot, as rendezvous.best's ascending scan). */
    Py_ssize_t chosen = -1, near = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (c[i].p.cost > limit || c[i].p.depth != deepest)
            continue;
        near++;
        if (c[i].p.slot == home)
            chosen = i;
    }
    if (chosen < 0) {
        double top = -1.0;
        for (Py_ssize_t i = 0; i < count; i++) {
            if (c[i].p.cost > limit || c[i].p.depth != deepest)
                continue;
            double s = 0.0; /* one near-best pod: no score needed */
            if (near > 1 && score(route_key, PyList_GET_ITEM(seeds, c[i].p.slot), &s) < 0)
                return NULL;
            if (chosen < 0 || s > top || (s == top && c[i].p.slot < c[chosen].p.slot)) {
                chosen = i;
                top = s;
            }
        }
    }
    if (chosen < 0) {
        PyErr_SetString(PyExc_ValueError, "pick: no candidate priced (a NaN?)");
        return NULL;
    }
    /* The chosen pod now holds the prompt. */
    const Candidate *won = &c[chosen];
    PyObject *lru = PyDict_GetItemWithError(pr.lrus, won->p.obj);
    if (lru == NULL && PyErr_Occurred())
        return NULL;
    if (lru != NULL && n > 0) {
        long long capacity = pr.default_capacity;
        PyObject *cap = PyDict_GetItemWithError(pr.capacities, won->p.obj);
        if (cap == NULL && PyErr_Occurred())
            return NULL;
        if (cap != NULL && (capacity = PyLong_AsLongLong(cap)) == -1 && PyErr_Occurred())
            return NULL;
        PyObject *one = PyLong_FromLong(1);
        PyObject *bit = one == NULL ? NULL : PyNumber_Lshift(one, won->p.obj);
        Py_XDECREF(one);
        if (bit == NULL)
            return NULL;
        int rc = ace_lru_record(lru, items, n, roots, bit, (Py_ssize_t)capacity);
        Py_DECREF(bit);
        if (rc < 0)
            return NULL;
    }
    /* The next cheapest, for Envoy's retries: the ``keep`` cheapest less the chosen. */
    Priced *priced = PyMem_New(Priced, (size_t)count);
    const Priced **cheap = PyMem_New(const Priced *, (size_t)(keep < count ? keep : count));
    PyObject *backups = NULL;
    if (priced == NULL || cheap == NULL) {
        PyErr_NoMemory();
    } else {
        for (Py_ssize_t i = 0; i < count; i++)
            priced[i] = c[i].p;
        Py_ssize_t held = ace_cheapest(priced, count, keep, cheap), named = 0;
        for (Py_ssize_t i = 0; i < held; i++)
            named += cheap[i]->slot != won->p.slot;
        if (named > fallbacks)
            named = fallbacks;
        backups = PyTuple_New(named);
        for (Py_ssize_t i = 0, k = 0; backups != NULL && k < named; i++) {
            if (cheap[i]->slot == won->p.slot)
                continue;
            Py_INCREF(cheap[i]->obj);
            PyTuple_SET_ITEM(backups, k++, cheap[i]->obj);
        }
    }
    PyMem_Free(priced);
    PyMem_Free(cheap);
    if (backups == NULL)
        return NULL;
    /* What steered: none (a miss), the chosen pod's match (a hit), or a deeper match
     * elsewhere (a spill: the hot prefix moved on). */
    PyObject *action = !best ? miss_str : won->p.depth == best ? hit_str : spill_str;
    return Py_BuildValue("(OLON)", won->p.obj, won->held, action, backups);
}
