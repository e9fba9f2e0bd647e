/* _headers.c's entry point, registered in _speedups.c's method table. */
#ifndef ACE_HEADERS_H
#define ACE_HEADERS_H

#include <Python.h>

PyObject *ace_header_map(PyObject *module, PyObject *data);

#endif
