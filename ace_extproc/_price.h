/* _price.c's entry point, registered in _speedups.c's method table, and the pricing
 * it shares with _pick.c (the cost pipeline's whole pick in one call). */
#ifndef ACE_PRICE_H
#define ACE_PRICE_H

#include <Python.h>

PyObject *ace_price(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

/* A priced candidate. */
typedef struct {
    double cost;
    long long slot;
    long long depth;
    PyObject *obj; /* the slot's int, borrowed */
} Priced;

/* Whether ``a`` comes before ``b``: cheaper, or as cheap and a lower slot. */
static inline int ace_before(const Priced *a, const Priced *b)
{
    return a->cost < b->cost || (a->cost == b->cost && a->slot < b->slot);
}

/* What prices every candidate of one request: PriceParams' floats and the rooms. */
typedef struct {
    double tpb, a_ms, b_ms, t_step_ms, evict_ms, slack_ratio, slack_ms;
    PyObject *lrus, *capacities; /* borrowed from the rooms tuple */
    long long default_capacity;
} Pricing;

/* ``params`` (PriceParams) and ``rooms`` ((lrus, capacities, default)) read into
 * ``out``; -1 with an error set (``function`` names the caller). */
int ace_pricing(PyObject *params, PyObject *rooms, const char *function, Pricing *out);

/* The cost of ``load_item`` (a PodLoad) at ``slot`` (``obj``: its int) holding ``depth``
 * of the prompt's ``n`` blocks (``tokens`` tokens); -1 with an error set. */
int ace_cost(const Pricing *pr, PyObject *obj, PyObject *load_item, long long depth,
             long long n, long long tokens, double *cost);

/* ``count`` candidates' ``keep`` cheapest (ties by slot), cheapest first, into ``best``
 * (room for ``keep``); returns how many. */
Py_ssize_t ace_cheapest(const Priced *priced, Py_ssize_t count, Py_ssize_t keep,
                        const Priced **best);

#endif
