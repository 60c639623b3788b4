/* BLAKE3-256 (the hash mode of the BLAKE3 specification, default 32-byte output), portable C.
 * Written from the published specification and checked against its test vectors (c/tests). */
#ifndef FP_BLAKE3_H
#define FP_BLAKE3_H
#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint32_t cv[8];
    uint64_t chunk_counter;
    uint8_t block[64];
    uint8_t block_len;
    uint8_t blocks_compressed;
    uint32_t stack[54][8]; /* one chaining value per level of the chunk tree (2^54 chunks) */
    int stack_len;
} fp_blake3_hasher;

void fp_blake3_init(fp_blake3_hasher *h);
void fp_blake3_update(fp_blake3_hasher *h, const void *data, size_t len);
void fp_blake3_final(const fp_blake3_hasher *h, uint8_t out[32]);
/* One call: the 32-byte digest of `len` bytes. */
void fp_blake3(const void *data, size_t len, uint8_t out[32]);
#endif
