/* The native pieces (native/__init__.py): ``prompt``, a body to its canonical prompt and
 * the prompt's block hashes, here; ``lru``, in _lru.c.
 *
 * chat_prompt(body) -> (model, prompt, cacheable_end, has_router_fields, stream,
 *                       stream_options) | None
 *     One pass over a /v1/chat/completions body that checks it is JSON and builds
 *     the canonical prompt bytes of request.py's _parse_chat: text, text parts, tool
 *     definitions and tool calls. Anything else (an image part, say), valid or not,
 *     returns None and request.py's msgspec path decides, so this never accepts a
 *     body that path rejects and never disagrees with it (tests/test_speedups.py).
 *     No Python object is made for the prompt's text: it is unescaped straight into
 *     the canonical bytes.
 *
 * completion_prompt(body) -> (model, prompt, None, has_router_fields, stream,
 *                             stream_options) | None
 *     The same for a /v1/completions body: a string, strings, token ids or lists of
 *     token ids, as request.py's _parse_completion writes them.
 *
 * chain(data, block_bytes, seed) -> list[int]
 *     native/hashing.py's chained hashes: h_i = xxh3_64(block_i, seed=h_{i-1}) over every
 *     full block, h_{-1} = seed.
 *
 * BlockLRU, record(...), evict(...), match(...)
 *     A pod's block LRU and routing/index.py's record, eviction and match depths on
 *     it (_lru.c).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_lru.h"

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
        int nibble;
        if (ch >= '0' && ch <= '9')
            nibble = ch - '0';
        else if (ch >= 'a' && ch <= 'f')
            nibble = ch - 'a' + 10;
        else if (ch >= 'A' && ch <= 'F')
            nibble = ch - 'A' + 10;
        else
            return -1;
        value = value * 16 + nibble;
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

/* The canonical prompt being built, in a buffer sized once (parse_body says how);
 * a write past its end is refused, and the body goes to msgspec's path. */
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
        p = memchr(run, '\\', s->stop - run); /* glibc's is vectorised */
        if (p == NULL)
            p = s->stop;
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

/* An array's elements, one ``element`` call each (at the element, past whitespace). An
 * empty array is ``empty_ok`` or not. */
static int array(Cursor *c, int empty_ok, int (*element)(Cursor *, void *), void *arg)
{
    TRY(expect(c, '['));
    skip_ws(c);
    if (c->p < c->end && *c->p == ']') {
        c->p++;
        return empty_ok ? 0 : -1;
    }
    int more = 1;
    while (more) {
        TRY(element(c, arg));
        TRY(more = next_member(c, ']'));
    }
    return 0;
}

/* An object's members: ``on_key`` is called at each value and must pass over it. */
static int object(Cursor *c, int (*on_key)(Cursor *, const Str *, void *), void *arg)
{
    TRY(expect(c, '{'));
    skip_ws(c);
    if (c->p < c->end && *c->p == '}') {
        c->p++;
        return 0;
    }
    Str key;
    int more = 1;
    while (more) {
        TRY(object_key(c, &key));
        TRY(on_key(c, &key, arg));
        TRY(more = next_member(c, '}'));
    }
    return 0;
}

/* ---- tool calls: {"function": {"name": str, "arguments": str}, "id", "type"} ---- */

typedef struct {
    Str name, arguments;
    int has_name, has_arguments, has_function;
} ToolCall;

static int function_key(Cursor *c, const Str *key, void *arg)
{
    ToolCall *call = arg;
    if (key_is(key, "name", 4)) {
        call->has_name = 1;
        return scan_string(c, &call->name);
    }
    if (key_is(key, "arguments", 9)) {
        call->has_arguments = 1;
        return scan_string(c, &call->arguments);
    }
    return skip_value(c, 4);
}

static int tool_call_key(Cursor *c, const Str *key, void *arg)
{
    ToolCall *call = arg;
    if (key_is(key, "function", 8)) { /* the last one wins, whole */
        call->has_function = 1;
        call->has_name = call->has_arguments = 0;
        return object(c, function_key, call);
    }
    if (key_is(key, "id", 2)) {
        Str ignored;
        int is_set;
        return string_or_null(c, &ignored, &is_set);
    }
    if (key_is(key, "type", 4)) {
        Str ignored;
        return scan_string(c, &ignored);
    }
    return skip_value(c, 3);
}

/* One call, as request.py writes it: group, name, field, arguments. ``arg``: the Out,
 * or NULL to check only. */
static int tool_call(Cursor *c, void *arg)
{
    Out *out = arg;
    ToolCall call = {0};
    TRY(object(c, tool_call_key, &call));
    if (!call.has_function)
        return -1;
    if (out == NULL)
        return 0;
    TRY(put_byte(out, SEP_GROUP));
    if (call.has_name)
        TRY(put_string(out, &call.name));
    TRY(put_byte(out, SEP_FIELD));
    if (call.has_arguments)
        TRY(put_string(out, &call.arguments));
    return 0;
}

/* ---- multi-part content: text parts by their text; any other part is msgspec's ---- */

typedef struct {
    Str text;
    int has_text;
} Part;

static int part_key(Cursor *c, const Str *key, void *arg)
{
    Part *part = arg;
    if (key_is(key, "text", 4)) {
        part->has_text = 1;
        return scan_string(c, &part->text); /* not a string: msgspec's (JSON-encoded) */
    }
    c->decoded = 1; /* a part is decoded into a dict: its numbers must be in range */
    TRY(skip_value(c, 4));
    c->decoded = 0;
    return 0;
}

/* One part: its text, then a field separator. ``arg``: the Out, or NULL to check only. */
static int content_part(Cursor *c, void *arg)
{
    Out *out = arg;
    Part part = {0};
    TRY(object(c, part_key, &part));
    if (!part.has_text) /* an image, audio or file part */
        return -1;
    if (out == NULL)
        return 0;
    TRY(put_string(out, &part.text));
    return put_byte(out, SEP_FIELD);
}

/* ---- messages ---- */

typedef struct {
    Str role, content, name, call_id;
    int has_role, has_content, has_name, has_call_id;
    const uint8_t *parts; /* where a content list starts: written on a second pass */
    const uint8_t *calls; /* where the tool_calls array starts: written on a second pass */
} Message;

static int message_key(Cursor *c, const Str *key, void *arg)
{
    Message *m = arg;
    if (key_is(key, "role", 4)) {
        m->has_role = 1;
        return scan_string(c, &m->role);
    }
    if (key_is(key, "content", 7)) {
        m->parts = NULL;
        if (c->p < c->end && *c->p == '[') {
            m->has_content = 0;
            m->parts = c->p;
            return array(c, 1, content_part, NULL);
        }
        return string_or_null(c, &m->content, &m->has_content);
    }
    if (key_is(key, "name", 4))
        return string_or_null(c, &m->name, &m->has_name);
    if (key_is(key, "tool_call_id", 12))
        return string_or_null(c, &m->call_id, &m->has_call_id);
    if (key_is(key, "tool_calls", 10)) {
        m->calls = NULL;
        if (c->p < c->end && *c->p == 'n')
            return literal(c, "null", 4);
        m->calls = c->p;
        return array(c, 1, tool_call, NULL);
    }
    return skip_value(c, 2);
}

typedef struct {
    Out *out;
    Py_ssize_t newest_user; /* where the newest user turn starts in ``out``; -1: none */
} Messages;

/* One message object, appended to the canonical prompt in request.py's order: role,
 * name, content, tool calls, tool call id. */
static int message(Cursor *c, void *arg)
{
    Messages *ms = arg;
    Out *out = ms->out;
    Message m = {0};
    TRY(object(c, message_key, &m));
    if (!m.has_role)
        return -1;
    Py_ssize_t start = out->len;
    TRY(put_byte(out, SEP_MSG));
    Py_ssize_t role_at = out->len;
    TRY(put_string(out, &m.role));
    if (out->len - role_at == 4 && memcmp(out->data + role_at, "user", 4) == 0)
        ms->newest_user = start;
    TRY(put_byte(out, SEP_FIELD));
    if (m.has_name && m.name.stop > m.name.start) {
        TRY(put_string(out, &m.name));
        TRY(put_byte(out, SEP_FIELD));
    }
    if (m.has_content)
        TRY(put_string(out, &m.content));
    if (m.parts != NULL) { /* checked already: this pass writes them */
        Cursor again = {m.parts, c->end, 0};
        TRY(array(&again, 1, content_part, out));
    }
    if (m.calls != NULL) { /* checked already: this pass writes them */
        Cursor again = {m.calls, c->end, 0};
        TRY(array(&again, 1, tool_call, out));
    }
    if (m.has_call_id && m.call_id.stop > m.call_id.start) {
        TRY(put_byte(out, SEP_GROUP));
        TRY(put_string(out, &m.call_id));
    }
    return 0;
}

/* ---- tool definitions: their JSON as written, ahead of the messages ---- */

typedef struct {
    Out *out; /* NULL: measure only */
    Py_ssize_t count, bytes;
} Tools;

static int tool(Cursor *c, void *arg)
{
    Tools *tools = arg;
    const uint8_t *start = c->p;
    TRY(skip_value(c, 2));
    if (tools->out != NULL) {
        if (tools->count)
            TRY(put_byte(tools->out, SEP_FIELD));
        TRY(put(tools->out, start, c->p - start));
    }
    tools->count++;
    tools->bytes += c->p - start;
    return 0;
}

/* ---- the body: fields both kinds share, then each kind's own ---- */

typedef struct {
    Out *out;
    Str model;
    int has_model, stream, stream_options, router_fields;
    int has_prompt;              /* chat: messages; completions: prompt */
    Py_ssize_t newest_user;      /* chat */
    const uint8_t *tools;        /* chat: where the tools array starts, if not empty */
    Tools tools_size;            /* chat: its definitions' count and bytes */
    const uint8_t *end;          /* the body's end */
} Body;

/* The keys both bodies have: 1 if ``key`` is one (its value passed), 0 if not. */
static int common_key(Cursor *c, const Str *key, Body *body)
{
    if (key_is(key, "model", 5)) {
        body->has_model = 1;
        TRY(scan_string(c, &body->model));
        return 1;
    }
    if (key_is(key, "stream", 6)) {
        if (c->p < c->end && *c->p == 't') {
            TRY(literal(c, "true", 4));
            body->stream = 1;
        }
        else {
            TRY(literal(c, "false", 5));
            body->stream = 0;
        }
        return 1;
    }
    int *flag = key_is(key, "stream_options", 14) ? &body->stream_options
                : key_is(key, "cache_salt", 10) || key_is(key, "cache_prefix_id", 15)
                    ? &body->router_fields
                    : NULL;
    if (flag == NULL)
        return 0;
    c->decoded = 1;
    TRY(skip_value(c, 1));
    c->decoded = 0;
    *flag = 1;
    return 1;
}

static int chat_key(Cursor *c, const Str *key, void *arg)
{
    Body *body = arg;
    int done = common_key(c, key, body);
    if (done)
        return done < 0 ? -1 : 0;
    if (key_is(key, "messages", 8)) {
        if (body->has_prompt)
            return -1; /* a repeated list: msgspec's */
        body->has_prompt = 1;
        Messages ms = {body->out, -1};
        TRY(array(c, 0, message, &ms)); /* empty: msgspec's path says so */
        body->newest_user = ms.newest_user;
        return 0;
    }
    if (key_is(key, "tools", 5)) { /* the last one wins */
        body->tools = NULL;
        if (c->p < c->end && *c->p == 'n')
            return literal(c, "null", 4);
        const uint8_t *at = c->p;
        Tools measure = {NULL, 0, 0};
        TRY(array(c, 1, tool, &measure));
        if (measure.count) {
            body->tools = at;
            body->tools_size = measure;
        }
        return 0;
    }
    return skip_value(c, 1);
}

/* The tool definitions, put ahead of the messages already written: group, "tools",
 * field, then each definition's JSON, fields between. */
static int prepend_tools(Out *out, Body *body)
{
    Py_ssize_t size = 7 + body->tools_size.bytes + (body->tools_size.count - 1);
    if (out->cap - out->len < size)
        return -1;
    memmove(out->data + size, out->data, out->len);
    Out head = {out->data, 0, size};
    TRY(put_byte(&head, SEP_GROUP));
    TRY(put(&head, (const uint8_t *)"tools", 5));
    TRY(put_byte(&head, SEP_FIELD));
    Tools write = {&head, 0, 0};
    Cursor c = {body->tools, body->end, 0}; /* checked in the first pass */
    TRY(array(&c, 1, tool, &write));
    out->len += size;
    if (body->newest_user >= 0)
        body->newest_user += size;
    return 0;
}

/* ---- completions: a string, strings, token ids, or lists of token ids ---- */

static int token(Cursor *c, void *arg)
{
    Out *out = arg;
    const uint8_t *p = c->p, *end = c->end;
    int negative = p < end && *p == '-';
    p += negative;
    if (p >= end || *p < '0' || *p > '9' || (*p == '0' && p + 1 < end && p[1] >= '0' && p[1] <= '9'))
        return -1;
    int64_t value = 0;
    while (p < end && *p >= '0' && *p <= '9') {
        value = value * 10 + (*p++ - '0');
        if (value > 2147483648LL)
            return -1;
    }
    if (p < end && (*p == '.' || *p == 'e' || *p == 'E'))
        return -1; /* a float: not a token id */
    value = negative ? -value : value;
    if (value > 2147483647LL)
        return -1;
    int32_t id = (int32_t)value; /* as array("i") writes it: native byte order */
    TRY(put(out, (const uint8_t *)&id, 4));
    c->p = p;
    return 0;
}

/* Strings or token lists, joined by record separators. */
typedef struct {
    Out *out;
    int count;
} Joined;

static int token_list(Cursor *c, void *arg)
{
    Joined *joined = arg;
    if (joined->count++)
        TRY(put_byte(joined->out, SEP_MSG));
    return array(c, 0, token, joined->out);
}

static int prompt_string(Cursor *c, void *arg)
{
    Joined *joined = arg;
    Str s;
    TRY(scan_string(c, &s));
    if (joined->count++)
        TRY(put_byte(joined->out, SEP_MSG));
    return put_string(joined->out, &s);
}

/* The prompt, written afresh (the last "prompt" key wins). */
static int prompt(Cursor *c, Out *out)
{
    out->len = 0;
    if (c->p < c->end && *c->p == '"') {
        Str s;
        TRY(scan_string(c, &s));
        if (s.stop == s.start)
            return -1; /* empty: msgspec's path says so */
        return put_string(out, &s);
    }
    if (c->p >= c->end || *c->p != '[')
        return -1;
    const uint8_t *first = c->p + 1;
    while (first < c->end && (*first == ' ' || *first == '\n' || *first == '\r' || *first == '\t'))
        first++;
    Joined joined = {out, 0};
    if (first < c->end && *first == '"')
        return array(c, 0, prompt_string, &joined);
    if (first < c->end && *first == '[')
        return array(c, 0, token_list, &joined);
    return array(c, 0, token, out);
}

static int completion_key(Cursor *c, const Str *key, void *arg)
{
    Body *body = arg;
    int done = common_key(c, key, body);
    if (done)
        return done < 0 ? -1 : 0;
    if (key_is(key, "prompt", 6)) {
        body->has_prompt = 1;
        return prompt(c, body->out);
    }
    return skip_value(c, 1);
}

static PyObject *model_name(const Body *body)
{
    if (!body->has_model)
        return PyUnicode_FromStringAndSize("", 0);
    const Str *s = &body->model;
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

/* Either body kind to request.py's ParsedRequest fields, or None. */
static PyObject *parse_body(PyObject *data, int chat)
{
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    /* A chat prompt is never longer than its body (a message's separators take fewer
     * bytes than its JSON keys and quotes, and no escape decodes longer than it is
     * written); token ids can double ("1," becomes 4 bytes). */
    Py_ssize_t cap = chat ? view.len : 2 * view.len + 8;
    PyObject *prompt_bytes = PyBytes_FromStringAndSize(NULL, cap);
    if (prompt_bytes == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    Out out = {(uint8_t *)PyBytes_AS_STRING(prompt_bytes), 0, cap};
    Cursor c = {(const uint8_t *)view.buf, (const uint8_t *)view.buf + view.len, 0};
    Body body = {.out = &out, .newest_user = -1, .end = c.end};
    skip_ws(&c);
    int ok = object(&c, chat ? chat_key : completion_key, &body);
    skip_ws(&c);
    if (ok < 0 || c.p != c.end || !body.has_prompt ||
        (body.tools != NULL && prepend_tools(&out, &body) < 0)) {
        Py_DECREF(prompt_bytes);
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    PyObject *model = model_name(&body); /* reads the body: before it is released */
    PyBuffer_Release(&view);
    if (model == NULL || _PyBytes_Resize(&prompt_bytes, out.len) < 0) {
        Py_XDECREF(model);
        Py_XDECREF(prompt_bytes);
        return NULL;
    }
    PyObject *head;
    if (chat) /* no user turn (a lone system prompt): all of it is the prefix */
        head = PyLong_FromSsize_t(body.newest_user < 0 ? out.len : body.newest_user);
    else
        head = Py_NewRef(Py_None); /* a plain prompt: its leading full blocks */
    if (head == NULL) {
        Py_DECREF(model);
        Py_DECREF(prompt_bytes);
        return NULL;
    }
    return Py_BuildValue("(NNNNNN)", model, prompt_bytes, head,
                         PyBool_FromLong(body.router_fields), PyBool_FromLong(body.stream),
                         PyBool_FromLong(body.stream_options));
}

static PyObject *chat_prompt(PyObject *Py_UNUSED(module), PyObject *data)
{
    return parse_body(data, 1);
}

static PyObject *completion_prompt(PyObject *Py_UNUSED(module), PyObject *data)
{
    return parse_body(data, 0);
}

/* The chained hashes of the ``count`` full blocks at ``data``; the last in ``*last``. */
static PyObject *chain_blocks(const uint8_t *data, Py_ssize_t count, Py_ssize_t block,
                              uint64_t seed, uint64_t *last)
{
    PyObject *hashes = PyList_New(count);
    XXH64_hash_t h = seed;
    for (Py_ssize_t i = 0; hashes != NULL && i < count; i++) {
        h = XXH3_64bits_withSeed(data + i * block, (size_t)block, h);
        PyObject *item = PyLong_FromUnsignedLongLong(h);
        if (item == NULL)
            Py_CLEAR(hashes);
        else
            PyList_SET_ITEM(hashes, i, item);
    }
    *last = h;
    return hashes;
}

/* block_bytes and seed, arguments 1 and 2 of chain and 2 and 3 of prefix_hashes. */
static int block_and_seed(PyObject *const *args, Py_ssize_t *block, uint64_t *seed)
{
    *block = PyLong_AsSsize_t(args[0]);
    if (*block == -1 && PyErr_Occurred())
        return -1;
    if (*block < 1) {
        PyErr_SetString(PyExc_ValueError, "block_bytes must be at least 1");
        return -1;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(args[1]);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *seed = value;
    return 0;
}

static PyObject *chain(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "chain(data, block_bytes, seed) takes 3 arguments");
        return NULL;
    }
    Py_ssize_t block;
    uint64_t seed, last;
    if (block_and_seed(args + 1, &block, &seed) < 0)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *hashes = chain_blocks(view.buf, view.len / block, block, seed, &last);
    PyBuffer_Release(&view);
    return hashes;
}

/* prefix.py's prefix_hashes_pure: the blocks' chained hashes and the prefix key. */
static PyObject *prefix_hashes(PyObject *Py_UNUSED(module), PyObject *const *args,
                               Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "prefix_hashes(prompt, cacheable_end, block_bytes, seed) takes 4 arguments");
        return NULL;
    }
    Py_ssize_t block;
    uint64_t seed, last;
    if (block_and_seed(args + 2, &block, &seed) < 0)
        return NULL;
    if (!PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "prefix_hashes: prompt must be bytes");
        return NULL;
    }
    const uint8_t *data = (const uint8_t *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t len = PyBytes_GET_SIZE(args[0]), count = len / block, end = count * block;
    if (args[1] != Py_None) {
        end = PyLong_AsSsize_t(args[1]);
        if (end == -1 && PyErr_Occurred())
            return NULL;
        if (end < 0 || end > len) {
            PyErr_SetString(PyExc_IndexError, "prefix_hashes: cacheable_end out of the prompt");
            return NULL;
        }
    }
    PyObject *hashes = chain_blocks(data, count, block, seed, &last);
    if (hashes == NULL)
        return NULL;
    /* The chain at the last full block inside the prefix, extended by its partial tail. */
    Py_ssize_t full = end / block;
    uint64_t h = full ? PyLong_AsUnsignedLongLong(PyList_GET_ITEM(hashes, full - 1)) : seed;
    if (end > full * block)
        h = XXH3_64bits_withSeed(data + full * block, (size_t)(end - full * block), h);
    char key[17];
    static const char hex[] = "0123456789abcdef";
    for (int i = 15; i >= 0; i--, h >>= 4)
        key[i] = hex[h & 15];
    return Py_BuildValue("(Ns#)", hashes, key, (Py_ssize_t)16);
}

static PyMethodDef methods[] = {
    {"chat_prompt", (PyCFunction)chat_prompt, METH_O,
     "chat_prompt(body) -> (model, prompt, cacheable_end, has_router_fields, stream, "
     "stream_options) for a plain chat body, or None: request.py's msgspec path decides."},
    {"completion_prompt", (PyCFunction)completion_prompt, METH_O,
     "completion_prompt(body) -> (model, prompt, None, has_router_fields, stream, "
     "stream_options) for a /v1/completions body, or None: request.py's msgspec path "
     "decides."},
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL,
     "chain(data, block_bytes, seed) -> the chained xxh3_64 hashes of data's full blocks."},
    {"prefix_hashes", (PyCFunction)(void (*)(void))prefix_hashes, METH_FASTCALL,
     "prefix_hashes(prompt, cacheable_end, block_bytes, seed) -> (blocks, prefix_key): "
     "prefix.py's prefix_hashes_pure."},
    {"match", (PyCFunction)(void (*)(void))ace_match, METH_FASTCALL,
     "match(lrus, blocks, holders) -> {slot: leading blocks held} for each slot of the "
     "holders bitmask (each holds blocks[0]; lrus maps slots to BlockLRUs)."},
    {"record", (PyCFunction)(void (*)(void))ace_record, METH_FASTCALL,
     "record(lru, blocks, roots, bit, capacity): blocks moved to the BlockLRU's most "
     "recent end, the last first; the root marked; the oldest past capacity forgotten."},
    {"evict", (PyCFunction)(void (*)(void))ace_evict, METH_FASTCALL,
     "evict(lru, roots, bit, count): the BlockLRU's count oldest blocks forgotten, a "
     "forgotten root losing bit."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ace_extproc.native._speedups",
    "Prompt parsing, block hashing and the per-pod block LRU in C (native/__init__.py "
    "chooses between them and their Python references).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__speedups(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && ace_lru_add_type(m) < 0)
        Py_CLEAR(m);
    return m;
}
