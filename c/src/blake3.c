/* BLAKE3 hash mode from the specification: 1 KiB chunks of 64-byte blocks compressed with 7
 * rounds, chunk chaining values merged pairwise into a binary tree, the root flagged ROOT.
 * The stack merge keeps the last chunk open until more input arrives, as the spec's reference
 * does, so that the root is always compressed with the ROOT flag. */
#include "blake3.h"

#include <string.h>

enum { CHUNK_START = 1, CHUNK_END = 2, PARENT = 4, ROOT = 8 };
enum { BLOCK_LEN = 64, CHUNK_LEN = 1024 };

static const uint32_t IV[8] = {0x6A09E667u, 0xBB67AE85u, 0x3C6EF372u, 0xA54FF53Au,
                               0x510E527Fu, 0x9B05688Cu, 0x1F83D9ABu, 0x5BE0CD19u};
/* the message word order of each round: the spec's permutation applied round after round */
static const uint8_t SCHEDULE[7][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8},
    {3, 4, 10, 12, 13, 2, 7, 14, 6, 5, 9, 0, 11, 15, 8, 1},
    {10, 7, 12, 9, 14, 3, 13, 15, 4, 0, 11, 2, 5, 8, 1, 6},
    {12, 13, 9, 11, 15, 10, 14, 8, 7, 2, 5, 3, 0, 1, 6, 4},
    {9, 14, 11, 5, 8, 12, 15, 1, 13, 3, 0, 10, 2, 6, 4, 7},
    {11, 15, 5, 0, 1, 9, 8, 6, 14, 10, 2, 12, 3, 4, 7, 13},
};

static inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static inline uint32_t load32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

#define G(a, b, c, d, x, y)              \
    do {                                 \
        s[a] = s[a] + s[b] + (x);        \
        s[d] = rotr(s[d] ^ s[a], 16);    \
        s[c] = s[c] + s[d];              \
        s[b] = rotr(s[b] ^ s[c], 12);    \
        s[a] = s[a] + s[b] + (y);        \
        s[d] = rotr(s[d] ^ s[a], 8);     \
        s[c] = s[c] + s[d];              \
        s[b] = rotr(s[b] ^ s[c], 7);     \
    } while (0)

/* The compression function; writes the new chaining value (the first 8 output words) to `out`. */
static void compress(const uint32_t cv[8], const uint8_t block[BLOCK_LEN], uint64_t counter, uint32_t block_len,
                     uint32_t flags, uint32_t out[8]) {
    uint32_t m[16], s[16];
    for (int i = 0; i < 16; i++) m[i] = load32(block + 4 * i);
    memcpy(s, cv, 32);
    s[8] = IV[0], s[9] = IV[1], s[10] = IV[2], s[11] = IV[3];
    s[12] = (uint32_t)counter, s[13] = (uint32_t)(counter >> 32), s[14] = block_len, s[15] = flags;
    for (int r = 0; r < 7; r++) {
        const uint8_t *w = SCHEDULE[r];
        G(0, 4, 8, 12, m[w[0]], m[w[1]]);
        G(1, 5, 9, 13, m[w[2]], m[w[3]]);
        G(2, 6, 10, 14, m[w[4]], m[w[5]]);
        G(3, 7, 11, 15, m[w[6]], m[w[7]]);
        G(0, 5, 10, 15, m[w[8]], m[w[9]]);
        G(1, 6, 11, 12, m[w[10]], m[w[11]]);
        G(2, 7, 8, 13, m[w[12]], m[w[13]]);
        G(3, 4, 9, 14, m[w[14]], m[w[15]]);
    }
    for (int i = 0; i < 8; i++) out[i] = s[i] ^ s[i + 8];
}

static void parent_cv(const uint32_t left[8], const uint32_t right[8], uint32_t flags, uint32_t out[8]) {
    uint8_t block[BLOCK_LEN];
    for (int i = 0; i < 8; i++) {
        for (int k = 0; k < 4; k++) {
            block[4 * i + k] = (uint8_t)(left[i] >> (8 * k));
            block[32 + 4 * i + k] = (uint8_t)(right[i] >> (8 * k));
        }
    }
    compress(IV, block, 0, BLOCK_LEN, PARENT | flags, out);
}

void fp_blake3_init(fp_blake3_hasher *h) {
    memset(h, 0, sizeof *h);
    memcpy(h->cv, IV, sizeof IV);
}

static size_t chunk_len(const fp_blake3_hasher *h) {
    return (size_t)h->blocks_compressed * BLOCK_LEN + h->block_len;
}

static void push_chunk(fp_blake3_hasher *h, const uint32_t cv[8]) {
    uint32_t merged[8];
    memcpy(merged, cv, 32);
    uint64_t total = h->chunk_counter + 1;
    while ((total & 1) == 0) { /* a completed subtree on the right: merge it with its left sibling */
        parent_cv(h->stack[--h->stack_len], merged, 0, merged);
        total >>= 1;
    }
    memcpy(h->stack[h->stack_len++], merged, 32);
}

void fp_blake3_update(fp_blake3_hasher *h, const void *data, size_t len) {
    const uint8_t *p = data;
    while (len) {
        if (chunk_len(h) == CHUNK_LEN) { /* the open chunk is full and more input follows: close it */
            uint32_t cv[8];
            compress(h->cv, h->block, h->chunk_counter, BLOCK_LEN, CHUNK_END, cv);
            push_chunk(h, cv);
            h->chunk_counter++;
            memcpy(h->cv, IV, sizeof IV);
            h->blocks_compressed = 0;
            h->block_len = 0;
        }
        if (h->block_len == BLOCK_LEN) {
            uint32_t flags = h->blocks_compressed == 0 ? CHUNK_START : 0;
            compress(h->cv, h->block, h->chunk_counter, BLOCK_LEN, flags, h->cv);
            h->blocks_compressed++;
            h->block_len = 0;
        }
        /* whole blocks straight from the input while at least one more byte follows them */
        while (h->block_len == 0 && len > BLOCK_LEN && h->blocks_compressed < CHUNK_LEN / BLOCK_LEN - 1) {
            uint32_t flags = h->blocks_compressed == 0 ? CHUNK_START : 0;
            compress(h->cv, p, h->chunk_counter, BLOCK_LEN, flags, h->cv);
            h->blocks_compressed++;
            p += BLOCK_LEN;
            len -= BLOCK_LEN;
        }
        size_t take = BLOCK_LEN - h->block_len;
        if (take > len) take = len;
        memcpy(h->block + h->block_len, p, take);
        h->block_len = (uint8_t)(h->block_len + take);
        p += take;
        len -= take;
    }
}

void fp_blake3_final(const fp_blake3_hasher *h, uint8_t out[32]) {
    uint32_t flags = CHUNK_END | (h->blocks_compressed == 0 ? CHUNK_START : 0);
    uint8_t block[BLOCK_LEN] = {0};
    memcpy(block, h->block, h->block_len);
    uint32_t cv[8];
    if (h->stack_len == 0) {
        compress(h->cv, block, h->chunk_counter, h->block_len, flags | ROOT, cv);
    } else {
        compress(h->cv, block, h->chunk_counter, h->block_len, flags, cv);
        for (int i = h->stack_len - 1; i >= 0; i--) parent_cv(h->stack[i], cv, i == 0 ? ROOT : 0, cv);
    }
    for (int i = 0; i < 8; i++)
        for (int k = 0; k < 4; k++) out[4 * i + k] = (uint8_t)(cv[i] >> (8 * k));
}

void fp_blake3(const void *data, size_t len, uint8_t out[32]) {
    fp_blake3_hasher h;
    fp_blake3_init(&h);
    fp_blake3_update(&h, data, len);
    fp_blake3_final(&h, out);
}
