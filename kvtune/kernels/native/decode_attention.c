/* Decode attention over every stream of a step in one pass on a CPU: each stored key and value
 * is decoded from its codes into a small stack buffer (pool_codes.h), dotted with the query
 * heads of its KV head, and folded into an online softmax, where the torch path first writes
 * the whole cache out as fp32 and then runs SDPA over it. Driven by
 * kvtune/kernels/native/decode_attention.py, which checks every argument first.
 *
 * Work: one item per (sequence, KV head, split), a split being a run of `split_blocks` of the
 * sequence's blocks (its streams' blocks in stream order), each item's partial (max, sum,
 * unnormalized output per query head) merged in split order. A sequence's splits and every
 * sum's order depend on that sequence alone, so its output has the same bits whatever else the
 * batch holds and however the threads share the items. */
#include <stdlib.h>

#include "pool_codes.h"

#define MAX_GROUP 16 /* query heads a KV head serves */
#define MAX_DIM 512
#define TILE 32 /* tokens whose logits are taken before the running sums are rescaled */

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

/* q . key in sixteen lanes the compiler keeps in vector registers, the lanes summed pairwise
 * (vector adds, where summing them in a row was a chain of sixteen scalar adds), then the
 * rest. */
static inline float dot(const float *q, const float *key, int64_t dim) {
  float lanes[16] = {0};
  int64_t c = 0;
  for (; c + 16 <= dim; c += 16)
    for (int64_t l = 0; l < 16; l++) lanes[l] += q[c + l] * key[c + l];
  for (int64_t l = 0; l < 8; l++) lanes[l] += lanes[l + 8];
  for (int64_t l = 0; l < 4; l++) lanes[l] += lanes[l + 4];
  float sum = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
  for (; c < dim; c++) sum += q[c] * key[c];
  return sum;
}

/* The running softmax of one work item: per query head of the KV head, the largest logit so
 * far, the sum of exp(logit - max) and the output weighted likewise. */
typedef struct {
  float max[MAX_GROUP], sum[MAX_GROUP];
  float acc[MAX_GROUP][MAX_DIM];
  float q[MAX_GROUP][MAX_DIM];
} Running;

/* Fold the vectors [first, first + count) of block `b` (pool block id) of a stream into run. */
static void attend_tile(const DecodeArgs *a, const DecodeStream *stream, int64_t seq, int64_t head,
                        int64_t b, int64_t id, int64_t first, int64_t count, Running *run) {
  const int64_t group = a->group, dim = a->head_dim;
  const PoolCodes *k = &stream->k, *v = &stream->v;
  const uint8_t *mask = stream->query_mask
                            ? stream->query_mask + seq * stream->mask_seq + head * stream->mask_head
                            : NULL;
  float weights[MAX_GROUP][TILE], tile_max[MAX_GROUP];
  uint8_t shown[TILE];
  float vector[MAX_DIM];
  RowScales scales;
  int64_t scale_row = -1, visible = 0;
  for (int64_t g = 0; g < group; g++) tile_max[g] = -INFINITY;
  for (int64_t j = 0; j < count; j++) {
    const int64_t t = first + j, position = b * k->block_size + t;
    shown[j] = !mask || (position < stream->mask_len && mask[position]);
    if (!shown[j]) continue;
    visible++;
    if (k->groups && t / k->rows != scale_row) {
      scale_row = t / k->rows;
      load_row_scales(k, id, t, head, &scales);
    }
    decode_vector(k, code_row(k, id, t, head), &scales, vector);
    for (int64_t g = 0; g < group; g++) {
      const float logit = dot(run->q[g], vector, dim) * a->scale + stream->logit_bias;
      weights[g][j] = logit;
      if (logit > tile_max[g]) tile_max[g] = logit;
    }
  }
  if (!visible) return;
  for (int64_t g = 0; g < group; g++) {
    const float new_max = run->max[g] > tile_max[g] ? run->max[g] : tile_max[g];
    if (new_max == -INFINITY) continue; /* every logit -inf: nothing to add yet */
    const float alpha = expf(run->max[g] - new_max);
    if (alpha != 1.0f) {
      run->sum[g] *= alpha;
      for (int64_t c = 0; c < dim; c++) run->acc[g][c] *= alpha;
    }
    float sum = run->sum[g];
    for (int64_t j = 0; j < count; j++) {
      weights[g][j] = shown[j] ? expf(weights[g][j] - new_max) : 0.0f;
      sum += weights[g][j];
    }
    run->sum[g] = sum;
    run->max[g] = new_max;
  }
  scale_row = -1;
  for (int64_t j = 0; j < count; j++) {
    if (!shown[j]) continue;
    const int64_t t = first + j;
    if (v->groups && t / v->rows != scale_row) {
      scale_row = t / v->rows;
      load_row_scales(v, id, t, head, &scales);
    }
    decode_vector(v, code_row(v, id, t, head), &scales, vector);
    for (int64_t g = 0; g < group; g++) {
      const float weight = weights[g][j];
      if (weight == 0.0f) continue; /* nothing to add (a hidden vector, or exp underflow) */
      for (int64_t c = 0; c < dim; c++) run->acc[g][c] += weight * vector[c];
    }
  }
}

/* Ask for a block's codes and scales of one head before they are read: blocks lie anywhere
 * in the pool, and the CPU's own prefetchers lose a block's run of rows at every jump. */
static void prefetch_block(const DecodeStream *stream, int64_t id, int64_t head) {
#ifdef __GNUC__
  const PoolCodes *pools[2] = {&stream->k, &stream->v};
  for (int p = 0; p < 2; p++) {
    const PoolCodes *pool = pools[p];
    const int64_t bytes = pool->code_head > 0 ? pool->code_head : pool->code_token;
    for (int64_t t = 0; t < pool->block_size; t++) {
      const uint8_t *row = code_row(pool, id, t, head);
      for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(row + offset);
    }
  }
#else
  (void)stream, (void)id, (void)head;
#endif
}

/* The partial of one work item: blocks [first, last) of the sequence's blocks in stream
 * order, written as [group][max, sum, output[head_dim]]. */
static void attend_split(const DecodeArgs *a, const DecodeStream *streams, int64_t num_streams,
                         int64_t seq, int64_t head, int64_t first, int64_t last, float *partial) {
  const int64_t group = a->group, dim = a->head_dim;
  Running run;
  for (int64_t g = 0; g < group; g++) {
    const float *query = a->q + seq * a->q_seq + (head * group + g) * a->q_head;
    memcpy(run.q[g], query, sizeof(float) * dim);
    memset(run.acc[g], 0, sizeof(float) * dim);
    run.max[g] = -INFINITY;
    run.sum[g] = 0.0f;
  }
  int64_t index = 0; /* the sequence's blocks before this stream's */
  for (int64_t i = 0; i < num_streams && index < last; i++) {
    const DecodeStream *stream = &streams[i];
    const int64_t used = blocks_used(stream, seq), length = stream->lengths[seq];
    const int64_t block_size = stream->k.block_size;
    const int64_t begin = first > index ? first - index : 0;
    const int64_t end = last - index < used ? last - index : used;
    for (int64_t b = begin; b < end; b++) {
      const int32_t *ids = stream->table + seq * stream->table_stride;
      const int64_t id = ids[b];
      if (b + 1 < end) prefetch_block(stream, ids[b + 1], head);
      const int64_t tokens = length - b * block_size < block_size ? length - b * block_size
                                                                   : block_size;
      for (int64_t t = 0; t < tokens; t += TILE)
        attend_tile(a, stream, seq, head, b, id, t, tokens - t < TILE ? tokens - t : TILE, &run);
    }
    index += used;
  }
  for (int64_t g = 0; g < group; g++) {
    float *row = partial + g * (dim + 2);
    row[0] = run.max[g];
    row[1] = run.sum[g];
    memcpy(row + 2, run.acc[g], sizeof(float) * dim);
  }
}

/* The output of one (sequence, KV head): its splits' partials merged in split order; 0 for a
 * query head that sees no vector. */
static void merge_splits(const DecodeArgs *a, const float *partials, int64_t splits,
                         int64_t seq, int64_t head) {
  const int64_t group = a->group, dim = a->head_dim, width = group * (dim + 2);
  for (int64_t g = 0; g < group; g++) {
    float *out = a->out + seq * a->out_seq + (head * group + g) * a->out_head;
    float max = -INFINITY;
    for (int64_t p = 0; p < splits; p++) {
      const float part_max = partials[p * width + g * (dim + 2)];
      if (part_max > max) max = part_max;
    }
    float sum = 0.0f;
    memset(out, 0, sizeof(float) * dim);
    if (max == -INFINITY) continue;
    for (int64_t p = 0; p < splits; p++) {
      const float *row = partials + p * width + g * (dim + 2);
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
  /* first_item[s]: the first work item of sequence s; its items are head-major. */
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
    const int64_t splits = blocks > split ? (blocks + split - 1) / split : 1;
    first_item[s + 1] = first_item[s] + splits * a->kv_heads;
  }
  const int64_t items = first_item[a->seqs], width = a->group * (a->head_dim + 2);
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
    const int64_t splits = (first_item[seq + 1] - first_item[seq]) / a->kv_heads;
    const int64_t local = item - first_item[seq], head = local / splits, split = local % splits;
    attend_split(a, streams, num_streams, seq, head, split * a->split_blocks,
                 (split + 1) * a->split_blocks, partials + item * width);
  }
  #pragma omp parallel for schedule(static) if (threaded)
  for (int64_t pair = 0; pair < a->seqs * a->kv_heads; pair++) {
    const int64_t s = pair / a->kv_heads, head = pair % a->kv_heads;
    const int64_t splits = (first_item[s + 1] - first_item[s]) / a->kv_heads;
    merge_splits(a, partials + (first_item[s] + head * splits) * width, splits, s, head);
  }
  free(partials);
  free(first_item);
  return 0;
}
