/* The body phase's answer to Envoy, written straight to protobuf wire bytes.
 *
 * body_answer(headers, remove, clear_route_cache, body, namespaces) -> bytes
 *     A serialized envoy.service.ext_proc.v3.ProcessingResponse answering a request
 *     body: request_body.response (a CommonResponse: the header mutation, the body
 *     mutation, clear_route_cache) and dynamic_metadata.
 *       headers     [(key: str, raw_value: bytes)], each set OVERWRITE_IF_EXISTS_OR_ADD
 *       remove      [key: str]
 *       body        bytes for body_mutation.body, or None for no body mutation
 *       namespaces  [(namespace: str, [(key: str, value: str | float)])]
 *     mutate.body_answer passes what mutate.body_decided builds in upb, and the two
 *     parse to the same message (tests/test_speedups.py). Filling that message field
 *     by field from Python is a call per field, more than parsing and hashing a
 *     4K-token prompt together; here the sizes are added up first, then everything
 *     is written once, the body copied once.
 *
 * Field numbers: envoy/service/ext_proc/v3/external_processor.proto,
 * envoy/config/core/v3/base.proto, google/protobuf/struct.proto.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_answer.h"

/* Tags: field number << 3 | wire type (2: length-delimited, 0: varint, 1: 64-bit). */
#define TAG_REQUEST_BODY 0x1a     /* ProcessingResponse.request_body = 3 */
#define TAG_DYNAMIC_METADATA 0x42 /* ProcessingResponse.dynamic_metadata = 8 */
#define TAG_RESPONSE 0x0a         /* BodyResponse.response = 1 */
#define TAG_HEADER_MUTATION 0x12  /* CommonResponse.header_mutation = 2 */
#define TAG_BODY_MUTATION 0x1a    /* CommonResponse.body_mutation = 3 */
#define TAG_CLEAR_ROUTE 0x28      /* CommonResponse.clear_route_cache = 5 (varint) */
#define TAG_SET_HEADERS 0x0a      /* HeaderMutation.set_headers = 1 */
#define TAG_REMOVE_HEADERS 0x12   /* HeaderMutation.remove_headers = 2 */
#define TAG_HEADER 0x0a           /* HeaderValueOption.header = 1 */
#define TAG_APPEND_ACTION 0x18    /* HeaderValueOption.append_action = 3 (varint) */
#define OVERWRITE_IF_EXISTS_OR_ADD 2
#define TAG_KEY 0x0a              /* HeaderValue.key = 1; a map entry's key = 1 */
#define TAG_RAW_VALUE 0x1a        /* HeaderValue.raw_value = 3 */
#define TAG_BODY 0x0a             /* BodyMutation.body = 1 */
#define TAG_FIELDS 0x0a           /* Struct.fields = 1: one map entry */
#define TAG_ENTRY_VALUE 0x12      /* a map entry's value = 2 */
#define TAG_NUMBER 0x11           /* Value.number_value = 2 (double) */
#define TAG_STRING 0x1a           /* Value.string_value = 3 */
#define TAG_STRUCT 0x2a           /* Value.struct_value = 5 */

/* An answer names a few headers and a few metadata fields; past these it is a bug. */
#define MAX_HEADERS 16
#define MAX_REMOVE 8
#define MAX_NAMESPACES 4
#define MAX_FIELDS 16

typedef struct {
    const char *p;
    Py_ssize_t n;
} Span;

typedef struct {
    Span key;
    Span text; /* a string value, or text.p == NULL for a number */
    double number;
    size_t value; /* the serialized Value's size */
} MetaField;

typedef struct {
    Span key;
    MetaField fields[MAX_FIELDS];
    Py_ssize_t count;
    size_t fields_size; /* the Struct's size */
} Namespace;

typedef struct {
    Span headers[MAX_HEADERS][2];
    Py_ssize_t n_headers;
    Span remove[MAX_REMOVE];
    Py_ssize_t n_remove;
    int clear_route_cache;
    Span body; /* body.p == NULL: no body mutation */
    Namespace namespaces[MAX_NAMESPACES];
    Py_ssize_t n_namespaces;
} Answer;

static size_t varint_size(size_t v)
{
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

/* A length-delimited field with a one-byte tag. */
static size_t field_size(size_t payload)
{
    return 1 + varint_size(payload) + payload;
}

static uint8_t *put_varint(uint8_t *o, size_t v)
{
    while (v >= 0x80) {
        *o++ = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    *o++ = (uint8_t)v;
    return o;
}

static uint8_t *put_head(uint8_t *o, uint8_t tag, size_t size)
{
    *o++ = tag;
    return put_varint(o, size);
}

static uint8_t *put_span(uint8_t *o, uint8_t tag, Span s)
{
    o = put_head(o, tag, (size_t)s.n);
    memcpy(o, s.p, (size_t)s.n);
    return o + s.n;
}

static int text(PyObject *obj, Span *out, const char *what)
{
    if (!PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "body_answer: %s must be a str", what);
        return -1;
    }
    out->p = PyUnicode_AsUTF8AndSize(obj, &out->n); /* cached on the str */
    return out->p == NULL ? -1 : 0;
}

static int raw(PyObject *obj, Span *out, const char *what)
{
    if (!PyBytes_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "body_answer: %s must be bytes", what);
        return -1;
    }
    out->p = PyBytes_AS_STRING(obj);
    out->n = PyBytes_GET_SIZE(obj);
    return 0;
}

/* A list or tuple of ``count`` pairs at most, its items in ``*items``. */
static int sequence(PyObject *obj, Py_ssize_t limit, const char *what, PyObject ***items,
                    Py_ssize_t *count)
{
    if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "body_answer: %s must be a list or tuple", what);
        return -1;
    }
    *count = PySequence_Fast_GET_SIZE(obj);
    if (*count > limit) {
        PyErr_Format(PyExc_ValueError, "body_answer: more than %zd %s", limit, what);
        return -1;
    }
    *items = PySequence_Fast_ITEMS(obj);
    return 0;
}

static int pair(PyObject *obj, const char *what, PyObject **first, PyObject **second)
{
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 2) {
        PyErr_Format(PyExc_TypeError, "body_answer: each of %s must be a 2-tuple", what);
        return -1;
    }
    *first = PyTuple_GET_ITEM(obj, 0);
    *second = PyTuple_GET_ITEM(obj, 1);
    return 0;
}

static int read_namespace(PyObject *obj, Namespace *ns)
{
    PyObject *name, *fields, **items;
    if (pair(obj, "namespaces", &name, &fields) < 0 || text(name, &ns->key, "a namespace") < 0 ||
        sequence(fields, MAX_FIELDS, "metadata fields", &items, &ns->count) < 0)
        return -1;
    ns->fields_size = 0;
    for (Py_ssize_t i = 0; i < ns->count; i++) {
        MetaField *f = &ns->fields[i];
        PyObject *key, *value;
        if (pair(items[i], "metadata fields", &key, &value) < 0 ||
            text(key, &f->key, "a metadata key") < 0)
            return -1;
        if (PyFloat_Check(value)) {
            f->text.p = NULL;
            f->number = PyFloat_AS_DOUBLE(value);
            f->value = 9;
        }
        else {
            if (text(value, &f->text, "a metadata value (or a float)") < 0)
                return -1;
            f->value = field_size((size_t)f->text.n);
        }
        ns->fields_size += field_size(field_size((size_t)f->key.n) + field_size(f->value));
    }
    return 0;
}

static int read_answer(PyObject *const *args, Answer *a)
{
    PyObject **items, *key, *value;
    if (sequence(args[0], MAX_HEADERS, "headers", &items, &a->n_headers) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < a->n_headers; i++) {
        if (pair(items[i], "headers", &key, &value) < 0 ||
            text(key, &a->headers[i][0], "a header key") < 0 ||
            raw(value, &a->headers[i][1], "a header value") < 0)
            return -1;
    }
    if (sequence(args[1], MAX_REMOVE, "removed headers", &items, &a->n_remove) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < a->n_remove; i++) {
        if (text(items[i], &a->remove[i], "a removed header") < 0)
            return -1;
    }
    if (!PyBool_Check(args[2])) { /* a bool: no __bool__ of ours runs mid-read */
        PyErr_SetString(PyExc_TypeError, "body_answer: clear_route_cache must be a bool");
        return -1;
    }
    a->clear_route_cache = args[2] == Py_True;
    a->body.p = NULL;
    a->body.n = 0;
    if (args[3] != Py_None && raw(args[3], &a->body, "body") < 0)
        return -1;
    if (sequence(args[4], MAX_NAMESPACES, "namespaces", &items, &a->n_namespaces) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < a->n_namespaces; i++) {
        if (read_namespace(items[i], &a->namespaces[i]) < 0)
            return -1;
    }
    return 0;
}

static size_t header_size(const Span *h)
{
    return field_size(field_size((size_t)h[0].n) + field_size((size_t)h[1].n)) + 2;
}

static size_t namespace_size(const Namespace *ns)
{
    return field_size((size_t)ns->key.n) + field_size(field_size(ns->fields_size));
}

static uint8_t *put_struct(uint8_t *o, const Namespace *ns)
{
    for (Py_ssize_t i = 0; i < ns->count; i++) {
        const MetaField *f = &ns->fields[i];
        o = put_head(o, TAG_FIELDS, field_size((size_t)f->key.n) + field_size(f->value));
        o = put_span(o, TAG_KEY, f->key);
        o = put_head(o, TAG_ENTRY_VALUE, f->value);
        if (f->text.p == NULL) {
            *o++ = TAG_NUMBER;
            PyFloat_Pack8(f->number, (char *)o, 1); /* little-endian, as protobuf wants */
            o += 8;
        }
        else {
            o = put_span(o, TAG_STRING, f->text);
        }
    }
    return o;
}

/* The answer's wire bytes. */
static PyObject *write_answer(const Answer *ap)
{
    const Answer a = *ap;
    /* Sizes, innermost first. */
    size_t mutation = 0;
    for (Py_ssize_t i = 0; i < a.n_headers; i++)
        mutation += field_size(header_size(a.headers[i]));
    for (Py_ssize_t i = 0; i < a.n_remove; i++)
        mutation += field_size((size_t)a.remove[i].n);
    int has_mutation = a.n_headers + a.n_remove > 0;
    size_t body_mutation = a.body.p ? field_size((size_t)a.body.n) : 0;
    size_t common = (has_mutation ? field_size(mutation) : 0) +
                    (a.body.p ? field_size(body_mutation) : 0) + (a.clear_route_cache ? 2 : 0);
    size_t reply = field_size(common);
    size_t metadata = 0;
    for (Py_ssize_t i = 0; i < a.n_namespaces; i++)
        metadata += field_size(namespace_size(&a.namespaces[i]));
    size_t total = field_size(reply) + (a.n_namespaces ? field_size(metadata) : 0);
    if (total > (size_t)PY_SSIZE_T_MAX) {
        PyErr_SetString(PyExc_OverflowError, "body_answer: answer too large");
        return NULL;
    }

    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (out == NULL)
        return NULL;
    uint8_t *o = (uint8_t *)PyBytes_AS_STRING(out);
    o = put_head(o, TAG_REQUEST_BODY, reply);
    o = put_head(o, TAG_RESPONSE, common);
    if (has_mutation) {
        o = put_head(o, TAG_HEADER_MUTATION, mutation);
        for (Py_ssize_t i = 0; i < a.n_headers; i++) {
            const Span *h = a.headers[i];
            o = put_head(o, TAG_SET_HEADERS, header_size(h));
            o = put_head(o, TAG_HEADER, field_size((size_t)h[0].n) + field_size((size_t)h[1].n));
            o = put_span(o, TAG_KEY, h[0]);
            o = put_span(o, TAG_RAW_VALUE, h[1]);
            *o++ = TAG_APPEND_ACTION;
            *o++ = OVERWRITE_IF_EXISTS_OR_ADD;
        }
        for (Py_ssize_t i = 0; i < a.n_remove; i++)
            o = put_span(o, TAG_REMOVE_HEADERS, a.remove[i]);
    }
    if (a.body.p) {
        o = put_head(o, TAG_BODY_MUTATION, body_mutation);
        o = put_span(o, TAG_BODY, a.body);
    }
    if (a.clear_route_cache) {
        *o++ = TAG_CLEAR_ROUTE;
        *o++ = 1;
    }
    if (a.n_namespaces) {
        o = put_head(o, TAG_DYNAMIC_METADATA, metadata);
        for (Py_ssize_t i = 0; i < a.n_namespaces; i++) {
            const Namespace *ns = &a.namespaces[i];
            o = put_head(o, TAG_FIELDS, namespace_size(ns));
            o = put_span(o, TAG_KEY, ns->key);
            o = put_head(o, TAG_ENTRY_VALUE, field_size(ns->fields_size));
            o = put_head(o, TAG_STRUCT, ns->fields_size);
            o = put_struct(o, ns);
        }
    }
    if ((size_t)(o - (uint8_t *)PyBytes_AS_STRING(out)) != total) {
        Py_DECREF(out);
        PyErr_SetString(PyExc_SystemError, "body_answer: size mismatch");
        return NULL;
    }
    return out;
}

PyObject *ace_body_answer(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "body_answer(headers, remove, clear_route_cache, body, namespaces) "
                        "takes 5 arguments");
        return NULL;
    }
    Answer a;
    if (read_answer(args, &a) < 0)
        return NULL;
    return write_answer(&a);
}

/* splice(body, fields) -> bytes
 *     processor.py's splice_pure: ``fields`` (a JSON object fragment, no braces, str)
 *     inserted after the body's opening brace, with a comma unless the object is empty;
 *     the client's bytes otherwise as they were. One allocation, the body copied once. */
PyObject *ace_splice(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyBytes_Check(args[0]) || !PyUnicode_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "splice(body: bytes, fields: str) takes 2 arguments");
        return NULL;
    }
    const char *body = PyBytes_AS_STRING(args[0]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]), flen;
    const char *fields = PyUnicode_AsUTF8AndSize(args[1], &flen);
    if (fields == NULL)
        return NULL;
    const char *brace = memchr(body, '{', (size_t)n);
    if (brace == NULL) {
        PyErr_SetString(PyExc_ValueError, "splice: the body has no '{'");
        return NULL;
    }
    Py_ssize_t start = brace - body + 1, first = start;
    while (first < n && (body[first] == ' ' || body[first] == '\t' || body[first] == '\r' ||
                         body[first] == '\n'))
        first++;
    Py_ssize_t sep = first < n && body[first] == '}' ? 0 : 1;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n + flen + sep);
    if (out == NULL)
        return NULL;
    char *p = PyBytes_AS_STRING(out);
    memcpy(p, body, (size_t)start);
    memcpy(p + start, fields, (size_t)flen);
    if (sep)
        p[start + flen] = ',';
    memcpy(p + start + flen + sep, body + start, (size_t)(n - start));
    return out;
}
