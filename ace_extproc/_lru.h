/* _lru.c's type and entry points, registered in _speedups.c's module. */
#ifndef ACE_LRU_H
#define ACE_LRU_H

#include <Python.h>

int ace_lru_add_type(PyObject *module);
PyObject *ace_record(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *ace_evict(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *ace_match(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

/* For _pick.c: one holder's depth, the length of its held run of the hashes ``items``
 * (it holds the first; ``lru`` must be a BlockLRU), and record() on ``items``. Each
 * returns -1 with an error set. */
int ace_lru_depth(PyObject *lru, PyObject **items, Py_ssize_t n, Py_ssize_t *depth);
int ace_lru_record(PyObject *lru, PyObject **items, Py_ssize_t n, PyObject *roots,
                   PyObject *bit, Py_ssize_t capacity);

#endif
