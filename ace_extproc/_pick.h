/* _pick.c's entry point, registered in _speedups.c's method table. */
#ifndef ACE_PICK_H
#define ACE_PICK_H

#include <Python.h>

PyObject *ace_pick(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

#endif
