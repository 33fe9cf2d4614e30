/* One paged K or V pool as the C kernels read it, and the one decoder of its stored vectors:
 * element codes -> fp32, then group scale, zero point and tensor scale, the same bits as the
 * torch reference (kvtune/kernels/formats/quantize.py's dequantize_ref). Included by
 * read_blocks.c and decode_attention.c; kvtune/kernels/native/pool_codes.py fills PoolCodes
 * from a KVPool (kvtune/kernels/cache/pool.py) and picks each format's decode by checking it
 * against the format's own decode of every byte. */
#ifndef KVTUNE_POOL_CODES_H
#define KVTUNE_POOL_CODES_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>
#define HAVE_F16C 1 /* eight halves to floats in one instruction (x86) */
#endif

/* How a vector's elements decode. Arithmetic where it gives the format's values (vectorized),
 * else a table of every byte's values; the unquantized formats are their own values. */
enum {
  DECODE_NIBBLES = 0,      /* unsigned 4-bit codes, element 2i in the low nibble */
  DECODE_BYTES = 1,        /* unsigned bytes */
  DECODE_TABLE = 2,        /* decode_table[byte * per_byte + j] */
  DECODE_SIGNED_BYTES = 3, /* two's complement bytes */
  DECODE_E4M3 = 4,         /* FP8 E4M3 (no infinities; 0x7f and 0xff are NaN) */
  DECODE_E2M1 = 5,         /* FP4 E2M1 nibbles, element 2i in the low nibble */
  DECODE_FP16 = 6,         /* unquantized: IEEE binary16 values */
  DECODE_BF16 = 7,         /* unquantized: bfloat16 values */
  DECODE_FP32 = 8,         /* unquantized: fp32 values */
  DECODE_PACKED = 9,       /* codes across byte boundaries: eight `bits`-bit codes in `bits`
                              bytes, code j at bit j x bits of their little-endian word;
                              decode_table[code] (3-bit and 5-bit codes) */
};
enum { SCALE_FP16 = 0, SCALE_FP32 = 1, SCALE_TABLE = 2 };
#define MAX_GROUPS 512

typedef struct {
  const uint8_t *codes;            /* [num_blocks, block_size, heads, code bytes] */
  int64_t num_blocks, code_block, code_token, code_head; /* strides in bytes */
  int64_t block_size, heads, head_dim;
  int32_t decode;                  /* DECODE_* */
  int32_t per_byte;                /* codes a byte holds (DECODE_TABLE) */
  int32_t bits;                    /* bits a code takes (DECODE_PACKED) */
  const float *decode_table;       /* [256, per_byte]: the values of every byte (DECODE_TABLE);
                                      [2^bits]: the value of every code (DECODE_PACKED) */
  const float *code_table;         /* [32]: the value of every code of 2 to 5 bits (zeros
                                      after 2^bits), or NULL: the vector decode of such codes */
  const uint8_t *scales;           /* [num_blocks, block_size / rows, heads, groups (+ groups)] */
  int64_t scale_block, scale_row, scale_head; /* strides in bytes */
  int32_t scale_kind;              /* SCALE_*: how a stored scale reads */
  const float *scale_table;        /* [256]: the value of every scale byte (SCALE_TABLE) */
  int32_t rows;                    /* consecutive tokens a scale row serves */
  int32_t groups;                  /* group scales a vector has; 0: none (per tensor, fp16...) */
  int32_t zero_point;              /* a zero point follows each row's group scales */
  float tensor_scale;              /* multiplies every value (1 where the format takes none) */
} PoolCodes;

/* A vector's group scales [groups] then zero points [groups] (0 where the format keeps none):
 * the parameters of one scale row. */
typedef struct {
  float values[2 * MAX_GROUPS];
} RowScales;

/* The decoders below build fp32 bit patterns with integer operations and choose between them
 * by masks, without branches, so that a vector's loop compiles to vector instructions; no fp32
 * subnormal is formed (no slow path). Each is exact. */
static inline float bits_to_float(uint32_t bits) {
  float value;
  memcpy(&value, &bits, 4);
  return value;
}

static inline uint32_t float_bits(float value) {
  uint32_t bits;
  memcpy(&bits, &value, 4);
  return bits;
}

/* a where mask is all ones, b where it is 0. */
static inline uint32_t select_bits(uint32_t mask, uint32_t a, uint32_t b) {
  return (a & mask) | (b & ~mask);
}

static inline uint32_t mask_of(uint32_t condition) { return -(uint32_t)(condition != 0); }

/* IEEE binary16 bits -> float: normals rebiased, subnormals mantissa x 2^-24, infinities and
 * NaN kept. */
static inline float half_to_float(uint32_t half) {
  const uint32_t sign = (half & 0x8000u) << 16, magnitude = half & 0x7fffu;
  const uint32_t exponent = magnitude >> 10;
  const uint32_t normal = (magnitude << 13) + (112u << 23);
  const uint32_t special = (magnitude << 13) | 0x7f800000u;
  const uint32_t small = float_bits((float)(int32_t)magnitude * 0x1p-24f);
  const uint32_t bits = select_bits(mask_of(exponent == 0), small,
                                    select_bits(mask_of(exponent == 31), special, normal));
  return bits_to_float(sign | bits);
}

static inline float half_at(const uint8_t *bytes) {
  uint16_t half;
  memcpy(&half, bytes, 2);
  return half_to_float(half);
}

/* FP8 E4M3 -> float (no infinities; 0x7f and 0xff are NaN): normals rebiased, subnormals
 * mantissa x 2^-9. */
static inline float e4m3_to_float(uint32_t code) {
  const uint32_t magnitude = code & 0x7fu, sign = (code & 0x80u) << 24;
  const uint32_t normal = (magnitude << 20) + (120u << 23);
  const uint32_t small = float_bits((float)(int32_t)(magnitude & 7u) * 0x1p-9f);
  const uint32_t bits = sign | select_bits(mask_of(magnitude >> 3), normal, small);
  return bits_to_float(select_bits(mask_of(magnitude == 0x7fu), 0x7fc00000u, bits));
}

/* FP4 E2M1 nibble -> float: normals rebiased, the subnormal 0.5 x mantissa. */
static inline float e2m1_to_float(uint32_t nibble) {
  const uint32_t magnitude = nibble & 7u, sign = (nibble & 8u) << 28;
  const uint32_t normal = (magnitude << 22) + (126u << 23);
  const uint32_t small = float_bits((float)(int32_t)(magnitude & 1u) * 0.5f);
  return bits_to_float(sign | select_bits(mask_of(magnitude >> 1), normal, small));
}

/* The bytes of the codes of (block id, token, head), and of its scale row. */
static inline const uint8_t *code_row(const PoolCodes *p, int64_t id, int64_t token,
                                      int64_t head) {
  return p->codes + id * p->code_block + token * p->code_token + head * p->code_head;
}

/* The parameters of the scale row that serves token `token` of block id, head `head`. */
static inline void load_row_scales(const PoolCodes *p, int64_t id, int64_t token, int64_t head,
                                   RowScales *row) {
  const int64_t groups = p->groups, stored = p->zero_point ? 2 * groups : groups;
  const int64_t scale_row = p->rows == 1 ? token : token / p->rows; /* no division per token */
  const uint8_t *src = p->scales + id * p->scale_block + scale_row * p->scale_row +
                       head * p->scale_head;
  float *values = row->values;
  if (p->scale_kind == SCALE_FP16) {
#ifdef HAVE_F16C
    for (int64_t i = 0; i < stored; i++) { /* one instruction a scale, where half_at takes ten */
      uint16_t half;
      memcpy(&half, src + 2 * i, 2);
      values[i] = _cvtsh_ss(half);
    }
#else
    for (int64_t i = 0; i < stored; i++) values[i] = half_at(src + 2 * i);
#endif
  } else if (p->scale_kind == SCALE_FP32) {
    memcpy(values, src, 4 * stored);
  } else {
    for (int64_t i = 0; i < stored; i++) values[i] = p->scale_table[src[i]];
  }
}

#ifdef HAVE_F16C
/* Codes of 2 to 5 bits looked up in p->code_table, eight at a time: eight codes lie in `bits`
 * bytes, code j at bit j x bits of their little-endian word (the layout of nibbles and of
 * 2-bit codes as well), so shifting that word by j x bits in lane j gives the codes, and a
 * permute per eight table entries their values. */
static inline void decode_small_codes(const PoolCodes *p, const uint8_t *src, float *dst) {
  const int32_t bits = p->bits;
  const float *table = p->code_table;
  const __m256 t0 = _mm256_loadu_ps(table), t1 = _mm256_loadu_ps(table + 8);
  const __m256 t2 = _mm256_loadu_ps(table + 16), t3 = _mm256_loadu_ps(table + 24);
  const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
  /* 5-bit codes span 40 bits: codes 6 and 7 come from the word of bytes 1-4. */
  const __m256i shifts =
      bits == 5 ? _mm256_setr_epi32(0, 5, 10, 15, 20, 25, 22, 27)
                : _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                     _mm256_set1_epi32(bits));
  for (int64_t i = 0; i < p->head_dim / 8; i++) {
    const uint8_t *chunk = src + i * bits;
    /* Whole-width loads assembled in registers: bytes copied into part of a word in memory
     * and read back as the word stall the load (no store forwarding). */
    uint16_t pair;
    memcpy(&pair, chunk, 2);
    uint32_t low = pair, high = 0;
    if (bits == 3) low |= (uint32_t)chunk[2] << 16;
    if (bits >= 4) memcpy(&low, chunk, 4);
    if (bits == 5) memcpy(&high, chunk + 1, 4);
    const __m256i words = bits == 5 ? _mm256_setr_epi32(low, low, low, low, low, low, high, high)
                                    : _mm256_set1_epi32(low);
    const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(words, shifts), mask);
    /* A permute reads an index's low 3 bits; bits 3 and 4 choose among the table's eights. */
    const __m256 bit3 = _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28));
    __m256 values = _mm256_permutevar8x32_ps(t0, codes);
    if (bits >= 4)
      values = _mm256_blendv_ps(values, _mm256_permutevar8x32_ps(t1, codes), bit3);
    if (bits == 5) {
      const __m256 upper = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t2, codes),
                                            _mm256_permutevar8x32_ps(t3, codes), bit3);
      values = _mm256_blendv_ps(values, upper, _mm256_castsi256_ps(_mm256_slli_epi32(codes, 27)));
    }
    _mm256_storeu_ps(dst + 8 * i, values);
  }
}
#endif

/* Element codes -> their code values (quantized) or values (unquantized). */
static inline void decode_elements(const PoolCodes *p, const uint8_t *src, float *dst) {
  const int64_t dim = p->head_dim;
#ifdef HAVE_F16C
  if (p->code_table && dim % 8 == 0) {
    decode_small_codes(p, src, dst);
    return;
  }
#endif
  switch (p->decode) {
    case DECODE_NIBBLES:
      for (int64_t i = 0; i < dim / 2; i++) {
        dst[2 * i] = (float)(src[i] & 15);
        dst[2 * i + 1] = (float)(src[i] >> 4);
      }
      break;
    case DECODE_BYTES:
      for (int64_t i = 0; i < dim; i++) dst[i] = (float)src[i];
      break;
    case DECODE_SIGNED_BYTES:
      for (int64_t i = 0; i < dim; i++) dst[i] = (float)(int8_t)src[i];
      break;
    case DECODE_E4M3:
#ifdef HAVE_F16C
      if (dim % 8 == 0) { /* E4M3 bits shifted into a half are the value x 2^-8 (exact) */
        for (int64_t i = 0; i < dim; i += 8) {
          const __m128i codes = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(src + i)));
          const __m128i magnitude = _mm_and_si128(codes, _mm_set1_epi16(0x7f));
          const __m128i sign = _mm_slli_epi16(_mm_and_si128(codes, _mm_set1_epi16(0x80)), 8);
          /* The NaN codes (magnitude 0x7f) shift to a nonzero mantissa: all-ones exponent
           * bits make that half a NaN, before the conversion rather than a blend after it. */
          const __m128i nan = _mm_and_si128(_mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7f)),
                                            _mm_set1_epi16(0x7c00));
          const __m128i half = _mm_or_si128(_mm_or_si128(sign, _mm_slli_epi16(magnitude, 7)), nan);
          _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0f)));
        }
        break;
      }
#endif
      for (int64_t i = 0; i < dim; i++) dst[i] = e4m3_to_float(src[i]);
      break;
    case DECODE_E2M1:
      for (int64_t i = 0; i < dim / 2; i++) {
        dst[2 * i] = e2m1_to_float(src[i] & 15u);
        dst[2 * i + 1] = e2m1_to_float(src[i] >> 4);
      }
      break;
    case DECODE_FP16:
#ifdef HAVE_F16C
      if (dim % 8 == 0) {
        for (int64_t i = 0; i < dim; i += 8) {
          const __m128i halves = _mm_loadu_si128((const __m128i *)(src + 2 * i));
          _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(halves));
        }
        break;
      }
#endif
      for (int64_t i = 0; i < dim; i++) dst[i] = half_at(src + 2 * i);
      break;
    case DECODE_BF16:
      for (int64_t i = 0; i < dim; i++) {
        uint16_t half;
        memcpy(&half, src + 2 * i, 2);
        dst[i] = bits_to_float((uint32_t)half << 16);
      }
      break;
    case DECODE_FP32:
      memcpy(dst, src, 4 * dim);
      break;
    case DECODE_PACKED: {
      const int64_t bits = p->bits;
      const uint64_t mask = (1u << bits) - 1;
      for (int64_t i = 0; i < dim / 8; i++) {
        uint64_t word = 0;
        memcpy(&word, src + i * bits, bits); /* little-endian hosts (x86, ARM) */
        for (int64_t j = 0; j < 8; j++) dst[8 * i + j] = p->decode_table[(word >> (j * bits)) & mask];
      }
      break;
    }
    default: {
      const int64_t per_byte = p->per_byte;
      for (int64_t i = 0; i < dim / per_byte; i++)
        for (int64_t j = 0; j < per_byte; j++)
          dst[i * per_byte + j] = p->decode_table[src[i] * per_byte + j];
    }
  }
}

/* One stored vector: (code * scale + zero) * tensor scale, rounded after each operation as the
 * torch reference rounds it (built without contracting into fused multiply-adds), in passes
 * over the vector that take vector instructions; code * tensor scale without group scales (a
 * tensor scale of 1 is skipped: exact either way). row: the vector's scale row (unused
 * without group scales). */
static inline void decode_vector(const PoolCodes *p, const uint8_t *src, const RowScales *row,
                                 float *dst) {
  decode_elements(p, src, dst);
  const int64_t dim = p->head_dim;
  const float tensor_scale = p->tensor_scale;
  if (p->groups == 0) {
    if (tensor_scale != 1.0f)
      for (int64_t c = 0; c < dim; c++) dst[c] *= tensor_scale;
    return;
  }
  const float *scale = row->values, *zero = row->values + p->groups;
  const int64_t width = dim / p->groups;
  if (width == 1) {
    for (int64_t c = 0; c < dim; c++) dst[c] *= scale[c];
  } else {
    for (int64_t g = 0; g < p->groups; g++)
      for (int64_t c = 0; c < width; c++) dst[g * width + c] *= scale[g];
  }
  /* The reference adds no zero point where the format keeps none (adding 0 would turn -0 into
   * +0), and multiplies by the tensor scale only where there is one. */
  if (p->zero_point) {
    if (width == 1) {
      for (int64_t c = 0; c < dim; c++) dst[c] += zero[c];
    } else {
      for (int64_t g = 0; g < p->groups; g++)
        for (int64_t c = 0; c < width; c++) dst[g * width + c] += zero[g];
    }
  }
  if (tensor_scale != 1.0f)
    for (int64_t c = 0; c < dim; c++) dst[c] *= tensor_scale;
}

#endif
