/* A pod's block LRU in C, and the index's per-prompt operations on it.
 *
 * BlockLRU([hashes]) holds 64-bit block hashes, least recently used first, as the
 * engine's prefix cache is an LRU of blocks. It is what routing/index.py keeps per
 * pod where the extension was built; the Python reference is a plain dict (insertion
 * order as recency), and the functions below give the same results on a BlockLRU as
 * index.py's record_pure, evict_pure and match_pure give on the dict
 * (tests/test_lru.py). Why not the dict: a hash kept as a Python int and its dict
 * entry cost ~80 bytes a block, and refreshing a block is a delete and a re-insert
 * (the dict's table fills with dead entries and is rebuilt). Here a block is 16 bytes
 * in a dense array (its hash and its two list links) plus a 4-byte slot in an
 * open-addressing table, and a refresh relinks two neighbours, as vLLM's
 * FreeKVCacheBlockQueue does.
 *
 *   len(lru), h in lru, iter(lru) (oldest first), sys.getsizeof(lru)
 *
 * record(lru, blocks, roots, bit, capacity) -> None
 *     Each block moved to the most recent end, the last block first, so the first
 *     ends most recent; the first block's holders in ``roots`` gain ``bit``; past
 *     ``capacity`` the oldest blocks are forgotten, and a forgotten root loses ``bit``.
 *     ``blocks`` is a sequence of ints, or an ``array("Q")`` (what another replica's
 *     placement decodes to: read in place, with no int made for each hash).
 *
 * evict(lru, roots, bit, count) -> None
 *     The ``count`` least recently used blocks forgotten, roots cleared as above.
 *
 * match(lrus, blocks, holders) -> {slot: depth}
 *     Each holder's run of leading blocks held, by binary search on the chain.
 *
 * Hashes are ints in [0, 2**64): chain's output. Anything else raises.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_lru.h"

#define NIL UINT32_MAX
#define MIN_TABLE_BITS 3
/* Open addressing with linear probing stays fast below ~0.7 full. */
#define MAX_LOAD_TENTHS 7

typedef struct {
    uint64_t key;
    uint32_t prev; /* towards the least recent; NIL at the oldest */
    uint32_t next; /* towards the most recent; NIL at the newest; the free list's link */
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *entries; /* dense: [0, top) handed out, each live or on the free list */
    uint32_t *table; /* entry index + 1 at each slot, 0 for empty */
    uint32_t table_bits;
    uint32_t used; /* live entries */
    uint32_t allocated; /* entries' length */
    uint32_t top;
    uint32_t free; /* head of the free list, NIL when empty */
    uint32_t oldest, newest;
} BlockLRU;

static PyTypeObject BlockLRUType;

/* Fibonacci hashing: the top bits of key * 2^64/phi. The keys are xxh3 hashes, but
 * a test's small ints must spread too. */
static inline uint32_t home(const BlockLRU *lru, uint64_t key)
{
    return (uint32_t)((key * 0x9E3779B97F4A7C15ULL) >> (64 - lru->table_bits));
}

static inline uint32_t table_mask(const BlockLRU *lru)
{
    return (uint32_t)((1ULL << lru->table_bits) - 1);
}

/* The table slot holding ``key``, or the empty slot where it would go. */
static inline uint32_t probe(const BlockLRU *lru, uint64_t key)
{
    uint32_t mask = table_mask(lru), i = home(lru, key);
    while (lru->table[i] && lru->entries[lru->table[i] - 1].key != key)
        i = (i + 1) & mask;
    return i;
}

static inline uint32_t find(const BlockLRU *lru, uint64_t key)
{
    if (lru->table == NULL)
        return NIL;
    uint32_t slot = lru->table[probe(lru, key)];
    return slot ? slot - 1 : NIL;
}

static inline void unlink_entry(BlockLRU *lru, uint32_t e)
{
    Entry *x = &lru->entries[e];
    if (x->prev != NIL)
        lru->entries[x->prev].next = x->next;
    else
        lru->oldest = x->next;
    if (x->next != NIL)
        lru->entries[x->next].prev = x->prev;
    else
        lru->newest = x->prev;
}

static inline void link_newest(BlockLRU *lru, uint32_t e)
{
    Entry *x = &lru->entries[e];
    x->prev = lru->newest;
    x->next = NIL;
    if (lru->newest != NIL)
        lru->entries[lru->newest].next = e;
    else
        lru->oldest = e;
    lru->newest = e;
}

/* A table of 2**bits slots holding every live entry. */
static int rebuild_table(BlockLRU *lru, uint32_t bits)
{
    uint32_t *table = PyMem_Calloc((size_t)1 << bits, sizeof(uint32_t));
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyMem_Free(lru->table);
    lru->table = table;
    lru->table_bits = bits;
    for (uint32_t e = lru->oldest; e != NIL; e = lru->entries[e].next)
        table[probe(lru, lru->entries[e].key)] = e + 1;
    return 0;
}

/* Room for one more entry: a free one, or the array and the table grown. */
static int reserve_one(BlockLRU *lru)
{
    uint64_t size = (uint64_t)1 << lru->table_bits;
    if (lru->table == NULL || ((uint64_t)lru->used + 1) * 10 > size * MAX_LOAD_TENTHS) {
        uint32_t bits = lru->table == NULL ? MIN_TABLE_BITS : lru->table_bits + 1;
        if (bits > 32) {
            PyErr_SetString(PyExc_MemoryError, "BlockLRU: too many blocks");
            return -1;
        }
        if (rebuild_table(lru, bits) < 0)
            return -1;
    }
    if (lru->free == NIL && lru->top == lru->allocated) {
        uint64_t grown = (uint64_t)lru->allocated + lru->allocated / 2 + 16;
        if (grown >= NIL)
            grown = NIL - 1;
        if (grown <= lru->allocated) {
            PyErr_SetString(PyExc_MemoryError, "BlockLRU: too many blocks");
            return -1;
        }
        Entry *entries = PyMem_Realloc(lru->entries, (size_t)grown * sizeof(Entry));
        if (entries == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        lru->entries = entries;
        lru->allocated = (uint32_t)grown;
    }
    return 0;
}

/* ``key``, known absent, added as the most recent. */
static int insert(BlockLRU *lru, uint64_t key)
{
    if (reserve_one(lru) < 0)
        return -1;
    uint32_t e;
    if (lru->free != NIL) {
        e = lru->free;
        lru->free = lru->entries[e].next;
    } else {
        e = lru->top++;
    }
    lru->entries[e].key = key;
    link_newest(lru, e);
    lru->table[probe(lru, key)] = e + 1;
    lru->used++;
    return 0;
}

/* Entry ``e`` forgotten: out of the list and the table (linear probing's backward
 * shift, so no tombstones), onto the free list. */
static void forget(BlockLRU *lru, uint32_t e)
{
    unlink_entry(lru, e);
    uint32_t mask = table_mask(lru), hole = probe(lru, lru->entries[e].key);
    for (uint32_t j = (hole + 1) & mask; lru->table[j]; j = (j + 1) & mask) {
        uint32_t want = home(lru, lru->entries[lru->table[j] - 1].key);
        /* The entry at j may fill the hole unless its home lies in (hole, j]. */
        int stays = hole <= j ? (hole < want && want <= j) : (hole < want || want <= j);
        if (!stays) {
            lru->table[hole] = lru->table[j];
            hole = j;
        }
    }
    lru->table[hole] = 0;
    lru->entries[e].next = lru->free;
    lru->free = e;
    lru->used--;
}

/* ``h`` as a block hash: an int in [0, 2**64). */
static int as_key(PyObject *h, uint64_t *key)
{
    if (!PyLong_Check(h)) {
        PyErr_Format(PyExc_TypeError, "a block hash must be an int, not %.100s",
                     Py_TYPE(h)->tp_name);
        return -1;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(h);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *key = value;
    return 0;
}

/* Moved to the most recent end, added if absent. */
static int touch(BlockLRU *lru, uint64_t key)
{
    uint32_t e = find(lru, key);
    if (e == NIL)
        return insert(lru, key);
    if (e != lru->newest) {
        unlink_entry(lru, e);
        link_newest(lru, e);
    }
    return 0;
}

/* ------------------------------------------------------------------ the type */

static PyObject *lru_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *initial = NULL;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "BlockLRU() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "BlockLRU", 0, 1, &initial))
        return NULL;
    BlockLRU *lru = (BlockLRU *)type->tp_alloc(type, 0);
    if (lru == NULL)
        return NULL;
    lru->free = lru->oldest = lru->newest = NIL;
    if (initial != NULL) {
        PyObject *it = PyObject_GetIter(initial);
        if (it == NULL) {
            Py_DECREF(lru);
            return NULL;
        }
        PyObject *h;
        uint64_t key;
        while ((h = PyIter_Next(it)) != NULL) {
            int rc = as_key(h, &key) < 0 ? -1 : touch(lru, key);
            Py_DECREF(h);
            if (rc < 0)
                break;
        }
        Py_DECREF(it);
        if (PyErr_Occurred()) {
            Py_DECREF(lru);
            return NULL;
        }
    }
    return (PyObject *)lru;
}

static void lru_dealloc(BlockLRU *lru)
{
    PyMem_Free(lru->entries);
    PyMem_Free(lru->table);
    Py_TYPE(lru)->tp_free((PyObject *)lru);
}

static Py_ssize_t lru_len(BlockLRU *lru)
{
    return lru->used;
}

static int lru_contains(BlockLRU *lru, PyObject *h)
{
    if (!PyLong_Check(h))
        return 0;
    uint64_t key = PyLong_AsUnsignedLongLong(h);
    if (key == (uint64_t)-1 && PyErr_Occurred()) { /* negative or too big: not a hash */
        PyErr_Clear();
        return 0;
    }
    return find(lru, key) != NIL;
}

/* Oldest first, as a list's iterator (a snapshot: iterate, then change). The hashes
 * are copied out before any int is made: making one may run a collection, whose
 * finalizers must not find the walk half done. */
static PyObject *lru_iter(BlockLRU *lru)
{
    Py_ssize_t n = lru->used;
    uint64_t *keys = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    if (keys == NULL)
        return PyErr_NoMemory();
    Py_ssize_t i = 0;
    for (uint32_t e = lru->oldest; e != NIL; e = lru->entries[e].next)
        keys[i++] = lru->entries[e].key;
    PyObject *list = PyList_New(n), *it = NULL;
    for (i = 0; list != NULL && i < n; i++) {
        PyObject *h = PyLong_FromUnsignedLongLong(keys[i]);
        if (h == NULL)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, i, h);
    }
    PyMem_Free(keys);
    if (list != NULL) {
        it = PyObject_GetIter(list);
        Py_DECREF(list);
    }
    return it;
}

static PyObject *lru_sizeof(BlockLRU *lru, PyObject *Py_UNUSED(ignored))
{
    size_t table = lru->table == NULL ? 0 : ((size_t)1 << lru->table_bits) * sizeof(uint32_t);
    return PyLong_FromSize_t(Py_TYPE(lru)->tp_basicsize +
                             (size_t)lru->allocated * sizeof(Entry) + table);
}

static PySequenceMethods lru_as_sequence = {
    .sq_length = (lenfunc)lru_len,
    .sq_contains = (objobjproc)lru_contains,
};

static PyMethodDef lru_methods[] = {
    {"__sizeof__", (PyCFunction)lru_sizeof, METH_NOARGS,
     "Bytes held: the object, its entries (16 bytes each) and its table."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BlockLRUType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ace_extproc._speedups.BlockLRU",
    .tp_doc = "BlockLRU([hashes]): a pod's block hashes, least recently used first "
              "(routing/index.py; a dict is the Python reference).",
    .tp_basicsize = sizeof(BlockLRU),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = lru_new,
    .tp_dealloc = (destructor)lru_dealloc,
    .tp_as_sequence = &lru_as_sequence,
    .tp_iter = (getiterfunc)lru_iter,
    .tp_methods = lru_methods,
};

int ace_lru_add_type(PyObject *module)
{
    if (PyType_Ready(&BlockLRUType) < 0)
        return -1;
    Py_INCREF(&BlockLRUType);
    if (PyModule_AddObject(module, "BlockLRU", (PyObject *)&BlockLRUType) < 0) {
        Py_DECREF(&BlockLRUType);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------- the index's operations */

static BlockLRU *as_lru(PyObject *obj, const char *function)
{
    if (!PyObject_TypeCheck(obj, &BlockLRUType)) {
        PyErr_Format(PyExc_TypeError, "%s: an LRU must be a BlockLRU, not %.100s", function,
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return (BlockLRU *)obj;
}

/* roots[key] &= ~bit, the key gone when no pod holds it any more. */
static int clear_root(PyObject *roots, uint64_t key, PyObject *not_bit)
{
    if (PyDict_GET_SIZE(roots) == 0)
        return 0;
    PyObject *h = PyLong_FromUnsignedLongLong(key);
    if (h == NULL)
        return -1;
    int rc = 0;
    PyObject *mask = PyDict_GetItemWithError(roots, h);
    if (mask == NULL) {
        rc = PyErr_Occurred() ? -1 : 0;
    } else {
        PyObject *kept = PyNumber_And(mask, not_bit);
        int truth = kept == NULL ? -1 : PyObject_IsTrue(kept);
        rc = truth < 0 ? -1 : truth ? PyDict_SetItem(roots, h, kept) : PyDict_DelItem(roots, h);
        Py_XDECREF(kept);
    }
    Py_DECREF(h);
    return rc;
}

static int evict_oldest(BlockLRU *lru, PyObject *roots, PyObject *bit, Py_ssize_t count)
{
    if (count <= 0 || lru->used == 0)
        return 0;
    PyObject *not_bit = PyNumber_Invert(bit);
    if (not_bit == NULL)
        return -1;
    int rc = 0;
    for (; rc == 0 && count > 0 && lru->oldest != NIL; count--) {
        uint32_t e = lru->oldest;
        uint64_t key = lru->entries[e].key;
        forget(lru, e);
        rc = clear_root(roots, key, not_bit);
    }
    Py_DECREF(not_bit);
    return rc;
}

static int check_roots_and_bit(PyObject *roots, PyObject *bit, const char *function)
{
    if (!PyDict_CheckExact(roots)) {
        PyErr_Format(PyExc_TypeError, "%s: roots must be a dict", function);
        return -1;
    }
    if (!PyLong_Check(bit)) {
        PyErr_Format(PyExc_TypeError, "%s: bit must be an int", function);
        return -1;
    }
    return 0;
}

PyObject *ace_evict(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "evict(lru, roots, bit, count) takes 4 arguments");
        return NULL;
    }
    BlockLRU *lru = as_lru(args[0], "evict");
    if (lru == NULL || check_roots_and_bit(args[1], args[2], "evict") < 0)
        return NULL;
    Py_ssize_t count = PyLong_AsSsize_t(args[3]);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    if (evict_oldest(lru, args[1], args[2], count) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* The first block's holders gain ``bit``; then the LRU is cut back to ``capacity``. */
static int mark_root(BlockLRU *lru, PyObject *first, PyObject *roots, PyObject *bit,
                     Py_ssize_t capacity)
{
    PyObject *mask = PyDict_GetItemWithError(roots, first);
    if (mask == NULL && PyErr_Occurred())
        return -1;
    PyObject *marked = mask == NULL ? (Py_INCREF(bit), bit) : PyNumber_Or(mask, bit);
    if (marked == NULL)
        return -1;
    int rc = PyDict_SetItem(roots, first, marked);
    Py_DECREF(marked);
    if (rc < 0)
        return -1;
    return evict_oldest(lru, roots, bit, (Py_ssize_t)lru->used - capacity);
}

/* 1 with ``view`` filled (the caller releases it) when ``obj`` is an array("Q") or any
 * contiguous buffer of native 64-bit unsigned ints; 0 otherwise, no error set. */
static int uint64_view(PyObject *obj, Py_buffer *view)
{
    if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj) || !PyObject_CheckBuffer(obj))
        return 0;
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return 0;
    }
    const char *f = view->format;
    if (view->itemsize == 8 && f != NULL && (f[0] == 'Q' || f[0] == 'L') && f[1] == 0)
        return 1;
    PyBuffer_Release(view);
    return 0;
}

/* record() on hashes read in place from ``view``, which it releases. */
static PyObject *record_packed(BlockLRU *lru, Py_buffer *view, PyObject *roots,
                               PyObject *bit, Py_ssize_t capacity)
{
    const uint64_t *keys = (const uint64_t *)view->buf;
    Py_ssize_t n = view->len / 8;
    int rc = 0;
    for (Py_ssize_t i = n - 1; i >= 0 && rc == 0; i--)
        rc = touch(lru, keys[i]);
    if (rc == 0 && n > 0) {
        PyObject *first = PyLong_FromUnsignedLongLong(keys[0]);
        rc = first == NULL ? -1 : mark_root(lru, first, roots, bit, capacity);
        Py_XDECREF(first);
    }
    PyBuffer_Release(view);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* record() on ``n`` > 0 hashes as ints. */
static int record_items(BlockLRU *lru, PyObject **items, Py_ssize_t n, PyObject *roots,
                        PyObject *bit, Py_ssize_t capacity)
{
    uint64_t key;
    for (Py_ssize_t i = n - 1; i >= 0; i--)
        if (as_key(items[i], &key) < 0 || touch(lru, key) < 0)
            return -1;
    return mark_root(lru, items[0], roots, bit, capacity);
}

PyObject *ace_record(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "record(lru, blocks, roots, bit, capacity) takes 5 arguments");
        return NULL;
    }
    BlockLRU *lru = as_lru(args[0], "record");
    PyObject *roots = args[2], *bit = args[3];
    if (lru == NULL || check_roots_and_bit(roots, bit, "record") < 0)
        return NULL;
    Py_ssize_t capacity = PyLong_AsSsize_t(args[4]);
    if (capacity == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (uint64_view(args[1], &view))
        return record_packed(lru, &view, roots, bit, capacity);
    PyObject *blocks = PySequence_Fast(args[1], "record: blocks must be a sequence");
    if (blocks == NULL)
        return NULL;
    PyObject **items = PySequence_Fast_ITEMS(blocks);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(blocks);
    if (n == 0) { /* nothing recorded, nothing to make room for */
        Py_DECREF(blocks);
        Py_RETURN_NONE;
    }
    int rc = record_items(lru, items, n, roots, bit, capacity);
    Py_DECREF(blocks);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* One holder's depth: the length of its held run of ``items`` (it holds the first). */
static int held_run(const BlockLRU *lru, PyObject **items, Py_ssize_t n, Py_ssize_t *depth)
{
    uint64_t key;
    if (as_key(items[n - 1], &key) < 0)
        return -1;
    if (find(lru, key) != NIL) {
        *depth = n;
        return 0;
    }
    Py_ssize_t lo = 1, hi = n - 1; /* items[:lo] held, items[:hi + 1] not */
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi + 1) >> 1;
        if (as_key(items[mid - 1], &key) < 0)
            return -1;
        if (find(lru, key) != NIL)
            lo = mid;
        else
            hi = mid - 1;
    }
    *depth = lo;
    return 0;
}

/* depths[slot] = the slot's held run, its LRU looked up in ``lrus``. */
static int put_depth(PyObject *depths, PyObject *lrus, long long slot, PyObject **items,
                     Py_ssize_t n)
{
    PyObject *key = PyLong_FromLongLong(slot);
    if (key == NULL)
        return -1;
    PyObject *found = PyDict_GetItemWithError(lrus, key);
    BlockLRU *lru;
    Py_ssize_t depth;
    int rc = -1;
    if (found == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, key);
    } else if ((lru = as_lru(found, "match")) != NULL && held_run(lru, items, n, &depth) == 0) {
        PyObject *value = PyLong_FromSsize_t(depth);
        if (value != NULL) {
            rc = PyDict_SetItem(depths, key, value);
            Py_DECREF(value);
        }
    }
    Py_DECREF(key);
    return rc;
}

PyObject *ace_match(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "match(lrus, blocks, holders) takes 3 arguments");
        return NULL;
    }
    PyObject *lrus = args[0], *holders = args[2];
    if (!PyDict_Check(lrus) || !PyLong_Check(holders)) {
        PyErr_SetString(PyExc_TypeError, "match: lrus must be a dict and holders an int");
        return NULL;
    }
    PyObject *zero = PyLong_FromLong(0);
    int negative = zero == NULL ? -1 : PyObject_RichCompareBool(holders, zero, Py_LT);
    Py_XDECREF(zero);
    if (negative) {
        if (negative > 0)
            PyErr_SetString(PyExc_ValueError, "match: holders must not be negative");
        return NULL;
    }
    PyObject *blocks = PySequence_Fast(args[1], "match: blocks must be a sequence");
    if (blocks == NULL)
        return NULL;
    PyObject *depths = PyDict_New();
    Py_ssize_t n = PySequence_Fast_GET_SIZE(blocks);
    PyObject *rest = holders; /* the bits not yet looked at, 64 at a time */
    Py_INCREF(rest);
    for (long long base = 0; depths != NULL && n > 0; base += 64) {
        unsigned long long bits = PyLong_AsUnsignedLongLongMask(rest);
        if (bits == (unsigned long long)-1 && PyErr_Occurred())
            goto fail;
        while (bits) {
            int bit = __builtin_ctzll(bits);
            bits &= bits - 1;
            if (put_depth(depths, lrus, base + bit, PySequence_Fast_ITEMS(blocks), n) < 0)
                goto fail;
        }
        PyObject *shift = PyLong_FromLong(64);
        PyObject *next = shift == NULL ? NULL : PyNumber_Rshift(rest, shift);
        Py_XDECREF(shift);
        Py_DECREF(rest);
        rest = next;
        if (rest == NULL)
            goto fail;
        int more = PyObject_IsTrue(rest);
        if (more < 0)
            goto fail;
        if (!more)
            break;
    }
    Py_XDECREF(rest);
    Py_DECREF(blocks);
    return depths;
fail:
    Py_XDECREF(rest);
    Py_XDECREF(depths);
    Py_DECREF(blocks);
    return NULL;
}
