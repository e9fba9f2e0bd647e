/* _price.c's entry point, registered in _speedups.c's method table. */
#ifndef ACE_PRICE_H
#define ACE_PRICE_H

#include <Python.h>

PyObject *ace_price(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

#endif
