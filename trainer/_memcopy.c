/* Copying a large run of bytes with streaming (non-temporal) stores: trainer/memcopy.py says why.
 *
 * copy(dst, src, n): n bytes from address src to address dst, without the GIL. The two ranges
 * must not overlap. On x86-64 the bulk is written with SSE2's MOVNTDQ, 64 bytes (one cache line)
 * at a time from a 64-byte-aligned destination, and an SFENCE orders those stores before the call
 * returns; the unaligned head and the tail go through memcpy. Elsewhere: memcpy. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

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

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS, "copy(dst, src, n): n bytes from address src to dst (not overlapping), "
                                 "with streaming stores where the CPU has them; without the GIL."},
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
