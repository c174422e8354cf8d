/* Weights in panels of 16 output channels, the layout every CPU matmul of ringserve reads
 * (ringserve.gpu.native.panel). Shared by the float kernel (panel_f32.c), the int8 / int4
 * kernels (panel_quant.c) and the fused decode step (decode_step.c).
 *
 * A weight W [n, k] (y = x W^T) is stored as ceil(n / 16) panels; panel p holds channels
 * 16 p .. 16 p + 15 (rows past n are zero padding), k-major inside the panel so that one
 * stream of memory feeds 16 output channels at once:
 *   RS_F32:  data float [P][k][16]; scales, mins unused.
 *   RS_INT8: data int8 [P][k][16] symmetric codes; scales float [P * 16] per channel
 *            (w = code * scale).
 *   RS_INT8G: data int8 [P][k][16] as RS_INT8; scales float [P][k / 32][16] per group of 32
 *            inputs (GGUF's Q8_0 blocks kept as they are; w = code * scale).
 *   RS_INT4: data uint8 [P][k / 2][16]: byte (p, j, l) holds the code of input 2 j in its low
 *            nibble and of input 2 j + 1 in its high nibble; scales and mins float
 *            [P][k / 32][16] per group of 32 inputs (w = code * scale + min).
 *   RS_BF16: data uint16 [P][k][16]: the bf16 bits of each weight (its float32's top half;
 *            panel_bf16.c widens them in registers); scales, mins unused.
 */
#ifndef RINGSERVE_PANEL_H
#define RINGSERVE_PANEL_H

#include <stdint.h>

#define RS_PANEL 16
#define RS_INT4_GROUP 32

enum { RS_F32 = 0, RS_INT8 = 1, RS_INT4 = 2, RS_INT8G = 3, RS_BF16 = 4 };

typedef struct {
    int64_t format; /* RS_F32, RS_INT8, RS_INT4, RS_INT8G or RS_BF16 */
    int64_t n, k;   /* output and input features */
    const void *data;
    const float *scales;
    const float *mins;
    const float *bias; /* [n] or NULL */
} rs_weight;

/* y[i * ldy + c] = sum_j x[i * ldx + j] * W[c][j] (bias not added) for rows i < m and the
 * channels c < n of panels p0 <= p < p1. No threading inside: callers split panels over
 * their threads. Channels past n are never written. */
typedef void (*rs_panel_fn)(const rs_weight *w, const float *x, int64_t m, int64_t ldx,
                            float *y, int64_t ldy, int64_t p0, int64_t p1);

void rs_f32_panels(const rs_weight *w, const float *x, int64_t m, int64_t ldx, float *y,
                   int64_t ldy, int64_t p0, int64_t p1);
void rs_int8_panels(const rs_weight *w, const float *x, int64_t m, int64_t ldx, float *y,
                    int64_t ldy, int64_t p0, int64_t p1);
void rs_int4_panels(const rs_weight *w, const float *x, int64_t m, int64_t ldx, float *y,
                    int64_t ldy, int64_t p0, int64_t p1);
void rs_int8g_panels(const rs_weight *w, const float *x, int64_t m, int64_t ldx, float *y,
                     int64_t ldy, int64_t p0, int64_t p1);
void rs_bf16_panels(const rs_weight *w, const float *x, int64_t m, int64_t ldx, float *y,
                    int64_t ldy, int64_t p0, int64_t p1);

/* The kernel of w's format, then the bias, for panels p0 .. p1. */
void rs_panels(const rs_weight *w, const float *x, int64_t m, int64_t ldx, float *y,
               int64_t ldy, int64_t p0, int64_t p1);

/* Row r of w's logical [n, k] weight (output channel r < n), as float32 into out[k]: the
 * values its kernel multiplies by (int8: code * scale; int4: code * scale + min, rounded
 * once each; bf16: widened). A tied embedding's lookups read its LM head's panels so. */
void rs_panel_row(const rs_weight *w, int64_t r, float *out);
/* rs_panel_row for ids[0 .. n - 1] into out [n, k], on `nthreads` threads. Returns 0. */
int rs_panel_rows(const rs_weight *w, const int64_t *ids, int64_t n, float *out, int nthreads);

/* Inside a parallel region, every thread of the team calls this: the panels are split
 * statically over the team (an orphaned `omp for`, with its barrier). */
void rs_linear_team(const rs_weight *w, const float *x, int64_t m, int64_t ldx, float *y,
                    int64_t ldy);

/* One pack into panels (panel_pack.c): rows row0 .. row0 + m - 1 of a float32 [n, k] weight
 * from src (row stride ld) into their lanes of panels [P][k][16]. */
typedef struct {
    const float *src;
    int64_t m, k, ld;
    float *panels;
    int64_t row0;
} rs_pack_job;

int rs_pack_f32_batch(const rs_pack_job *jobs, int64_t count, int nthreads);

#endif
