/* repack.h: matrices repacked 8 rows at a time ("x8"), so that one pass over a group of
 * rows computes their 8 products side by side (vector lane i: row i) instead of summing
 * each row's block across the vector; one stream of memory instead of eight.
 *
 * Group g holds rows 8g .. 8g + 7 (the last group padded with rows of zero factors and
 * zero quants), block after block: block c of the group holds block c of its 8 rows
 * (a block of 32 elements; a super-block of 256 for the K-quants). Within it the rows'
 * quants lie in "words": 32 bytes holding 4 bytes of every row, lane i (bytes 4i ..
 * 4i + 3) row i's, so that one 4-byte group of activations, broadcast, multiplies
 * the 8 rows at once. The headers come first, each field of the 8 rows side by side.
 * Per type, a group block is (offsets in bytes; "word w" = 32 bytes as above):
 *
 *   Q8_0 (272)  0: 8 d (halves); 16: word w (0..7) = the quants 4w .. 4w + 3 (int8).
 *   Q4_0 (144)  0: 8 d; 16: word w (0..3) = stored bytes 4w .. 4w + 3 of the nibbles
 *               (low nibble element l, high nibble element l + 16, as stored).
 *   Q4_1 (160)  0: 8 d; 16: 8 m; 32: the nibbles as Q4_0's.
 *   Q5_0 (176)  0: 8 d; 16: the fifth bits, a word (4 bytes a row) reordered: element
 *               4w + b's at bit w of byte b, element 16 + 4w + b's at bit 4 + w (w <
 *               4); 48: the nibbles as Q4_0's.
 *   Q5_1 (192)  0: 8 d; 16: 8 m; 32: the fifth bits as Q5_0's; 64: the nibbles.
 *   IQ4_NL (144) as Q4_0 (its nibbles index IQ4_VALUES).
 *   IQ4_XS (1104) 0: 8 d; 16 + 8 s + i: the signed scale (less 32, an int8) of
 *               sub-block s of row i; 80 + 128 s + 32 w: word w (0..3) of sub-block s's
 *               nibbles, as Q4_0's (low nibble element 4w + b, high 16 + 4w + b).
 *   Q4_K (1184) 0: 8 d; 16: 8 dmin; 32 + 8 s + i: the 6-bit scale of sub-block s of
 *               row i; 96 + 16 p + 2 i + e: the min of sub-block 2 p + e of row i
 *               (pairs, for 16-bit multiply-adds); 160 + 256 p + 32 w: word w of
 *               sub-blocks 2p, 2p+1: byte b of row i holds element 4w + b of sub-block
 *               2p (low nibble) and of 2p + 1 (high nibble), as stored.
 *   Q5_K (1440) Q4_K's header (160 bytes); 160 + 64 p + 32 e: the fifth bits of
 *               sub-block 2p + e, byte b of row i holding in bit w element 4w + b's;
 *               416: the nibbles as Q4_K's.
 *   Q6_K (1680) 0: 8 d; 16 + 8 j + i: the int8 scale of 16-element group j of row i;
 *               144 + 256 p + 32 w: the low 4 bits, as Q4_K's nibbles; 1168 + 128 p +
 *               32 k: the high 2 bits of words 2k (bits 0-1 sub-block 2p, bits 2-3
 *               2p + 1) and 2k + 1 (bits 4-5 and 6-7), byte b of row i.
 *   Q2_K (672)  0: 8 d; 16: 8 dmin; 32 + 8 j + i: the scale (low nibble) and min (high
 *               nibble) of 16-element group j of row i, as stored; 160 + 256 h + 32 w:
 *               the 2 bits of element 4w + b of sub-blocks 4h .. 4h + 3 (bits 2e, 2e + 1
 *               sub-block 4h + e), byte b of row i (Q3_K's low bits' layout).
 *   Q3_K (912)  0: 8 d; 16 + 8 j + i: the signed scale (less 32, an int8) of 16-element
 *               group j of row i, as Q6_K's; 144 + 256 h + 32 w: the low 2 bits of
 *               element 4w + b of sub-blocks 4h .. 4h + 3 (bits 2e, 2e + 1 sub-block
 *               4h + e), byte b of row i; 656 + 32 w: the high bits of element 4w + b
 *               (bit s sub-block s), byte b of row i. (Stored, 880 bytes: the 16
 *               scales of 6 bits take 12 bytes a row, here 16.)
 *
 * The layouts move bits, never change them: a row unpacked (x8_unpack_row) is the
 * stored row, byte for byte, and a repacked row computes what its stored row computes,
 * bit for bit (dot.h's arithmetic, the same order of every addition): the layout
 * changes which rows a pass reads together, not what any row computes.
 */
#ifndef GPP_REPACK_H
#define GPP_REPACK_H

#include <stdint.h>

#define X8 8

/* How far ahead of the block being read the x8 products prefetch, into the second-level
 * cache (X8_AHEAD(block bytes); AVX-512's decode products of Q4_0, Q4_1, IQ4_NL, Q4_K and
 * Q6_K take their own distances: x8_pair_kernels.h): blocks of 512 bytes or more (the
 * super-blocks, Q2_K to Q6_K and IQ4_XS) 8 of them ahead, the smaller ones (Q8_0, Q4_0,
 * Q4_1, Q5_0, Q5_1, IQ4_NL) X8_AHEAD_BYTES ahead; Q8_0's product of one row
 * X8_AHEAD_Q8_0_ROW bytes ahead into the first level.
 * Measured over a decode step's distinct matrices (8B shape, 4 blocks, 1 thread,
 * `benchmarks/cpu_step_products.py`). AMD Zen 5, the AVX2 set, ms a token, into the
 * first level: 3360 bytes Q4_0 17.5-17.7, Q4_K_S 17.7-18.0, Q6_K 24.4-24.7; 6720:
 * 16.3-16.5, 16.4-16.7, 22.8-23.8; 13440: 15.5-15.9, 16.5-17.2, 23.0-23.7 (the second
 * level not tried there). AMD Zen 4 (EPYC family 25, model 17), first level at 6720
 * against the second (the super-blocks 8 ahead, the others 13440), GB/s: Q6_K 9.2 ->
 * 26.1, Q4_K 16.7 -> 28.3; ms, the builds in turn (two rounds): Q3_K_S 1 row 31.7-33.7
 * -> 21.7-22.1, 2 rows (this set's 256-bit kernel) 45-48 -> 31; Q2_K 27.3-30.6 ->
 * 20.2-21.9; Q5_0 1 row 31.2-31.9 -> 25.5-33.1, 2 rows 39.2-39.3 -> 27.4-28.6; Q5_1
 * 30.1-31.3 -> 26.8-30.7, 46-50 -> 32-37; Q4_0 with the AVX2 set 24.4-25.1 -> 20.7-20.9,
 * 3 rows 38.7-39.9 -> 26.3-33.3; IQ4_NL (AVX2) 30.6-31.5 -> 29.8-30.4; Q8_0 2 rows
 * 51.7-62.5 -> 48.8-49.1, 3 rows 60.7-62.9 -> 46.0-47.3, but 1 row 44.1-46.6 -> 50.9-51.5
 * (AVX2: 40.5-43.3 -> 45.2-51.5), which stays in the first level. Prefill's products (32
 * rows) within the noise. */
#define X8_AHEAD_BYTES 13440
#define X8_AHEAD(gb) ((gb) >= 512 ? 8 * (gb) : X8_AHEAD_BYTES)
#define X8_AHEAD_Q8_0_ROW 6720
/* With AVX-512's VNNI (x8_vectors.h: X8_EMBED), Q8_0's products of 2 rows or more and
 * Q4_1's, Q5_0's and Q5_1's of any also prefetch (where they take x8_kernels.h's kernels:
 * avx512's pair kernel of 1 and 2 rows of Q4_1 keeps its own) X8_AHEAD_L1 bytes ahead into
 * the first level, beside the second level's X8_AHEAD: on AMD Zen 4 (the avx512-zen4 set),
 * 14336 x 4096 from memory, 1 thread, the builds in one process in turn
 * (`benchmarks/cpu_builds_ab.py`, 21 rounds), ms over the build without: Q8_0 2 rows
 * 0.87-0.93 (544 bytes ahead 0.95, 4352 0.90, 6720 0.90; into the first level alone 1.08),
 * 3 rows 0.89-0.94, 4 rows 0.87-0.96, 16 rows 0.96; Q4_1 3 rows 0.81-0.82, 1 row 0.88-0.98,
 * 4 rows 0.93-1.00; Q5_0 0.94-1.04; Q5_1 4 rows 0.91, 1-3 rows 0.97-1.01. Not Q4_0's or
 * IQ4_NL's (0.99-1.05), nor the K-quants' (two super-blocks ahead: 1.07-1.32); AVX2's set
 * measured within 3 % either way. */
#define X8_AHEAD_L1 2176

/* the types that repack: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
 * IQ4_NL, IQ4_XS (every quantized type) */
int x8_supported(int t);
/* bytes of one block of a group (8 rows' blocks, see above) */
int x8_block_bytes(int t);
/* bytes of a group of rows of n_in elements */
int64_t x8_group_bytes(int t, int64_t n_in);
/* bytes of a repacked matrix of n_out rows of n_in elements of type t */
int64_t x8_bytes(int t, int64_t n_out, int64_t n_in);
/* groups g0 .. g1 - 1 of rows (n_out of row_bytes) -> out (x8_bytes) */
void x8_pack(int t, const uint8_t *rows, int64_t n_out, int64_t row_bytes, int64_t g0, int64_t g1,
             uint8_t *out);
/* row i (< 8) of a group (rows of n_in elements) as its stored bytes */
void x8_unpack_row(int t, const uint8_t *group, int i, int64_t n_in, uint8_t *row);

#endif
