/* tierckpt._copycrc: copy runs of a file's resident page cache into a buffer (copy_runs), or a group of
 * spans each into its own buffer through one mapping (copy_spans), taking each run's CRC-32C in the same
 * pass (see tierckpt/backends/mapped_read.py, which decides when to use them); and fold runs' CRC-32Cs
 * into per-block raw CRCs for the load's read check (fold_runs, tierckpt/io/readcheck.py).
 *
 * The file is mapped read-only; when the span is resident (mincore, sampled), each run is copied with
 * its CRC-32C computed from the same loads: one pass over the bytes instead of a kernel copy (pread) and
 * a second pass to checksum them; short runs go three at a time, one CRC stream each. A file system that
 * keeps large folios in the page cache maps them with 2 MiB page-table entries, so the mapping costs next
 * to nothing. When a sampled page is not resident the call returns None and the caller reads with pread
 * (a fault-driven read of a cold file is slower than pread's). x86-64 with SSE4.2 only (the CRC32
 * instruction); elsewhere AVAILABLE is 0.
 *
 * CRC-32C over three interleaved streams (the instruction's latency is three cycles, its throughput
 * one), combined by shifting with precomputed tables: shift(c, n) is the raw CRC of n zero bytes
 * starting from c, a linear map applied byte by byte through four 256-entry tables.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define HW 1
#define SSE42 __attribute__((target("sse4.2")))
#else
#define HW 0
#endif

#if HW
#define LONG_BLOCK 8192
#define SHORT_BLOCK 256
static uint32_t long_shift[4][256], short_shift[4][256];

SSE42 static uint32_t zeros(uint32_t crc, size_t n) {
    uint64_t c = crc;
    for (size_t i = 0; i < n / 8; i++) c = _mm_crc32_u64(c, 0);
    return (uint32_t)c;
}

SSE42 static void init_tables(void) {
    for (int k = 0; k < 4; k++)
        for (uint32_t v = 0; v < 256; v++) {
            long_shift[k][v] = zeros(v << (8 * k), LONG_BLOCK);
            short_shift[k][v] = zeros(v << (8 * k), SHORT_BLOCK);
        }
}

static inline uint32_t shift(uint32_t table[4][256], uint32_t c) {
    return table[0][c & 0xff] ^ table[1][(c >> 8) & 0xff] ^ table[2][(c >> 16) & 0xff] ^ table[3][c >> 24];
}

static inline uint64_t load64(const unsigned char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

static inline void store64(unsigned char *d, uint64_t w) { memcpy(d, &w, 8); }

/* Copy n bytes from p to d; return the raw CRC-32C (no pre/post inversion) of them, continuing crc. */
#define THREE_WAY(BLOCK, TABLE)                                                                          \
    while (n >= 3 * (BLOCK)) {                                                                           \
        uint64_t c1 = 0, c2 = 0;                                                                         \
        const unsigned char *end = p + (BLOCK);                                                          \
        do {                                                                                             \
            uint64_t a = load64(p), b = load64(p + (BLOCK)), c = load64(p + 2 * (BLOCK));                \
            store64(d, a), store64(d + (BLOCK), b), store64(d + 2 * (BLOCK), c);                         \
            c0 = _mm_crc32_u64(c0, a), c1 = _mm_crc32_u64(c1, b), c2 = _mm_crc32_u64(c2, c);             \
            p += 8, d += 8;                                                                              \
        } while (p < end);                                                                               \
        c0 = shift(TABLE, (uint32_t)c0) ^ (uint32_t)c1;                                                  \
        c0 = shift(TABLE, (uint32_t)c0) ^ (uint32_t)c2;                                                  \
        p += 2 * (BLOCK), d += 2 * (BLOCK), n -= 3 * (BLOCK);                                            \
    }

SSE42 static uint32_t copy_crc(uint32_t crc, unsigned char *d, const unsigned char *p, size_t n) {
    uint64_t c0 = crc;
    THREE_WAY(LONG_BLOCK, long_shift)
    THREE_WAY(SHORT_BLOCK, short_shift)
    for (; n >= 8; n -= 8, p += 8, d += 8) {
        uint64_t a = load64(p);
        store64(d, a);
        c0 = _mm_crc32_u64(c0, a);
    }
    for (; n; n--) {
        *d++ = *p;
        c0 = _mm_crc32_u8((uint32_t)c0, *p++);
    }
    return (uint32_t)c0;
}

/* Three runs of n bytes at once, each copied and checksummed in its own stream (no shifts to combine):
 * the many short runs of a strided read cost what one long run does. Raw CRCs in crc[0..2]. */
SSE42 static void copy_crc3(uint32_t crc[3], unsigned char *d[3], const unsigned char *p[3], size_t n) {
    uint64_t c0 = crc[0], c1 = crc[1], c2 = crc[2];
    const unsigned char *p0 = p[0], *p1 = p[1], *p2 = p[2];
    unsigned char *d0 = d[0], *d1 = d[1], *d2 = d[2];
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t a = load64(p0 + i), b = load64(p1 + i), c = load64(p2 + i);
        store64(d0 + i, a), store64(d1 + i, b), store64(d2 + i, c);
        c0 = _mm_crc32_u64(c0, a), c1 = _mm_crc32_u64(c1, b), c2 = _mm_crc32_u64(c2, c);
    }
    for (; i < n; i++) {
        d0[i] = p0[i], d1[i] = p1[i], d2[i] = p2[i];
        c0 = _mm_crc32_u8((uint32_t)c0, p0[i]), c1 = _mm_crc32_u8((uint32_t)c1, p1[i]), c2 = _mm_crc32_u8((uint32_t)c2, p2[i]);
    }
    crc[0] = (uint32_t)c0, crc[1] = (uint32_t)c1, crc[2] = (uint32_t)c2;
}

/* A plain copy in 16-byte vectors: glibc's memcpy takes `rep movsb` for runs of a few KiB to a few MiB,
 * which ran 2-4x slower than this loop on the test VM (AMD EPYC, Zen 3). */
static void copy_plain(unsigned char *d, const unsigned char *p, size_t n) {
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(p + i)), b = _mm_loadu_si128((const __m128i *)(p + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(p + i + 32)), e = _mm_loadu_si128((const __m128i *)(p + i + 48));
        _mm_storeu_si128((__m128i *)(d + i), a), _mm_storeu_si128((__m128i *)(d + i + 16), b);
        _mm_storeu_si128((__m128i *)(d + i + 32), c), _mm_storeu_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + i, p + i, n - i);
}

static int hardware = 0;
#endif

/* Whether the span's pages are in the page cache, judged by one page in every 2 MiB and the last: a
 * full mincore costs about 9 ms per 512 MiB here (a page-cache lookup per 4 KiB), a sample 0.1 ms. A page
 * the sample missed is read by its fault (the same bytes, later), so the guess only costs speed. */
static int resident(unsigned char *map, size_t span, size_t page) {
    unsigned char v;
    for (size_t at = 0; at < span; at += (size_t)2 << 20)
        if (mincore(map + at, page, &v) != 0 || !(v & 1)) return 0;
    return mincore(map + (span - 1) / page * page, page, &v) == 0 && (v & 1);
}

/* Mapped pages the copy has passed count in the process's resident set until unmapped (they are the
 * page cache's, shared, not new memory, but RSS-based accounting sees them): every DROP_BYTES copied, the
 * pages of the runs copied since are dropped from the mapping (MADV_DONTNEED: the page cache keeps them),
 * so a copy adds at most about DROP_BYTES to the process's resident set, whatever the span. */
#define DROP_BYTES ((size_t)8 << 20)

struct dropper {
    unsigned char *map;
    size_t page, since, lo, hi;  /* bytes copied and the span [lo, hi) of their sources since the last drop */
};

static void drop_passed(struct dropper *d) {
    if (d->since) {
        size_t lo = d->lo / d->page * d->page;
        madvise(d->map + lo, d->hi - lo, MADV_DONTNEED);
        d->since = 0;
    }
}

static void passed(struct dropper *d, size_t from, size_t n) {
    d->lo = d->since == 0 || from < d->lo ? from : d->lo;
    d->hi = d->since == 0 || from + n > d->hi ? from + n : d->hi;
    d->since += n;
    if (d->since >= DROP_BYTES) drop_passed(d);
}

/* The page-aligned window of a file that a copy of the bytes [lo, hi) maps. */
struct window {
    long page;
    int64_t base;  /* lo rounded down to a page */
    size_t size;   /* hi - base */
};

/* The window of [lo, hi) of the open file fd in w: 1, or 0 when the file is shorter than hi (nothing to
 * map), or -1 when fstat failed (OSError set). */
static int window_of(int fd, int64_t lo, int64_t hi, struct window *w) {
    struct stat st;
    if (fstat(fd, &st) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (st.st_size < hi) return 0;
    w->page = sysconf(_SC_PAGESIZE);
    w->base = lo - lo % w->page;
    w->size = (size_t)(hi - w->base);
    return 1;
}

/* What a copy returns: an OSError for errno failed; None when nothing was copied (the caller reads with
 * pread); else the list of the count CRCs (crcs NULL: no CRCs asked, an empty list). */
static PyObject *copy_result(int failed, int copied, const uint32_t *crcs, Py_ssize_t count) {
    if (failed) {
        errno = failed;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (!copied) return Py_NewRef(Py_None);
    PyObject *result = PyList_New(crcs ? count : 0);
    for (Py_ssize_t i = 0; result && crcs && i < count; i++) {
        PyObject *value = PyLong_FromUnsignedLong(crcs[i]);
        if (!value) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, value);
    }
    return result;
}

/* copy_runs(fd, offsets, run_bytes, out, crc) -> list[int] | None
 *
 * Copy the runs [offsets[i], offsets[i] + run_bytes) of the open file fd back to back into the writable
 * buffer out (len(offsets) * run_bytes bytes); with crc, return the CRC-32C of each run, else [].
 * offsets: a buffer of int64. Returns None, having copied nothing, when the file is shorter than the
 * runs or a page of their span is not in the page cache. The GIL is released while copying. */
static PyObject *copy_runs(PyObject *self, PyObject *args) {
    int fd, want_crc;
    Py_ssize_t run_bytes;
    Py_buffer offsets, out;
    if (!PyArg_ParseTuple(args, "iy*nw*p", &fd, &offsets, &run_bytes, &out, &want_crc)) return NULL;
    PyObject *result = NULL;
    uint32_t *crcs = NULL;
    Py_ssize_t count = offsets.len / (Py_ssize_t)sizeof(int64_t);
#if HW
    if (!hardware) {
        PyErr_SetString(PyExc_RuntimeError, "copy_runs needs a CPU with SSE4.2");
        goto done;
    }
    if (offsets.len % (Py_ssize_t)sizeof(int64_t) || run_bytes < 0 || out.len != count * run_bytes) {
        PyErr_SetString(PyExc_ValueError, "copy_runs: out must hold len(offsets) * run_bytes bytes, offsets int64");
        goto done;
    }
    if (count == 0 || run_bytes == 0) {
        result = PyList_New(0);
        goto done;
    }
    const int64_t *at = (const int64_t *)offsets.buf;
    int64_t lo = at[0], hi = at[0];
    for (Py_ssize_t i = 0; i < count; i++) {
        if (at[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "copy_runs: a negative offset");
            goto done;
        }
        lo = at[i] < lo ? at[i] : lo;
        hi = at[i] > hi ? at[i] : hi;
    }
    hi += run_bytes;
    struct window w;
    int covers = window_of(fd, lo, hi, &w);
    if (covers <= 0) {
        result = covers < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    crcs = want_crc ? malloc(sizeof(uint32_t) * (size_t)count) : NULL;
    if (want_crc && !crcs) {
        PyErr_NoMemory();
        goto done;
    }
    int copied = 0, failed = 0;
    Py_BEGIN_ALLOW_THREADS
    unsigned char *map = mmap(NULL, w.size, PROT_READ, MAP_SHARED, fd, (off_t)w.base);
    if (map == MAP_FAILED) {
        failed = errno;
    } else {
        if (resident(map, w.size, (size_t)w.page)) {
            unsigned char *dst = out.buf;
            struct dropper drop = {map, (size_t)w.page, 0, 0, 0};
            Py_ssize_t i = 0;
            if (want_crc && run_bytes < 3 * LONG_BLOCK) {  /* short runs: three at a time */
                for (; i + 3 <= count; i += 3, dst += 3 * run_bytes) {
                    uint32_t c[3] = {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu};
                    unsigned char *d[3] = {dst, dst + run_bytes, dst + 2 * run_bytes};
                    const unsigned char *p[3] = {map + (at[i] - w.base), map + (at[i + 1] - w.base), map + (at[i + 2] - w.base)};
                    copy_crc3(c, d, p, (size_t)run_bytes);
                    crcs[i] = ~c[0], crcs[i + 1] = ~c[1], crcs[i + 2] = ~c[2];
                    for (int k = 0; k < 3; k++)
                        passed(&drop, (size_t)(at[i + k] - w.base), (size_t)run_bytes);
                }
            }
            for (; i < count; i++, dst += run_bytes) {
                const unsigned char *src = map + (at[i] - w.base);
                if (want_crc)
                    crcs[i] = ~copy_crc(0xFFFFFFFFu, dst, src, (size_t)run_bytes);
                else
                    copy_plain(dst, src, (size_t)run_bytes);
                passed(&drop, (size_t)(at[i] - w.base), (size_t)run_bytes);
            }
            copied = 1;
        }
        munmap(map, w.size);
    }
    Py_END_ALLOW_THREADS
    result = copy_result(failed, copied, want_crc ? crcs : NULL, count);
#else
    PyErr_SetString(PyExc_RuntimeError, "copy_runs is built for x86-64 only");
#endif
done:
    free(crcs);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&out);
    return result;
}

/* copy_spans(fd, starts, lengths, outs, crc) -> list[int] | None
 *
 * copy_runs for a group of units of one file, each a single span with its own output: copy the bytes
 * [starts[i], starts[i] + lengths[i]) of the open file fd into the writable buffer outs[i] (exactly
 * lengths[i] bytes), through one mapping of the group's whole extent; with crc, return the CRC-32C of each
 * span, else []. starts, lengths: buffers of int64. A load's many small units of one file then cost one
 * mapping, not one each (a mapping per 1/4 MiB unit costs more than it saves). Returns None, having copied
 * nothing, when the file is shorter than a span or a sampled page of a span is not in the page cache. The
 * GIL is released while copying. */
static PyObject *copy_spans(PyObject *self, PyObject *args) {
    int fd, want_crc;
    Py_buffer starts, lengths;
    PyObject *outs_arg, *outs = NULL, *result = NULL;
    Py_buffer *views = NULL;
    Py_ssize_t held = 0;
    uint32_t *crcs = NULL;
    if (!PyArg_ParseTuple(args, "iy*y*Op", &fd, &starts, &lengths, &outs_arg, &want_crc)) return NULL;
    Py_ssize_t count = starts.len / (Py_ssize_t)sizeof(int64_t);
#if HW
    if (!hardware) {
        PyErr_SetString(PyExc_RuntimeError, "copy_spans needs a CPU with SSE4.2");
        goto done;
    }
    if (starts.len % (Py_ssize_t)sizeof(int64_t) || lengths.len != starts.len) {
        PyErr_SetString(PyExc_ValueError, "copy_spans: starts and lengths must be int64 buffers of one length");
        goto done;
    }
    outs = PySequence_Fast(outs_arg, "copy_spans: outs must be a sequence of writable buffers");
    if (!outs) goto done;
    if (PySequence_Fast_GET_SIZE(outs) != count) {
        PyErr_SetString(PyExc_ValueError, "copy_spans: one output buffer per span");
        goto done;
    }
    views = PyMem_Calloc((size_t)(count ? count : 1), sizeof(Py_buffer));
    if (!views) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *at = (const int64_t *)starts.buf, *len = (const int64_t *)lengths.buf;
    int64_t lo = INT64_MAX, hi = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(outs, i), &views[i], PyBUF_WRITABLE) != 0) goto done;
        held++;
        if (at[i] < 0 || len[i] < 0 || len[i] > INT64_MAX - at[i] || views[i].len != len[i]) {
            PyErr_SetString(PyExc_ValueError,
                            "copy_spans: a negative start or length, a span past 2^63, or an output of another length");
            goto done;
        }
        if (len[i] == 0) continue;
        lo = at[i] < lo ? at[i] : lo;
        hi = at[i] + len[i] > hi ? at[i] + len[i] : hi;
    }
    crcs = want_crc ? calloc((size_t)(count ? count : 1), sizeof(uint32_t)) : NULL;
    if (want_crc && !crcs) {
        PyErr_NoMemory();
        goto done;
    }
    int copied = 1, failed = 0;
    if (hi > lo) {  /* else every span is empty: nothing to map, every CRC is 0 */
        struct window w;
        int covers = window_of(fd, lo, hi, &w);
        if (covers <= 0) {
            result = covers < 0 ? NULL : Py_NewRef(Py_None);
            goto done;
        }
        Py_BEGIN_ALLOW_THREADS
        unsigned char *map = mmap(NULL, w.size, PROT_READ, MAP_SHARED, fd, (off_t)w.base);
        if (map == MAP_FAILED) {
            failed = errno;
        } else {
            for (Py_ssize_t i = 0; copied && i < count; i++) {
                if (len[i] == 0) continue;
                size_t from = (size_t)(at[i] - w.base) / (size_t)w.page * (size_t)w.page;
                copied = resident(map + from, (size_t)(at[i] - w.base) + (size_t)len[i] - from, (size_t)w.page);
            }
            if (copied) {
                struct dropper drop = {map, (size_t)w.page, 0, 0, 0};
                for (Py_ssize_t i = 0; i < count; i++) {
                    if (len[i] == 0) continue;
                    unsigned char *dst = views[i].buf;
                    const unsigned char *src = map + (at[i] - w.base);
                    if (want_crc)
                        crcs[i] = ~copy_crc(0xFFFFFFFFu, dst, src, (size_t)len[i]);
                    else
                        copy_plain(dst, src, (size_t)len[i]);
                    passed(&drop, (size_t)(at[i] - w.base), (size_t)len[i]);
                }
            }
            munmap(map, w.size);
        }
        Py_END_ALLOW_THREADS
    }
    result = copy_result(failed, copied, want_crc ? crcs : NULL, count);
#else
    PyErr_SetString(PyExc_RuntimeError, "copy_spans is built for x86-64 only");
#endif
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    Py_XDECREF(outs);
    free(crcs);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&lengths);
    return result;
}

/* crc32c(data, crc=0) -> int: the CRC-32C of data continuing crc (crc32c.crc32c's convention); for tests. */
static PyObject *crc32c_of(PyObject *self, PyObject *args) {
    Py_buffer data;
    unsigned int crc = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &data, &crc)) return NULL;
    PyObject *result = NULL;
#if HW
    if (hardware) {
        unsigned char *scratch = malloc(data.len ? (size_t)data.len : 1);
        if (!scratch) {
            PyErr_NoMemory();
        } else {
            uint32_t got;
            Py_BEGIN_ALLOW_THREADS
            got = ~copy_crc(~(uint32_t)crc, scratch, data.buf, (size_t)data.len);
            Py_END_ALLOW_THREADS
            free(scratch);
            result = PyLong_FromUnsignedLong(got);
        }
    } else {
        PyErr_SetString(PyExc_RuntimeError, "crc32c needs a CPU with SSE4.2");
    }
#else
    PyErr_SetString(PyExc_RuntimeError, "crc32c is built for x86-64 only");
#endif
    PyBuffer_Release(&data);
    return result;
}

/* Raw CRC arithmetic over GF(2) (bit-reflected, as CRC-32C computes): shifting a raw CRC by n zero
 * bytes is a multiplication by x^(8n) mod P. Portable C: no CPU feature needed. */
#define POLY 0x82F63B78u
#define ONE 0x80000000u /* the polynomial 1 */
static uint32_t x2n[64]; /* x^(2^k) mod P */

static uint32_t mulmod(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (int bit = 31; bit >= 0; bit--) {
        product ^= (uint32_t)(-(int32_t)((a >> bit) & 1)) & b;
        b = (b >> 1) ^ ((uint32_t)(-(int32_t)(b & 1)) & POLY);
    }
    return product;
}

static void init_powers(void) {
    x2n[0] = ONE >> 1; /* x^1 */
    for (int k = 1; k < 64; k++) x2n[k] = mulmod(x2n[k - 1], x2n[k - 1]);
}

static uint32_t x8n(uint64_t n) { /* x^(8n) mod P */
    uint32_t out = ONE;
    for (int k = 3; n; n >>= 1, k++)
        if (n & 1) out = mulmod(x2n[k & 63], out);
    return out;
}

/* fold_runs(offsets, run_bytes, crcs, block, length) -> (blocks, raw, covered) | None
 *
 * The runs [offsets[i], offsets[i] + run_bytes) of a piece of length bytes checksummed in blocks of
 * block bytes (offsets: int64, relative to the piece, ascending, not overlapping; crcs: each run's
 * CRC-32C) folded per block they touch: the block's index, the raw CRC of the block with every byte
 * outside the runs taken as zero (the XOR of the runs' raw CRCs, each shifted to the block's end), and
 * the bytes the runs cover — three native arrays (int64, uint64, int64) as bytes. A block the runs cover
 * whole thus carries its own raw CRC. None when a run crosses a block edge or the runs are out of
 * order (the caller cuts them in Python). One multiplication per run instead of numpy's table passes. */
static PyObject *fold_runs(PyObject *self, PyObject *args) {
    Py_buffer offsets;
    Py_ssize_t run_bytes;
    long long block, length;
    PyObject *crc_list;
    if (!PyArg_ParseTuple(args, "y*nOLL", &offsets, &run_bytes, &crc_list, &block, &length)) return NULL;
    PyObject *result = NULL, *fast = NULL;
    uint32_t *raw_runs = NULL;
    int64_t *out_blocks = NULL, *out_covered = NULL;
    uint64_t *out_raw = NULL;
    Py_ssize_t count = offsets.len / (Py_ssize_t)sizeof(int64_t);
    if (offsets.len % (Py_ssize_t)sizeof(int64_t) || run_bytes <= 0 || block <= 0 || length < 0) {
        PyErr_SetString(PyExc_ValueError, "fold_runs: offsets int64, run_bytes and block positive");
        goto done;
    }
    fast = PySequence_Fast(crc_list, "fold_runs: crcs must be a sequence");
    if (!fast) goto done;
    if (PySequence_Fast_GET_SIZE(fast) != count) {
        PyErr_SetString(PyExc_ValueError, "fold_runs: one CRC per run");
        goto done;
    }
    size_t n = count ? (size_t)count : 1;
    raw_runs = malloc(sizeof(uint32_t) * n);
    out_blocks = malloc(sizeof(int64_t) * n), out_covered = malloc(sizeof(int64_t) * n);
    out_raw = malloc(sizeof(uint64_t) * n);
    if (!raw_runs || !out_blocks || !out_covered || !out_raw) {
        PyErr_NoMemory();
        goto done;
    }
    uint32_t to_raw = mulmod(0xFFFFFFFFu, x8n((uint64_t)run_bytes)) ^ 0xFFFFFFFFu; /* CRC of run_bytes zeros */
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < count; i++) {
        unsigned long v = PyLong_AsUnsignedLongMask(items[i]); /* any integer, numpy's too */
        if (v == (unsigned long)-1 && PyErr_Occurred()) goto done;
        raw_runs[i] = (uint32_t)v ^ to_raw;
    }
    const int64_t *at = (const int64_t *)offsets.buf;
    Py_ssize_t folded = 0;
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    int64_t current = -1, acc_end = 0, covered = 0;
    uint32_t acc = 0, step = ONE;
    int64_t step_bytes = 0;
    for (Py_ssize_t i = 0; i <= count; i++) {
        int64_t b = i < count ? at[i] / block : -1;
        if (i < count && (at[i] < 0 || at[i] + run_bytes > length || (at[i] + run_bytes - 1) / block != b ||
                          b < current || (b == current && at[i] < acc_end))) {
            ok = 0;
            break;
        }
        if (b != current && current >= 0) { /* the block is done: shift its fold to the block's end */
            int64_t end = (current + 1) * block < length ? (current + 1) * block : length;
            out_blocks[folded] = current, out_covered[folded] = covered;
            out_raw[folded++] = mulmod(acc, x8n((uint64_t)(end - acc_end)));
        }
        if (i == count) break;
        int64_t end = at[i] + run_bytes;
        if (b != current) {
            current = b, acc = raw_runs[i], covered = run_bytes;
        } else {
            if (end - acc_end != step_bytes) step_bytes = end - acc_end, step = x8n((uint64_t)step_bytes);
            acc = mulmod(acc, step) ^ raw_runs[i], covered += run_bytes;
        }
        acc_end = end;
    }
    Py_END_ALLOW_THREADS
    if (!ok) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    result = Py_BuildValue("(y#y#y#)", (const char *)out_blocks, (Py_ssize_t)(folded * sizeof(int64_t)),
                           (const char *)out_raw, (Py_ssize_t)(folded * sizeof(uint64_t)),
                           (const char *)out_covered, (Py_ssize_t)(folded * sizeof(int64_t)));
done:
    Py_XDECREF(fast);
    free(raw_runs), free(out_blocks), free(out_covered), free(out_raw);
    PyBuffer_Release(&offsets);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_runs", copy_runs, METH_VARARGS, "Copy resident runs of a file into a buffer, with each run's CRC-32C."},
    {"copy_spans", copy_spans, METH_VARARGS, "Copy resident spans of a file into their own buffers through one mapping, with each span's CRC-32C."},
    {"crc32c", crc32c_of, METH_VARARGS, "CRC-32C of a buffer, through the copying kernel (for tests)."},
    {"fold_runs", fold_runs, METH_VARARGS, "Fold runs' CRC-32Cs into the raw CRCs of the blocks they lie in."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tierckpt._copycrc", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copycrc(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    int available = 0;
    init_powers();
#if HW
    __builtin_cpu_init();
    hardware = __builtin_cpu_supports("sse4.2") != 0;
    if (hardware) init_tables();
    available = hardware;
#endif
    if (PyModule_AddIntConstant(m, "AVAILABLE", available) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
