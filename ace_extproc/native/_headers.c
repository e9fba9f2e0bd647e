/* Envoy's request headers as a dict, read from the message's wire bytes.
 *
 * header_map(data) -> {key: value}
 *     server.py's header_map_pure on a serialized ProcessingRequest (the bytes gRPC
 *     received): request_headers.headers' HeaderValues, each ``key`` to its
 *     ``raw_value`` decoded as latin-1 (Envoy 1.40 sends values there, not in
 *     ``value``), the last of a repeated key kept; {} for a message of another kind.
 *     Walking the parsed message from Python costs a wrapper object and two field
 *     reads a header, more than the rest of the header phase (bench/RESULTS.md).
 *     Fields other than those are skipped, as unknown ones are; a malformed message
 *     raises ValueError (upb parsed the same bytes first: never expected).
 *
 * Field numbers: envoy/service/ext_proc/v3/external_processor.proto (request_headers
 * = 2), envoy/config/core/v3/base.proto (HttpHeaders.headers = 1, HeaderMap.headers =
 * 1, HeaderValue.key = 1, raw_value = 3).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_headers.h"

typedef struct {
    const uint8_t *p, *end;
} Reader;

static int varint(Reader *r, uint64_t *out)
{
    uint64_t v = 0;
    for (int shift = 0; shift < 64 && r->p < r->end; shift += 7) {
        uint8_t b = *r->p++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

/* One field's tag, and for a length-delimited field its bytes in ``*sub``; other wire
 * types are skipped (``sub`` left empty). */
static int field(Reader *r, uint64_t *number, Reader *sub)
{
    uint64_t tag, n;
    if (varint(r, &tag) < 0)
        return -1;
    *number = tag >> 3;
    sub->p = sub->end = NULL;
    switch (tag & 7) {
    case 0:
        return varint(r, &n);
    case 1:
        if (r->end - r->p < 8)
            return -1;
        r->p += 8;
        return 0;
    case 2:
        if (varint(r, &n) < 0 || n > (uint64_t)(r->end - r->p))
            return -1;
        sub->p = r->p;
        sub->end = r->p + n;
        r->p += n;
        return 0;
    case 5:
        if (r->end - r->p < 4)
            return -1;
        r->p += 4;
        return 0;
    default: /* groups: not in these messages */
        return -1;
    }
}

/* One HeaderValue into ``out``; -1 when malformed (an error set only by Python). */
static int header_value(Reader r, PyObject *out)
{
    Reader key = {NULL, NULL}, raw = {NULL, NULL}, sub;
    uint64_t number;
    while (r.p < r.end) {
        if (field(&r, &number, &sub) < 0)
            return -1;
        if (number == 1 && sub.p != NULL)
            key = sub;
        else if (number == 3 && sub.p != NULL)
            raw = sub;
    }
    PyObject *k = PyUnicode_DecodeUTF8((const char *)key.p, key.end - key.p, NULL);
    if (k == NULL)
        return -1;
    PyObject *v = PyUnicode_DecodeLatin1((const char *)raw.p, raw.end - raw.p, NULL);
    int rc = v == NULL ? -1 : PyDict_SetItem(out, k, v);
    Py_DECREF(k);
    Py_XDECREF(v);
    return rc;
}

/* Each occurrence of the length-delimited field ``number`` in ``r``, in order, through
 * ``each`` (a message field sent in parts is merged: its repeated fields concatenate). */
static int each_field(Reader r, uint64_t number, int (*each)(Reader, PyObject *), PyObject *out)
{
    Reader sub;
    uint64_t n;
    while (r.p < r.end) {
        if (field(&r, &n, &sub) < 0)
            return -1;
        if (n == number && sub.p != NULL && each(sub, out) < 0)
            return -1;
    }
    return 0;
}

static int header_map_values(Reader map, PyObject *out) /* HeaderMap.headers = 1 */
{
    return each_field(map, 1, header_value, out);
}

static int http_headers(Reader http, PyObject *out) /* HttpHeaders.headers = 1 */
{
    return each_field(http, 1, header_map_values, out);
}

PyObject *ace_header_map(PyObject *Py_UNUSED(module), PyObject *data)
{
    if (!PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "header_map: data must be bytes");
        return NULL;
    }
    const uint8_t *p = (const uint8_t *)PyBytes_AS_STRING(data);
    Reader r = {p, p + PyBytes_GET_SIZE(data)};
    PyObject *out = PyDict_New();
    if (out != NULL && each_field(r, 2, http_headers, out) < 0) { /* request_headers = 2 */
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "header_map: not a ProcessingRequest");
        Py_CLEAR(out);
    }
    return out;
}
