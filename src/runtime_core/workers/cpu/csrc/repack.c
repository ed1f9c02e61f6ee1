/* repack.c: the x8 layout (repack.h). */
#include "repack.h"

#include <string.h>

#include "quant.h"

_Static_assert(X8 * 4 == 32, "a word of every row fills 32 bytes");

int x8_header_bytes(int t) { return t == T_Q4_0 ? 2 : t == T_Q4_1 ? 4 : 0; }

int x8_supported(int t) { return t == T_Q4_0 || t == T_Q4_1; }

/* a block's header is halves (2 bytes each): half f of row i at x8_half(f, i) */
static int x8_half(int f, int i) { return (f * X8 + i) * 2; }

int64_t x8_bytes(int t, int64_t n_out, int64_t n_in) {
    int64_t groups = (n_out + X8 - 1) / X8;
    return groups * X8 * (n_in / QTYPE_BLOCK_ELEMS[t]) * QTYPE_BLOCK_BYTES[t];
}

void x8_pack(int t, const uint8_t *rows, int64_t n_out, int64_t row_bytes, uint8_t *out) {
    const int bb = QTYPE_BLOCK_BYTES[t], hb = x8_header_bytes(t), pb = bb - hb;
    const int64_t nb = row_bytes / bb, groups = (n_out + X8 - 1) / X8;
    for (int64_t g = 0; g < groups; ++g)
        for (int64_t c = 0; c < nb; ++c) {
            uint8_t *dst = out + (g * nb + c) * X8 * bb;
            for (int i = 0; i < X8; ++i) {
                int64_t r = g * X8 + i;
                const uint8_t *b = r < n_out ? rows + r * row_bytes + c * bb : NULL;
                for (int f = 0; f < hb / 2; ++f) {
                    if (b) memcpy(dst + x8_half(f, i), b + 2 * f, 2);
                    else memset(dst + x8_half(f, i), 0, 2);
                }
                for (int l = 0; l < pb; l += 4) {
                    if (b) memcpy(dst + x8_at(hb, i, l), b + hb + l, 4);
                    else memset(dst + x8_at(hb, i, l), 0, 4);
                }
            }
        }
}

void x8_unpack_row(int t, const uint8_t *group, int i, int64_t n_chunks, uint8_t *row) {
    const int bb = QTYPE_BLOCK_BYTES[t], hb = x8_header_bytes(t), pb = bb - hb;
    const int64_t nb = n_chunks * 32 / QTYPE_BLOCK_ELEMS[t];
    for (int64_t c = 0; c < nb; ++c) {
        const uint8_t *src = group + c * X8 * bb;
        for (int f = 0; f < hb / 2; ++f) memcpy(row + c * bb + 2 * f, src + x8_half(f, i), 2);
        for (int l = 0; l < pb; l += 4) memcpy(row + c * bb + hb + l, src + x8_at(hb, i, l), 4);
    }
}
