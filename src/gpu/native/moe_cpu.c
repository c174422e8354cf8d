/* The SwiGLU experts of a mixture-of-experts layer on CPU, for rows already grouped by expert
 * (ringserve.gpu.moe.cpu_experts packs the weights and calls it; ringserve.gpu.moe.grouped is
 * the torch reference).
 *
 * Built with panel_f32.c, panel_quant.c and the other kernels into one library
 * (ringserve.gpu.native.panel). For expert e with rows R_e [n_e, H]:
 *   out_e = (silu(R_e gate_e^T) * (R_e up_e^T)) down_e^T,
 * w13[e] = [gate_e; up_e] ([2I, H]) and w2[e] ([H, I]) in the panel layout of panel.h, in any
 * of its formats (rs_panels dispatches on each weight's own).
 *
 * One parallel region in three phases: gate-up for every expert, SiLU(gate) * up, down for
 * every expert. In a matmul phase the tasks are (expert, block of up to 48 rows, panel) over
 * the experts that have rows, handed out dynamically: one loop for all experts, so there are
 * two barriers in all instead of three per expert, the threads stay balanced when the experts'
 * panel counts do not split evenly over the team, and an expert without rows costs nothing.
 * Inside a task rs_panels runs the panel kernel of panel_f32.c / panel_quant.c; a block's rows
 * stay in L2 while the team passes the expert's panels (as rs_linear_team's row blocks).
 * On the 2-core VM (E=8, H=576, I=256, 2 threads) this ran 5-25% faster at 32 rows than
 * rs_linear_team per expert, and alike at 2 and 512 rows; chunks of 1 to 16 tasks per grab
 * measured alike.
 */
#include <immintrin.h>
#include <stdlib.h>

#include "fast_exp.h"
#include "moe_cpu.h"
#include "panel.h"

/* Rows of one task (rs_linear_team's ROW_BLOCK). */
#define MOE_ROW_BLOCK 48
/* Tasks handed out per thread and phase, about: enough to even out the threads, few enough
 * that each grab of the dynamic schedule fetches several panels in a row (one stream). */
#define MOE_CHUNKS_PER_THREAD 8

/* The group of task t: the last group whose first task is <= t (groups sorted by it). */
static int64_t group_of(const rs_moe_group *g, int64_t num_groups, int64_t t)
{
    int64_t lo = 0, hi = num_groups - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (g[mid].first_task <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* One matmul phase over every active expert: y rows of expert e = x rows of e times w[e]^T.
 * Called by every thread of the team; ends with the loop's barrier. */
static void experts_team(const rs_weight *w, const rs_moe_group *g, int64_t num_groups,
                         int64_t tasks, int64_t panels, const float *x, int64_t ldx, float *y,
                         int64_t ldy, int64_t chunk)
{
#pragma omp for schedule(dynamic, chunk)
    for (int64_t t = 0; t < tasks; t++) {
        const rs_moe_group *grp = g + group_of(g, num_groups, t);
        const int64_t local = t - grp->first_task;
        const int64_t block = local / panels, p = local % panels;
        const int64_t i0 = grp->first_row + block * MOE_ROW_BLOCK;
        const int64_t left = grp->first_row + grp->rows - i0;
        const int64_t rows = left < MOE_ROW_BLOCK ? left : MOE_ROW_BLOCK;
        rs_panels(w + grp->expert, x + i0 * ldx, rows, ldx, y + i0 * ldy, ldy, p, p + 1);
    }
}

int rs_moe_make_plan(rs_moe_plan *plan, const rs_weight *w13, const rs_weight *w2,
                     int64_t num_experts, const int64_t *counts, int64_t num_rows,
                     rs_moe_group *groups, int nthreads)
{
    if (num_experts < 1 || num_rows < 0)
        return -2;
    const int64_t hidden = w13[0].k, inter2 = w13[0].n;
    int64_t total = 0, active = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        if (counts[e] < 0 || w13[e].n != inter2 || w13[e].k != hidden || w2[e].n != hidden
            || w2[e].k != inter2 / 2)
            return -2;
        total += counts[e];
        active += counts[e] > 0;
    }
    if (total != num_rows || inter2 % 2)
        return -2;
    plan->w13 = w13;
    plan->w2 = w2;
    plan->hidden = hidden;
    plan->inter = inter2 / 2;
    plan->active = active;
    plan->up = groups;
    plan->down = groups + active;
    plan->up_panels = (inter2 + RS_PANEL - 1) / RS_PANEL;
    plan->down_panels = (hidden + RS_PANEL - 1) / RS_PANEL;
    int64_t a = 0, first_row = 0, up_tasks = 0, down_tasks = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        if (counts[e] == 0)
            continue;
        const int64_t blocks = (counts[e] + MOE_ROW_BLOCK - 1) / MOE_ROW_BLOCK;
        plan->up[a] = (rs_moe_group){e, first_row, counts[e], up_tasks};
        plan->down[a] = (rs_moe_group){e, first_row, counts[e], down_tasks};
        up_tasks += blocks * plan->up_panels;
        down_tasks += blocks * plan->down_panels;
        first_row += counts[e];
        a++;
    }
    const int64_t per = MOE_CHUNKS_PER_THREAD * (int64_t)(nthreads < 1 ? 1 : nthreads);
    plan->up_tasks = up_tasks;
    plan->down_tasks = down_tasks;
    plan->up_chunk = up_tasks / per > 1 ? up_tasks / per : 1;
    plan->down_chunk = down_tasks / per > 1 ? down_tasks / per : 1;
    return 0;
}

void rs_moe_swiglu_team(const rs_moe_plan *plan, const float *rows, int64_t num_rows,
                        float *scratch, float *out)
{
    const int64_t hidden = plan->hidden, inter = plan->inter, inter2 = 2 * inter;
    experts_team(plan->w13, plan->up, plan->active, plan->up_tasks, plan->up_panels, rows,
                 hidden, scratch, inter2, plan->up_chunk);
    /* SiLU(gate) * up over the gate half, in place: the down matmul reads it with a row
     * stride of 2I. */
#pragma omp for schedule(static)
    for (int64_t i = 0; i < num_rows; i++) {
        float *g = scratch + i * inter2;
        const float *u = g + inter;
        int64_t j = 0;
        for (; j + 8 <= inter; j += 8)
            _mm256_storeu_ps(g + j, rs_silu_mul8(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
        for (; j < inter; j++)
            g[j] = g[j] / (1.f + rs_exp(-g[j])) * u[j];
    }
    experts_team(plan->w2, plan->down, plan->active, plan->down_tasks, plan->down_panels,
                 scratch, inter2, out, hidden, plan->down_chunk);
}

/* out [num_rows, H] = the SwiGLU experts of `rows` [num_rows, H], grouped by expert in expert
 * order with counts[e] rows each, on `nthreads` threads. w13[e]: [2I, H]; w2[e]: [H, I];
 * `work` [num_rows, 2I] scratch (NULL: allocated here). Returns 0; -1: the scratch could not
 * be allocated; -2: the counts are negative or do not sum to num_rows, or the experts'
 * shapes disagree (nothing is written then). */
int rs_moe_swiglu(const rs_weight *w13, const rs_weight *w2, int64_t num_experts,
                  const int64_t *counts, const float *rows, int64_t num_rows, float *work,
                  float *out, int nthreads)
{
    if (num_experts < 1 || num_rows < 0)
        return -2;
    rs_moe_group *groups = malloc(sizeof(rs_moe_group) * 2 * (size_t)num_experts);
    if (groups == NULL)
        return -1;
    const int threads = nthreads < 1 ? 1 : nthreads;
    rs_moe_plan plan;
    const int status = rs_moe_make_plan(&plan, w13, w2, num_experts, counts, num_rows, groups,
                                        threads);
    if (status != 0 || num_rows == 0) {
        free(groups);
        return status;
    }
    float *scratch = work;
    if (scratch == NULL)
        scratch = malloc(sizeof(float) * (size_t)(num_rows * 2 * plan.inter));
    if (scratch == NULL) {
        free(groups);
        return -1;
    }
#pragma omp parallel num_threads(threads)
    rs_moe_swiglu_team(&plan, rows, num_rows, scratch, out);
    free(groups);
    if (work == NULL)
        free(scratch);
    return 0;
}
