/* The SwiGLU experts kernel of moe_cpu.c, for callers that already hold a parallel region
 * (the fused decode step, decode_step.c): plan a call from the per-expert row counts, then
 * every thread of the team runs rs_moe_swiglu_team. */
#ifndef RINGSERVE_MOE_CPU_H
#define RINGSERVE_MOE_CPU_H

#include <stdint.h>

#include "panel.h"

typedef struct {
    int64_t expert, first_row, rows; /* an active expert and its rows */
    int64_t first_task;              /* its first task in a phase */
} rs_moe_group;

typedef struct {
    const rs_weight *w13, *w2;        /* [E]: [2I, H] and [H, I] panels */
    int64_t hidden, inter, active;    /* H, I, experts with rows */
    int64_t up_tasks, down_tasks, up_panels, down_panels, up_chunk, down_chunk;
    rs_moe_group *up, *down;          /* [active] each */
} rs_moe_plan;

/* Plan the experts of `num_rows` rows grouped by expert (counts[e] rows each, in expert
 * order) for a team of `nthreads`; `groups` holds 2 * num_experts entries. Returns 0; -2: the
 * counts are negative or do not sum to num_rows, or the experts' shapes disagree. */
int rs_moe_make_plan(rs_moe_plan *plan, const rs_weight *w13, const rs_weight *w2,
                     int64_t num_experts, const int64_t *counts, int64_t num_rows,
                     rs_moe_group *groups, int nthreads);

/* Called by every thread of a team: out [num_rows, H] = the experts of `rows` [num_rows, H];
 * scratch [num_rows, 2I]. Ends with a barrier. */
void rs_moe_swiglu_team(const rs_moe_plan *plan, const float *rows, int64_t num_rows,
                        float *scratch, float *out);

#endif
