/* Decode attention over every stream of a step in one pass on a CPU: a tile of stored keys is
 * decoded from its codes into a stack buffer (pool_codes.h), dotted with the query heads of its
 * KV head and folded into an online softmax, then its values likewise, where the torch path
 * first writes the whole cache out as fp32 and then runs SDPA over it. Driven by
 * kvtune/kernels/native/decode_attention.py, which checks every argument first.
 *
 * Work: one item per (sequence, split), a split being a run of `split_blocks` of the
 * sequence's blocks (its streams' blocks in stream order) read for every KV head, each item's
 * partial (max, sum, unnormalized output per query head) merged in split order. A sequence's splits and every
 * sum's order depend on that sequence alone, so its output has the same bits whatever else the
 * batch holds and however the threads share the items. */
#include <stdlib.h>

#include "pool_codes.h"

#define MAX_GROUP 16 /* query heads a KV head serves */
#define MAX_DIM 512
#define TILE 32 /* tokens whose logits are taken before the running sums are rescaled */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2_FMA 1
#endif

typedef struct {
  PoolCodes k, v;
  const int32_t *table;            /* [seqs, >= blocks used] block ids, rows table_stride apart */
  int64_t table_stride;
  const int32_t *lengths;          /* [seqs]: vectors each sequence stores here */
  const uint8_t *query_mask;       /* bool [seqs, heads, mask_len] (strides in bytes), or NULL */
  int64_t mask_seq, mask_head, mask_len;
  float logit_bias;                /* added to every logit of the stream */
} DecodeStream;

typedef struct {
  const float *q;                  /* [seqs, kv_heads * group, head_dim], channels contiguous */
  int64_t q_seq, q_head;
  int64_t seqs, kv_heads, group, head_dim;
  float scale;                     /* logits are q . k x scale + the stream's bias */
  int64_t split_blocks;            /* blocks of a sequence one work item reads */
  float *out;                      /* [seqs, kv_heads * group, head_dim], channels contiguous */
  int64_t out_seq, out_head;
} DecodeArgs;

static int64_t blocks_used(const DecodeStream *stream, int64_t seq) {
  const int64_t length = stream->lengths[seq], block_size = stream->k.block_size;
  return length > 0 ? (length + block_size - 1) / block_size : 0;
}

/* a * b + c, rounded once where the CPU fuses them. The build contracts nothing by itself
 * (pool_codes.h's decoders keep the torch reference's rounding); the attention sums below are
 * not bit-matched to anything and take the fused operation where there is one. */
#ifdef __FMA__
#define MADD(a, b, c) fmaf((a), (b), (c))
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

/* The logits' dot products of a tile: out[j] = q . rows[j] for j < count, rows head_dim
 * apart (rows up to count rounded up to 4 are readable). In vector registers with fused
 * multiply-adds where the CPU has them (four rows at a time, their sums reduced together),
 * else in sixteen lanes the compiler may vectorize. */
static void tile_dots(const float *restrict q, const float *restrict rows, int64_t dim,
                      int64_t count, float *restrict out) {
#ifdef HAVE_AVX2_FMA
  if (dim % 8 == 0) {
    for (int64_t j = 0; j < count; j += 4) {
      const float *r = rows + j * dim;
      __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
      __m256 s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
      for (int64_t c = 0; c < dim; c += 8) {
        const __m256 qc = _mm256_loadu_ps(q + c);
        s0 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(r + c), s0);
        s1 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(r + dim + c), s1);
        s2 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(r + 2 * dim + c), s2);
        s3 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(r + 3 * dim + c), s3);
      }
      /* hadd pairs rows within each 128-bit half; the halves then add: the four sums. */
      const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
      const __m128 sums =
          _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
      float four[4];
      _mm_storeu_ps(four, sums);
      for (int64_t i = 0; i < 4 && j + i < count; i++) out[j + i] = four[i];
    }
    return;
  }
#endif
  for (int64_t j = 0; j < count; j++) {
    const float *key = rows + j * dim;
    float lanes[16] = {0};
    int64_t c = 0;
    for (; c + 16 <= dim; c += 16)
      for (int64_t l = 0; l < 16; l++) lanes[l] = MADD(q[c + l], key[c + l], lanes[l]);
    for (int64_t l = 0; l < 8; l++) lanes[l] += lanes[l + 8];
    for (int64_t l = 0; l < 4; l++) lanes[l] += lanes[l + 4];
    float sum = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
    for (; c < dim; c++) sum = MADD(q[c], key[c], sum);
    out[j] = sum;
  }
}

/* acc[c] += sum over j < count of weights[j] x rows[j][c], rows head_dim apart: 64 (or 8)
 * channels at a time held in vector registers over the whole tile where the CPU has fused
 * multiply-adds. */
static void tile_weighted_sum(const float *restrict weights, const float *restrict rows,
                              int64_t dim, int64_t count, float *restrict acc) {
  int64_t c0 = 0;
#ifdef HAVE_AVX2_FMA
  for (; c0 + 64 <= dim; c0 += 64) {
    __m256 sums[8];
    for (int i = 0; i < 8; i++) sums[i] = _mm256_loadu_ps(acc + c0 + 8 * i);
    for (int64_t j = 0; j < count; j++) {
      const __m256 weight = _mm256_set1_ps(weights[j]);
      const float *row = rows + j * dim + c0;
      for (int i = 0; i < 8; i++)
        sums[i] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(row + 8 * i), sums[i]);
    }
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + c0 + 8 * i, sums[i]);
  }
  for (; c0 + 8 <= dim; c0 += 8) {
    __m256 sum = _mm256_loadu_ps(acc + c0);
    for (int64_t j = 0; j < count; j++)
      sum = _mm256_fmadd_ps(_mm256_set1_ps(weights[j]), _mm256_loadu_ps(rows + j * dim + c0), sum);
    _mm256_storeu_ps(acc + c0, sum);
  }
#endif
  for (int64_t j = 0; j < count; j++)
    for (int64_t c = c0; c < dim; c++) acc[c] = MADD(weights[j], rows[j * dim + c], acc[c]);
}

/* e^x for a logit minus the running maximum (x <= 0; -inf gives 0), within a few fp32 ulps:
 * x = n ln 2 + r, e^r by Cephes' expf polynomial, 2^n by the exponent bits. Below -87
 * (weights under 2^-126 of the largest) it gives 0. Eight at a time in vector registers where
 * the CPU has them: a tile's weights, where expf is one call a weight. */
#define EXP_FLOOR -87.0f
#define EXP_SHIFTER 12582912.0f /* 1.5 x 2^23: adding it rounds to an integer */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HIGH -0.693359375f
#define EXP_LN2_LOW 2.12194440e-4f
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_nonpositive(float x) {
  const float clamped = x < EXP_FLOOR ? EXP_FLOOR : x;
  const float n = (clamped * EXP_LOG2E + EXP_SHIFTER) - EXP_SHIFTER;
  const float r = MADD(n, EXP_LN2_LOW, MADD(n, EXP_LN2_HIGH, clamped));
  float p = EXP_POLY[0];
  for (int i = 1; i < 6; i++) p = MADD(p, r, EXP_POLY[i]);
  p = MADD(p, r * r, r) + 1.0f;
  const uint32_t power_bits = (uint32_t)((int32_t)n + 127) << 23;
  float power;
  memcpy(&power, &power_bits, 4);
  return x < EXP_FLOOR ? 0.0f : p * power;
}

/* values[j] = exp_nonpositive(values[j] - max) for j < count; returns their sum. */
static float tile_exp(float *values, int64_t count, float max) {
  int64_t j = 0;
  float sum = 0.0f;
#ifdef HAVE_AVX2_FMA
  __m256 sums = _mm256_setzero_ps();
  for (; j + 8 <= count; j += 8) {
    const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(values + j), _mm256_set1_ps(max));
    const __m256 floor = _mm256_set1_ps(EXP_FLOOR), shifter = _mm256_set1_ps(EXP_SHIFTER);
    const __m256 clamped = _mm256_max_ps(x, floor);
    const __m256 n = _mm256_sub_ps(
        _mm256_add_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(EXP_LOG2E)), shifter), shifter);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(EXP_LN2_HIGH), clamped);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(EXP_LN2_LOW), r);
    __m256 p = _mm256_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[i]));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i power = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 weight = _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(power)),
                                        _mm256_cmp_ps(x, floor, _CMP_GE_OQ));
    _mm256_storeu_ps(values + j, weight);
    sums = _mm256_add_ps(sums, weight);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, sums);
  sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
#endif
  for (; j < count; j++) {
    values[j] = exp_nonpositive(values[j] - max);
    sum += values[j];
  }
  return sum;
}

/* A work item keeps, per query head, its running softmax in one row of its partial
 * (STATE_WIDTH(head_dim) floats): the largest logit so far, the sum of exp(logit - max), and
 * the output weighted likewise. */
#define STATE_WIDTH(dim) ((dim) + 2)

/* Decode the vectors [first, first + count) of block id of one pool into rows of `rows`
 * (head_dim apart); a hidden vector's row, and those after count up to a multiple of 4, are 0,
 * so that a weight of 0 adds nothing whatever a slot holds. */
static void decode_tile(const PoolCodes *pool, int64_t id, int64_t head, int64_t first,
                        int64_t count, const uint8_t *shown, float *rows) {
  const int64_t dim = pool->head_dim;
  RowScales scales;
  int64_t scale_row = -1;
  for (int64_t j = 0; j < count; j++) {
    float *row = rows + j * dim;
    if (!shown[j]) {
      memset(row, 0, sizeof(float) * dim);
      continue;
    }
    const int64_t t = first + j, t_row = pool->rows == 1 ? t : t / pool->rows;
    if (pool->groups && t_row != scale_row) {
      scale_row = t_row;
      load_row_scales(pool, id, t, head, &scales);
    }
    decode_vector(pool, code_row(pool, id, t, head), &scales, row);
  }
  memset(rows + count * dim, 0, sizeof(float) * dim * ((4 - count % 4) % 4));
}

/* Fold the vectors [first, first + count) of block `b` (pool block id) of a stream into the
 * running softmax of KV head `head`'s query heads (state: their rows, STATE_WIDTH apart): the
 * tile's keys decoded, every query head's logits and its weights against the new running
 * maximum, then the tile's values decoded and added under those weights. */
static void attend_tile(const DecodeArgs *a, const DecodeStream *stream, int64_t seq, int64_t head,
                        int64_t b, int64_t id, int64_t first, int64_t count, float *state) {
  const int64_t group = a->group, dim = a->head_dim;
  const float *queries = a->q + seq * a->q_seq + head * group * a->q_head;
  const uint8_t *mask = stream->query_mask
                            ? stream->query_mask + seq * stream->mask_seq + head * stream->mask_head
                            : NULL;
  float weights[MAX_GROUP][TILE];
  uint8_t shown[TILE];
  float rows[(TILE + 3) * MAX_DIM];
  int64_t visible = 0;
  for (int64_t j = 0; j < count; j++) {
    const int64_t position = b * stream->k.block_size + first + j;
    shown[j] = !mask || (position < stream->mask_len && mask[position]);
    visible += shown[j];
  }
  if (!visible) return;
  decode_tile(&stream->k, id, head, first, count, shown, rows);
  for (int64_t g = 0; g < group; g++) {
    float *running = state + g * STATE_WIDTH(dim), *acc = running + 2, *logits = weights[g];
    tile_dots(queries + g * a->q_head, rows, dim, count, logits);
    float tile_max = -INFINITY;
    for (int64_t j = 0; j < count; j++) {
      logits[j] = shown[j] ? logits[j] * a->scale + stream->logit_bias : -INFINITY;
      if (logits[j] > tile_max) tile_max = logits[j];
    }
    const float new_max = running[0] > tile_max ? running[0] : tile_max;
    if (new_max == -INFINITY) { /* every logit -inf: nothing to add yet */
      memset(logits, 0, sizeof(float) * count);
      continue;
    }
    const float alpha = expf(running[0] - new_max);
    if (alpha != 1.0f) {
      running[1] *= alpha;
      for (int64_t c = 0; c < dim; c++) acc[c] *= alpha;
    }
    running[1] += tile_exp(logits, count, new_max);
    running[0] = new_max;
  }
  decode_tile(&stream->v, id, head, first, count, shown, rows);
  for (int64_t g = 0; g < group; g++)
    tile_weighted_sum(weights[g], rows, dim, count, state + g * STATE_WIDTH(dim) + 2);
}

/* Ask for a block's codes before they are read: blocks lie anywhere in the pool, and the
 * CPU's own prefetchers lose the run at every jump. A block's codes are one run of bytes
 * (tokens, then heads). */
static void prefetch_block(const DecodeStream *stream, int64_t id) {
#ifdef __GNUC__
  const PoolCodes *pools[2] = {&stream->k, &stream->v};
  for (int p = 0; p < 2; p++) {
    const PoolCodes *pool = pools[p];
    const uint8_t *codes = code_row(pool, id, 0, 0);
    const int64_t bytes = pool->block_size * pool->code_token;
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(codes + offset);
  }
#else
  (void)stream, (void)id;
#endif
}

/* The partial of one work item: blocks [first, last) of the sequence's blocks in stream
 * order, every KV head of each block in turn (a block's heads lie together in memory),
 * written as [query head][max, sum, output[head_dim]]. */
static void attend_split(const DecodeArgs *a, const DecodeStream *streams, int64_t num_streams,
                         int64_t seq, int64_t first, int64_t last, float *partial) {
  const int64_t group = a->group, dim = a->head_dim;
  for (int64_t h = 0; h < a->kv_heads * group; h++) {
    float *running = partial + h * STATE_WIDTH(dim);
    running[0] = -INFINITY;
    running[1] = 0.0f;
    memset(running + 2, 0, sizeof(float) * dim);
  }
  int64_t index = 0; /* the sequence's blocks before this stream's */
  for (int64_t i = 0; i < num_streams && index < last; i++) {
    const DecodeStream *stream = &streams[i];
    const int64_t used = blocks_used(stream, seq), length = stream->lengths[seq];
    const int64_t block_size = stream->k.block_size;
    const int64_t begin = first > index ? first - index : 0;
    const int64_t end = last - index < used ? last - index : used;
    const int32_t *ids = stream->table + seq * stream->table_stride;
    for (int64_t b = begin; b < end; b++) {
      const int64_t id = ids[b];
      if (b + 1 < end) prefetch_block(stream, ids[b + 1]);
      const int64_t tokens = length - b * block_size < block_size ? length - b * block_size
                                                                   : block_size;
      for (int64_t head = 0; head < a->kv_heads; head++)
        for (int64_t t = 0; t < tokens; t += TILE)
          attend_tile(a, stream, seq, head, b, id, t, tokens - t < TILE ? tokens - t : TILE,
                      partial + head * group * STATE_WIDTH(dim));
    }
    index += used;
  }
}

/* The output of one sequence: its splits' partials merged in split order, query head by
 * query head; 0 for a query head that sees no vector. */
static void merge_splits(const DecodeArgs *a, const float *partials, int64_t splits,
                         int64_t seq) {
  const int64_t heads = a->kv_heads * a->group, dim = a->head_dim;
  const int64_t width = heads * STATE_WIDTH(dim);
  for (int64_t h = 0; h < heads; h++) {
    float *out = a->out + seq * a->out_seq + h * a->out_head;
    float max = -INFINITY;
    for (int64_t p = 0; p < splits; p++) {
      const float part_max = partials[p * width + h * STATE_WIDTH(dim)];
      if (part_max > max) max = part_max;
    }
    float sum = 0.0f;
    memset(out, 0, sizeof(float) * dim);
    if (max == -INFINITY) continue;
    for (int64_t p = 0; p < splits; p++) {
      const float *row = partials + p * width + h * STATE_WIDTH(dim);
      if (row[0] == -INFINITY) continue;
      const float weight = expf(row[0] - max);
      sum += row[1] * weight;
      for (int64_t c = 0; c < dim; c++) out[c] += row[2 + c] * weight;
    }
    if (sum > 0.0f)
      for (int64_t c = 0; c < dim; c++) out[c] /= sum;
  }
}

/* 0; 1 when a block id a sequence reads lies outside its pool (nothing is written then);
 * 2 when the work's partials cannot be allocated. */
int kvtune_decode_attention(const DecodeArgs *a, const DecodeStream *streams,
                            int64_t num_streams) {
  if (a->group > MAX_GROUP || a->head_dim > MAX_DIM) return 1;
  for (int64_t i = 0; i < num_streams; i++)
    for (int64_t s = 0; s < a->seqs; s++)
      for (int64_t b = 0; b < blocks_used(&streams[i], s); b++) {
        const int64_t id = streams[i].table[s * streams[i].table_stride + b];
        if (id < 0 || id >= streams[i].k.num_blocks || id >= streams[i].v.num_blocks) return 1;
      }
  /* first_item[s]: the first work item (split) of sequence s. */
  int64_t *first_item = malloc(sizeof(int64_t) * (a->seqs + 1));
  if (!first_item) return 2;
  int64_t work = 0; /* vectors x query heads, for the threading threshold */
  first_item[0] = 0;
  for (int64_t s = 0; s < a->seqs; s++) {
    int64_t blocks = 0;
    for (int64_t i = 0; i < num_streams; i++) {
      blocks += blocks_used(&streams[i], s);
      work += streams[i].lengths[s] > 0 ? streams[i].lengths[s] : 0;
    }
    const int64_t split = a->split_blocks;
    first_item[s + 1] = first_item[s] + (blocks > split ? (blocks + split - 1) / split : 1);
  }
  const int64_t items = first_item[a->seqs];
  const int64_t width = a->kv_heads * a->group * STATE_WIDTH(a->head_dim);
  float *partials = malloc(sizeof(float) * items * width);
  if (!partials) {
    free(first_item);
    return 2;
  }
  const int threaded = work * a->kv_heads * a->group * a->head_dim >= 65536;
  int64_t seq = 0;
  #pragma omp parallel for schedule(dynamic) firstprivate(seq) if (threaded)
  for (int64_t item = 0; item < items; item++) {
    while (first_item[seq + 1] <= item) seq++; /* items rise within a thread */
    while (first_item[seq] > item) seq--;
    const int64_t split = item - first_item[seq];
    attend_split(a, streams, num_streams, seq, split * a->split_blocks,
                 (split + 1) * a->split_blocks, partials + item * width);
  }
  #pragma omp parallel for schedule(static) if (threaded)
  for (int64_t s = 0; s < a->seqs; s++)
    merge_splits(a, partials + first_item[s] * width, first_item[s + 1] - first_item[s], s);
  free(partials);
  free(first_item);
  return 0;
}
