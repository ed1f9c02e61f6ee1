/* repack.h: matrices repacked 8 rows at a time ("x8"), so that one pass over a group of
 * rows computes their 8 products side by side (vector lane i: row i) instead of summing
 * each row's block across the vector; one stream of memory instead of eight.
 *
 * Group g holds rows 8g .. 8g + 7 (the last group padded with rows of zero factors and
 * zero quants). Its block c takes 8 blocks' bytes: the 8 rows' headers, half by half
 * (each 16 bytes hold one of the header's halves for every row, rows in order: Q4_0's
 * 8 d; Q4_1's 8 d, then its 8 m), then their payloads (16 bytes of nibbles) in words
 * of 4 bytes, word w of the 8 rows side by side (x8_at): each 32 bytes hold one word
 * of every row, lane i (4 bytes) row i's. A repacked row
 * computes what its stored row computes, bit for bit (dot.h's arithmetic, the same
 * order of every addition): the layout changes which rows a pass reads together,
 * not what any row computes.
 */
#ifndef GPP_REPACK_H
#define GPP_REPACK_H

#include <stdint.h>

#define X8 8

/* the types that repack: those with an x8 kernel (Q4_0, Q4_1) */
int x8_supported(int t);
/* header bytes of a block of a type that repacks (halves: Q4_0 2, Q4_1 4) */
int x8_header_bytes(int t);
/* bytes of a repacked matrix of n_out rows of n_in elements of type t */
int64_t x8_bytes(int t, int64_t n_out, int64_t n_in);
/* rows (n_out of row_bytes) -> out (x8_bytes) */
void x8_pack(int t, const uint8_t *rows, int64_t n_out, int64_t row_bytes, uint8_t *out);
/* row i (< 8) of a group (blocks of n_chunks chunks) as its stored bytes */
void x8_unpack_row(int t, const uint8_t *group, int i, int64_t n_chunks, uint8_t *row);
/* the bytes of a group: 8 stored rows */
static inline int64_t x8_group_bytes(int64_t row_bytes) { return X8 * row_bytes; }
/* where byte l of row i's payload lies in a group block whose headers take hb bytes
 * per row: after the 8 headers, word l / 4 of the 8 rows, row i's 4 bytes in lane i */
static inline int x8_at(int hb, int i, int l) { return X8 * hb + ((l >> 2) * X8 + i) * 4 + (l & 3); }

#endif
