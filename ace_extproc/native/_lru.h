/* _lru.c's type and entry points, registered in _speedups.c's module. */
#ifndef ACE_LRU_H
#define ACE_LRU_H

#include <Python.h>

int ace_lru_add_type(PyObject *module);
PyObject *ace_record(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *ace_evict(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *ace_match(PyObject *module, PyObject *const *args, Py_ssize_t nargs);


#endif
