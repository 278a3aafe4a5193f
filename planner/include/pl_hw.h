/* pl_hw.h: a hardware profile for the planner: what one device (a GPU, or on a CPU machine
 * one group of cores) can do, the links between devices, and the efficiency factors that
 * turn peaks into what a serving engine gets.
 *
 * Purpose: the simulator (pl_sim.h) prices every forward, collective and transfer from it.
 * Shipped profiles (deploy/hw/, one YAML file each) hold published peaks with their sources and
 * stated efficiencies; `tandem calibrate` measures this machine and writes the same schema.
 *
 * Schema (YAML, every figure per device; keys not listed here are errors):
 *   name: h100                 devices_per_node: 8          memory_gib: 80
 *   peak_tflops: {fp8: 1979, bf16: 989, f32: 67}   (dense; at least the two types below)
 *   matmul_type: fp8           attention_type: bf16         (keys of peak_tflops)
 *   hbm_gbps: 3350             nvlink_gbps: 450             net_gbps: 50   (one direction)
 *   latency_us: {nvlink: 3, net: 10}
 *   efficiency: {matmul: 0.6, attention: 0.5, memory: 0.8, nvlink: 0.7, net: 0.8}  in (0, 1]
 *   overhead_ms: {chunk: 2, step: 1}      fixed cost of a prefill forward, a decode step
 *   kv_transfer: {gbps: 40, latency_us: 20}   optional; left out: the network's figures
 *   allreduce_us: {tp2: 12, tp3: 40, tp4: 60}   optional: a measured small all-reduce (one
 *                   token's hidden state) at that tp on one node, in place of
 *                   2 (tp - 1) x latency_us.nvlink (`tandem calibrate` writes it)
 *   one_node: 1     optional (0): every device is on this one node, as the core groups of a
 *                   CPU machine are: a group of more than devices_per_node devices does not
 *                   span nodes (its collectives stay on the node's links), it time-shares the
 *                   node's devices_per_node (`tandem calibrate` writes it)
 *   decode_speedup: {tp3: 1.1}   optional: the batch-1 decode step at that tp, measured, as a
 *                   speed-up over tp 1 with its all-reduces, in place of pl_hw_parallel and
 *                   allreduce_us for decode steps (`tandem calibrate` writes it)
 *   decode_speedup_ep: {tp2: 1.3}   optional: the same with a mixture-of-experts model's
 *                   experts whole on the ranks (decode[].ep), in place of decode_speedup for
 *                   ep steps (`tandem calibrate` writes it for such a model)
 *   prefill_speedup: {tp2: 1.7}   optional: a prefill chunk (the whole model, no logits) at
 *                   that tp, measured, as a speed-up over tp 1 with its all-reduces, in place
 *                   of pl_hw_parallel, the all-reduces and a whole overhead_ms.chunk for
 *                   prefill chunks at that tp (`tandem calibrate` writes it)
 *   prefill_speedup_ep: {tp2: 1.6}   optional: the same with the experts whole on the ranks
 *   decode_speedup_dp: {tp2: 0.8}, prefill_speedup_dp: {tp2: 0.9}   optional: a
 *                   data-parallel attention group of that many members (decode[].dp; the
 *                   keys' tpN is the member count): a member's batch-1 step with every member
 *                   stepping, and member 0's prefill chunk with the others idle, as speed-ups
 *                   over tp 1 (`tandem calibrate` writes them for a mixture-of-experts model)
 *   decode_attention_us_per_token: 3.5   optional: a decode step's attention, measured, per
 *                   token of context it reads (all layers, one device), in place of the
 *                   roofline of the KV bytes and FLOPs (`tandem calibrate` writes it)
 * Invariants: a loaded profile has every figure > 0 (overheads and latencies >= 0).
 * Threading: none. Ownership: plain values.
 */
#ifndef PL_HW_H
#define PL_HW_H

#include <stddef.h>

#define PL_HW_MAX_AR_TP 4 /* allreduce_us.tpN keys: N in 2..this */

typedef struct {
    char name[64];
    int devices_per_node;
    double mem_bytes;                     /* per device */
    double peak_fp8, peak_bf16, peak_f32; /* dense FLOP/s; 0: not given */
    char matmul_type[8], attention_type[8];
    double matmul_flops, attn_flops;  /* the peaks of those types, FLOP/s */
    double hbm_bw, nvlink_bw, net_bw; /* bytes/s, one direction */
    double nvlink_lat, net_lat;       /* s */
    double eff_matmul, eff_attn, eff_mem, eff_nvlink, eff_net; /* (0, 1] */
    double chunk_overhead, step_overhead;                      /* s */
    double kvx_bw, kvx_lat;             /* KV transfer bytes/s and s per transfer */
    int one_node;                       /* 1: all devices on one node, extra ones time-share it */
    double ar_lat[PL_HW_MAX_AR_TP + 1]; /* [tp]: measured all-reduce latency, s; 0: none */
    double decode_speedup[PL_HW_MAX_AR_TP + 1];    /* [tp]: a measured batch-1 decode step's
                                                      speed-up over tp 1, all-reduces included */
    double decode_speedup_ep[PL_HW_MAX_AR_TP + 1]; /* [tp]: the same with experts whole */
    double prefill_speedup[PL_HW_MAX_AR_TP + 1];   /* [tp]: a measured prefill chunk's
                                                      speed-up over tp 1, all-reduces included */
    double prefill_speedup_ep[PL_HW_MAX_AR_TP + 1]; /* [tp]: the same with experts whole */
    double decode_speedup_dp[PL_HW_MAX_AR_TP + 1];  /* [members]: a dp group member's step */
    double prefill_speedup_dp[PL_HW_MAX_AR_TP + 1]; /* [members]: member 0's chunk */
    double decode_attn; /* s per KV token a decode step attends to (all layers,
                           one device); 0: the memory/compute roofline */
} pl_hw;

/* The speed-up of a group of n devices that work in lock step (a tp group: an all-reduce
 * after every slice of work): n, or on a one_node profile with n > c = devices_per_node,
 * n / ceil(n / c): c of the n slices run at once, and every all-reduce waits for the last
 * round (tp 3 on 2 cores: 1.5, not 2). */
double pl_hw_parallel(const pl_hw *hw, int n);

/* Load a profile. Errors are FILE:LINE:COLUMN: reason, into err (and logged); returns 0,
 * TD_EIO (cannot open), TD_EFORMAT (not YAML) or TD_EINVAL (bad schema or value). */
int pl_hw_load(const char *path, pl_hw *hw, char *err, size_t errcap);

/* The same from a string (tests). `what` names it in errors. */
int pl_hw_parse(const char *text, size_t len, const char *what, pl_hw *hw, char *err,
                size_t errcap);

/* Write hw in the schema above, with `comment` (may be NULL; '#' lines) on top, to path.
 * Returns 0 or TD_EIO (logged). */
int pl_hw_write(const pl_hw *hw, const char *comment, const char *path);

#endif
