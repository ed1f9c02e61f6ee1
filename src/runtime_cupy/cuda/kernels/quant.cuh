// quant.cuh: GGUF block layouts, decoded 32 elements ("a chunk") at a time.
//
// A row of a quantized matrix is a run of blocks: 32 elements per block for
// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL, 256 per super-block for the K-quants and
// IQ4_XS (8 chunks of 32). Each type below has
//   dequant(row, c, v):        v[0..31] = the floats of chunk c of the row, rounded
//                              exactly as the gguf package's dequantize rounds them;
//   dot_q8(row, c, x, xd, xs): the chunk's dot product with an activation chunk
//                              quantized to 8 bits (x: 32 int8 packed in 8 ints,
//                              value = xd * x[i]; xs = xd * sum(x)), by integer dot
//                              products and one float expression per chunk.
// The float expression of each dot_q8 is written down in tests/support/twins.py
// (`_chunk_terms_*`), which computes the same terms in NumPy.
//
// Byte layouts (offsets within one block; f16 = IEEE half; element e of a block):
//   Q8_0  34 B: d f16 @0, q int8[32] @2.                        v = d * q[e]
//   Q4_0  18 B: d @0, qs[16] @2; e < 16: low nibble of qs[e], else high nibble of
//               qs[e-16].                                        v = d * (q - 8)
//   Q4_1  20 B: d @0, m @2, qs[16] @4 (nibbles as Q4_0).        v = d * q + m
//   Q5_0  22 B: d @0, qh u32 @2, qs[16] @6; q = nibble | bit e of qh << 4.
//                                                                v = d * (q - 16)
//   Q5_1  24 B: d @0, m @2, qh @4, qs[16] @8.                   v = d * q + m
//   Q2_K  84 B: scales[16] @0 (low 4 bits scale, high 4 bits min, per 16 elements),
//               qs[64] @16, d @80, dmin @82. e = 128h + 32t + l: q = qs[32h + l] >> 2t & 3.
//                                   v = (d * sc) * q - (dmin * m)
//   Q3_K 110 B: hmask[32] @0, qs[64] @32, scales[12] @96, d @108. e = 128h + 32t + l:
//               q = (qs[32h + l] >> 2t & 3) - (bit (4h + t) of hmask[l] ? 0 : 4);
//               16 signed 6-bit scales (low 4 bits in bytes 0-7, high 2 in 8-11) - 32.
//                                   v = (d * sc) * q
//   Q4_K 144 B: d @0, dmin @2, scales[12] @4 (8 6-bit scales and mins), qs[128] @16.
//               e = 64g + 32n + l: q = nibble n of qs[32g + l]; sub-block 2g + n.
//                                   v = (d * sc) * q - (dmin * m)
//   Q5_K 176 B: d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48;
//               q = nibble as Q4_K | bit (sub-block) of qh[l] << 4.  v as Q4_K
//   Q6_K 210 B: ql[128] @0, qh[64] @128, scales int8[16] @192, d @208.
//               e = 128h + r: q = (nibble (r / 64) of ql[64h + r % 64]
//                              | (qh[32h + r % 32] >> 2 (r / 32) & 3) << 4) - 32.
//                                   v = (d * sc) * q
//   IQ4_NL 18 B: d @0, qs[16] @2 (nibbles as Q4_0); a nibble n indexes the 16 signed
//               values kv (llama.cpp's kvalues_iq4nl: -127 -104 ... 89 113).  v = d * kv[n]
//   IQ4_XS 136 B: d @0, scales_h u16 @2, scales_l[4] @4, qs[128] @8. Sub-block s
//               (chunk s, 0..7): qs[16s .. 16s + 15], nibbles as Q4_0; scale =
//               (nibble (s % 2) of scales_l[s / 2] | (scales_h >> 2s & 3) << 4) - 32.
//                                   v = (d * scale) * kv[n]
#pragma once
#include "common.cuh"

// ---- helpers -----------------------------------------------------------------------

// Spread the 4 low bits of b into bit 4 of each byte: (b0 << 4, b1 << 12, ...).
HD u32 spread_bit4(u32 b) {
    return ((b & 1u) << 4) | ((b & 2u) << 11) | ((b & 4u) << 18) | ((b & 8u) << 25);
}

// Sum of 4 packed signed bytes.
HD int sum4(int x) { return dot4(0x01010101, x, 0); }

// The 6-bit scale and min of sub-block s (0..7) of a Q4_K / Q5_K super-block.
HD void k4_scale_min(const u8* sc, int s, int* scale, int* min) {
    if (s < 4) {
        *scale = sc[s] & 63;
        *min = sc[s + 4] & 63;
    } else {
        *scale = (sc[s + 4] & 15) | ((sc[s - 4] >> 6) << 4);
        *min = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
    }
}

// The signed 6-bit scale of group j (0..15) of a Q3_K super-block.
HD int k3_scale(const u8* sc, int j) {
    int low = (sc[j & 7] >> (4 * (j >> 3))) & 15;
    int high = (sc[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
    return (low | (high << 4)) - 32;
}

// IQ4_NL's and IQ4_XS's 16 values, 4 signed bytes a word: value n is byte n % 4 of
// word n / 4 (plain arithmetic, the same on the host and the device: no table in memory).
#define IQ4_W0 0xbfad9881u  // -127 -104  -83  -65
#define IQ4_W1 0xf6eaddcfu  //  -49  -35  -22  -10
#define IQ4_W2 0x26190d01u  //    1   13   25   38
#define IQ4_W3 0x71594535u  //   53   69   89  113

// The values of 4 nibbles, one in the low 4 bits of each byte of n, as 4 packed signed
// bytes (a dot4 operand).
HD u32 iq4_values4(u32 n) {
    u32 v = 0;
    UNROLL for (int k = 0; k < 4; ++k) {
        u32 i = (n >> (8 * k)) & 15u;
        u32 w = (i & 8u) ? ((i & 4u) ? IQ4_W3 : IQ4_W2) : ((i & 4u) ? IQ4_W1 : IQ4_W0);
        v |= ((w >> (8 * (i & 3u))) & 0xffu) << (8 * k);
    }
    return v;
}

// The value of nibble n (0..15).
HD int iq4_value(int n) { return (int)(i8)iq4_values4((u32)n); }

// The signed 6-bit scale of sub-block s (0..7) of the IQ4_XS super-block at b.
HD int iq4xs_scale(const u8* b, int s) {
    int low = (b[4 + (s >> 1)] >> (4 * (s & 1))) & 15;
    int high = (int)(load_u16(b + 2) >> (2 * s)) & 3;
    return (low | (high << 4)) - 32;
}

// ---- float types --------------------------------------------------------------------

struct TypeF32 {
    static const int BLOCK_ELEMS = 1, BLOCK_BYTES = 4;
    HD static void dequant(const u8* row, int c, float* v) {
        CHECK_ALIGNED(row + 128 * c, 16, "F32 chunk");
        const F4* p = (const F4*)(row + 128 * c);
        UNROLL for (int i = 0; i < 8; ++i) {
            F4 f = p[i];
            v[4 * i] = f.x;
            v[4 * i + 1] = f.y;
            v[4 * i + 2] = f.z;
            v[4 * i + 3] = f.w;
        }
    }
};

// 8 halves (or bfloat16s) packed in a U4, to floats.
template <bool BF>
HD void unpack8(U4 u, float* v) {
    u32 w[4] = {u.x, u.y, u.z, u.w};
    UNROLL for (int i = 0; i < 4; ++i) {
        u16 lo = (u16)(w[i] & 0xffffu), hi = (u16)(w[i] >> 16);
        v[2 * i] = BF ? bf16_to_float(lo) : half_to_float(lo);
        v[2 * i + 1] = BF ? bf16_to_float(hi) : half_to_float(hi);
    }
}

struct TypeF16 {
    static const int BLOCK_ELEMS = 1, BLOCK_BYTES = 2;
    HD static void dequant(const u8* row, int c, float* v) {
        CHECK_ALIGNED(row + 64 * c, 16, "F16 chunk");
        const U4* p = (const U4*)(row + 64 * c);
        UNROLL for (int i = 0; i < 4; ++i) unpack8<false>(p[i], v + 8 * i);
    }
};

struct TypeBF16 {
    static const int BLOCK_ELEMS = 1, BLOCK_BYTES = 2;
    HD static void dequant(const u8* row, int c, float* v) {
        CHECK_ALIGNED(row + 64 * c, 16, "BF16 chunk");
        const U4* p = (const U4*)(row + 64 * c);
        UNROLL for (int i = 0; i < 4; ++i) unpack8<true>(p[i], v + 8 * i);
    }
};

// ---- 32-element blocks -----------------------------------------------------------------

struct TypeQ8_0 {
    static const int BLOCK_ELEMS = 32, BLOCK_BYTES = 34;
    HD static void dequant(const u8* row, int c, float* v) {
        const u8* b = row + 34 * c;
        float d = half_to_float(load_u16(b));
        UNROLL for (int i = 0; i < 32; ++i) v[i] = mul_rn((float)(i8)b[2 + i], d);
    }
    HD static float dot_q8(const u8* row, int c, const int* x, float xd, float xs) {
        const u8* b = row + 34 * c;
        float d = half_to_float(load_u16(b));
        int sumi = 0;
        UNROLL for (int i = 0; i < 8; ++i) sumi = dot4((int)load_u32_a2(b + 2 + 4 * i), x[i], sumi);
        return d * (xd * (float)sumi);
    }
};

struct TypeQ4_0 {
    static const int BLOCK_ELEMS = 32, BLOCK_BYTES = 18;
    HD static void dequant(const u8* row, int c, float* v) {
        const u8* b = row + 18 * c;
        float d = half_to_float(load_u16(b));
        UNROLL for (int i = 0; i < 16; ++i) {
            v[i] = mul_rn(d, (float)((b[2 + i] & 15) - 8));
            v[i + 16] = mul_rn(d, (float)((b[2 + i] >> 4) - 8));
        }
    }
    HD static float dot_q8(const u8* row, int c, const int* x, float xd, float xs) {
        const u8* b = row + 18 * c;
        float d = half_to_float(load_u16(b));
        int sumi = 0;
        UNROLL for (int i = 0; i < 4; ++i) {
            u32 q = load_u32_a2(b + 2 + 4 * i);
            sumi = dot4((int)(q & 0x0f0f0f0fu), x[i], sumi);
            sumi = dot4((int)((q >> 4) & 0x0f0f0f0fu), x[i + 4], sumi);
        }
        return d * (xd * (float)sumi - 8.0f * xs);
    }
};

struct TypeQ4_1 {
    static const int BLOCK_ELEMS = 32, BLOCK_BYTES = 20;
    HD static void dequant(const u8* row, int c, float* v) {
        const u8* b = row + 20 * c;
        float d = half_to_float(load_u16(b)), m = half_to_float(load_u16(b + 2));
        UNROLL for (int i = 0; i < 16; ++i) {
            v[i] = add_rn(mul_rn(d, (float)(b[4 + i] & 15)), m);
            v[i + 16] = add_rn(mul_rn(d, (float)(b[4 + i] >> 4)), m);
        }
    }
    HD static float dot_q8(const u8* row, int c, const int* x, float xd, float xs) {
        const u8* b = row + 20 * c;
        float d = half_to_float(load_u16(b)), m = half_to_float(load_u16(b + 2));
        int sumi = 0;
        UNROLL for (int i = 0; i < 4; ++i) {
            u32 q = load_u32_a4(b + 4 + 4 * i);
            sumi = dot4((int)(q & 0x0f0f0f0fu), x[i], sumi);
            sumi = dot4((int)((q >> 4) & 0x0f0f0f0fu), x[i + 4], sumi);
        }
        return d * (xd * (float)sumi) + m * xs;
    }
};

struct TypeQ5_0 {
    static const int BLOCK_ELEMS = 32, BLOCK_BYTES = 22;
    HD static void dequant(const u8* row, int c, float* v) {
        const u8* b = row + 22 * c;
        float d = half_to_float(load_u16(b));
        u32 qh = load_u32_a2(b + 2);
        UNROLL for (int i = 0; i < 16; ++i) {
            int lo = (b[6 + i] & 15) | (((qh >> i) & 1) << 4);
            int hi = (b[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
            v[i] = mul_rn(d, (float)(lo - 16));
            v[i + 16] = mul_rn(d, (float)(hi - 16));
        }
    }
    HD static float dot_q8(const u8* row, int c, const int* x, float xd, float xs) {
        const u8* b = row + 22 * c;
        float d = half_to_float(load_u16(b));
        u32 qh = load_u32_a2(b + 2);
        int sumi = 0;
        UNROLL for (int i = 0; i < 4; ++i) {
            u32 q = load_u32_a2(b + 6 + 4 * i);
            u32 lo = (q & 0x0f0f0f0fu) | spread_bit4((qh >> (4 * i)) & 15u);
            u32 hi = ((q >> 4) & 0x0f0f0f0fu) | spread_bit4((qh >> (4 * i + 16)) & 15u);
            sumi = dot4((int)lo, x[i], sumi);
            sumi = dot4((int)hi, x[i + 4], sumi);
        }
        return d * (xd * (float)sumi - 16.0f * xs);
    }
};

struct TypeQ5_1 {
    static const int BLOCK_ELEMS = 32, BLOCK_BYTES = 24;
    HD static void dequant(const u8* row, int c, float* v) {
        const u8* b = row + 24 * c;
        float d = half_to_float(load_u16(b)), m = half_to_float(load_u16(b + 2));
        u32 qh = load_u32_a4(b + 4);
        UNROLL for (int i = 0; i < 16; ++i) {
            int lo = (b[8 + i] & 15) | (((qh >> i) & 1) << 4);
            int hi = (b[8 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
            v[i] = add_rn(mul_rn(d, (float)lo), m);
            v[i + 16] = add_rn(mul_rn(d, (float)hi), m);
        }
    }
    HD static float dot_q8(const u8* row, int c, const int* x, float xd, float xs) {
        const u8* b = row + 24 * c;
        float d = half_to_float(load_u16(b)), m = half_to_float(load_u16(b + 2));
        u32 qh = load_u32_a4(b + 4);
        int sumi = 0;
        UNROLL for (int i = 0; i < 4; ++i) {
            u32 q = load_u32_a4(b + 8 + 4 * i);
            u32 lo = (q & 0x0f0f0f0fu) | spread_bit4((qh >> (4 * i)) & 15u);
            u32 hi = ((q >> 4) & 0x0f0f0f0fu) | spread_bit4((qh >> (4 * i + 16)) & 15u);
            sumi = dot4((int)lo, x[i], sumi);
            sumi = dot4((int)hi, x[i + 4], sumi);
        }
        return d * (xd * (float)sumi) + m * xs;
    }
};

// ---- K-quants: chunk c is sub-block s = c % 8 of super-block c / 8 -----------------------

struct TypeQ2_K {
    static const int BLOCK_ELEMS = 256, BLOCK_BYTES = 84;
    HD static void dequant(const u8* row, int c, float* v) {
        const u8* b = row + 84 * (c >> 3);
        int s = c & 7, h = s >> 2, t = s & 3;
        float d = half_to_float(load_u16(b + 80)), dmin = half_to_float(load_u16(b + 82));
        UNROLL for (int g = 0; g < 2; ++g) {
            int sc = b[2 * s + g];
            float dl = mul_rn(d, (float)(sc & 15)), ml = mul_rn(dmin, (float)(sc >> 4));
            UNROLL for (int i = 0; i < 16; ++i) {
                int l = 16 * g + i;
                int q = (b[16 + 32 * h + l] >> (2 * t)) & 3;
                v[l] = sub_rn(mul_rn(dl, (float)q), ml);
            }
        }
    }
    HD static float dot_q8(const u8* row, int c, const int* x, float xd, float xs) {
        const u8* b = row + 84 * (c >> 3);
        int s = c & 7, h = s >> 2, t = s & 3;
        float d = half_to_float(load_u16(b + 80)), dmin = half_to_float(load_u16(b + 82));
        int isum = 0, imin = 0;
        UNROLL for (int g = 0; g < 2; ++g) {
            int sc = b[2 * s + g];
            int sumi = 0, sumx = 0;
            UNROLL for (int i = 0; i < 4; ++i) {
                u32 q = (load_u32_a4(b + 16 + 32 * h + 16 * g + 4 * i) >> (2 * t)) & 0x03030303u;
                sumi = dot4((int)q, x[4 * g + i], sumi);
                sumx = dot4(0x01010101, x[4 * g + i], sumx);
            }
            isum += (sc & 15) * sumi;
            imin += (sc >> 4) * sumx;
        }
        return xd * (d * (float)isum - dmin * (float)imin);
    }
};

struct TypeQ3_K {
    static const int BLOCK_ELEMS = 256, BLOCK_BYTES = 110;
    HD static void dequant(const u8* row, int c, float* v) {
        const u8* b = row + 110 * (c >> 3);
        int s = c & 7, h = s >> 2, t = s & 3;
        float d = half_to_float(load_u16(b + 108));
        UNROLL for (int g = 0; g < 2; ++g) {
            float dl = mul_rn(d, (float)k3_scale(b + 96, 2 * s + g));
            UNROLL for (int i = 0; i < 16; ++i) {
                int l = 16 * g + i;
                int q = (b[32 + 32 * h + l] >> (2 * t)) & 3;
                if (!((b[l] >> (4 * h + t)) & 1)) q -= 4;
                v[l] = mul_rn(dl, (float)q);
            }
        }
    }
    HD static float dot_q8(const u8* row, int c, const int* x, float xd, float xs) {
        const u8* b = row + 110 * (c >> 3);
        int s = c & 7, h = s >> 2, t = s & 3;
        float d = half_to_float(load_u16(b + 108));
        int isum = 0;
        UNROLL for (int g = 0; g < 2; ++g) {
            int sumi = 0;
            UNROLL for (int i = 0; i < 4; ++i) {
                int l = 16 * g + 4 * i;
                u32 q = (load_u32_a2(b + 32 + 32 * h + l) >> (2 * t)) & 0x03030303u;
                u32 low = ((load_u32_a2(b + l) >> (4 * h + t)) & 0x01010101u) ^ 0x01010101u;
                sumi = dot4((int)q, x[4 * g + i], sumi);
                sumi -= 4 * dot4((int)low, x[4 * g + i], 0);
            }
            isum += k3_scale(b + 96, 2 * s + g) * sumi;
        }
        return xd * (d * (float)isum);
    }
};

struct TypeQ4_K {
    static const int BLOCK_ELEMS = 256, BLOCK_BYTES = 144;
    HD static void dequant(const u8* row, int c, float* v) {
        const u8* b = row + 144 * (c >> 3);
        int s = c & 7, sc, m;
        k4_scale_min(b + 4, s, &sc, &m);
        float d = half_to_float(load_u16(b)), dmin = half_to_float(load_u16(b + 2));
        float dl = mul_rn(d, (float)sc), ml = mul_rn(dmin, (float)m);
        const u8* q = b + 16 + 32 * (s >> 1);
        int shift = 4 * (s & 1);
        UNROLL for (int l = 0; l < 32; ++l) v[l] = sub_rn(mul_rn(dl, (float)((q[l] >> shift) & 15)), ml);
    }
    HD static float dot_q8(const u8* row, int c, const int* x, float xd, float xs) {
        const u8* b = row + 144 * (c >> 3);
        int s = c & 7, sc, m;
        k4_scale_min(b + 4, s, &sc, &m);
        float d = half_to_float(load_u16(b)), dmin = half_to_float(load_u16(b + 2));
        const u8* q = b + 16 + 32 * (s >> 1);
        int shift = 4 * (s & 1);
        int sumi = 0;
        UNROLL for (int i = 0; i < 8; ++i) {
            sumi = dot4((int)((load_u32_a4(q + 4 * i) >> shift) & 0x0f0f0f0fu), x[i], sumi);
        }
        return d * (xd * (float)(sc * sumi)) - dmin * ((float)m * xs);
    }
};

struct TypeQ5_K {
    static const int BLOCK_ELEMS = 256, BLOCK_BYTES = 176;
    HD static void dequant(const u8* row, int c, float* v) {
        const u8* b = row + 176 * (c >> 3);
        int s = c & 7, sc, m;
        k4_scale_min(b + 4, s, &sc, &m);
        float d = half_to_float(load_u16(b)), dmin = half_to_float(load_u16(b + 2));
        float dl = mul_rn(d, (float)sc), ml = mul_rn(dmin, (float)m);
        const u8* qh = b + 16;
        const u8* q = b + 48 + 32 * (s >> 1);
        int shift = 4 * (s & 1);
        UNROLL for (int l = 0; l < 32; ++l) {
            int v5 = ((q[l] >> shift) & 15) | (((qh[l] >> s) & 1) << 4);
            v[l] = sub_rn(mul_rn(dl, (float)v5), ml);
        }
    }
    HD static float dot_q8(const u8* row, int c, const int* x, float xd, float xs) {
        const u8* b = row + 176 * (c >> 3);
        int s = c & 7, sc, m;
        k4_scale_min(b + 4, s, &sc, &m);
        float d = half_to_float(load_u16(b)), dmin = half_to_float(load_u16(b + 2));
        const u8* qh = b + 16;
        const u8* q = b + 48 + 32 * (s >> 1);
        int shift = 4 * (s & 1);
        int sumi = 0;
        UNROLL for (int i = 0; i < 8; ++i) {
            u32 lo = (load_u32_a4(q + 4 * i) >> shift) & 0x0f0f0f0fu;
            u32 hi = ((load_u32_a4(qh + 4 * i) >> s) & 0x01010101u) << 4;
            sumi = dot4((int)(lo | hi), x[i], sumi);
        }
        return d * (xd * (float)(sc * sumi)) - dmin * ((float)m * xs);
    }
};

struct TypeQ6_K {
    static const int BLOCK_ELEMS = 256, BLOCK_BYTES = 210;
    HD static void dequant(const u8* row, int c, float* v) {
        const u8* b = row + 210 * (c >> 3);
        int s = c & 7, h = s >> 2, t = s & 3;
        float d = half_to_float(load_u16(b + 208));
        const u8* ql = b + 64 * h + 32 * (t & 1);
        const u8* qh = b + 128 + 32 * h;
        int lshift = 4 * (t >> 1), hshift = 2 * t;
        UNROLL for (int g = 0; g < 2; ++g) {
            float dl = mul_rn(d, (float)(i8)b[192 + 2 * s + g]);
            UNROLL for (int i = 0; i < 16; ++i) {
                int l = 16 * g + i;
                int q = (((ql[l] >> lshift) & 15) | (((qh[l] >> hshift) & 3) << 4)) - 32;
                v[l] = mul_rn(dl, (float)q);
            }
        }
    }
    HD static float dot_q8(const u8* row, int c, const int* x, float xd, float xs) {
        const u8* b = row + 210 * (c >> 3);
        int s = c & 7, h = s >> 2, t = s & 3;
        float d = half_to_float(load_u16(b + 208));
        const u8* ql = b + 64 * h + 32 * (t & 1);
        const u8* qh = b + 128 + 32 * h;
        int lshift = 4 * (t >> 1), hshift = 2 * t;
        int isum = 0;
        UNROLL for (int g = 0; g < 2; ++g) {
            int sumi = 0, sumx = 0;
            UNROLL for (int i = 0; i < 4; ++i) {
                int l = 16 * g + 4 * i;
                u32 lo = (load_u32_a2(ql + l) >> lshift) & 0x0f0f0f0fu;
                u32 hi = ((load_u32_a2(qh + l) >> hshift) & 0x03030303u) << 4;
                sumi = dot4((int)(lo | hi), x[4 * g + i], sumi);
                sumx = dot4(0x01010101, x[4 * g + i], sumx);
            }
            isum += (int)(i8)b[192 + 2 * s + g] * (sumi - 32 * sumx);
        }
        return xd * (d * (float)isum);
    }
};

// ---- non-linear 4-bit values: a nibble indexes a table of 16 signed values ------------------

struct TypeIQ4_NL {
    static const int BLOCK_ELEMS = 32, BLOCK_BYTES = 18;
    HD static void dequant(const u8* row, int c, float* v) {
        const u8* b = row + 18 * c;
        float d = half_to_float(load_u16(b));
        UNROLL for (int i = 0; i < 16; ++i) {
            v[i] = mul_rn(d, (float)iq4_value(b[2 + i] & 15));
            v[i + 16] = mul_rn(d, (float)iq4_value(b[2 + i] >> 4));
        }
    }
    HD static float dot_q8(const u8* row, int c, const int* x, float xd, float xs) {
        const u8* b = row + 18 * c;
        float d = half_to_float(load_u16(b));
        int sumi = 0;
        UNROLL for (int i = 0; i < 4; ++i) {
            u32 q = load_u32_a2(b + 2 + 4 * i);
            sumi = dot4((int)iq4_values4(q & 0x0f0f0f0fu), x[i], sumi);
            sumi = dot4((int)iq4_values4((q >> 4) & 0x0f0f0f0fu), x[i + 4], sumi);
        }
        return d * (xd * (float)sumi);
    }
};

// Chunk c is sub-block s = c % 8 of super-block c / 8, as for the K-quants.
struct TypeIQ4_XS {
    static const int BLOCK_ELEMS = 256, BLOCK_BYTES = 136;
    HD static void dequant(const u8* row, int c, float* v) {
        const u8* b = row + 136 * (c >> 3);
        int s = c & 7;
        float d = half_to_float(load_u16(b));
        float dl = mul_rn(d, (float)iq4xs_scale(b, s));
        const u8* q = b + 8 + 16 * s;
        UNROLL for (int i = 0; i < 16; ++i) {
            v[i] = mul_rn(dl, (float)iq4_value(q[i] & 15));
            v[i + 16] = mul_rn(dl, (float)iq4_value(q[i] >> 4));
        }
    }
    // |scale * sumi| <= 32 * 32 * 127 * 127 < 2^24: the int and its float are exact.
    HD static float dot_q8(const u8* row, int c, const int* x, float xd, float xs) {
        const u8* b = row + 136 * (c >> 3);
        int s = c & 7;
        float d = half_to_float(load_u16(b));
        const u8* q = b + 8 + 16 * s;
        int sumi = 0;
        UNROLL for (int i = 0; i < 4; ++i) {
            u32 w = load_u32_a4(q + 4 * i);
            sumi = dot4((int)iq4_values4(w & 0x0f0f0f0fu), x[i], sumi);
            sumi = dot4((int)iq4_values4((w >> 4) & 0x0f0f0f0fu), x[i + 4], sumi);
        }
        return d * (xd * (float)(iq4xs_scale(b, s) * sumi));
    }
};
