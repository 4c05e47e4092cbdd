/* The load's data phase in C, without the GIL: ckptflow/fast/memcopy.py says why.
 *
 * copy(dst, src, n): n bytes from address src to address dst. The two ranges must not overlap.
 * On x86-64 the bulk is written with SSE2's MOVNTDQ, 64 bytes (one cache line) at a time from a
 * 64-byte-aligned destination, and an SFENCE orders those stores before the call returns; the
 * unaligned head and the tail go through memcpy. Elsewhere: memcpy.
 *
 * verify_copy(...): a run of consecutive blocks of a mapped file, each hashed (xxh3-64) and
 * compared with its expected digest, and each block's pieces copied right after it matched (while
 * its bytes are still in cache), stopping at the first block that does not match. One call per
 * run instead of a Python round per block: the pool's threads then hardly need the GIL, which the
 * thread planning the load holds most of the time.
 *
 * xxh3(addr, n): the xxh3-64 digest of n bytes (for the tests: the same function as python-xxhash's).
 *
 * stream_in(fd, sink, off, n, addr, step) (Linux): bytes [off, off + n) of file fd into the page cache
 * by sendfile to sink (/dev/null: nothing is copied out), then the file's mapping at addr touched one
 * byte every step bytes over them, so its pages are mapped into the process. One call a chunk of a
 * cold file's stream (verifiedcopy.Streamer): the streaming thread, which took the GIL back after the
 * sendfile and again after the torch op that mapped the pages, waited up to a switch interval (5 ms)
 * each time while the thread planning the load ran Python, and the stream ran well below the disk.
 *
 * xxHash is vendored in _xxhash/ (BSD 2-Clause, its LICENSE beside it), with its own runtime
 * dispatch on x86-64 (AVX-512, AVX2 or SSE2, whatever the CPU has; the file is built with the
 * baseline flags). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#ifdef __linux__
#include <sys/sendfile.h>
#endif

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#include "xxh_x86dispatch.c" /* XXH3_64bits: the best of SSE2 / AVX2 / AVX-512 at run time */
#else
#define XXH_INLINE_ALL
#include "xxhash.h"
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define CKPTFLOW_STREAMING 1

static void stream_copy(char *d, const char *s, size_t n)
{
    size_t head = (64 - ((uintptr_t)d & 63)) & 63;
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t lines = n / 64;
    for (size_t i = 0; i < lines; i++) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)(d), a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
        s += 64;
        d += 64;
    }
    _mm_sfence(); /* streaming stores are weakly ordered: make them visible before returning */
    memcpy(d, s, n - lines * 64);
}
#else
#define CKPTFLOW_STREAMING 0

static void stream_copy(char *d, const char *s, size_t n) { memcpy(d, s, n); }
#endif

static PyObject *copy(PyObject *self, PyObject *args)
{
    unsigned long long dst, src;
    Py_ssize_t n;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKn:copy", &dst, &src, &n))
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "copy: negative length");
        return NULL;
    }
    if (n && (!dst || !src)) {
        PyErr_SetString(PyExc_ValueError, "copy: null address");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    stream_copy((char *)(uintptr_t)dst, (const char *)(uintptr_t)src, (size_t)n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

#define STREAM_FROM (64 << 10) /* as memcopy.STREAM_FROM: smaller pieces go through memcpy */

static void copy_piece(char *d, const char *s, size_t n)
{
    if (n >= STREAM_FROM)
        stream_copy(d, s, n);
    else
        memcpy(d, s, n);
}

/* A read-only contiguous buffer of n uint64 values (an array('Q') or the like). */
static int u64_buffer(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len % 8 || view->itemsize != 8) {
        PyErr_Format(PyExc_ValueError, "verify_copy: %s must hold 8-byte unsigned integers", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *verify_copy(PyObject *self, PyObject *args)
{
    unsigned long long base;
    Py_ssize_t start, end, bs;
    PyObject *digests_obj, *counts_obj, *pieces_obj;
    Py_buffer dv, cv, pv;
    (void)self;
    if (!PyArg_ParseTuple(args, "KnnnOOO:verify_copy", &base, &start, &end, &bs, &digests_obj, &counts_obj,
                          &pieces_obj))
        return NULL;
    if (!base || start < 0 || end < start || bs <= 0) {
        PyErr_SetString(PyExc_ValueError, "verify_copy: bad address or range");
        return NULL;
    }
    if (u64_buffer(digests_obj, &dv, "digests") < 0)
        return NULL;
    if (u64_buffer(counts_obj, &cv, "counts") < 0) {
        PyBuffer_Release(&dv);
        return NULL;
    }
    if (u64_buffer(pieces_obj, &pv, "pieces") < 0) {
        PyBuffer_Release(&dv);
        PyBuffer_Release(&cv);
        return NULL;
    }
    Py_ssize_t nblocks = (end - start + bs - 1) / bs;
    const uint64_t *digests = (const uint64_t *)dv.buf, *counts = (const uint64_t *)cv.buf;
    const uint64_t *pieces = (const uint64_t *)pv.buf;
    Py_ssize_t npieces = pv.len / 24, total = 0;
    int ok = dv.len / 8 == nblocks && cv.len / 8 == nblocks && pv.len % 24 == 0;
    for (Py_ssize_t i = 0; ok && i < nblocks; i++) {
        total += (Py_ssize_t)counts[i];
        ok = counts[i] <= (uint64_t)npieces && total <= npieces;
    }
    if (!ok || total != npieces) {
        PyBuffer_Release(&dv);
        PyBuffer_Release(&cv);
        PyBuffer_Release(&pv);
        PyErr_SetString(PyExc_ValueError, "verify_copy: one digest and one piece count per block, and "
                                          "(dst, src, n) for every piece counted");
        return NULL;
    }
    Py_ssize_t matched = 0;
    Py_BEGIN_ALLOW_THREADS
    const uint64_t *p = pieces;
    for (; matched < nblocks; matched++) {
        Py_ssize_t a = start + matched * bs, b = a + bs < end ? a + bs : end;
        if (XXH3_64bits((const void *)(uintptr_t)(base + (uint64_t)a), (size_t)(b - a)) != digests[matched])
            break;
        for (uint64_t k = 0; k < counts[matched]; k++, p += 3)
            copy_piece((char *)(uintptr_t)p[0], (const char *)(uintptr_t)p[1], (size_t)p[2]);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dv);
    PyBuffer_Release(&cv);
    PyBuffer_Release(&pv);
    return PyLong_FromSsize_t(matched);
}

static PyObject *xxh3(PyObject *self, PyObject *args)
{
    unsigned long long addr;
    Py_ssize_t n;
    (void)self;
    if (!PyArg_ParseTuple(args, "Kn:xxh3", &addr, &n))
        return NULL;
    if (n < 0 || (n && !addr)) {
        PyErr_SetString(PyExc_ValueError, "xxh3: bad address or length");
        return NULL;
    }
    XXH64_hash_t h;
    Py_BEGIN_ALLOW_THREADS
    h = XXH3_64bits((const void *)(uintptr_t)addr, (size_t)n);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(h);
}

#ifdef __linux__
static PyObject *stream_in(PyObject *self, PyObject *args)
{
    int fd, sink;
    long long off;
    Py_ssize_t n, step;
    unsigned long long addr;
    (void)self;
    if (!PyArg_ParseTuple(args, "iiLnKn:stream_in", &fd, &sink, &off, &n, &addr, &step))
        return NULL;
    if (off < 0 || n < 0 || step <= 0) {
        PyErr_SetString(PyExc_ValueError, "stream_in: bad offset, length or step");
        return NULL;
    }
    Py_ssize_t got = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    off_t pos = (off_t)off;
    while (got < n) {
        ssize_t r = sendfile(sink, fd, &pos, (size_t)(n - got));
        if (r < 0) {
            if (errno == EINTR)
                continue;
            err = errno;
            break;
        }
        if (r == 0)
            break; /* the end of the file */
        got += r;
    }
    if (addr) {
        /* a read every step bytes: each page fault maps that many resident pages (fault-around) */
        const volatile unsigned char *p = (const volatile unsigned char *)(uintptr_t)addr + off;
        unsigned char acc = 0;
        for (Py_ssize_t i = 0; i < got; i += step)
            acc ^= p[i];
        (void)acc;
    }
    Py_END_ALLOW_THREADS
    if (err && !got) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(got);
}
#endif

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS, "copy(dst, src, n): n bytes from address src to dst (not overlapping), "
                                 "with streaming stores where the CPU has them; without the GIL."},
    {"verify_copy", verify_copy, METH_VARARGS,
     "verify_copy(base, start, end, bs, digests, counts, pieces) -> blocks matched: the blocks "
     "[start + i*bs, min(start + (i+1)*bs, end)) of the memory at address base, each hashed (xxh3-64) "
     "and compared with digests[i], then its counts[i] pieces (dst, src, n: consecutive triples in "
     "pieces) copied; stops at the first block that does not match. Buffers of uint64; no GIL."},
    {"xxh3", xxh3, METH_VARARGS, "xxh3(addr, n) -> the xxh3-64 digest of n bytes at addr (no GIL)."},
#ifdef __linux__
    {"stream_in", stream_in, METH_VARARGS,
     "stream_in(fd, sink, off, n, addr, step) -> bytes streamed: bytes [off, off + n) of file fd sent "
     "to sink (sendfile), then, if addr, the file's mapping at addr read every step bytes over them; "
     "no GIL. OSError if nothing could be sent."},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_memcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__memcopy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "STREAMING", CKPTFLOW_STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
