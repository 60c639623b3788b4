/* Copies of large buffers with non-temporal stores, for copies that nothing reads right after
 * (a restore's copies out of the memory tier, an asynchronous save's captures). Such stores
 * write around the caches instead of first reading every destination line into them, so a copy
 * larger than the caches moves about a third fewer bytes through memory. x86-64 uses SSE2
 * streaming stores, which every x86-64 processor has; elsewhere, or with
 * FORKPOINT_PORTABLE_KERNELS set to anything but "0" or "avx512", memcpy. The copy releases the GIL. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include "../kernel_choice.h"
#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#define STREAMING 1
#endif

static int streaming = 0;

#ifdef STREAMING
static void stream_copy(uint8_t *dst, const uint8_t *src, size_t n) {
    size_t i = (size_t)(-(uintptr_t)dst & 15);
    if (i > n) i = n;
    memcpy(dst, src, i);
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    _mm_sfence();
    memcpy(dst + i, src + i, n - i);
}
#endif

static PyObject *copy(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*", &dst, &src)) return NULL;
    if (src.len != dst.len) {
        PyErr_Format(PyExc_ValueError, "copy of %zd bytes into a buffer of %zd", src.len, dst.len);
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
#ifdef STREAMING
    if (streaming)
        stream_copy((uint8_t *)dst.buf, (const uint8_t *)src.buf, (size_t)src.len);
    else
#endif
        memcpy(dst.buf, src.buf, (size_t)src.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

static PyObject *kernel(PyObject *self, PyObject *noargs) {
    return PyUnicode_FromString(streaming ? "sse2" : "portable");
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS,
     "copy(dst, src)\n"
     "Copy the bytes of `src` into `dst`, of the same length and not overlapping it, with non-temporal stores."},
    {"kernel", kernel, METH_NOARGS,
     "kernel() -> str\n"
     "'sse2' where copies use streaming stores in this process, else 'portable' (memcpy)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_stream", NULL, -1, methods};

PyMODINIT_FUNC PyInit__stream(void) {
#ifdef STREAMING
    streaming = portable_kernels() < 2;
#endif
    return PyModule_Create(&module);
}
