/* The decoding kernels of the float-planes codec (docs/FORMAT.md, codec 3), in portable C with no
 * Python: an inflater of raw deflate streams, the join of byte planes (the top word rotated back),
 * the grid shifts, row matching undone, seven-bit bytes unpacked and sparse planes joined. One
 * copy serves both readers: the Python extension (codecs/_planes.c) and libforkpoint (c/). */
#ifndef FORKPOINT_PLANES_DECODE_H
#define FORKPOINT_PLANES_DECODE_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

static const uint8_t CL_ORDER[19] = {16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15};

/* Inflate: a raw deflate stream (RFC 1951: stored, fixed and dynamic blocks) into exactly the
 * bytes of `out`. Codes of up to FAST_BITS bits decode with one table lookup (up to three
 * literals at once where they fit), longer ones canonically, a bit at a time. Return 0; INFLATES_PAST when
 * the stream holds more bytes than `out` (stopping there), INFLATES_SHORT when fewer; -1 for an
 * invalid code or header, a distance before the start, or bits read past the end of the input. */
#define FAST_BITS 11
#define MAX_CODE_BITS 15
#define INFLATES_PAST (-3)
#define INFLATES_SHORT (-4)

typedef struct {
    uint16_t fast[1 << FAST_BITS]; /* symbol << 4 | length; 0: longer code (or none) */
    uint32_t run[1 << FAST_BITS]; /* up to 3 literals: bytes | count << 24 | bits << 26; 0: none */
    uint16_t count[MAX_CODE_BITS + 1];
    uint16_t sorted[288];
} Decoder;

typedef struct {
    const uint8_t *in, *end;
    uint64_t bits;
    int nbits;
    int padded;
} BitReader;

static inline void refill(BitReader *r) {
    if (r->end - r->in >= 8) {
        uint64_t word;
        memcpy(&word, r->in, 8);
        r->bits |= word << r->nbits;
        r->in += (63 - r->nbits) >> 3;
        r->nbits |= 56;
        return;
    }
    while (r->nbits <= 56) {
        if (r->in < r->end) r->bits |= (uint64_t)*r->in++ << r->nbits;
        else r->padded++;
        r->nbits += 8;
    }
}

static inline uint32_t take_bits(BitReader *r, int n) {
    if (r->nbits < n) refill(r);
    uint32_t v = (uint32_t)(r->bits & ((1ull << n) - 1));
    r->bits >>= n;
    r->nbits -= n;
    return v;
}

/* Build a decoder for `n` code lengths (with the table of literal runs where `literals`); -1
 * when the lengths over-subscribe the code space. */
static int build_decoder(Decoder *d, const uint8_t *lengths, int n, int literals) {
    uint16_t offs[MAX_CODE_BITS + 2];
    memset(d->count, 0, sizeof d->count);
    memset(d->fast, 0, sizeof d->fast);
    for (int i = 0; i < n; i++) d->count[lengths[i]]++;
    d->count[0] = 0;
    int left = 1;
    for (int len = 1; len <= MAX_CODE_BITS; len++) {
        left = (left << 1) - d->count[len];
        if (left < 0) return -1;
    }
    offs[1] = 0;
    for (int len = 1; len <= MAX_CODE_BITS; len++) offs[len + 1] = (uint16_t)(offs[len] + d->count[len]);
    for (int i = 0; i < n; i++)
        if (lengths[i]) d->sorted[offs[lengths[i]]++] = (uint16_t)i;
    /* Canonical codes in (length, symbol) order; the table is indexed by the bit-reversed code. */
    uint32_t code = 0;
    int k = 0;
    for (int len = 1; len <= FAST_BITS; len++) {
        for (int c = 0; c < d->count[len]; c++, k++, code++) {
            uint32_t reversed = 0;
            for (int b = 0; b < len; b++) reversed |= ((code >> b) & 1u) << (len - 1 - b);
            for (uint32_t fill = reversed; fill < (1u << FAST_BITS); fill += 1u << len)
                d->fast[fill] = (uint16_t)(d->sorted[k] << 4 | len);
        }
        code <<= 1;
    }
    if (literals) {
        for (uint32_t i = 0; i < (1u << FAST_BITS); i++) {
            uint32_t entry = 0, used = 0, count = 0;
            while (count < 3) {
                uint16_t next = d->fast[i >> used];
                uint32_t len = next & 15;
                if (!next || (next >> 4) > 255 || used + len > FAST_BITS) break;
                entry |= (uint32_t)(next >> 4) << (8 * count);
                used += len;
                count++;
            }
            d->run[i] = count ? entry | count << 24 | used << 26 : 0;
        }
    }
    return 0;
}

/* The next symbol, or -1 for a bit pattern that is no code. */
static inline int decode_symbol(BitReader *r, const Decoder *d) {
    if (r->nbits < MAX_CODE_BITS) refill(r);
    uint16_t entry = d->fast[r->bits & ((1u << FAST_BITS) - 1)];
    if (entry) {
        r->bits >>= entry & 15;
        r->nbits -= entry & 15;
        return entry >> 4;
    }
    int code = 0, first = 0, index = 0;
    for (int len = 1; len <= MAX_CODE_BITS; len++) {
        code |= (int)(r->bits & 1);
        r->bits >>= 1;
        r->nbits--;
        int count = d->count[len];
        if (code - first < count) return d->sorted[index + code - first];
        index += count;
        first = (first + count) << 1;
        code <<= 1;
    }
    return -1;
}

static const uint16_t LENGTH_BASE[29] = {3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59,
                                         67, 83, 99, 115, 131, 163, 195, 227, 258};
static const uint8_t LENGTH_BITS[29] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0};
static const uint16_t DIST_BASE[30] = {1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769,
                                       1025, 1537, 2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577};
static const uint8_t DIST_BITS[30] = {0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11,
                                      12, 12, 13, 13};

static int inflate_codes(BitReader *r, const Decoder *lit, const Decoder *dist, uint8_t *out, size_t n, size_t *at) {
    size_t o = *at;
    for (;;) {
        if (r->nbits < 4 * FAST_BITS) refill(r);
        int k = 0;
        for (; k < 4; k++) { /* at least 4 x FAST_BITS bits are in the buffer */
            uint32_t three = lit->run[r->bits & ((1u << FAST_BITS) - 1)];
            if (!three || n - o < 3) break;
            out[o] = (uint8_t)three; /* bytes past the count are written over later */
            out[o + 1] = (uint8_t)(three >> 8);
            out[o + 2] = (uint8_t)(three >> 16);
            o += (three >> 24) & 3;
            r->bits >>= three >> 26;
            r->nbits -= (int)(three >> 26);
        }
        if (k == 4) continue;
        int sym = decode_symbol(r, lit);
        if (sym < 256) {
            if (sym < 0) return -1;
            if (o >= n) return INFLATES_PAST;
            out[o++] = (uint8_t)sym;
            continue;
        }
        if (sym == 256) break;
        sym -= 257;
        if (sym >= 29) return -1;
        size_t length = LENGTH_BASE[sym] + take_bits(r, LENGTH_BITS[sym]);
        int dsym = decode_symbol(r, dist);
        if (dsym < 0 || dsym >= 30) return -1;
        size_t distance = DIST_BASE[dsym] + take_bits(r, DIST_BITS[dsym]);
        if (distance > o) return -1;
        if (length > n - o) return INFLATES_PAST;
        const uint8_t *from = out + o - distance;
        if (distance == 1) memset(out + o, out[o - 1], length);
        else for (size_t i = 0; i < length; i++) out[o + i] = from[i];
        o += length;
        if (r->padded > 8) return -1;
    }
    *at = o;
    return 0;
}

static int dynamic_header(BitReader *r, Decoder *lit, Decoder *dist) {
    int nlit = (int)take_bits(r, 5) + 257, ndist = (int)take_bits(r, 5) + 1, ncl = (int)take_bits(r, 4) + 4;
    if (nlit > 286 || ndist > 30) return -1;
    uint8_t lengths[320] = {0};
    for (int i = 0; i < ncl; i++) lengths[CL_ORDER[i]] = (uint8_t)take_bits(r, 3);
    Decoder cl;
    if (build_decoder(&cl, lengths, 19, 0) < 0) return -1;
    memset(lengths, 0, sizeof lengths);
    for (int i = 0; i < nlit + ndist;) {
        int sym = decode_symbol(r, &cl);
        if (sym < 0) return -1;
        if (sym < 16) { lengths[i++] = (uint8_t)sym; continue; }
        int repeat;
        uint8_t value = 0;
        if (sym == 16) {
            if (i == 0) return -1;
            value = lengths[i - 1];
            repeat = 3 + (int)take_bits(r, 2);
        } else if (sym == 17) {
            repeat = 3 + (int)take_bits(r, 3);
        } else {
            repeat = 11 + (int)take_bits(r, 7);
        }
        if (i + repeat > nlit + ndist) return -1;
        while (repeat--) lengths[i++] = value;
    }
    if (!lengths[256]) return -1;
    if (build_decoder(lit, lengths, nlit, 1) < 0 || build_decoder(dist, lengths + nlit, ndist, 0) < 0) return -1;
    return r->padded > 8 ? -1 : 0;
}

static int inflate_kernel(const uint8_t *in, size_t len, uint8_t *out, size_t n, Decoder *lit, Decoder *dist,
                          size_t *produced) {
    BitReader r = {in, in + len, 0, 0, 0};
    size_t o = 0;
    int final = 0, status;
    while (!final) {
        final = (int)take_bits(&r, 1);
        int type = (int)take_bits(&r, 2);
        if (type == 0) {
            take_bits(&r, r.nbits & 7);
            uint32_t stored = take_bits(&r, 16), check = take_bits(&r, 16);
            if ((stored ^ 0xffff) != check) return -1;
            if (stored > n - o) return INFLATES_PAST;
            for (uint32_t i = 0; i < stored; i++) out[o++] = (uint8_t)take_bits(&r, 8);
        } else if (type == 1) {
            uint8_t lengths[320];
            memset(lengths, 8, 144);
            memset(lengths + 144, 9, 112);
            memset(lengths + 256, 7, 24);
            memset(lengths + 280, 8, 8);
            memset(lengths + 288, 5, 32);
            build_decoder(lit, lengths, 288, 1);
            build_decoder(dist, lengths + 288, 32, 0);
            if ((status = inflate_codes(&r, lit, dist, out, n, &o)) < 0) return status;
        } else if (type == 2) {
            if (dynamic_header(&r, lit, dist) < 0) return -1;
            if ((status = inflate_codes(&r, lit, dist, out, n, &o)) < 0) return status;
        } else {
            return -1;
        }
        if (r.padded > 8) return -1;
    }
    size_t consumed = (size_t)(r.in - in) * 8 - (size_t)r.nbits + (size_t)r.padded * 8;
    if (consumed > len * 8) return -1;
    *produced = o;
    return o == n ? 0 : INFLATES_SHORT;
}

static inline uint16_t rotate_left(uint16_t w) { return (uint16_t)((w << 1) | (w >> 15)); }
static inline uint16_t rotate_right(uint16_t w) { return (uint16_t)((w >> 1) | (w << 15)); }

/* Inverse of split_from. */
static void join_from(const uint8_t *s, uint8_t *d, size_t n, size_t from, int itemsize, int rotated) {
    if (itemsize == 2) {
        const uint8_t *p0 = s, *p1 = s + n;
        for (size_t i = from; i < n; i++) {
            uint16_t w = (uint16_t)(p0[i] | (p1[i] << 8));
            if (rotated) w = rotate_right(w);
            memcpy(d + 2 * i, &w, 2);
        }
    } else if (itemsize == 4) {
        const uint8_t *p0 = s, *p1 = s + n, *p2 = s + 2 * n, *p3 = s + 3 * n;
        for (size_t i = from; i < n; i++) {
            uint16_t top = (uint16_t)(p2[i] | (p3[i] << 8));
            if (rotated) top = rotate_right(top);
            uint32_t v = (uint32_t)p0[i] | (uint32_t)p1[i] << 8 | (uint32_t)top << 16;
            memcpy(d + 4 * i, &v, 4);
        }
    } else {
        for (size_t i = from; i < n; i++) {
            uint16_t top = (uint16_t)(s[6 * n + i] | (s[7 * n + i] << 8));
            if (rotated) top = rotate_right(top);
            uint64_t v = (uint64_t)top << 48;
            for (int k = 0; k < 6; k++) v |= (uint64_t)s[k * n + i] << (8 * k);
            memcpy(d + 8 * i, &v, 8);
        }
    }
}

static void apply_grid_kernel(const uint8_t *s, uint8_t *d, size_t rows, size_t cols, const uint8_t *R,
                              const uint8_t *K, int add) {
    for (size_t r = 0; r < rows; r++) {
        const uint8_t *in = s + r * cols;
        uint8_t *out = d + r * cols;
        const uint8_t shift = R[r];
        if (add)
            for (size_t c = 0; c < cols; c++) out[c] = (uint8_t)(in[c] + K[c] + shift);
        else
            for (size_t c = 0; c < cols; c++) out[c] = (uint8_t)(in[c] - K[c] - shift);
    }
}

/* Return the first row whose reference is out of range, or -1 when all rows were restored. */
static ptrdiff_t unmatch_rows_kernel(uint8_t *p, const uint8_t *side, size_t n, size_t width) {
    size_t rows = (n + width - 1) / width;
    for (size_t r = 0; r < rows; r++) {
        size_t o = side[r];
        if (!o) continue;
        if (o > r) return (ptrdiff_t)r;
        uint8_t *row = p + r * width;
        const uint8_t *ref = row - o * width;
        const uint8_t t = side[rows + r];
        size_t len = (r + 1) * width <= n ? width : n - r * width;
        for (size_t c = 0; c < len; c++) row[c] = (uint8_t)(row[c] + ref[c] + t);
    }
    return -1;
}

static void unpack_seven_kernel(const uint8_t *s, uint8_t *d, size_t n) {
    size_t i = 0, o = 0;
    for (; i + 8 <= n; i += 8, o += 7) {
        uint64_t v = 0, x = 0;
        memcpy(&v, s + o, 7);
        for (int k = 0; k < 8; k++) x |= ((v >> (7 * k)) & 0x7F) << (8 * k + 1);
        memcpy(d + i, &x, 8);
    }
    if (i < n) {
        uint64_t v = 0;
        size_t t = n - i;
        memcpy(&v, s + o, (7 * t + 7) / 8);
        for (size_t k = 0; k < t; k++) d[i + k] = (uint8_t)(((v >> (7 * k)) & 0x7F) << 1);
    }
}

/* Inverse of split: `out` (n bytes) from the bitmap and the `count` nonzero bytes. */
static void join_sparse_portable(const uint8_t *bitmap, const uint8_t *nonzero, size_t count, uint8_t *out, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (i % 8 == 0 && i + 8 <= n && !bitmap[i / 8]) {
            memset(out + i, 0, 8);
            i += 7;
            continue;
        }
        int bit = bitmap[i / 8] >> (i % 8) & 1;
        uint8_t v = count ? nonzero[k < count ? k : count - 1] : 0;
        out[i] = bit ? v : 0;
        k += (size_t)bit;
    }
}

/* Set bits in `n` bytes (eight at a time, without the popcnt instruction). */
static size_t popcount_bytes(const uint8_t *p, size_t n) {
    size_t total = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        v = v - ((v >> 1) & 0x5555555555555555ULL);
        v = (v & 0x3333333333333333ULL) + ((v >> 2) & 0x3333333333333333ULL);
        v = (v + (v >> 4)) & 0x0F0F0F0F0F0F0F0FULL;
        total += (size_t)((v * 0x0101010101010101ULL) >> 56);
    }
    for (; i < n; i++) total += (size_t)__builtin_popcount(p[i]);
    return total;
}

#endif
