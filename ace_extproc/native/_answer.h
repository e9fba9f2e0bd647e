/* _answer.c's entry points, registered in _speedups.c's method table. */
#ifndef ACE_ANSWER_H
#define ACE_ANSWER_H

#include <Python.h>

PyObject *ace_body_answer(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *ace_splice(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

#endif
