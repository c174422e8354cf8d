/* The fused decode step: every decoder layer of a Llama-structured model (Llama, Mistral,
 * Qwen2, Qwen3, Phi-3) for a batch of single-token decodes, in one call and one OpenMP
 * parallel region (ringserve.gpu.runner.decode_capture builds the tables and calls it).
 *
 * Built with panel_f32.c, panel_quant.c and cpu_decode.c into one library
 * (ringserve.gpu.native.panel). Eagerly, a decode step of the 135M-parameter model is ~15
 * torch calls per layer, each with its dispatch, allocation and OpenMP fork/join; here the
 * threads stay in one region, the phases are separated by barriers, and every activation
 * lives in one preallocated work buffer that stays in cache. The arithmetic is the eager
 * path's: the same panel matmuls (bias included), RMSNorm as x * rsqrt(mean(x^2) + eps) * w,
 * rope by rotate-half from the same cos/sin table, the key and value written to the paged
 * cache before the attention reads it (cpu_decode.c's task function), SiLU(gate) *
 * up; only float32 rounding order differs.
 *
 * Per layer: norm -> qkv -> (q/k norm), rope, KV write -> attention per (decode, kv head) ->
 * o_proj -> residual add + norm -> gate_up -> SiLU * up -> down -> residual add + the next
 * norm (the next layer's input norm, or the final norm into `out`).
 *
 * A mixture-of-experts layer (Qwen3-MoE, Mixtral, Qwen2-MoE) replaces gate_up ... down
 * by the router's panel matmul, a float32 softmax and top-k per decode (renormalised when the
 * model says so), a counting sort of the (decode, expert) pairs by expert (stable, as the
 * eager path's argsort), the rows gathered in that order, the experts' SwiGLU
 * (moe_cpu.c's team function) and each decode's weighted sum of its k outputs, plus
 * the shared expert where there is one (the layer's gate_up / down, gated by a sigmoid).
 *
 * LoRA (rs_step.row_slots): after each dense projection, a decode on a LoRA slot gets that
 * slot's delta, h = A x then each part's h B^T (the tensors the eager wrappers multiply:
 * ringserve.gpu.lora.capture); base decodes are untouched.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_decode.h"
#include "fast_exp.h"
#include "moe_cpu.h"
#include "panel.h"

typedef struct {
    rs_weight router;          /* [num_experts, hidden] */
    const rs_weight *w13, *w2; /* [num_experts]: [2I, hidden] and [hidden, I] */
    int64_t num_experts, top_k, renormalize;
    int64_t *load; /* [num_experts] routings counted (--enable-expert-load-metrics), or NULL */
    /* A shared expert (Qwen2-MoE): the layer's gate_up / down panels, intermediate
     * shared_inter, scaled per decode by sigmoid(x . shared_gate); NULL: none. */
    const float *shared_gate; /* [hidden] */
    int64_t shared_inter;
} rs_moe;

/* One part of a LoRA delta's expand: y[offset:offset + width] += h[c0:c1] b, b [c1 - c0,
 * width] (B transposed, already scaled). */
typedef struct {
    int64_t c0, c1, offset, width;
    const float *b;
} rs_lora_seg;

/* One slot's LoRA delta on one projection: h = A x (A [rank, in]), then its parts' expands
 * (q / k / v or gate / up apart). a == NULL: the slot's adapter leaves the projection alone. */
typedef struct {
    const float *a;
    int64_t rank, nsegs;
    rs_lora_seg segs[3];
} rs_lora;

typedef struct {
    rs_weight qkv, o, gate_up, down;     /* gate_up, down unused when moe is set */
    const float *input_norm, *post_norm; /* [hidden] */
    const float *q_norm, *k_norm;        /* [head_dim] (Qwen3), or NULL */
    float *kv_cache;                     /* [2, num_slots, num_kv_heads, head_dim] */
    int64_t window;                      /* sliding window, 0: full attention */
    const rs_moe *moe;                   /* the layer's experts, or NULL: the dense MLP */
    /* LoRA (ringserve.gpu.lora.capture): per projection (qkv, o, gate_up, down), the slots'
     * deltas [max_loras] indexed by rs_step.row_slots; NULL: no adapter touches it. */
    const rs_lora *lora[4];
} rs_layer;

/* The scratch of the MoE layers of one step (sized for the largest of them). */
typedef struct {
    float *logits, *weights, *rows, *ys, *swiglu; /* [n, E], [n k], [n k, H] x 2, [n k, 2I] */
    int64_t *ids, *pos, *counts;                  /* [n k], [n k], [E] */
    rs_moe_group *groups;                         /* [2 E] */
    rs_moe_plan plan;
    int status;
} moe_scratch;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t rotary_dim, max_position, num_slots, block_size, vocab;
    float eps, scale;
    const float *cos_sin;    /* [2, max_position, rotary_dim] */
    const float *embedding;  /* [vocab, hidden] (unused with embedding_rows) */
    const float *final_norm; /* [hidden] */
    const rs_layer *layers;
    const rs_weight *embedding_rows; /* non-NULL: the rows are a tied LM head's panels, read
                                      * by rs_panel_row (any format) */
} rs_model;

typedef struct {
    int64_t n;                                  /* decodes */
    const int64_t *token_ids, *positions, *slots; /* [n] */
    const int32_t *tables;                      /* [n, max_blocks] block ids */
    int64_t max_blocks;
    const int32_t *lens;                        /* [n] sequence lengths, the new token included */
    int64_t max_len;
    float *out;                                 /* [n, hidden] final normed hidden states */
    float *work;                                /* rs_step_work_floats(model, n) floats */
    int64_t nthreads;
    /* Read between layers: nonzero ends the step there (a pause came; the step is taken
     * back and run again later, so the KV it wrote is rewritten). NULL: never. */
    const volatile unsigned char *abort_flag;
    /* The residual stream entering each of these layers is copied out (an EAGLE-3 head
     * reads it): aux_out [n, num_aux, hidden]. num_aux 0: none. */
    const int64_t *aux_layers;
    int64_t num_aux;
    float *aux_out;
    /* [n] the LoRA slot of each decode, -1 for the base model; NULL: no LoRA row. */
    const int64_t *row_slots;
} rs_step;

static int64_t qkv_width(const rs_model *m)
{
    return (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
}

/* Floats of work buffer a step of n decodes needs. */
int64_t rs_step_work_floats(const rs_model *m, int64_t n)
{
    return n * (3 * m->hidden + qkv_width(m) + m->num_heads * m->head_dim
                + 3 * m->intermediate);
}

static void rmsnorm(const float *x, const float *w, float *y, int64_t h, float eps)
{
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < h; j++)
        ss += x[j] * x[j];
    const float r = 1.f / sqrtf(ss / (float)h + eps);
#pragma omp simd
    for (int64_t j = 0; j < h; j++)
        y[j] = x[j] * r * w[j];
}

/* Rotate the first rotary_dim channels of one head by rotate-half (cos, sin: its row). */
static void rope(float *x, const float *cos, const float *sin, int64_t rotary_dim)
{
    const int64_t half = rotary_dim / 2;
    for (int64_t j = 0; j < half; j++) {
        const float a = x[j], b = x[j + half];
        x[j] = a * cos[j] - b * sin[j];
        x[j + half] = b * cos[j + half] + a * sin[j + half];
    }
}

/* q/k norm, rope and the KV write of decode i (its row of the qkv buffer). */
static void prepare_row(const rs_model *m, const rs_layer *layer, float *qkv, int64_t pos,
                        int64_t slot)
{
    const int64_t d = m->head_dim, hq = m->num_heads, hkv = m->num_kv_heads;
    const float *cos = m->cos_sin + pos * m->rotary_dim;
    const float *sin = m->cos_sin + (m->max_position + pos) * m->rotary_dim;
    for (int64_t h = 0; h < hq + hkv; h++) {
        float *x = qkv + h * d;
        const float *norm = h < hq ? layer->q_norm : layer->k_norm;
        if (norm != NULL)
            rmsnorm(x, norm, x, d, m->eps);
        rope(x, cos, sin, m->rotary_dim);
    }
    float *keys = layer->kv_cache, *values = layer->kv_cache + m->num_slots * hkv * d;
    memcpy(keys + slot * hkv * d, qkv + hq * d, sizeof(float) * (size_t)(hkv * d));
    memcpy(values + slot * hkv * d, qkv + (hq + hkv) * d, sizeof(float) * (size_t)(hkv * d));
}

/* residual[i] += delta[i], then out[i] = rmsnorm(residual[i]) for the team's rows. */
static void add_and_norm(const rs_model *m, int64_t n, float *residual, const float *delta,
                         const float *norm, float *out)
{
    const int64_t hid = m->hidden;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float *r = residual + i * hid;
        for (int64_t j = 0; j < hid; j++)
            r[j] += delta[i * hid + j];
        rmsnorm(r, norm, out + i * hid, hid, m->eps);
    }
}

/* Softmax over one decode's router logits, its top_k experts (the larger index loses a
 * tie, as torch.topk keeps the first) and their weights, renormalised when asked. */
static void route_row(const float *logits, int64_t num_experts, int64_t top_k, int renormalize,
                      int64_t *ids, float *weights)
{
    float peak = logits[0], total = 0.f;
    for (int64_t e = 1; e < num_experts; e++)
        peak = logits[e] > peak ? logits[e] : peak;
    for (int64_t e = 0; e < num_experts; e++)
        total += expf(logits[e] - peak);
    float kept = 0.f;
    for (int64_t j = 0; j < top_k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < num_experts; e++) {
            int taken = 0;
            for (int64_t q = 0; q < j; q++)
                taken |= ids[q] == e;
            if (!taken && (best < 0 || logits[e] > logits[best]))
                best = e;
        }
        ids[j] = best;
        weights[j] = expf(logits[best] - peak) / total;
        kept += weights[j];
    }
    if (renormalize)
        for (int64_t j = 0; j < top_k; j++)
            weights[j] /= kept;
}

/* tmp [n, hidden] = the MoE layer's output for normed [n, hidden]; every thread of the team. */
static void moe_forward(const rs_model *m, const rs_moe *moe, int64_t n, const float *normed,
                        float *tmp, moe_scratch *ms)
{
    const int64_t E = moe->num_experts, k = moe->top_k, hid = m->hidden, pairs = n * k;
    rs_linear_team(&moe->router, normed, n, hid, ms->logits, E);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i++)
        route_row(ms->logits + i * E, E, k, (int)moe->renormalize, ms->ids + i * k,
                  ms->weights + i * k);
#pragma omp single
    {
        for (int64_t e = 0; e < E; e++)
            ms->counts[e] = 0;
        for (int64_t p = 0; p < pairs; p++)
            ms->counts[ms->ids[p]]++;
        if (moe->load != NULL)
            for (int64_t e = 0; e < E; e++)
                moe->load[e] += ms->counts[e];
        int64_t next[E > 0 ? E : 1];
        int64_t start = 0;
        for (int64_t e = 0; e < E; e++) {
            next[e] = start;
            start += ms->counts[e];
        }
        for (int64_t p = 0; p < pairs; p++)
            ms->pos[p] = next[ms->ids[p]]++;
        ms->status = rs_moe_make_plan(&ms->plan, moe->w13, moe->w2, E, ms->counts, pairs,
                                      ms->groups, omp_get_num_threads());
    }
    if (ms->status != 0)
        return; /* cannot happen with ids from route_row; the step reports -2 */
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; p++)
        memcpy(ms->rows + ms->pos[p] * hid, normed + (p / k) * hid, sizeof(float) * (size_t)hid);
    rs_moe_swiglu_team(&ms->plan, ms->rows, pairs, ms->swiglu, ms->ys);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float *out = tmp + i * hid;
        for (int64_t c = 0; c < hid; c++)
            out[c] = 0.f;
        for (int64_t j = 0; j < k; j++) {
            const float w = ms->weights[i * k + j];
            const float *y = ms->ys + ms->pos[i * k + j] * hid;
#pragma omp simd
            for (int64_t c = 0; c < hid; c++)
                out[c] += w * y[c];
        }
    }
}

/* y[i] += the LoRA delta of decode i's slot on x[i] (x [n, in], y [n, ldy]), for the rows on
 * a slot whose adapter touches this projection; the others are left as they are. */
static void lora_delta(const rs_lora *slots, const rs_step *s, const float *x, int64_t in,
                       float *y, int64_t ldy)
{
    if (slots == NULL || s->row_slots == NULL)
        return;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < s->n; i++) {
        const int64_t slot = s->row_slots[i];
        if (slot < 0 || slots[slot].a == NULL)
            continue;
        const rs_lora *d = &slots[slot];
        const float *xi = x + i * in;
        float h[d->rank > 0 ? d->rank : 1];
        for (int64_t j = 0; j < d->rank; j++) {
            const float *a = d->a + j * in;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t c = 0; c < in; c++)
                dot += a[c] * xi[c];
            h[j] = dot;
        }
        float *yi = y + i * ldy;
        for (int64_t g = 0; g < d->nsegs; g++) {
            const rs_lora_seg *seg = &d->segs[g];
            float *out = yi + seg->offset;
            for (int64_t j = seg->c0; j < seg->c1; j++) {
                const float hj = h[j], *b = seg->b + (j - seg->c0) * seg->width;
#pragma omp simd
                for (int64_t c = 0; c < seg->width; c++)
                    out[c] += hj * b[c];
            }
        }
    }
}

/* out [n, hidden] = down(SiLU(gate(x)) * up(x)) with the layer's gate_up / down panels (and
 * their LoRA deltas when `lora` is set). */
static void swiglu_mlp(const rs_layer *layer, const rs_step *lora, int64_t n, int64_t hid,
                       int64_t inter, const float *x, float *gu, float *act, float *out)
{
    rs_linear_team(&layer->gate_up, x, n, hid, gu, 2 * inter);
    if (lora != NULL)
        lora_delta(layer->lora[2], lora, x, hid, gu, 2 * inter);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float *g = gu + i * 2 * inter, *u = g + inter;
        float *a = act + i * inter;
        int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; j + 8 <= inter; j += 8)
            _mm256_storeu_ps(a + j, rs_silu_mul8(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
#endif
        for (; j < inter; j++)
            a[j] = g[j] / (1.f + rs_exp(-g[j])) * u[j];
    }
    rs_linear_team(&layer->down, act, n, inter, out, hid);
    if (lora != NULL)
        lora_delta(layer->lora[3], lora, act, inter, out, hid);
}

static void layer_forward(const rs_model *m, const rs_layer *layer, const rs_step *s,
                          const float *next_norm, float *next_out, float *residual,
                          float *normed, float *tmp, float *qkv, float *attn, float *gu,
                          float *act, float *scores, moe_scratch *ms)
{
    const int64_t n = s->n, hid = m->hidden, inter = m->intermediate;
    const int64_t qw = qkv_width(m), aw = m->num_heads * m->head_dim;

    rs_linear_team(&layer->qkv, normed, n, hid, qkv, qw);
    lora_delta(layer->lora[0], s, normed, hid, qkv, qw);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i++)
        prepare_row(m, layer, qkv + i * qw, s->positions[i], s->slots[i]);
    const int64_t hkv = m->num_kv_heads, per = rs_attend_heads_per_task(n, hkv, s->nthreads);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n * (hkv / per); t++) {
        const int64_t i = t / (hkv / per), kv0 = t % (hkv / per) * per;
        rs_attend_heads(qkv + i * qw, attn + i * aw, layer->kv_cache, m->num_slots,
                        s->tables + i * s->max_blocks, s->lens[i], m->num_heads, hkv,
                        m->head_dim, kv0, kv0 + per, m->block_size, m->scale, layer->window,
                        0.f, scores);
    }
    rs_linear_team(&layer->o, attn, n, aw, tmp, hid);
    lora_delta(layer->lora[1], s, attn, aw, tmp, hid);
    add_and_norm(m, n, residual, tmp, layer->post_norm, normed);
    const rs_moe *moe = layer->moe;
    if (moe != NULL) {
        moe_forward(m, moe, n, normed, tmp, ms);
        if (moe->shared_gate != NULL) {
            /* The routed rows are consumed: their buffer holds the shared expert's output. */
            float *shared = ms->rows;
            swiglu_mlp(layer, NULL, n, hid, moe->shared_inter, normed, gu, act, shared);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < n; i++) {
                const float *x = normed + i * hid, *y = shared + i * hid;
                float dot = 0.f;
                for (int64_t c = 0; c < hid; c++)
                    dot += x[c] * moe->shared_gate[c];
                const float gate = 1.f / (1.f + expf(-dot));
                float *out = tmp + i * hid;
                for (int64_t c = 0; c < hid; c++)
                    out[c] += gate * y[c];
            }
        }
        add_and_norm(m, n, residual, tmp, next_norm, next_out);
        return;
    }
    swiglu_mlp(layer, s, n, hid, inter, normed, gu, act, tmp);
    add_and_norm(m, n, residual, tmp, next_norm, next_out);
}

/* Runs the step. Returns 0; -1: a scratch buffer could not be allocated; -2: a token id,
 * position or slot is out of range (nothing was computed or written); -3: `abort_flag` was
 * raised and the step stopped between two layers (`out` holds nothing). */
int rs_decode_step(const rs_model *m, const rs_step *s)
{
    const int64_t n = s->n, hid = m->hidden;
    for (int64_t i = 0; i < n; i++) {
        if (s->token_ids[i] < 0 || s->token_ids[i] >= m->vocab || s->positions[i] < 0
            || s->positions[i] >= m->max_position || s->slots[i] < 0
            || s->slots[i] >= m->num_slots || s->lens[i] < 1 || s->lens[i] > s->max_len)
            return -2;
    }
    const int64_t per_thread = rs_attend_scratch_floats(
        m->num_heads, m->num_kv_heads, rs_attend_heads_per_task(n, m->num_kv_heads, s->nthreads),
        s->max_len);
    float *scores = malloc(sizeof(float) * (size_t)(per_thread * s->nthreads));
    if (scores == NULL)
        return -1;
    moe_scratch ms = {0};
    void *moe_block = NULL;
    int64_t max_e = 0, max_k = 0, max_i = 0;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const rs_moe *moe = m->layers[l].moe;
        if (moe == NULL)
            continue;
        max_e = moe->num_experts > max_e ? moe->num_experts : max_e;
        max_k = moe->top_k > max_k ? moe->top_k : max_k;
        max_i = moe->w2[0].k > max_i ? moe->w2[0].k : max_i;
    }
    if (max_e > 0) {
        const int64_t pairs = n * max_k;
        const size_t floats = (size_t)(n * max_e + pairs + 2 * pairs * hid + pairs * 2 * max_i);
        const size_t ints = (size_t)(2 * pairs + max_e);
        moe_block = malloc(sizeof(float) * floats + sizeof(int64_t) * ints
                           + sizeof(rs_moe_group) * 2 * (size_t)max_e);
        if (moe_block == NULL) {
            free(scores);
            return -1;
        }
        ms.groups = moe_block;
        ms.ids = (int64_t *)(ms.groups + 2 * max_e);
        ms.pos = ms.ids + pairs;
        ms.counts = ms.pos + pairs;
        ms.logits = (float *)(ms.counts + max_e);
        ms.weights = ms.logits + n * max_e;
        ms.rows = ms.weights + pairs;
        ms.ys = ms.rows + pairs * hid;
        ms.swiglu = ms.ys + pairs * hid;
    }
    float *residual = s->work, *normed = residual + n * hid, *tmp = normed + n * hid;
    float *qkv = tmp + n * hid, *attn = qkv + n * qkv_width(m);
    float *gu = attn + n * m->num_heads * m->head_dim, *act = gu + n * 2 * m->intermediate;
    int aborted = 0; /* shared: set by one thread, read by all after the single's barrier */

#pragma omp parallel num_threads((int)s->nthreads)
    {
        float *mine = scores + per_thread * omp_get_thread_num();
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            const int64_t t = s->token_ids[i];
            if (m->embedding_rows != NULL) {
                rs_panel_row(m->embedding_rows, t, residual + i * hid);
            } else {
                memcpy(residual + i * hid, m->embedding + t * hid, sizeof(float) * (size_t)hid);
            }
            rmsnorm(residual + i * hid, m->layers[0].input_norm, normed + i * hid, hid, m->eps);
        }
        for (int64_t l = 0; l < m->num_layers; l++) {
            const int last = l == m->num_layers - 1;
            for (int64_t a = 0; a < s->num_aux; a++) {
                if (s->aux_layers[a] != l)
                    continue;
#pragma omp for schedule(static)
                for (int64_t i = 0; i < n; i++)
                    memcpy(s->aux_out + (i * s->num_aux + a) * hid, residual + i * hid,
                           sizeof(float) * (size_t)hid);
            }
            layer_forward(m, &m->layers[l], s,
                          last ? m->final_norm : m->layers[l + 1].input_norm,
                          last ? s->out : normed, residual, normed, tmp, qkv, attn, gu, act,
                          mine, &ms);
            if (s->abort_flag != NULL && !last) {
#pragma omp single
                aborted = *s->abort_flag != 0;
                /* Every thread reads it after the barrier, and none writes it again before
                 * all have passed the next layer's barriers: they all stop here, or none. */
                if (aborted)
                    break;
            }
        }
    }
    free(scores);
    free(moe_block);
    if (aborted)
        return -3;
    return ms.status == 0 ? 0 : -2;
}
