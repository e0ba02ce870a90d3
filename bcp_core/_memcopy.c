/* bcp_core._memcopy: copies of large runs of bytes with non-temporal stores (bcp_core/memcopy.py).
 *
 * A load copies each verified range out of the page cache into the caller's tensor. With ordinary
 * stores every destination cache line is first read from memory (read for ownership), then
 * written back: three passes over memory for a copy. Non-temporal stores write whole lines
 * without reading them, two passes; glibc's memcpy uses them only from about 3/4 of the shared
 * cache size up (190 MiB on a 480 MiB L3), far above most tensors. The destination is not read
 * again soon (a state too large for the cache), so bypassing the cache costs nothing.
 *
 * One function, copy(dst, src): `src` any contiguous buffer, `dst` a writable one of the same
 * length. The GIL is released during the copy. On other than x86-64 it is memcpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define NON_TEMPORAL 1

static void stream_copy(char *dst, const char *src, size_t n)
{
    /* ordinary stores up to the first 16-byte boundary of dst, then 64 bytes (a cache line) per
       round with streaming stores, the tail ordinary again; the fence orders the streamed stores
       before whatever the caller does next */
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
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
#else
#define NON_TEMPORAL 0

static void stream_copy(char *dst, const char *src, size_t n)
{
    memcpy(dst, src, n);
}
#endif

static PyObject *copy(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*:copy", &dst, &src))
        return NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy: destination has %zd bytes, source %zd", dst.len, src.len);
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    stream_copy((char *)dst.buf, (const char *)src.buf, (size_t)dst.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS,
     "copy(dst, src): the bytes of contiguous buffer src into writable buffer dst of the same length, "
     "with non-temporal stores where NON_TEMPORAL; the GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_memcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__memcopy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "NON_TEMPORAL", NON_TEMPORAL) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
