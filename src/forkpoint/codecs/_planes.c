/* Native kernels of the float-planes codec (codecs/floatcodec.py): byte-plane split and join
 * with the rotated top word, and a Huffman deflate encoder (RFC 1951 dynamic blocks, literals
 * only or with runs as matches at distance 1; a plane is taken a piece at a time, and pieces
 * whose bytes keep one distribution share a block). Its output is an ordinary raw deflate stream
 * that zlib inflates; the Python module falls back to zlib-ng's Z_HUFFMAN_ONLY or Z_RLE when
 * this extension is not built. Also the significand rounding of the lossy modes
 * (codecs/lossy.py, numpy fallback), the grid model of exponent planes (a row shift plus a
 * column shift per byte, fitted by medians) and the seven-bit packing of planes whose bit 0 is
 * always zero, row matching, the split and join of sparse planes (a bitmap of the nonzero bytes
 * and those bytes), the statistics and Huffman sizes that choosing a plane's coder asks for,
 * and a deflate decoder. Every function releases the GIL. Row matching scores its candidates
 * with AVX-512 or AVX2, the sparse split and join shuffle with SSSE3, and the plane split and
 * join and the coding of literals in blocks too varied for pair tables use AVX-512, where the
 * processor has them (chosen at import, the same output either way); FORKPOINT_PORTABLE_KERNELS
 * in the environment keeps the portable paths (see PyInit__planes). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "../kernel_choice.h"
#include "planes_decode.h"
#ifdef __SSE2__
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define X86_VECTOR 1 /* AVX2, AVX-512 and SSSE3 kernels, chosen at import where the processor has them */
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "forkpoint._planes assumes a little-endian machine"
#endif

#define MAX_DATA_BITS 14 /* four codes and 7 pending bits fit one 64-bit buffer */
#define MAX_CL_BITS 7
#define LIT_SYMBOLS 257  /* 0..255 and end-of-block */
#define END_OF_BLOCK 256
#define LITLEN_SYMBOLS 286 /* and the length codes 257..285 of a match */
#define MAX_LITLEN_BITS 15

typedef struct {
    uint8_t *out;
    uint64_t buf;
    int count;
} BitWriter;

/* Add `n` bits to the buffer without storing (the caller keeps count + n under 64). */
static inline void add_bits(BitWriter *w, uint64_t bits, int n) {
    w->buf |= bits << w->count;
    w->count += n;
}

static inline void put_bits(BitWriter *w, uint32_t bits, int n) {
    add_bits(w, bits, n);
    if (w->count >= 32) {
        memcpy(w->out, &w->buf, 8);
        w->out += 4;
        w->buf >>= 32;
        w->count -= 32;
    }
}

static inline void flush_whole_bytes(BitWriter *w) {
    memcpy(w->out, &w->buf, 8);
    w->out += w->count >> 3;
    w->buf >>= (w->count & ~7);
    w->count &= 7;
}

/* In-place minimum-redundancy code lengths (Moffat and Katajainen, 1995): `a` holds n
 * frequencies in ascending order on entry and their code lengths on return. */
static void minimum_redundancy(int *a, int n) {
    int root, leaf, next, avail, used, depth;
    if (n == 0) return;
    if (n == 1) { a[0] = 1; return; }
    a[0] += a[1];
    root = 0;
    leaf = 2;
    for (next = 1; next < n - 1; next++) {
        if (leaf >= n || a[root] < a[leaf]) { a[next] = a[root]; a[root++] = next; }
        else a[next] = a[leaf++];
        if (leaf >= n || (root < next && a[root] < a[leaf])) { a[next] += a[root]; a[root++] = next; }
        else a[next] += a[leaf++];
    }
    a[n - 2] = 0;
    for (next = n - 3; next >= 0; next--) a[next] = a[a[next]] + 1;
    avail = 1;
    used = depth = 0;
    root = n - 2;
    next = n - 1;
    while (avail > 0) {
        while (root >= 0 && a[root] == depth) { used++; root--; }
        while (avail > used) { a[next--] = depth; avail--; }
        avail = 2 * used;
        depth++;
        used = 0;
    }
}

/* Each byte with its bits in reverse order (canonical codes are written LSB first). */
static uint8_t REVERSED[256];

static void fill_reversed(void) {
    for (int i = 0; i < 256; i++) {
        uint8_t r = 0;
        for (int b = 0; b < 8; b++) r |= (uint8_t)(((i >> b) & 1) << (7 - b));
        REVERSED[i] = r;
    }
}

typedef struct { uint32_t freq; int symbol; } SymbolFreq;

/* Sort `m` symbols by (frequency, symbol), ascending: LSD radix sort, one byte of the
 * frequency per pass (stable, so equal frequencies keep symbol order). */
static void sort_by_freq(SymbolFreq *used, int m) {
    SymbolFreq spare[LITLEN_SYMBOLS], *from = used, *to = spare;
    uint32_t largest = 0;
    for (int i = 0; i < m; i++) largest |= used[i].freq;
    for (int shift = 0; shift < 32 && (largest >> shift); shift += 8) {
        int start[257] = {0};
        for (int i = 0; i < m; i++) start[((from[i].freq >> shift) & 0xff) + 1]++;
        for (int d = 0; d < 256; d++) start[d + 1] += start[d];
        for (int i = 0; i < m; i++) to[start[(from[i].freq >> shift) & 0xff]++] = from[i];
        SymbolFreq *t = from; from = to; to = t;
    }
    if (from != used) memcpy(used, from, (size_t)m * sizeof used[0]);
}

/* Code lengths at most `limit` bits for `n` symbols with frequencies `freq` (at least two
 * nonzero), then canonical codes, bit-reversed for LSB-first output. */
static void build_code(const uint32_t *freq, int n, int limit, uint8_t *lengths, uint16_t *codes) {
    SymbolFreq used[LITLEN_SYMBOLS];
    int work[LITLEN_SYMBOLS], per_length[32] = {0};
    int m = 0, i, len;
    for (i = 0; i < n; i++) {
        lengths[i] = 0;
        codes[i] = 0;
        if (freq[i]) { used[m].freq = freq[i]; used[m].symbol = i; m++; }
    }
    sort_by_freq(used, m);
    for (i = 0; i < m; i++) work[i] = (int)used[i].freq;
    minimum_redundancy(work, m);
    for (i = 0; i < m; i++) per_length[work[i] > limit ? limit : work[i]]++;
    /* Lengths over the limit were clamped: lengthen shorter codes until Kraft holds again. */
    uint32_t total = 0;
    for (len = 1; len <= limit; len++) total += (uint32_t)per_length[len] << (limit - len);
    while (total > (1u << limit)) {
        per_length[limit]--;
        for (len = limit - 1; len > 0; len--) {
            if (per_length[len]) { per_length[len]--; per_length[len + 1] += 2; break; }
        }
        total--;
    }
    /* The rarest symbols (front of `used`) take the longest codes. */
    int k = 0;
    for (len = limit; len > 0; len--)
        for (i = 0; i < per_length[len]; i++) lengths[used[k++].symbol] = (uint8_t)len;
    int next_code[32] = {0}, count_of[32] = {0}, code = 0;
    for (i = 0; i < n; i++) count_of[lengths[i]]++;
    count_of[0] = 0;
    for (len = 1; len <= limit; len++) { code = (code + count_of[len - 1]) << 1; next_code[len] = code; }
    for (i = 0; i < n; i++) {
        len = lengths[i];
        if (!len) continue;
        uint32_t c = (uint32_t)next_code[len]++;
        codes[i] = (uint16_t)(((uint32_t)REVERSED[c & 0xff] << 8 | REVERSED[c >> 8]) >> (16 - len));
    }
}


/* The code-length sequence of `nlit` literal/length code lengths followed by one distance
 * code of length `dist_length`, as code-length symbols, each with its extra bits:
 * (symbol | extra << 8). */
static int run_length_code(const uint8_t *lengths, int nlit, int dist_length, uint32_t *sequence) {
    uint8_t all[LITLEN_SYMBOLS + 1];
    memcpy(all, lengths, nlit);
    all[nlit] = (uint8_t)dist_length;
    int total = nlit + 1, s = 0, i = 0;
    while (i < total) {
        int value = all[i], run = 1;
        while (i + run < total && all[i + run] == value) run++;
        i += run;
        if (value == 0) {
            while (run >= 11) { int k = run > 138 ? 138 : run; sequence[s++] = 18 | (uint32_t)(k - 11) << 8; run -= k; }
            if (run >= 3) { sequence[s++] = 17 | (uint32_t)(run - 3) << 8; run = 0; }
        } else {
            sequence[s++] = (uint32_t)value;
            run--;
            while (run >= 3) { int k = run > 6 ? 6 : run; sequence[s++] = 16 | (uint32_t)(k - 3) << 8; run -= k; }
        }
        while (run-- > 0) sequence[s++] = (uint32_t)value;
    }
    return s;
}

/* The header of a dynamic block: its code lengths (nlit literal/length codes, one distance
 * code of `dist_length` bits), run-length coded with a code-length code. */
static void write_header(BitWriter *w, const uint8_t *lengths, int nlit, int dist_length, int final) {
    uint32_t sequence[LITLEN_SYMBOLS + 2], cl_freq[19] = {0};
    uint8_t cl_lengths[19];
    uint16_t cl_codes[19];
    int ns = run_length_code(lengths, nlit, dist_length, sequence), cl_distinct = 0;
    for (int j = 0; j < ns; j++) cl_freq[sequence[j] & 0xff]++;
    for (int j = 0; j < 19; j++) cl_distinct += cl_freq[j] != 0;
    if (cl_distinct < 2) cl_freq[cl_freq[0] ? 1 : 0] = 1; /* a code-length code must be complete */
    build_code(cl_freq, 19, MAX_CL_BITS, cl_lengths, cl_codes);
    int ncl = 19;
    while (ncl > 4 && cl_lengths[CL_ORDER[ncl - 1]] == 0) ncl--;

    put_bits(w, final ? 1 : 0, 1);
    put_bits(w, 2, 2);
    put_bits(w, (uint32_t)(nlit - 257), 5);
    put_bits(w, 0, 5);
    put_bits(w, (uint32_t)(ncl - 4), 4);
    for (int j = 0; j < ncl; j++) put_bits(w, cl_lengths[CL_ORDER[j]], 3);
    for (int j = 0; j < ns; j++) {
        int sym = sequence[j] & 0xff;
        uint32_t extra = sequence[j] >> 8;
        put_bits(w, cl_codes[sym], cl_lengths[sym]);
        if (sym == 16) put_bits(w, extra, 2);
        else if (sym == 17) put_bits(w, extra, 3);
        else if (sym == 18) put_bits(w, extra, 7);
    }
}

/* Scratch for the codes of every pair of byte values (the first in the low byte). */
typedef struct {
    uint32_t code[65536];
    uint8_t length[65536];
} PairTable;

/* Code `data` two bytes per lookup of a table of every pair of the byte values that have a
 * code while four bytes remain; return the bytes coded. */
static size_t encode_pairs(BitWriter *w, const uint8_t *data, size_t n, const uint8_t *lengths,
                           const uint16_t *codes, PairTable *pairs) {
    uint32_t *pair_code = pairs->code;
    uint8_t *pair_length = pairs->length;
    uint8_t used[256];
    int m = 0;
    for (int s = 0; s < 256; s++)
        if (lengths[s]) used[m++] = (uint8_t)s;
    for (int x = 0; x < m; x++)
        for (int y = 0; y < m; y++) {
            uint8_t a = used[x], b = used[y];
            pair_code[a | b << 8] = (uint32_t)codes[a] | (uint32_t)codes[b] << lengths[a];
            pair_length[a | b << 8] = (uint8_t)(lengths[a] + lengths[b]);
        }
    BitWriter v = *w;
    size_t i;
    for (i = 0; i + 4 <= n; i += 4) { /* two pairs' codes of at most 28 bits and 7 pending bits fit */
        uint32_t quad;
        memcpy(&quad, data + i, 4);
        uint32_t lo = quad & 0xffff, hi = quad >> 16;
        add_bits(&v, pair_code[lo], pair_length[lo]);
        add_bits(&v, pair_code[hi], pair_length[hi]);
        flush_whole_bytes(&v);
    }
    *w = v;
    return i;
}

/* Counts of each byte value in `data`, added to `freq`: sixteen tables of 16-bit counters (a run
 * of one value does not wait on one counter; no table passes 65535 in a stretch of 1 MiB), 16
 * bytes a step. 1.05-1.6x eight tables of 32-bit counters on these planes, the most where few
 * values repeat (the zero-heavy planes of deltas). */
#define COUNT_TABLES 16
#define COUNT_STRETCH (1u << 20)
static void count_bytes(const uint8_t *data, size_t n, uint32_t *freq) {
    uint16_t hist[COUNT_TABLES][256];
    for (size_t at = 0; at < n; at += COUNT_STRETCH) {
        const uint8_t *p = data + at;
        size_t len = n - at < COUNT_STRETCH ? n - at : COUNT_STRETCH, i;
        memset(hist, 0, sizeof hist);
        for (i = 0; i + 16 <= len; i += 16) {
            uint64_t v, u;
            memcpy(&v, p + i, 8);
            memcpy(&u, p + i + 8, 8);
            hist[0][v & 255]++; hist[1][(v >> 8) & 255]++; hist[2][(v >> 16) & 255]++; hist[3][(v >> 24) & 255]++;
            hist[4][(v >> 32) & 255]++; hist[5][(v >> 40) & 255]++; hist[6][(v >> 48) & 255]++; hist[7][v >> 56]++;
            hist[8][u & 255]++; hist[9][(u >> 8) & 255]++; hist[10][(u >> 16) & 255]++; hist[11][(u >> 24) & 255]++;
            hist[12][(u >> 32) & 255]++; hist[13][(u >> 40) & 255]++; hist[14][(u >> 48) & 255]++; hist[15][u >> 56]++;
        }
        for (; i < len; i++) hist[0][p[i]]++;
        for (int s = 0; s < 256; s++) {
            uint32_t total = 0;
            for (int k = 0; k < COUNT_TABLES; k++) total += hist[k][s];
            freq[s] += total;
        }
    }
}

/* One dynamic block of literals whose byte counts are `counts`; where few byte values occur,
 * coded two at a time through `pairs` (or not, when NULL), else through wide_literals where the
 * processor has it. Pairs of more than PAIR_MAX_DISTINCT values make a table too large for the
 * cache: wide planes coded 10-25% faster one at a time. */
#define PAIR_MAX_DISTINCT 128
/* The code of a literals block whose byte counts are `counts` (and one end of block); returns
 * how many byte values occur. */
static int literal_code(const uint32_t *counts, uint8_t *lengths, uint16_t *codes) {
    uint32_t freq[LIT_SYMBOLS];
    int distinct = 0;
    for (int s = 0; s < 256; s++) {
        freq[s] = counts[s];
        distinct += freq[s] != 0;
    }
    freq[END_OF_BLOCK] = 1;
    if (distinct == 0) freq[0] = 1; /* two codes at least: a complete code */
    build_code(freq, LIT_SYMBOLS, MAX_DATA_BITS, lengths, codes);
    return distinct;
}

/* Literals coded through a vector path where one was chosen at import (NULL: none); returns the
 * bytes it coded, the caller codes the rest. */
typedef size_t (*LiteralCoder)(BitWriter *w, const uint8_t *data, size_t n, const uint8_t *lengths, const uint16_t *codes);
static LiteralCoder wide_literals = NULL;

#ifdef X86_VECTOR
/* The literals of `data` coded 64 at a time with AVX-512 (VBMI): each byte's code and length
 * looked up in 256-entry byte tables held in registers, four neighbours' codes joined into one
 * word of at most 56 bits, and the sixteen words of 64 bytes added to the stream in turn: the
 * same bits as the scalar loop, 1.1-1.4x faster where a block uses too many byte values for
 * pair tables (as fast as them elsewhere). Returns the bytes coded. */
__attribute__((target("avx512f,avx512bw,avx512vbmi")))
static size_t encode_literals_avx512(BitWriter *w, const uint8_t *data, size_t n, const uint8_t *lengths,
                                     const uint16_t *codes) {
    uint8_t low[256], high[256];
    for (int s = 0; s < 256; s++) {
        low[s] = (uint8_t)codes[s];
        high[s] = (uint8_t)(codes[s] >> 8);
    }
    const __m512i len0 = _mm512_loadu_si512(lengths), len1 = _mm512_loadu_si512(lengths + 64);
    const __m512i len2 = _mm512_loadu_si512(lengths + 128), len3 = _mm512_loadu_si512(lengths + 192);
    const __m512i low0 = _mm512_loadu_si512(low), low1 = _mm512_loadu_si512(low + 64);
    const __m512i low2 = _mm512_loadu_si512(low + 128), low3 = _mm512_loadu_si512(low + 192);
    const __m512i high0 = _mm512_loadu_si512(high), high1 = _mm512_loadu_si512(high + 64);
    const __m512i high2 = _mm512_loadu_si512(high + 128), high3 = _mm512_loadu_si512(high + 192);
    const __m512i zero = _mm512_setzero_si512(), words = _mm512_set1_epi32(0xffff), halves = _mm512_set1_epi64(0xffffffff);
    /* after the unpacks, register 0 holds the words of bytes 0-3, 4-7, 16-19, ... and register 1 of 8-11, 12-15, ... */
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    uint64_t bits[16], sizes[16];
    uint8_t *out = w->out;
    uint64_t buf = w->buf, count = (uint64_t)w->count;
    size_t i;
    for (i = 0; i + 64 <= n; i += 64) {
        __m512i x = _mm512_loadu_si512(data + i);
        __mmask64 upper = _mm512_movepi8_mask(x);
        __m512i len = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(len0, x, len1),
                                             _mm512_permutex2var_epi8(len2, x, len3));
        __m512i lo = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(low0, x, low1),
                                            _mm512_permutex2var_epi8(low2, x, low3));
        __m512i hi = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(high0, x, high1),
                                            _mm512_permutex2var_epi8(high2, x, high3));
        __m512i c[2] = {_mm512_unpacklo_epi8(lo, hi), _mm512_unpackhi_epi8(lo, hi)};
        __m512i l[2] = {_mm512_unpacklo_epi8(len, zero), _mm512_unpackhi_epi8(len, zero)};
        for (int k = 0; k < 2; k++) {
            __m512i even = _mm512_and_si512(l[k], words);
            __m512i c32 = _mm512_or_si512(_mm512_and_si512(c[k], words), _mm512_sllv_epi32(_mm512_srli_epi32(c[k], 16), even));
            __m512i l32 = _mm512_add_epi32(even, _mm512_srli_epi32(l[k], 16));
            __m512i pair = _mm512_and_si512(l32, halves);
            c[k] = _mm512_or_si512(_mm512_and_si512(c32, halves), _mm512_sllv_epi64(_mm512_srli_epi64(c32, 32), pair));
            l[k] = _mm512_add_epi64(pair, _mm512_srli_epi64(l32, 32));
        }
        _mm512_storeu_si512(bits, _mm512_permutex2var_epi64(c[0], first, c[1]));
        _mm512_storeu_si512(bits + 8, _mm512_permutex2var_epi64(c[0], second, c[1]));
        _mm512_storeu_si512(sizes, _mm512_permutex2var_epi64(l[0], first, l[1]));
        _mm512_storeu_si512(sizes + 8, _mm512_permutex2var_epi64(l[0], second, l[1]));
        for (int j = 0; j < 16; j++) { /* at most 56 bits and 7 pending fit; locals: 5-7% faster than a BitWriter */
            buf |= bits[j] << count;
            count += sizes[j];
            memcpy(out, &buf, 8);
            out += count >> 3;
            buf >>= count & 56;
            count &= 7;
        }
    }
    w->out = out;
    w->buf = buf;
    w->count = (int)count;
    return i;
}
#endif

static void encode_block(BitWriter *w, const uint8_t *data, size_t n, const uint32_t *counts, int final,
                         PairTable *pairs) {
    uint8_t lengths[LIT_SYMBOLS];
    uint16_t codes[LIT_SYMBOLS];
    size_t i;
    int distinct = literal_code(counts, lengths, codes);

    write_header(w, lengths, LIT_SYMBOLS, 0, final);
    flush_whole_bytes(w);
    BitWriter v = *w;
    if (pairs && distinct <= PAIR_MAX_DISTINCT && (size_t)distinct * (size_t)distinct * 4 <= n)
        i = encode_pairs(&v, data, n, lengths, codes, pairs);
    else
        i = wide_literals ? wide_literals(&v, data, n, lengths, codes) : 0;
    for (; i + 4 <= n; i += 4) { /* four codes of at most 14 bits and 7 pending bits fit */
        uint8_t a = data[i], b = data[i + 1], c = data[i + 2], d = data[i + 3];
        add_bits(&v, codes[a], lengths[a]);
        add_bits(&v, codes[b], lengths[b]);
        add_bits(&v, codes[c], lengths[c]);
        add_bits(&v, codes[d], lengths[d]);
        flush_whole_bytes(&v);
    }
    *w = v;
    for (; i < n; i++) put_bits(w, codes[data[i]], lengths[data[i]]);
    put_bits(w, codes[END_OF_BLOCK], lengths[END_OF_BLOCK]);
}

/* The bits encode_block writes for a block whose byte counts are `counts`: its header, codes
 * and end of block (the same code, built the same way). */
static uint64_t block_bits(const uint32_t *counts) {
    uint8_t lengths[LIT_SYMBOLS], header[1024];
    uint16_t codes[LIT_SYMBOLS];
    literal_code(counts, lengths, codes);
    BitWriter w = {header, 0, 0};
    write_header(&w, lengths, LIT_SYMBOLS, 0, 0);
    uint64_t bits = (uint64_t)(w.out - header) * 8 + (uint64_t)w.count + lengths[END_OF_BLOCK];
    for (int s = 0; s < 256; s++) bits += (uint64_t)counts[s] * lengths[s];
    return bits;
}

/* log2(1 + i / LOG2_STEPS) for i = 0..LOG2_STEPS, for fast_log2. */
#define LOG2_STEPS 1024
static double LOG2_TABLE[LOG2_STEPS + 1];

static void fill_log2(void) {
    for (int i = 0; i <= LOG2_STEPS; i++) LOG2_TABLE[i] = log2(1.0 + (double)i / LOG2_STEPS);
}

/* log2(x) of a positive normal double within 2e-7 (the table, interpolated), several times faster
 * than libm's: block decisions weigh entropies of hundreds of counts per piece. */
static inline double fast_log2(double x) {
    uint64_t bits;
    memcpy(&bits, &x, 8);
    int exponent = (int)(bits >> 52) - 1023;
    uint64_t mantissa = bits & ((1ull << 52) - 1);
    uint64_t index = mantissa >> 42;
    double frac = (double)(mantissa & ((1ull << 42) - 1)) * (1.0 / (double)(1ull << 42));
    return exponent + LOG2_TABLE[index] + frac * (LOG2_TABLE[index + 1] - LOG2_TABLE[index]);
}

/* Order-0 entropy of `symbols` symbols with these counts, in bits (see fast_log2). */
static double entropy_bits(const uint32_t *counts, int symbols) {
    double total = 0, sum = 0;
    for (int s = 0; s < symbols; s++)
        if (counts[s]) { total += counts[s]; sum += counts[s] * fast_log2((double)counts[s]); }
    return total > 0 ? total * fast_log2(total) - sum : 0;
}

/* Whether a piece of a plane with these counts of `symbols` symbols (entropy `piece_bits`) joins
 * the open block (counts `open`, entropy *open_bits): one code over both costs no more than two
 * codes and a block header of about MERGE_HEADER_BITS. If so, `open` and *open_bits become the
 * joined block's. */
#define MERGE_HEADER_BITS 800.0
static int joins_open_block(uint32_t *open, double *open_bits, const uint32_t *piece, double piece_bits, int symbols) {
    uint32_t joined[LITLEN_SYMBOLS];
    for (int s = 0; s < symbols; s++) joined[s] = open[s] + piece[s];
    double joined_bits = entropy_bits(joined, symbols);
    if (joined_bits > *open_bits + piece_bits + MERGE_HEADER_BITS) return 0;
    memcpy(open, joined, (size_t)symbols * sizeof *open);
    *open_bits = joined_bits;
    return 1;
}

/* Deflate blocks of literals over `data`, taken `step` bytes at a time: the next piece joins the
 * open block where joins_open_block says so (stationary planes: fewer codes to build, headers
 * and pair tables), else the open block is written and the piece opens the next. Without a
 * writer (`w` NULL), only the bits the blocks would take are counted and returned. */
static uint64_t encode_literals(BitWriter *w, const uint8_t *data, size_t n, size_t step, PairTable *pairs) {
    uint32_t open[256], piece[256];
    size_t lo = 0, hi = 0;
    uint64_t bits = 0;
    double open_bits = 0;
    memset(open, 0, sizeof open);
    while (hi < n) {
        size_t len = n - hi < step ? n - hi : step;
        memset(piece, 0, sizeof piece);
        count_bytes(data + hi, len, piece);
        double piece_bits = entropy_bits(piece, 256);
        if (hi == lo || !joins_open_block(open, &open_bits, piece, piece_bits, 256)) {
            if (hi > lo && w) encode_block(w, data + lo, hi - lo, open, 0, pairs);
            else if (hi > lo) bits += block_bits(open);
            memcpy(open, piece, sizeof open);
            open_bits = piece_bits;
            lo = hi;
        }
        hi += len;
    }
    if (w) encode_block(w, data + lo, hi - lo, open, 1, pairs);
    else bits += block_bits(open);
    return bits;
}

/* Deflate length codes: for each match length 3..258, its symbol, extra bits and their value. */
static uint16_t LENGTH_SYMBOL[259], LENGTH_EXTRA[259];
static uint8_t LENGTH_EXTRA_BITS[259];

static void fill_lengths(void) {
    static const uint16_t base[29] = {3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59,
                                      67, 83, 99, 115, 131, 163, 195, 227, 258};
    static const uint8_t bits[29] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3,
                                     4, 4, 4, 4, 5, 5, 5, 5, 0};
    for (int c = 0; c < 29; c++) {
        int last = c < 28 ? base[c + 1] - 1 : 258;
        for (int len = base[c]; len <= last; len++) {
            LENGTH_SYMBOL[len] = (uint16_t)(257 + c);
            LENGTH_EXTRA_BITS[len] = bits[c];
            LENGTH_EXTRA[len] = (uint16_t)(len - base[c]);
        }
    }
}

/* Bit j of the result: byte j of `p` (64 of them) equals the byte before it, p[j - 1]. */
static inline uint64_t same_as_before(const uint8_t *p) {
#ifdef __SSE2__
    uint64_t mask = 0;
    for (int k = 0; k < 4; k++) {
        __m128i now = _mm_loadu_si128((const __m128i *)(p + 16 * k));
        __m128i before = _mm_loadu_si128((const __m128i *)(p + 16 * k - 1));
        mask |= (uint64_t)(uint32_t)_mm_movemask_epi8(_mm_cmpeq_epi8(now, before)) << (16 * k);
    }
    return mask;
#else
    uint64_t mask = 0;
    for (int j = 0; j < 64; j++) mask |= (uint64_t)(p[j] == p[j - 1]) << j;
    return mask;
#endif
}

/* Append `len` literal tokens: the bytes at `p`. */
static inline size_t literal_tokens(const uint8_t *p, size_t len, uint16_t *tokens) {
    for (size_t j = 0; j < len; j++) tokens[j] = p[j];
    return len;
}

/* Append the tokens of a stretch of `len` bytes each equal to the byte before it, starting at
 * `p`: matches at distance 1 of up to 258 (none left under 3) where it is 3 or longer, else
 * literals. */
static inline size_t stretch_tokens(const uint8_t *p, size_t len, uint16_t *tokens) {
    if (len < 3) return literal_tokens(p, len, tokens);
    size_t nt = 0;
    while (len >= 3) {
        size_t take = len > 258 ? 258 : len;
        if (len - take && len - take < 3) take = len - 3;
        tokens[nt++] = (uint16_t)(256 + take);
        len -= take;
    }
    return nt;
}

/* Bit j: byte base + j of `data` (n bytes) equals the byte before it (never for byte 0, nor
 * past n). */
static inline uint64_t same_mask(const uint8_t *data, size_t n, size_t base) {
    if (base && base + 64 <= n) return same_as_before(data + base);
    uint64_t mask = 0;
    for (size_t j = base ? 0 : 1; base + j < n && j < 64; j++) mask |= (uint64_t)(data[base + j] == data[base + j - 1]) << j;
    return mask;
}

/* The tokens of `n` bytes in which every stretch of three or more bytes each equal to the byte
 * before it is matches at distance 1, the rest literals: a byte value, or 256 + a match length;
 * returns how many (at most n; `tokens` must hold n). The first byte has none before it. Bytes
 * are compared 64 at a time; literals skip to the next three equal bits of the mask, stretches
 * to its next clear bit. */
static size_t run_tokens(const uint8_t *data, size_t n, uint16_t *tokens) {
    size_t nt = 0, start = 0; /* where the open stretch of equal bytes (or of literals) began */
    int open = 0;             /* whether [start, here) is a stretch of equal bytes */
    uint64_t next = same_mask(data, n, 0);
    for (size_t base = 0; base < n; base += 64) {
        size_t width = n - base < 64 ? n - base : 64, j = 0;
        uint64_t mask = next;
        next = base + 64 < n ? same_mask(data, n, base + 64) : 0;
        uint64_t three = mask & (mask >> 1 | next << 63) & (mask >> 2 | next << 62);
        while (j < width) {
            if (open) {
                uint64_t rest = ~mask >> j;
                j = rest ? j + (size_t)__builtin_ctzll(rest) : 64;
                if (j < width) { /* the stretch ends at base + j */
                    nt += stretch_tokens(data + start, base + j - start, tokens + nt);
                    start = base + j;
                    open = 0;
                }
            } else {
                uint64_t rest = three >> j;
                j = rest ? j + (size_t)__builtin_ctzll(rest) : 64;
                if (j < width) { /* three or more equal bytes begin at base + j */
                    nt += literal_tokens(data + start, base + j - start, tokens + nt);
                    start = base + j;
                    open = 1;
                }
            }
        }
    }
    nt += open ? stretch_tokens(data + start, n - start, tokens + nt) : literal_tokens(data + start, n - start, tokens + nt);
    return nt;
}

/* Counts of the literal/length symbols of `tokens`, added to `freq` (four tables: no wait on
 * the count a repeated token just raised). */
static void count_tokens(const uint16_t *tokens, size_t nt, uint32_t *freq) {
    uint32_t hist[4][256 + 259];
    size_t j = 0;
    memset(hist, 0, sizeof hist);
    for (; j + 4 <= nt; j += 4) {
        hist[0][tokens[j]]++;
        hist[1][tokens[j + 1]]++;
        hist[2][tokens[j + 2]]++;
        hist[3][tokens[j + 3]]++;
    }
    for (; j < nt; j++) hist[0][tokens[j]]++;
    for (int t = 256 + 3; t < 256 + 259; t++)
        freq[LENGTH_SYMBOL[t - 256]] += hist[0][t] + hist[1][t] + hist[2][t] + hist[3][t];
    for (int k = 0; k < 256; k++) freq[k] += hist[0][k] + hist[1][k] + hist[2][k] + hist[3][k];
}

/* One dynamic block of `tokens` (see run_tokens) whose symbol counts are `counts`. */
static void encode_runs_block(BitWriter *w, const uint16_t *tokens, size_t nt, const uint32_t *counts, int final) {
    uint32_t freq[LITLEN_SYMBOLS];
    uint8_t lengths[LITLEN_SYMBOLS];
    uint16_t codes[LITLEN_SYMBOLS];
    size_t j, matches = 0;
    memcpy(freq, counts, sizeof freq);
    for (int k = LIT_SYMBOLS; k < LITLEN_SYMBOLS; k++) matches += freq[k];
    freq[END_OF_BLOCK] = 1;
    if (nt == 0) freq[0] = 1; /* two codes at least: a complete code */
    build_code(freq, LITLEN_SYMBOLS, MAX_LITLEN_BITS, lengths, codes);
    int nlit = LITLEN_SYMBOLS;
    while (nlit > LIT_SYMBOLS && lengths[nlit - 1] == 0) nlit--;
    write_header(w, lengths, nlit, matches ? 1 : 0, final);
    /* Each token's bits and their count: a literal's code, or a length code, its extra bits
     * and distance code 0 (distance 1, one 0 bit). */
    uint32_t token_bits[256 + 259];
    uint8_t token_count[256 + 259];
    for (int t = 0; t < 256; t++) {
        token_bits[t] = codes[t];
        token_count[t] = lengths[t];
    }
    for (int len = 3; matches && len <= 258; len++) {
        int sym = LENGTH_SYMBOL[len];
        token_bits[256 + len] = codes[sym] | (uint32_t)LENGTH_EXTRA[len] << lengths[sym];
        token_count[256 + len] = (uint8_t)(lengths[sym] + LENGTH_EXTRA_BITS[len] + 1);
    }
    flush_whole_bytes(w);
    BitWriter v = *w;
    for (j = 0; j + 2 <= nt; j += 2) { /* two tokens of at most 21 bits and 7 pending bits fit */
        add_bits(&v, token_bits[tokens[j]], token_count[tokens[j]]);
        add_bits(&v, token_bits[tokens[j + 1]], token_count[tokens[j + 1]]);
        flush_whole_bytes(&v);
    }
    *w = v;
    for (; j < nt; j++) put_bits(w, token_bits[tokens[j]], token_count[tokens[j]]);
    put_bits(w, codes[END_OF_BLOCK], lengths[END_OF_BLOCK]);
}

/* Deflate blocks of runs and literals over `data`, tokenized `step` bytes at a time, pieces
 * joining the open block where joins_open_block says so (a match's extra bits are the same
 * either way), up to RUNS_JOINED pieces a block; `tokens` holds (RUNS_JOINED + 1) * step, or n. */
#define RUNS_JOINED 16
static void encode_runs(BitWriter *w, const uint8_t *data, size_t n, size_t step, uint16_t *tokens) {
    uint32_t open[LITLEN_SYMBOLS], piece[LITLEN_SYMBOLS];
    size_t at = 0, open_nt = 0, pieces = 0;
    double open_bits = 0;
    memset(open, 0, sizeof open);
    while (at < n) {
        size_t len = n - at < step ? n - at : step;
        size_t nt = run_tokens(data + at, len, tokens + open_nt);
        memset(piece, 0, sizeof piece);
        count_tokens(tokens + open_nt, nt, piece);
        at += len;
        double piece_bits = entropy_bits(piece, LITLEN_SYMBOLS);
        if (pieces && pieces < RUNS_JOINED && joins_open_block(open, &open_bits, piece, piece_bits, LITLEN_SYMBOLS)) {
            open_nt += nt;
            pieces++;
            continue;
        }
        if (pieces) {
            encode_runs_block(w, tokens, open_nt, open, 0);
            memmove(tokens, tokens + open_nt, nt * sizeof *tokens);
        }
        memcpy(open, piece, sizeof open);
        open_bits = piece_bits;
        open_nt = nt;
        pieces = 1;
    }
    encode_runs_block(w, tokens, open_nt, open, 1);
}

/* Whether the deflate coders' piece size is 1 KiB to 16 MiB; ValueError set where not. */
static int block_in_range(Py_ssize_t block) {
    if (block >= 1024 && block <= (1 << 24)) return 1;
    PyErr_Format(PyExc_ValueError, "block of %zd bytes: must be 1 KiB to 16 MiB", block);
    return 0;
}

static PyObject *huffman_deflate(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t block = 32768;
    int runs = 0;
    if (!PyArg_ParseTuple(args, "y*|np", &view, &block, &runs)) return NULL;
    if (!block_in_range(block)) {
        PyBuffer_Release(&view);
        return NULL;
    }
    size_t n = (size_t)view.len, blocks = n ? (n + (size_t)block - 1) / (size_t)block : 1;
    size_t bound = n * (runs ? MAX_LITLEN_BITS : MAX_DATA_BITS) / 8 + blocks * 700 + 64;
    uint16_t *tokens = NULL;
    PairTable *pairs = NULL;
    size_t capacity = (RUNS_JOINED + 1) * (size_t)block < n ? (RUNS_JOINED + 1) * (size_t)block : n + 1;
    if (runs ? !(tokens = malloc(capacity * sizeof *tokens)) : !(pairs = malloc(sizeof *pairs))) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    PyObject *result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)bound);
    if (!result) { free(tokens); free(pairs); PyBuffer_Release(&view); return NULL; }
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    BitWriter w = {out, 0, 0};
    const uint8_t *data = view.buf;
    Py_BEGIN_ALLOW_THREADS
    if (runs) encode_runs(&w, data, n, (size_t)block, tokens);
    else encode_literals(&w, data, n, (size_t)block, pairs);
    if (w.count) { memcpy(w.out, &w.buf, 8); w.out += (w.count + 7) >> 3; }
    Py_END_ALLOW_THREADS
    free(tokens);
    free(pairs);
    PyBuffer_Release(&view);
    if (_PyBytes_Resize(&result, w.out - out) < 0) return NULL;
    return result;
}

/* The bytes of the literals-only stream huffman_deflate(data, block) writes, without writing it
 * (the same blocks: its pieces counted and joined as encode_literals does). */
static PyObject *huffman_bytes(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t block = 32768;
    if (!PyArg_ParseTuple(args, "y*|n", &view, &block)) return NULL;
    if (!block_in_range(block)) {
        PyBuffer_Release(&view);
        return NULL;
    }
    uint64_t bits;
    Py_BEGIN_ALLOW_THREADS
    bits = encode_literals(NULL, view.buf, (size_t)view.len, (size_t)block, NULL);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong((bits + 7) / 8);
}


static PyObject *inflate_into(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "y*w*", &src, &dst)) return NULL;
    Decoder *decoders = malloc(2 * sizeof(Decoder));
    int status = -2;
    size_t produced = 0;
    if (decoders) {
        Py_BEGIN_ALLOW_THREADS
        status = inflate_kernel(src.buf, (size_t)src.len, dst.buf, (size_t)dst.len, decoders, decoders + 1, &produced);
        Py_END_ALLOW_THREADS
    }
    free(decoders);
    Py_ssize_t n = dst.len;
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (status == -2) return PyErr_NoMemory();
    if (status == INFLATES_PAST) return PyErr_Format(PyExc_ValueError, "a deflate plane of %zd bytes inflates to more: damaged", n);
    if (status == INFLATES_SHORT)
        return PyErr_Format(PyExc_ValueError, "a deflate plane of %zd bytes inflates to %zu: damaged", n, produced);
    if (status < 0)
        return PyErr_Format(PyExc_ValueError, "a deflate plane of %zd bytes: invalid code, header or distance, or bits "
                            "past its end: damaged", n);
    Py_RETURN_NONE;
}

static int plane_args(PyObject *args, Py_buffer *src, Py_buffer *dst, int *itemsize, int *rotated) {
    if (!PyArg_ParseTuple(args, "y*w*ip", src, dst, itemsize, rotated)) return 0;
    if ((*itemsize != 2 && *itemsize != 4 && *itemsize != 8) || src->len != dst->len || src->len % *itemsize) {
        PyErr_Format(PyExc_ValueError, "planes of %zd bytes into %zd with itemsize %d", src->len, dst->len, *itemsize);
        PyBuffer_Release(src);
        PyBuffer_Release(dst);
        return 0;
    }
    return 1;
}


/* Elements `from` to n of `s` into their planes in `d` (n bytes apart). */
static void split_from(const uint8_t *s, uint8_t *d, size_t n, size_t from, int itemsize, int rotated) {
    if (itemsize == 2) {
        uint8_t *p0 = d, *p1 = d + n;
        for (size_t i = from; i < n; i++) {
            uint16_t w;
            memcpy(&w, s + 2 * i, 2);
            if (rotated) w = rotate_left(w);
            p0[i] = (uint8_t)w;
            p1[i] = (uint8_t)(w >> 8);
        }
    } else if (itemsize == 4) {
        uint8_t *p0 = d, *p1 = d + n, *p2 = d + 2 * n, *p3 = d + 3 * n;
        for (size_t i = from; i < n; i++) {
            uint32_t v;
            memcpy(&v, s + 4 * i, 4);
            uint16_t top = (uint16_t)(v >> 16);
            if (rotated) top = rotate_left(top);
            p0[i] = (uint8_t)v;
            p1[i] = (uint8_t)(v >> 8);
            p2[i] = (uint8_t)top;
            p3[i] = (uint8_t)(top >> 8);
        }
    } else {
        for (size_t i = from; i < n; i++) {
            uint64_t v;
            memcpy(&v, s + 8 * i, 8);
            uint16_t top = (uint16_t)(v >> 48);
            if (rotated) top = rotate_left(top);
            for (int k = 0; k < 6; k++) d[k * n + i] = (uint8_t)(v >> (8 * k));
            d[6 * n + i] = (uint8_t)top;
            d[7 * n + i] = (uint8_t)(top >> 8);
        }
    }
}


static void split(const uint8_t *s, uint8_t *d, size_t n, int itemsize, int rotated) {
    split_from(s, d, n, 0, itemsize, rotated);
}

static void join(const uint8_t *s, uint8_t *d, size_t n, int itemsize, int rotated) {
    join_from(s, d, n, 0, itemsize, rotated);
}

#ifdef X86_VECTOR
/* split and join with AVX-512 (VBMI byte permutes, VBMI2 16-bit rotates) for 2- and 4-byte
 * elements, 64 a step, the scalar loops doing the rest: the same bytes, 1.5-2.7x faster on data
 * in the cache. */
static uint8_t PLANE_ORDER[64]; /* byte k of each of 16 four-byte elements, plane after plane */
static uint8_t ELEMENT_ORDER[64]; /* the inverse of PLANE_ORDER */
static uint8_t EVEN_BYTES[64];
static uint8_t INTERLEAVED[128]; /* word k of two planes' 64 bytes: byte k of the first (k), of the second (64 + k) */

static void fill_plane_orders(void) {
    for (int k = 0; k < 4; k++)
        for (int e = 0; e < 16; e++) PLANE_ORDER[k * 16 + e] = (uint8_t)(e * 4 + k);
    for (int k = 0; k < 64; k++) {
        ELEMENT_ORDER[PLANE_ORDER[k]] = (uint8_t)k;
        EVEN_BYTES[k] = (uint8_t)(2 * k);
        INTERLEAVED[2 * k] = (uint8_t)k;
        INTERLEAVED[2 * k + 1] = (uint8_t)(64 + k);
    }
}

/* Transpose the 4 x 4 128-bit lanes of r[0..3] (its own inverse). */
__attribute__((target("avx512f")))
static inline void transpose_lanes(__m512i *r) {
    __m512i t0 = _mm512_shuffle_i64x2(r[0], r[1], 0x44), t1 = _mm512_shuffle_i64x2(r[0], r[1], 0xEE);
    __m512i t2 = _mm512_shuffle_i64x2(r[2], r[3], 0x44), t3 = _mm512_shuffle_i64x2(r[2], r[3], 0xEE);
    r[0] = _mm512_shuffle_i64x2(t0, t2, 0x88);
    r[1] = _mm512_shuffle_i64x2(t0, t2, 0xDD);
    r[2] = _mm512_shuffle_i64x2(t1, t3, 0x88);
    r[3] = _mm512_shuffle_i64x2(t1, t3, 0xDD);
}

__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512vbmi2")))
static void split_avx512(const uint8_t *s, uint8_t *d, size_t n, int itemsize, int rotated) {
    size_t i = 0;
    if (itemsize == 2) {
        const __m512i low = _mm512_loadu_si512(EVEN_BYTES), high = _mm512_add_epi8(low, _mm512_set1_epi8(1));
        for (; i + 64 <= n; i += 64) {
            __m512i a = _mm512_loadu_si512(s + 2 * i), b = _mm512_loadu_si512(s + 2 * i + 64);
            if (rotated) {
                a = _mm512_shldi_epi16(a, a, 1);
                b = _mm512_shldi_epi16(b, b, 1);
            }
            _mm512_storeu_si512(d + i, _mm512_permutex2var_epi8(a, low, b));
            _mm512_storeu_si512(d + n + i, _mm512_permutex2var_epi8(a, high, b));
        }
    } else if (itemsize == 4) {
        const __m512i order = _mm512_loadu_si512(PLANE_ORDER);
        for (; i + 64 <= n; i += 64) {
            __m512i r[4];
            for (int k = 0; k < 4; k++) {
                __m512i v = _mm512_loadu_si512(s + 4 * i + 64 * k);
                if (rotated) v = _mm512_mask_shldi_epi16(v, 0xAAAAAAAA, v, v, 1);
                r[k] = _mm512_permutexvar_epi8(order, v);
            }
            transpose_lanes(r);
            for (int k = 0; k < 4; k++) _mm512_storeu_si512(d + k * n + i, r[k]);
        }
    }
    split_from(s, d, n, i, itemsize, rotated);
}

__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512vbmi2")))
static void join_avx512(const uint8_t *s, uint8_t *d, size_t n, int itemsize, int rotated) {
    size_t i = 0;
    if (itemsize == 2) {
        const __m512i first = _mm512_loadu_si512(INTERLEAVED), second = _mm512_loadu_si512(INTERLEAVED + 64);
        for (; i + 64 <= n; i += 64) {
            __m512i p0 = _mm512_loadu_si512(s + i), p1 = _mm512_loadu_si512(s + n + i);
            __m512i a = _mm512_permutex2var_epi8(p0, first, p1), b = _mm512_permutex2var_epi8(p0, second, p1);
            if (rotated) {
                a = _mm512_shrdi_epi16(a, a, 1);
                b = _mm512_shrdi_epi16(b, b, 1);
            }
            _mm512_storeu_si512(d + 2 * i, a);
            _mm512_storeu_si512(d + 2 * i + 64, b);
        }
    } else if (itemsize == 4) {
        const __m512i order = _mm512_loadu_si512(ELEMENT_ORDER);
        for (; i + 64 <= n; i += 64) {
            __m512i r[4];
            for (int k = 0; k < 4; k++) r[k] = _mm512_loadu_si512(s + k * n + i);
            transpose_lanes(r);
            for (int k = 0; k < 4; k++) {
                __m512i v = _mm512_permutexvar_epi8(order, r[k]);
                if (rotated) v = _mm512_mask_shrdi_epi16(v, 0xAAAAAAAA, v, v, 1);
                _mm512_storeu_si512(d + 4 * i + 64 * k, v);
            }
        }
    }
    join_from(s, d, n, i, itemsize, rotated);
}
#endif

typedef void (*PlaneKernel)(const uint8_t *, uint8_t *, size_t, int, int);

static PyObject *run_planes(PyObject *args, PlaneKernel kernel) {
    Py_buffer src, dst;
    int itemsize, rotated;
    if (!plane_args(args, &src, &dst, &itemsize, &rotated)) return NULL;
    size_t n = (size_t)src.len / itemsize;
    Py_BEGIN_ALLOW_THREADS
    kernel(src.buf, dst.buf, n, itemsize, rotated);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    Py_RETURN_NONE;
}

static PlaneKernel plane_splitter = split, plane_joiner = join;

static PyObject *to_planes(PyObject *self, PyObject *args) { return run_planes(args, plane_splitter); }

static PyObject *from_planes(PyObject *self, PyObject *args) { return run_planes(args, plane_joiner); }

/* Round each finite, nonzero, normal element to `drop` fewer significand bits (to nearest,
 * ties to even), keeping those whose rounding would overflow to infinity; return the largest
 * relative error made. */
#define ROUND_KERNEL(NAME, UINT, FLOAT, SHIFT, EXP_MAX)                                      \
    static double NAME(UINT *bits, size_t n, int drop) {                                     \
        const UINT mask = ~(((UINT)1 << drop) - 1), half = ((UINT)1 << (drop - 1)) - 1;      \
        double worst = 0.0;                                                                  \
        for (size_t i = 0; i < n; i++) {                                                     \
            UINT b = bits[i], e = (b >> SHIFT) & EXP_MAX;                                     \
            UINT r = (b + half + ((b >> drop) & 1)) & mask;                                  \
            if (e == 0 || e == EXP_MAX || ((r >> SHIFT) & EXP_MAX) == EXP_MAX) continue;     \
            FLOAT before, after;                                                             \
            memcpy(&before, &b, sizeof b);                                                   \
            memcpy(&after, &r, sizeof r);                                                    \
            double err = fabs((double)after - (double)before) / fabs((double)before);        \
            worst = err > worst ? err : worst;                                               \
            bits[i] = r;                                                                     \
        }                                                                                    \
        return worst;                                                                        \
    }

ROUND_KERNEL(round32, uint32_t, float, 23, 0xFF)
ROUND_KERNEL(round64, uint64_t, double, 52, 0x7FF)

static PyObject *round_significand(PyObject *self, PyObject *args) {
    Py_buffer view;
    int itemsize, drop;
    if (!PyArg_ParseTuple(args, "w*ii", &view, &itemsize, &drop)) return NULL;
    int full = itemsize == 4 ? 23 : itemsize == 8 ? 52 : -1;
    if (full < 0 || drop < 1 || drop >= full || view.len % itemsize) {
        PyErr_Format(PyExc_ValueError, "cannot round %zd bytes of %d-byte floats by %d bits", view.len,
                     itemsize, drop);
        PyBuffer_Release(&view);
        return NULL;
    }
    double worst;
    size_t n = (size_t)view.len / itemsize;
    Py_BEGIN_ALLOW_THREADS
    worst = itemsize == 4 ? round32(view.buf, n, drop) : round64(view.buf, n, drop);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyFloat_FromDouble(worst);
}

/* Lower median of `m` values in 0..range-1 counted into `counts` (all zero on entry and on return),
 * which span lo..hi. */
static int lower_median(uint32_t *counts, int lo, int hi, int m) {
    int need = (m - 1) / 2, seen = 0, v = lo, median = lo;
    for (; v <= hi; v++) {
        seen += (int)counts[v];
        if (seen > need) { median = v; break; }
    }
    for (v = lo; v <= hi; v++) counts[v] = 0;
    return median;
}

/* Fit the grid model of a rows x cols byte plane: K[c], the lower median of column c over up to
 * `down` evenly spaced rows, then R[r], the lower median of (plane[r][c] - K[c]) over up to
 * `across` evenly spaced columns, taken modulo 256. */
static void fit_grid_kernel(const uint8_t *p, size_t rows, size_t cols, size_t mr, size_t mc, size_t *at,
                            int16_t *bias, uint8_t *R, uint8_t *K) {
    uint32_t counts[511] = {0};
    for (size_t k = 0; k < mr; k++) at[k] = (k * rows / mr) * cols;
    for (size_t c = 0; c < cols; c++) {
        int lo = 255, hi = 0;
        for (size_t k = 0; k < mr; k++) {
            int v = p[at[k] + c];
            counts[v]++;
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
        K[c] = (uint8_t)lower_median(counts, lo, hi, (int)mr);
    }
    for (size_t k = 0; k < mc; k++) {
        at[k] = k * cols / mc;
        bias[k] = (int16_t)(255 - K[at[k]]);
    }
    for (size_t r = 0; r < rows; r++) {
        const uint8_t *row = p + r * cols;
        int lo = 510, hi = 0;
        for (size_t k = 0; k < mc; k++) {
            int v = (int)row[at[k]] + bias[k];
            counts[v]++;
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
        R[r] = (uint8_t)((lower_median(counts, lo, hi, (int)mc) - 255) & 255);
    }
}


static PyObject *fit_grid(PyObject *self, PyObject *args) {
    Py_buffer plane, rshift, kshift;
    Py_ssize_t cols, down, across;
    if (!PyArg_ParseTuple(args, "y*nnnw*w*", &plane, &cols, &down, &across, &rshift, &kshift)) return NULL;
    PyObject *result = NULL;
    if (cols < 1 || down < 1 || across < 1 || plane.len % cols || rshift.len != plane.len / cols || kshift.len != cols) {
        PyErr_Format(PyExc_ValueError, "grid of %zd bytes by rows of %zd: shift buffers of %zd and %zd bytes do not fit",
                     plane.len, cols, rshift.len, kshift.len);
    } else {
        size_t rows = (size_t)(plane.len / cols);
        size_t mr = rows < (size_t)down ? rows : (size_t)down, mc = (size_t)cols < (size_t)across ? (size_t)cols : (size_t)across;
        size_t *at = malloc((mr > mc ? mr : mc) * sizeof(size_t) + 1);
        int16_t *bias = malloc(mc * sizeof(int16_t) + 1);
        if (at == NULL || bias == NULL) {
            PyErr_NoMemory();
        } else {
            Py_BEGIN_ALLOW_THREADS
            fit_grid_kernel(plane.buf, rows, (size_t)cols, mr, mc, at, bias, rshift.buf, kshift.buf);
            Py_END_ALLOW_THREADS
            result = Py_None;
            Py_INCREF(result);
        }
        free(at);
        free(bias);
    }
    PyBuffer_Release(&plane);
    PyBuffer_Release(&rshift);
    PyBuffer_Release(&kshift);
    return result;
}

static PyObject *apply_grid(PyObject *self, PyObject *args) {
    Py_buffer src, dst, rshift, kshift;
    int add;
    if (!PyArg_ParseTuple(args, "y*w*y*y*p", &src, &dst, &rshift, &kshift, &add)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t cols = kshift.len;
    if (cols < 1 || src.len != dst.len || src.len % cols || rshift.len != src.len / cols) {
        PyErr_Format(PyExc_ValueError, "grid of %zd bytes (into %zd) by rows of %zd: %zd row shifts do not fit",
                     src.len, dst.len, cols, rshift.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        apply_grid_kernel(src.buf, dst.buf, (size_t)(src.len / cols), (size_t)cols, rshift.buf, kshift.buf, add);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&rshift);
    PyBuffer_Release(&kshift);
    return result;
}

/* Row matching: a plane in rows of `width` bytes (the last may be shorter) where a row is often an
 * earlier row plus a constant (an Adam moment's exponents: rows are near multiples of each other).
 * For each whole row i > 0 the encoder scores the `reach` rows before it on MATCH_SAMPLES evenly spaced
 * columns: for each earlier row j and each shift t among the differences at four of those columns,
 * the count of sampled columns where row i - row j == t; the best count (first found on a tie,
 * nearer rows first) wins if it reaches `least`. side[i] = i - j (0: no reference), side[rows + i] = t;
 * residual = row i - row j - t (mod 256), or row i itself. The residual may overwrite the plane
 * (res == p): the encoder keeps the last reach + 1 rows as they were. Decoding adds them back,
 * first row to last. */
#define MATCH_SAMPLES 32

/* The best reference of whole row r among the `reach` before it, judged on their samples (see
 * above): raises *best (from least - 1) and sets *best_o and *best_t where a row scores more. */
typedef void (*MatchScorer)(const uint8_t *samples, size_t r, int reach, int *best, int *best_o, uint8_t *best_t);

static void score_rows(const uint8_t *samples, size_t r, int reach, int *best, int *best_o, uint8_t *best_t) {
    const uint8_t *mine = samples + r * MATCH_SAMPLES;
    for (int o = 1; o <= reach && (size_t)o <= r; o++) {
        const uint8_t *theirs = samples + (r - o) * MATCH_SAMPLES;
#ifdef __SSE2__
        __m128i lo = _mm_sub_epi8(_mm_loadu_si128((const __m128i *)mine), _mm_loadu_si128((const __m128i *)theirs));
        __m128i hi = _mm_sub_epi8(_mm_loadu_si128((const __m128i *)(mine + 16)),
                                  _mm_loadu_si128((const __m128i *)(theirs + 16)));
#else
        uint8_t d[MATCH_SAMPLES];
        for (int k = 0; k < MATCH_SAMPLES; k++) d[k] = (uint8_t)(mine[k] - theirs[k]);
#endif
        for (int c = 0; c < 4; c++) {
            uint8_t t = (uint8_t)(mine[c * (MATCH_SAMPLES / 4)] - theirs[c * (MATCH_SAMPLES / 4)]);
#ifdef __SSE2__
            __m128i tt = _mm_set1_epi8((char)t);
            __m128i ones = _mm_sub_epi8(_mm_setzero_si128(),
                                        _mm_add_epi8(_mm_cmpeq_epi8(lo, tt), _mm_cmpeq_epi8(hi, tt)));
            __m128i sums = _mm_sad_epu8(ones, _mm_setzero_si128());
            int score = _mm_cvtsi128_si32(sums) + _mm_cvtsi128_si32(_mm_srli_si128(sums, 8));
#else
            int score = 0;
            for (int k = 0; k < MATCH_SAMPLES; k++) score += d[k] == t;
#endif
            if (score > *best) { *best = score; *best_o = o; *best_t = t; }
        }
    }
}

#ifdef X86_VECTOR
/* score_rows with the 32 samples of a row in one AVX2 register: a compare, a mask and a
 * population count per shift (chosen at run time where the processor has them). */
__attribute__((target("avx2,popcnt")))
static void score_rows_avx2(const uint8_t *samples, size_t r, int reach, int *best, int *best_o, uint8_t *best_t) {
    const uint8_t *mine = samples + r * MATCH_SAMPLES;
    __m256i m = _mm256_loadu_si256((const __m256i *)mine);
    /* each candidate's score, then 1023 less its place in the search (under 4 * 256): the
     * greatest key is the best score, found first (no branch to mispredict on every candidate) */
    const int start = *best * 1024 + 1023;
    int top = start, last = reach < (int)r ? reach : (int)r;
    for (int o = 1; o <= last; o++) {
        const uint8_t *theirs = samples + (r - (size_t)o) * MATCH_SAMPLES;
        __m256i d = _mm256_sub_epi8(m, _mm256_loadu_si256((const __m256i *)theirs));
        for (int c = 0; c < 4; c++) {
            uint8_t t = (uint8_t)(mine[c * (MATCH_SAMPLES / 4)] - theirs[c * (MATCH_SAMPLES / 4)]);
            int score = __builtin_popcount((unsigned)_mm256_movemask_epi8(_mm256_cmpeq_epi8(d, _mm256_set1_epi8((char)t))));
            int key = score * 1024 + 1023 - ((o - 1) * 4 + c);
            top = key > top ? key : top;
        }
    }
    if (top == start) return;
    int place = 1023 - (top & 1023), o = place / 4 + 1, c = place % 4;
    *best = top / 1024;
    *best_o = o;
    *best_t = (uint8_t)(mine[c * (MATCH_SAMPLES / 4)] - samples[(r - (size_t)o) * MATCH_SAMPLES + c * (MATCH_SAMPLES / 4)]);
}

/* score_rows with AVX-512: a candidate's four shifts are two byte permutes and two compares of
 * its 32 samples held twice, and the keys of eight candidates' shifts (see score_rows_avx2) are
 * counted and compared in one register; the same picks, 1.35-1.55x faster row matching. */
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512vpopcntdq")))
static void score_rows_avx512(const uint8_t *samples, size_t r, int reach, int *best, int *best_o, uint8_t *best_t) {
    const uint8_t *mine = samples + r * MATCH_SAMPLES;
    __m512i m = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)mine));
    const __m512i first = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi8(8), 1);
    const __m512i second = _mm512_inserti64x4(_mm512_set1_epi8(16), _mm256_set1_epi8(24), 1);
    int last = reach < (int)r ? reach : (int)r;
    uint64_t masks[2 * 256 + 8];
    for (int o = 1; o <= last; o++) {
        __m512i theirs = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(samples + (r - (size_t)o) * MATCH_SAMPLES)));
        __m512i d = _mm512_sub_epi8(m, theirs);
        masks[2 * o - 2] = _mm512_cmpeq_epi8_mask(d, _mm512_permutexvar_epi8(first, d));
        masks[2 * o - 1] = _mm512_cmpeq_epi8_mask(d, _mm512_permutexvar_epi8(second, d));
    }
    /* lane j of a group of 8 masks: candidate g * 4 + j / 2 + 1, its shifts 2 (j % 2) (low half) and 2 (j % 2) + 1 */
    const __m512i low32 = _mm512_set1_epi64(0xffffffff);
    const __m512i place_lo = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14);
    const __m512i ones = _mm512_set1_epi64(1), sixteen = _mm512_set1_epi64(16), base = _mm512_set1_epi64(1023);
    const int start = *best * 1024 + 1023;
    __m512i top = _mm512_set1_epi64(start), place = place_lo;
    for (int j = 0; j < 2 * last; j += 8, place = _mm512_add_epi64(place, sixteen)) {
        __mmask8 live = (__mmask8)(2 * last - j >= 8 ? 0xff : (1u << (2 * last - j)) - 1);
        __m512i v = _mm512_maskz_loadu_epi64(live, masks + j);
        __m512i lo = _mm512_popcnt_epi64(_mm512_and_si512(v, low32)), hi = _mm512_popcnt_epi64(_mm512_srli_epi64(v, 32));
        __m512i key_lo = _mm512_sub_epi64(_mm512_add_epi64(_mm512_slli_epi64(lo, 10), base), place);
        __m512i key_hi = _mm512_sub_epi64(_mm512_add_epi64(_mm512_slli_epi64(hi, 10), base), _mm512_add_epi64(place, ones));
        top = _mm512_mask_max_epi64(top, live, top, _mm512_max_epi64(key_lo, key_hi));
    }
    int best_key = (int)_mm512_reduce_max_epi64(top);
    if (best_key <= start) return;
    int at = 1023 - (best_key & 1023), o = at / 4 + 1, c = at % 4;
    *best = best_key / 1024;
    *best_o = o;
    *best_t = (uint8_t)(mine[c * (MATCH_SAMPLES / 4)] - samples[(r - (size_t)o) * MATCH_SAMPLES + c * (MATCH_SAMPLES / 4)]);
}
#endif

static MatchScorer match_scorer = score_rows;

/* One pass, first row to last: each row's samples are taken and the row kept in `ring` (the
 * last reach + 1 rows as they were) before its residual overwrites it where res == p. */
static void match_rows_kernel(const uint8_t *p, uint8_t *res, uint8_t *side, size_t n, size_t width,
                              int reach, int least, uint8_t *samples, uint8_t *ring) {
    size_t rows = (n + width - 1) / width, whole = n / width, step = width / MATCH_SAMPLES, slots = (size_t)reach + 1;
    for (size_t r = 0; r < rows; r++) {
        const uint8_t *row = p + r * width;
        uint8_t *out = res + r * width;
        size_t len = r < whole ? width : n - r * width;
        int best = least - 1, best_o = 0;
        uint8_t best_t = 0;
        if (r < whole) {
            for (int k = 0; k < MATCH_SAMPLES; k++) samples[r * MATCH_SAMPLES + k] = row[k * step];
            match_scorer(samples, r, reach, &best, &best_o, &best_t);
        }
        side[r] = (uint8_t)best_o;
        side[rows + r] = best_t;
        uint8_t *kept = ring + (r % slots) * width;
        memcpy(kept, row, len);
        if (best_o) {
            const uint8_t *ref = ring + ((r - (size_t)best_o) % slots) * width;
            for (size_t c = 0; c < len; c++) out[c] = (uint8_t)(kept[c] - ref[c] - best_t);
        } else if (out != row) {
            memcpy(out, row, len);
        }
    }
}


static PyObject *match_rows(PyObject *self, PyObject *args) {
    Py_buffer src, dst, side;
    Py_ssize_t width;
    int reach, least;
    if (!PyArg_ParseTuple(args, "y*w*w*nii", &src, &dst, &side, &width, &reach, &least)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t rows = width > 0 ? (src.len + width - 1) / width : 0;
    if (width < MATCH_SAMPLES || width % MATCH_SAMPLES || reach < 0 || reach > 255 || dst.len != src.len
        || side.len != 2 * rows || (dst.buf != src.buf && (uint8_t *)dst.buf < (uint8_t *)src.buf + src.len
                                    && (uint8_t *)src.buf < (uint8_t *)dst.buf + dst.len)) {
        PyErr_Format(PyExc_ValueError, "row matching of %zd bytes (into %zd) by rows of %zd: %zd side bytes do not fit",
                     src.len, dst.len, width, side.len);
    } else {
        uint8_t *samples = malloc((size_t)(src.len / width) * MATCH_SAMPLES + 1);
        uint8_t *ring = malloc(((size_t)reach + 1) * (size_t)width);
        if (samples == NULL || ring == NULL) {
            PyErr_NoMemory();
        } else {
            Py_BEGIN_ALLOW_THREADS
            match_rows_kernel(src.buf, dst.buf, side.buf, (size_t)src.len, (size_t)width, reach, least, samples, ring);
            Py_END_ALLOW_THREADS
            result = Py_None;
            Py_INCREF(result);
        }
        free(samples);
        free(ring);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&side);
    return result;
}

static PyObject *unmatch_rows(PyObject *self, PyObject *args) {
    Py_buffer plane, side;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "w*y*n", &plane, &side, &width)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t rows = width > 0 ? (plane.len + width - 1) / width : 0;
    if (width < 1 || side.len != 2 * rows) {
        PyErr_Format(PyExc_ValueError, "row matching of %zd bytes by rows of %zd: %zd side bytes do not fit",
                     plane.len, width, side.len);
    } else {
        Py_ssize_t bad;
        Py_BEGIN_ALLOW_THREADS
        bad = unmatch_rows_kernel(plane.buf, side.buf, (size_t)plane.len, (size_t)width);
        Py_END_ALLOW_THREADS
        if (bad >= 0) {
            PyErr_Format(PyExc_ValueError, "row matching: row %zd refers to a row before the first", bad);
        } else {
            result = Py_None;
            Py_INCREF(result);
        }
    }
    PyBuffer_Release(&plane);
    PyBuffer_Release(&side);
    return result;
}

/* Pack bytes whose bit 0 is zero (a positive tensor's rotated sign) seven bits each: every 8
 * bytes become 7, little-endian, byte k's bits 7..1 at bits 7k..7k+6; a tail of t bytes takes
 * ceil(7t/8). Return nonzero when some byte has bit 0 set (nothing useful is written then). */
static int pack_seven_kernel(const uint8_t *s, uint8_t *d, size_t n) {
    uint64_t odd = 0;
    size_t i = 0, o = 0;
    for (; i + 8 <= n; i += 8, o += 7) {
        uint64_t x, v = 0;
        memcpy(&x, s + i, 8);
        odd |= x;
        x = (x >> 1) & 0x7F7F7F7F7F7F7F7FULL;
        for (int k = 0; k < 8; k++) v |= ((x >> (8 * k)) & 0x7F) << (7 * k);
        memcpy(d + o, &v, 7);
    }
    if (i < n) {
        uint64_t v = 0;
        size_t t = n - i;
        for (size_t k = 0; k < t; k++) {
            odd |= s[i + k];
            v |= (uint64_t)(s[i + k] >> 1) << (7 * k);
        }
        memcpy(d + o, &v, (7 * t + 7) / 8);
    }
    return (int)(odd & 0x0101010101010101ULL ? 1 : 0);
}


static PyObject *pack_seven(PyObject *self, PyObject *args) {
    Py_buffer src;
    if (!PyArg_ParseTuple(args, "y*", &src)) return NULL;
    size_t n = (size_t)src.len;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)((7 * n + 7) / 8));
    if (out == NULL) {
        PyBuffer_Release(&src);
        return NULL;
    }
    int odd;
    Py_BEGIN_ALLOW_THREADS
    odd = pack_seven_kernel(src.buf, (uint8_t *)PyBytes_AS_STRING(out), n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    if (odd) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}

static PyObject *unpack_seven(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "y*w*", &src, &dst)) return NULL;
    PyObject *result = NULL;
    if ((size_t)src.len != (7 * (size_t)dst.len + 7) / 8) {
        PyErr_Format(PyExc_ValueError, "%zd packed bytes cannot hold %zd seven-bit bytes", src.len, dst.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        unpack_seven_kernel(src.buf, dst.buf, (size_t)dst.len);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

/* What choosing a plane's coder asks of it, in one pass and without the GIL: the order-0 entropy
 * of its bytes in bytes, how many are zero, whether any has bit 0 set, and (where asked) the
 * share of bytes equal to the two before them. */
static PyObject *plane_stats(PyObject *self, PyObject *args) {
    Py_buffer view;
    int runs = 0;
    if (!PyArg_ParseTuple(args, "y*|p", &view, &runs)) return NULL;
    const uint8_t *data = view.buf;
    size_t n = (size_t)view.len, repeats = 0;
    double entropy = 0;
    uint64_t zeros, odd = 0;
    Py_BEGIN_ALLOW_THREADS
    uint64_t counts[256] = {0};
    for (size_t lo = 0; lo < n; lo += (size_t)1 << 30) {
        size_t len = n - lo < ((size_t)1 << 30) ? n - lo : (size_t)1 << 30;
        uint32_t part[256] = {0};
        count_bytes(data + lo, len, part);
        for (int k = 0; k < 256; k++) counts[k] += part[k];
    }
    double sum = 0;
    for (int k = 0; k < 256; k++) {
        if (counts[k]) sum += (double)counts[k] * log2((double)counts[k]);
        if (k & 1) odd |= counts[k];
    }
    entropy = n ? ((double)n * log2((double)n) - sum) / 8 : 0;
    zeros = counts[0];
    if (runs) {
        uint64_t carry = 0;
        for (size_t base = 0; base < n; base += 64) {
            uint64_t mask = same_mask(data, n, base);
            repeats += (size_t)__builtin_popcountll(mask & (mask << 1 | carry >> 63));
            carry = mask;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("dKOd", entropy, (unsigned long long)zeros, odd ? Py_True : Py_False,
                         n ? (double)repeats / (double)n : 0.0);
}

/* Sparse planes: a bitmap of the nonzero bytes (bit i of byte i / 8, least significant first)
 * and the nonzero bytes in order. Eight bytes at a time, through a shuffle per bitmap byte
 * (SSSE3, chosen at import) or branch-free scalar code. */
static uint8_t GATHER[256][8], SCATTER[256][8];

static void fill_sparse_tables(void) {
    for (int m = 0; m < 256; m++) {
        int k = 0;
        memset(GATHER[m], 0x80, 8);
        for (int j = 0; j < 8; j++) {
            SCATTER[m][j] = (m >> j & 1) ? (uint8_t)k : 0x80;
            if (m >> j & 1) GATHER[m][k++] = (uint8_t)j;
        }
    }
}

static inline uint8_t nonzero_bits(uint64_t v) {
    uint64_t t = (v | v >> 4) & 0x0F0F0F0F0F0F0F0FULL;
    t = (t | t >> 2) & 0x0303030303030303ULL;
    t = (t | t >> 1) & 0x0101010101010101ULL;
    return (uint8_t)((t * 0x0102040810204080ULL) >> 56);
}

/* Bitmap (n / 8 rounded up bytes) and nonzero bytes (room for n + 8) of `s`; returns how many. */
static size_t split_sparse_portable(const uint8_t *s, size_t n, uint8_t *bitmap, uint8_t *nonzero) {
    size_t i = 0, k = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, s + i, 8);
        bitmap[i / 8] = nonzero_bits(v);
        for (int j = 0; j < 8; j++) {
            uint8_t b = (uint8_t)(v >> (8 * j));
            nonzero[k] = b;
            k += b != 0;
        }
    }
    if (i < n) {
        uint8_t m = 0;
        for (size_t j = 0; i + j < n; j++) {
            m |= (uint8_t)((s[i + j] != 0) << j);
            nonzero[k] = s[i + j];
            k += s[i + j] != 0;
        }
        bitmap[i / 8] = m;
    }
    return k;
}


#ifdef X86_VECTOR
__attribute__((target("ssse3,popcnt")))
static size_t split_sparse_ssse3(const uint8_t *s, size_t n, uint8_t *bitmap, uint8_t *nonzero) {
    size_t i = 0, k = 0;
    const __m128i zero = _mm_setzero_si128();
    for (; i + 16 <= n; i += 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)(s + i));
        unsigned m = ~(unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(v, zero)) & 0xffff;
        bitmap[i / 8] = (uint8_t)m;
        bitmap[i / 8 + 1] = (uint8_t)(m >> 8);
        __m128i lo = _mm_shuffle_epi8(v, _mm_loadl_epi64((const __m128i *)GATHER[m & 255]));
        _mm_storel_epi64((__m128i *)(nonzero + k), lo);
        k += (size_t)__builtin_popcount(m & 255);
        __m128i hi = _mm_shuffle_epi8(_mm_srli_si128(v, 8), _mm_loadl_epi64((const __m128i *)GATHER[m >> 8]));
        _mm_storel_epi64((__m128i *)(nonzero + k), hi);
        k += (size_t)__builtin_popcount(m >> 8);
    }
    return k + split_sparse_portable(s + i, n - i, bitmap + i / 8, nonzero + k);
}

__attribute__((target("ssse3,popcnt")))
static void join_sparse_ssse3(const uint8_t *bitmap, const uint8_t *nonzero, size_t count, uint8_t *out, size_t n) {
    size_t i = 0, k = 0;
    for (; i + 8 <= n && k + 8 <= count; i += 8) {
        unsigned m = bitmap[i / 8];
        __m128i v = _mm_loadl_epi64((const __m128i *)(nonzero + k));
        _mm_storel_epi64((__m128i *)(out + i), _mm_shuffle_epi8(v, _mm_loadl_epi64((const __m128i *)SCATTER[m])));
        k += (size_t)__builtin_popcount(m);
    }
    if (i < n) join_sparse_portable(bitmap + i / 8, nonzero + k, count - k, out + i, n - i);
}
#endif

typedef size_t (*SparseSplit)(const uint8_t *, size_t, uint8_t *, uint8_t *);
typedef void (*SparseJoin)(const uint8_t *, const uint8_t *, size_t, uint8_t *, size_t);
static SparseSplit sparse_splitter = split_sparse_portable;
static SparseJoin sparse_joiner = join_sparse_portable;


static PyObject *split_sparse(PyObject *self, PyObject *args) {
    Py_buffer src, bitmap, nonzero;
    if (!PyArg_ParseTuple(args, "y*w*w*", &src, &bitmap, &nonzero)) return NULL;
    size_t n = (size_t)src.len, count = 0;
    PyObject *result = NULL;
    if ((size_t)bitmap.len < (n + 7) / 8 || (size_t)nonzero.len < n + 8) {
        PyErr_Format(PyExc_ValueError, "split_sparse of %zu bytes needs a bitmap of %zu bytes and room for %zu "
                     "nonzero bytes; got %zd and %zd", n, (n + 7) / 8, n + 8, bitmap.len, nonzero.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        count = sparse_splitter(src.buf, n, bitmap.buf, nonzero.buf);
        Py_END_ALLOW_THREADS
        result = PyLong_FromSize_t(count);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&bitmap);
    PyBuffer_Release(&nonzero);
    return result;
}

static PyObject *join_sparse(PyObject *self, PyObject *args) {
    Py_buffer bitmap, nonzero, dst;
    if (!PyArg_ParseTuple(args, "y*y*w*", &bitmap, &nonzero, &dst)) return NULL;
    size_t n = (size_t)dst.len, count = (size_t)nonzero.len;
    const uint8_t *bits = bitmap.buf;
    PyObject *result = NULL;
    size_t set = (size_t)bitmap.len == (n + 7) / 8 ? popcount_bytes(bits, (size_t)bitmap.len) : 0;
    if ((size_t)bitmap.len != (n + 7) / 8) {
        PyErr_Format(PyExc_ValueError, "a sparse plane of %zu bytes needs a bitmap of %zu bytes, not %zd", n, (n + 7) / 8, bitmap.len);
    } else if (n % 8 && bits[n / 8] >> (n % 8)) {
        PyErr_Format(PyExc_ValueError, "a sparse plane of %zu bytes: its bitmap marks bytes past its end: damaged", n);
    } else if (set != count) {
        PyErr_Format(PyExc_ValueError, "a sparse plane's bitmap marks %zu nonzero bytes, it holds %zu: damaged", set, count);
    } else {
        Py_BEGIN_ALLOW_THREADS
        sparse_joiner(bits, nonzero.buf, count, dst.buf, n);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&bitmap);
    PyBuffer_Release(&nonzero);
    PyBuffer_Release(&dst);
    return result;
}

/* The kernel each vector-capable step uses in this process, by name (see PyInit__planes). */
static PyObject *kernels(PyObject *self, PyObject *noargs) {
    const char *match = "portable", *split_name = "portable", *literals = "portable", *sparse = "portable";
#ifdef X86_VECTOR
    match = match_scorer == score_rows_avx512 ? "avx512" : match_scorer == score_rows_avx2 ? "avx2" : match;
    split_name = plane_splitter == split_avx512 ? "avx512" : split_name;
    literals = wide_literals == encode_literals_avx512 ? "avx512" : literals;
    sparse = sparse_splitter == split_sparse_ssse3 ? "ssse3" : sparse;
#endif
    return Py_BuildValue("{ssssssss}", "match_rows", match, "planes", split_name, "literals", literals,
                         "sparse", sparse);
}

static PyMethodDef methods[] = {
    {"round_significand", round_significand, METH_VARARGS,
     "round_significand(data, itemsize, drop) -> float\n"
     "Round the floats in `data` (changed in place) to `drop` fewer significand bits; return the largest relative error."},
    {"huffman_bytes", huffman_bytes, METH_VARARGS,
     "huffman_bytes(data, block=32768) -> int\n"
     "The bytes of huffman_deflate(data, block)'s stream, counted without coding it."},
    {"huffman_deflate", huffman_deflate, METH_VARARGS,
     "huffman_deflate(data, block=32768, runs=False) -> bytes\n"
     "A raw deflate stream of `data`, one dynamic Huffman block per `block` bytes: literals only, or with runs\n"
     "of a repeated byte as matches at distance 1."},
    {"inflate_into", inflate_into, METH_VARARGS,
     "inflate_into(stream, out)\n"
     "Inflate a raw deflate stream into exactly the bytes of `out`; ValueError when it is damaged."},
    {"plane_stats", plane_stats, METH_VARARGS,
     "plane_stats(data, runs=False) -> (entropy, zeros, odd, run_share)\n"
     "The order-0 entropy of `data`'s bytes in bytes, how many are zero, whether any has bit 0 set and, where\n"
     "`runs`, the share of bytes equal to the two before them (else 0)."},
    {"split_sparse", split_sparse, METH_VARARGS,
     "split_sparse(data, bitmap, nonzero) -> int\n"
     "Write a bitmap of `data`'s nonzero bytes (bit i of byte i / 8, least significant first) into `bitmap` and\n"
     "those bytes, in order, into `nonzero` (room for len(data) + 8); return how many there are."},
    {"join_sparse", join_sparse, METH_VARARGS,
     "join_sparse(bitmap, nonzero, out)\n"
     "Inverse of split_sparse into `out` (its length says how many bytes); ValueError where the bitmap\n"
     "does not match the nonzero bytes."},
    {"to_planes", to_planes, METH_VARARGS,
     "to_planes(src, dst, itemsize, rotated)\n"
     "Write the byte planes of `src`'s elements into `dst`, the top 16-bit word rotated left if asked."},
    {"from_planes", from_planes, METH_VARARGS,
     "from_planes(src, dst, itemsize, rotated)\n"
     "Inverse of to_planes: join the planes in `src` into elements in `dst`."},
    {"fit_grid", fit_grid, METH_VARARGS,
     "fit_grid(plane, cols, down, across, row_shifts, col_shifts)\n"
     "Fit a byte plane of rows of `cols` as row shift + column shift (lower medians over up to `down` rows,\n"
     "then `across` columns), written into `row_shifts` (one byte per row) and `col_shifts` (`cols` bytes)."},
    {"apply_grid", apply_grid, METH_VARARGS,
     "apply_grid(src, dst, row_shifts, col_shifts, add)\n"
     "dst = src - (or + where `add`) row shift - column shift, per byte, modulo 256."},
    {"match_rows", match_rows, METH_VARARGS,
     "match_rows(plane, residual, side, width, reach, least)\n"
     "Code each row of `width` bytes as an earlier row (up to `reach` back) plus a constant plus `residual`;\n"
     "`side` (2 bytes per row) receives each row's distance back (0: none) and constant. `residual` may be\n"
     "`plane` itself (not part of it)."},
    {"unmatch_rows", unmatch_rows, METH_VARARGS,
     "unmatch_rows(plane, side, width)\n"
     "Inverse of match_rows, in place: `plane` holds the residual and becomes the rows."},
    {"pack_seven", pack_seven, METH_VARARGS,
     "pack_seven(data) -> bytes | None\n"
     "Bytes whose bit 0 is zero, seven bits each (8 bytes into 7); None when some byte has bit 0 set."},
    {"unpack_seven", unpack_seven, METH_VARARGS,
     "unpack_seven(packed, out)\n"
     "Inverse of pack_seven into `out` (its length says how many bytes)."},
    {"kernels", kernels, METH_NOARGS,
     "kernels() -> dict\n"
     "The kernel each step with vector paths uses in this process: match_rows, planes (split and join), literals\n"
     "(Huffman blocks too varied for pair tables) and sparse, each 'portable' or the instruction set's name."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_planes", NULL, -1, methods};

/* FORKPOINT_PORTABLE_KERNELS in the environment keeps kernels off their vector paths: "avx512"
 * off the AVX-512 ones only, any other value but "0" off all of them (kernel_choice.h). */
PyMODINIT_FUNC PyInit__planes(void) {
#ifdef X86_VECTOR
    int level = portable_kernels();
    int all = level == 0;
    int older = level < 2; /* AVX2 and SSSE3 */
    __builtin_cpu_init();
    int avx512 = all && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                 && __builtin_cpu_supports("avx512vbmi");
    if (older && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt"))
        match_scorer = score_rows_avx2;
    if (older && __builtin_cpu_supports("ssse3") && __builtin_cpu_supports("popcnt")) {
        sparse_splitter = split_sparse_ssse3;
        sparse_joiner = join_sparse_ssse3;
    }
    if (avx512) wide_literals = encode_literals_avx512;
    if (avx512 && __builtin_cpu_supports("avx512vbmi2")) {
        plane_splitter = split_avx512;
        plane_joiner = join_avx512;
    }
    if (avx512 && __builtin_cpu_supports("avx512vpopcntdq")) match_scorer = score_rows_avx512;
    fill_plane_orders();
#endif
    fill_sparse_tables();
    fill_reversed();
    fill_lengths();
    fill_log2();
    return PyModule_Create(&module);
}
