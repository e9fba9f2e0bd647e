/* The request path's two per-byte steps, in C.
 *
 * chat_prompt(body) -> (model, prompt, cacheable_end, has_router_fields, stream,
 *                       stream_options) | None
 *     One pass over a /v1/chat/completions body that checks it is JSON and builds
 *     the canonical prompt bytes of request.py's _parse_chat, for the plain shape:
 *     string or null contents, no tools, no tool calls. Anything else, valid or not,
 *     returns None and request.py's msgspec path decides, so this never accepts a
 *     body that path rejects and never disagrees with it (tests/test_speedups.py).
 *     No Python object is made for the prompt's text: it is unescaped straight into
 *     the canonical bytes.
 *
 * chain(data, block_bytes, seed) -> list[int]
 *     prefix.py's chained hashes: h_i = xxh3_64(block_i, seed=h_{i-1}) over every
 *     full block, h_{-1} = seed.
 *
 * refresh(lru, blocks) -> None
 *     routing/index.py's LRU refresh of a prompt's blocks on one pod.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* The canonical form's separators: request.py's _MSG, _FIELD, _GROUP. */
#define SEP_MSG 0x1e
#define SEP_FIELD 0x1f
#define SEP_GROUP 0x1d

/* Deeper unknown values go to the msgspec path (it has its own limit). */
#define MAX_DEPTH 64

/* Every function below returns 0 on success and -1 for "not handled here": invalid
 * JSON or a shape this path leaves to msgspec. No Python error is ever set for -1. */
#define TRY(expr)              \
    do {                       \
        if ((expr) < 0)        \
            return -1;         \
    } while (0)

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
    /* Inside a field msgspec decodes into Python values (cache_salt, cache_prefix_id,
     * stream_options), where a number must fit a float or a 4300-digit int: leave any
     * number with an exponent or over 300 digits to it. Elsewhere it only checks them. */
    int decoded;
} Cursor;

/* A JSON string's raw bytes in the body, between its quotes. */
typedef struct {
    const uint8_t *start;
    const uint8_t *stop;
    int escaped; /* holds a backslash escape: decode it, don't copy it */
} Str;

static inline void skip_ws(Cursor *c)
{
    while (c->p < c->end &&
           (*c->p == ' ' || *c->p == '\n' || *c->p == '\r' || *c->p == '\t'))
        c->p++;
}

static inline int expect(Cursor *c, uint8_t ch)
{
    if (c->p >= c->end || *c->p != ch)
        return -1;
    c->p++;
    return 0;
}

static inline int literal(Cursor *c, const char *word, Py_ssize_t len)
{
    if (c->end - c->p < len || memcmp(c->p, word, len) != 0)
        return -1;
    c->p += len;
    return 0;
}

/* Any byte of an 8-byte word that needs a look: '"', '\\', a control byte or
 * non-ASCII. Exact about whether there is one (not where), so a clean word is
 * skipped whole. */
static inline int word_needs_look(uint64_t v)
{
    const uint64_t ones = 0x0101010101010101ULL, high = 0x8080808080808080ULL;
    uint64_t quote = v ^ (ones * '"'), slash = v ^ (ones * '\\');
    return (((quote - ones) & ~quote) | ((slash - ones) & ~slash) | ((v - ones * 0x20) & ~v) |
            v) & high ? 1 : 0;
}

static int hex4(const uint8_t *p, const uint8_t *end)
{
    if (end - p < 4)
        return -1;
    int value = 0;
    for (int i = 0; i < 4; i++) {
        uint8_t ch = p[i];
        int digit;
        if (ch >= '0' && ch <= '9')
            digit = ch - '0';
        else if (ch >= 'a' && ch <= 'f')
            digit = ch - 'a' + 10;
        else if (ch >= 'A' && ch <= 'F')
            digit = ch - 'A' + 10;
        else
            return -1;
        value = value * 16 + digit;
    }
    return value;
}

/* The length of the well-formed UTF-8 sequence at p (RFC 3629: no overlong forms,
 * no surrogates, nothing past U+10FFFF), or -1. */
static int utf8_length(const uint8_t *p, const uint8_t *end)
{
    uint8_t b0 = p[0];
    int n;
    uint8_t lo = 0x80, hi = 0xBF; /* the second byte's range */
    if (b0 >= 0xC2 && b0 <= 0xDF)
        n = 2;
    else if (b0 >= 0xE0 && b0 <= 0xEF) {
        n = 3;
        if (b0 == 0xE0)
            lo = 0xA0;
        else if (b0 == 0xED)
            hi = 0x9F;
    }
    else if (b0 >= 0xF0 && b0 <= 0xF4) {
        n = 4;
        if (b0 == 0xF0)
            lo = 0x90;
        else if (b0 == 0xF4)
            hi = 0x8F;
    }
    else
        return -1;
    if (end - p < n || p[1] < lo || p[1] > hi)
        return -1;
    for (int i = 2; i < n; i++)
        if (p[i] < 0x80 || p[i] > 0xBF)
            return -1;
    return n;
}

/* At an opening quote: check the string (escapes, UTF-8, no raw control bytes)
 * and note where it lies. */
static int scan_string(Cursor *c, Str *s)
{
    TRY(expect(c, '"'));
    const uint8_t *p = c->p, *end = c->end;
    s->start = p;
    s->escaped = 0;
    for (;;) {
#if defined(__SSE2__)
        /* 16 bytes at a time to the next byte that needs a look. A signed compare
         * with 0x20 catches control bytes and, as negative values, non-ASCII. */
        const __m128i quote = _mm_set1_epi8('"'), slash = _mm_set1_epi8('\\'),
                      space = _mm_set1_epi8(0x20);
        while (end - p >= 16) {
            __m128i v = _mm_loadu_si128((const __m128i *)p);
            __m128i look = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, quote),
                                                     _mm_cmpeq_epi8(v, slash)),
                                        _mm_cmplt_epi8(v, space));
            int mask = _mm_movemask_epi8(look);
            if (mask) {
                p += __builtin_ctz((unsigned)mask);
                break;
            }
            p += 16;
        }
#endif
        while (end - p >= 8) {
            uint64_t word;
            memcpy(&word, p, 8);
            if (word_needs_look(word))
                break;
            p += 8;
        }
        if (p >= end)
            return -1;
        uint8_t ch = *p;
        if (ch == '"')
            break;
        if (ch == '\\') {
            s->escaped = 1;
            if (end - p < 2)
                return -1;
            switch (p[1]) {
            case '"': case '\\': case '/': case 'b': case 'f': case 'n': case 'r': case 't':
                p += 2;
                break;
            case 'u': {
                int unit = hex4(p + 2, end);
                if (unit < 0)
                    return -1;
                p += 6;
                if (unit >= 0xD800 && unit <= 0xDBFF) { /* must pair with a low surrogate */
                    if (end - p < 6 || p[0] != '\\' || p[1] != 'u')
                        return -1;
                    int low = hex4(p + 2, end);
                    if (low < 0xDC00 || low > 0xDFFF)
                        return -1;
                    p += 6;
                }
                else if (unit >= 0xDC00 && unit <= 0xDFFF)
                    return -1;
                break;
            }
            default:
                return -1;
            }
        }
        else if (ch < 0x20)
            return -1;
        else if (ch < 0x80)
            p++;
        else {
            int n = utf8_length(p, end);
            if (n < 0)
                return -1;
            p += n;
        }
    }
    s->stop = p;
    c->p = p + 1;
    return 0;
}

static int skip_number(Cursor *c)
{
    const uint8_t *p = c->p, *end = c->end;
    if (p < end && *p == '-')
        p++;
    if (p >= end)
        return -1;
    const uint8_t *digits = p;
    if (*p == '0')
        p++;
    else if (*p >= '1' && *p <= '9')
        while (p < end && *p >= '0' && *p <= '9')
            p++;
    else
        return -1;
    if (c->decoded && p - digits > 300)
        return -1;
    if (p < end && *p == '.') {
        p++;
        if (p >= end || *p < '0' || *p > '9')
            return -1;
        while (p < end && *p >= '0' && *p <= '9')
            p++;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        if (c->decoded)
            return -1;
        p++;
        if (p < end && (*p == '+' || *p == '-'))
            p++;
        if (p >= end || *p < '0' || *p > '9')
            return -1;
        while (p < end && *p >= '0' && *p <= '9')
            p++;
    }
    c->p = p;
    return 0;
}

/* Past a ',' (returns 1: another member follows) or the closing bracket (0). */
static int next_member(Cursor *c, uint8_t close)
{
    skip_ws(c);
    if (c->p < c->end && *c->p == ',') {
        c->p++;
        skip_ws(c);
        return 1;
    }
    TRY(expect(c, close));
    return 0;
}

static int skip_value(Cursor *c, int depth);

/* At a key's opening quote: the key (one without escapes; a key spelled with them
 * goes to msgspec), then past the ':' and its whitespace. */
static int object_key(Cursor *c, Str *key)
{
    TRY(scan_string(c, key));
    if (key->escaped)
        return -1;
    skip_ws(c);
    TRY(expect(c, ':'));
    skip_ws(c);
    return 0;
}

static int skip_container(Cursor *c, int depth, uint8_t close)
{
    if (depth >= MAX_DEPTH)
        return -1;
    c->p++;
    skip_ws(c);
    if (c->p < c->end && *c->p == close) {
        c->p++;
        return 0;
    }
    int more = 1;
    while (more) {
        if (close == '}') {
            Str key;
            TRY(object_key(c, &key));
        }
        TRY(skip_value(c, depth + 1));
        TRY(more = next_member(c, close));
    }
    return 0;
}

/* Any JSON value, checked and passed over (fields the router does not read). */
static int skip_value(Cursor *c, int depth)
{
    if (c->p >= c->end)
        return -1;
    Str ignored;
    switch (*c->p) {
    case '"':
        return scan_string(c, &ignored);
    case '{':
        return skip_container(c, depth, '}');
    case '[':
        return skip_container(c, depth, ']');
    case 't':
        return literal(c, "true", 4);
    case 'f':
        return literal(c, "false", 5);
    case 'n':
        return literal(c, "null", 4);
    default:
        return skip_number(c);
    }
}

/* A string, or null (``is_set`` 0). */
static int string_or_null(Cursor *c, Str *s, int *is_set)
{
    if (c->p < c->end && *c->p == 'n') {
        *is_set = 0;
        return literal(c, "null", 4);
    }
    *is_set = 1;
    return scan_string(c, s);
}

static inline int key_is(const Str *key, const char *name, Py_ssize_t len)
{
    return key->stop - key->start == len && memcmp(key->start, name, len) == 0;
}

/* The canonical prompt being built: never longer than the body it comes from
 * (a message's separators take fewer bytes than its JSON keys and quotes, and no
 * escape decodes longer than it is written), so it is sized once. */
typedef struct {
    uint8_t *data;
    Py_ssize_t len;
    Py_ssize_t cap;
} Out;

static inline int put(Out *out, const uint8_t *bytes, Py_ssize_t n)
{
    if (out->cap - out->len < n)
        return -1;
    memcpy(out->data + out->len, bytes, n);
    out->len += n;
    return 0;
}

static inline int put_byte(Out *out, uint8_t byte)
{
    if (out->len >= out->cap)
        return -1;
    out->data[out->len++] = byte;
    return 0;
}

/* A checked string's text, escapes decoded, as UTF-8. */
static int put_string(Out *out, const Str *s)
{
    if (!s->escaped)
        return put(out, s->start, s->stop - s->start);
    const uint8_t *p = s->start;
    while (p < s->stop) {
        const uint8_t *run = p;
        while (p < s->stop && *p != '\\')
            p++;
        TRY(put(out, run, p - run));
        if (p >= s->stop)
            break;
        uint8_t code = p[1];
        p += 2;
        uint8_t byte;
        switch (code) {
        case 'b': byte = '\b'; break;
        case 'f': byte = '\f'; break;
        case 'n': byte = '\n'; break;
        case 'r': byte = '\r'; break;
        case 't': byte = '\t'; break;
        case 'u': {
            uint32_t cp = (uint32_t)hex4(p, s->stop);
            p += 4;
            if (cp >= 0xD800 && cp <= 0xDBFF) { /* scan_string saw its low half */
                cp = 0x10000 + ((cp - 0xD800) << 10) + ((uint32_t)hex4(p + 2, s->stop) - 0xDC00);
                p += 6;
            }
            uint8_t utf8[4];
            Py_ssize_t n;
            if (cp < 0x80) {
                utf8[0] = (uint8_t)cp;
                n = 1;
            }
            else if (cp < 0x800) {
                utf8[0] = (uint8_t)(0xC0 | (cp >> 6));
                utf8[1] = (uint8_t)(0x80 | (cp & 0x3F));
                n = 2;
            }
            else if (cp < 0x10000) {
                utf8[0] = (uint8_t)(0xE0 | (cp >> 12));
                utf8[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
                utf8[2] = (uint8_t)(0x80 | (cp & 0x3F));
                n = 3;
            }
            else {
                utf8[0] = (uint8_t)(0xF0 | (cp >> 18));
                utf8[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
                utf8[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
                utf8[3] = (uint8_t)(0x80 | (cp & 0x3F));
                n = 4;
            }
            TRY(put(out, utf8, n));
            continue;
        }
        default: byte = code; break; /* '"', '\\', '/' */
        }
        TRY(put_byte(out, byte));
    }
    return 0;
}

/* One message object, appended to the canonical prompt in request.py's order:
 * role, name, content, tool call id. ``newest_user`` is moved to its start if it is
 * a user turn. */
static int message(Cursor *c, Out *out, Py_ssize_t *newest_user)
{
    Str role = {0}, content = {0}, name = {0}, call_id = {0}, key;
    int has_role = 0, has_content = 0, has_name = 0, has_call_id = 0;
    TRY(expect(c, '{'));
    skip_ws(c);
    int more = 1;
    if (c->p < c->end && *c->p == '}') {
        c->p++;
        more = 0;
    }
    while (more) {
        TRY(object_key(c, &key));
        if (key_is(&key, "role", 4)) {
            TRY(scan_string(c, &role));
            has_role = 1;
        }
        else if (key_is(&key, "content", 7))
            TRY(string_or_null(c, &content, &has_content)); /* a list: msgspec's */
        else if (key_is(&key, "name", 4))
            TRY(string_or_null(c, &name, &has_name));
        else if (key_is(&key, "tool_call_id", 12))
            TRY(string_or_null(c, &call_id, &has_call_id));
        else if (key_is(&key, "tool_calls", 10))
            TRY(literal(c, "null", 4));
        else
            TRY(skip_value(c, 2));
        TRY(more = next_member(c, '}'));
    }
    if (!has_role)
        return -1;
    Py_ssize_t start = out->len;
    TRY(put_byte(out, SEP_MSG));
    Py_ssize_t role_at = out->len;
    TRY(put_string(out, &role));
    if (out->len - role_at == 4 && memcmp(out->data + role_at, "user", 4) == 0)
        *newest_user = start;
    TRY(put_byte(out, SEP_FIELD));
    if (has_name && name.stop > name.start) {
        TRY(put_string(out, &name));
        TRY(put_byte(out, SEP_FIELD));
    }
    if (has_content)
        TRY(put_string(out, &content));
    if (has_call_id && call_id.stop > call_id.start) {
        TRY(put_byte(out, SEP_GROUP));
        TRY(put_string(out, &call_id));
    }
    return 0;
}

static int messages(Cursor *c, Out *out, Py_ssize_t *newest_user)
{
    TRY(expect(c, '['));
    skip_ws(c);
    if (c->p < c->end && *c->p == ']')
        return -1; /* empty: msgspec's path says so */
    int more = 1;
    while (more) {
        TRY(message(c, out, newest_user));
        TRY(more = next_member(c, ']'));
    }
    return 0;
}

typedef struct {
    Str model;
    int has_model;
    int has_messages;
    int stream;
    int stream_options;
    int router_fields;
    Py_ssize_t newest_user;
} Chat;

static int chat_body(Cursor *c, Out *out, Chat *chat)
{
    skip_ws(c);
    TRY(expect(c, '{'));
    skip_ws(c);
    if (c->p < c->end && *c->p == '}')
        return -1; /* no messages */
    Str key;
    int more = 1;
    while (more) {
        TRY(object_key(c, &key));
        if (key_is(&key, "messages", 8)) {
            if (chat->has_messages)
                return -1; /* a repeated list: msgspec's */
            chat->has_messages = 1;
            TRY(messages(c, out, &chat->newest_user));
        }
        else if (key_is(&key, "model", 5)) {
            TRY(scan_string(c, &chat->model));
            chat->has_model = 1;
        }
        else if (key_is(&key, "stream", 6)) {
            if (c->p < c->end && *c->p == 't') {
                TRY(literal(c, "true", 4));
                chat->stream = 1;
            }
            else {
                TRY(literal(c, "false", 5));
                chat->stream = 0;
            }
        }
        else if (key_is(&key, "stream_options", 14)) {
            c->decoded = 1;
            TRY(skip_value(c, 1));
            c->decoded = 0;
            chat->stream_options = 1;
        }
        else if (key_is(&key, "cache_salt", 10) || key_is(&key, "cache_prefix_id", 15)) {
            c->decoded = 1;
            TRY(skip_value(c, 1));
            c->decoded = 0;
            chat->router_fields = 1;
        }
        else if (key_is(&key, "tools", 5))
            TRY(literal(c, "null", 4)); /* tool definitions: msgspec's */
        else
            TRY(skip_value(c, 1));
        TRY(more = next_member(c, '}'));
    }
    skip_ws(c);
    if (c->p != c->end || !chat->has_messages)
        return -1;
    return 0;
}

static PyObject *model_name(const Chat *chat)
{
    if (!chat->has_model)
        return PyUnicode_FromStringAndSize("", 0);
    const Str *s = &chat->model;
    Py_ssize_t raw = s->stop - s->start;
    if (!s->escaped)
        return PyUnicode_DecodeUTF8((const char *)s->start, raw, "strict");
    uint8_t *buffer = PyMem_Malloc(raw > 0 ? raw : 1);
    if (buffer == NULL)
        return PyErr_NoMemory();
    Out out = {buffer, 0, raw};
    PyObject *name = NULL;
    if (put_string(&out, s) == 0)
        name = PyUnicode_DecodeUTF8((const char *)buffer, out.len, "strict");
    else
        PyErr_SetString(PyExc_SystemError, "model name outgrew its escaped form");
    PyMem_Free(buffer);
    return name;
}

static PyObject *chat_prompt(PyObject *Py_UNUSED(module), PyObject *body)
{
    Py_buffer view;
    if (PyObject_GetBuffer(body, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *prompt = PyBytes_FromStringAndSize(NULL, view.len);
    if (prompt == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    Cursor cursor = {(const uint8_t *)view.buf, (const uint8_t *)view.buf + view.len, 0};
    Out out = {(uint8_t *)PyBytes_AS_STRING(prompt), 0, view.len};
    Chat chat = {.newest_user = -1};
    PyObject *result = NULL;
    if (chat_body(&cursor, &out, &chat) < 0) {
        Py_DECREF(prompt);
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    PyObject *model = model_name(&chat); /* reads the body: before it is released */
    PyBuffer_Release(&view);
    if (model == NULL || _PyBytes_Resize(&prompt, out.len) < 0) {
        Py_XDECREF(model);
        Py_XDECREF(prompt);
        return NULL;
    }
    /* No user turn (a lone system prompt): all of it is the prefix. */
    Py_ssize_t head = chat.newest_user < 0 ? out.len : chat.newest_user;
    result = Py_BuildValue("(NNnNNN)", model, prompt, head, PyBool_FromLong(chat.router_fields),
                           PyBool_FromLong(chat.stream), PyBool_FromLong(chat.stream_options));
    return result;
}

static PyObject *chain(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "chain(data, block_bytes, seed) takes 3 arguments");
        return NULL;
    }
    Py_ssize_t block = PyLong_AsSsize_t(args[1]);
    if (block == -1 && PyErr_Occurred())
        return NULL;
    if (block < 1) {
        PyErr_SetString(PyExc_ValueError, "block_bytes must be at least 1");
        return NULL;
    }
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[2]);
    if (seed == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t count = view.len / block;
    PyObject *hashes = PyList_New(count);
    if (hashes != NULL) {
        const uint8_t *data = view.buf;
        XXH64_hash_t h = seed;
        for (Py_ssize_t i = 0; i < count; i++) {
            h = XXH3_64bits_withSeed(data + i * block, (size_t)block, h);
            PyObject *item = PyLong_FromUnsignedLongLong(h);
            if (item == NULL) {
                Py_CLEAR(hashes);
                break;
            }
            PyList_SET_ITEM(hashes, i, item);
        }
    }
    PyBuffer_Release(&view);
    return hashes;
}

/* refresh(lru, blocks): each block moved to the end of the ``lru`` dict (most recent),
 * the last block first, so the first ends most recent. BlockIndex.record's loop,
 * without the interpreter. */
static PyObject *refresh(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "refresh(lru, blocks) takes 2 arguments");
        return NULL;
    }
    PyObject *lru = args[0];
    if (!PyDict_CheckExact(lru)) {
        PyErr_SetString(PyExc_TypeError, "refresh: lru must be a dict");
        return NULL;
    }
    PyObject *blocks = PySequence_Fast(args[1], "refresh: blocks must be a sequence");
    if (blocks == NULL)
        return NULL;
    PyObject **items = PySequence_Fast_ITEMS(blocks);
    for (Py_ssize_t i = PySequence_Fast_GET_SIZE(blocks) - 1; i >= 0; i--) {
        PyObject *h = items[i];
        int held = PyDict_Contains(lru, h);
        if (held < 0 || (held && PyDict_DelItem(lru, h) < 0) ||
            PyDict_SetItem(lru, h, Py_None) < 0) {
            Py_DECREF(blocks);
            return NULL;
        }
    }
    Py_DECREF(blocks);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"chat_prompt", (PyCFunction)chat_prompt, METH_O,
     "chat_prompt(body) -> (model, prompt, cacheable_end, has_router_fields, stream, "
     "stream_options) for a plain chat body, or None: request.py's msgspec path decides."},
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL,
     "chain(data, block_bytes, seed) -> the chained xxh3_64 hashes of data's full blocks."},
    {"refresh", (PyCFunction)(void (*)(void))refresh, METH_FASTCALL,
     "refresh(lru, blocks): blocks moved to the dict's end (most recent), the last first."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ace_extproc._speedups",
    "The request path's per-byte steps in C (request.py and prefix.py hold the reference).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__speedups(void)
{
    return PyModule_Create(&module);
}
