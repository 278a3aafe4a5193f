/* rt_metrics_text.h: the writer of the router's Prometheus text exposition (format 0.0.4),
 * and the histogram type its series are kept in (prefixes rt_mw_, rt_labels_, rt_hist_;
 * rt_metrics_label_escape).
 *
 * Purpose: one writer per metric family, so that no render function writes a `# HELP` or
 * `# TYPE` line, a label or a sample line by hand. rt_mw_family opens a family (its HELP
 * and TYPE lines, once); its samples follow, each written by rt_mw_uint / rt_mw_int /
 * rt_mw_real, or for a histogram by rt_mw_hist (cumulated `_bucket` lines with `le` the last
 * label, then `_sum` and `_count`). Label sets are built with rt_labels_add, which escapes
 * every value.
 * Invariants: a sample belongs to the family last opened on its writer (w->name); w->rc is
 * sticky: once an append failed (TD_ENOMEM) nothing more is written and it stays failed.
 * rt_hist.counts[] are per bucket; rt_mw_hist cumulates them.
 * Threading: none of its own. A writer belongs to one render (rt_metrics_render, under
 * rt_metrics.mu); rt_hist_observe's caller serializes access to the histogram.
 * Ownership: rt_mw appends to the caller's rt_buf and owns nothing; rt_labels is a value
 * (a fixed buffer, on the caller's stack).
 */
#ifndef RT_METRICS_TEXT_H
#define RT_METRICS_TEXT_H

#include <stddef.h>
#include <stdint.h>

#include "rt_buf.h"

#define RT_HIST_MAX 24 /* the most finite buckets of any histogram */

typedef struct {
    uint64_t counts[RT_HIST_MAX + 1]; /* per bucket, the one after the last bound: +Inf */
    double sum;
    uint64_t n;
} rt_hist;

/* A histogram's finite upper bounds, ascending (n <= RT_HIST_MAX). */
typedef struct {
    const double *le;
    int n;
} rt_bounds;

/* Count v in the first bucket whose bound is >= v (+Inf past the last). */
void rt_hist_observe(rt_hist *h, rt_bounds bd, double v);

/* A label set as it goes between the braces: `k="v",k2="v2"` (no braces; "" for none).
 * Large enough for the longest one rendered (tandem_instance_products_info's paths, every
 * byte escaped, or a model name). */
#define RT_LABELS_CAP 4096
typedef struct {
    char s[RT_LABELS_CAP];
    size_t n; /* strlen(s) */
} rt_labels;

void rt_labels_reset(rt_labels *l);
/* Append key="val", val escaped (backslash, double quote and line feed; text format 0.0.4)
 * and cut where the set is full. */
void rt_labels_add(rt_labels *l, const char *key, const char *val);
void rt_labels_add_int(rt_labels *l, const char *key, long long val);
/* s as a label value (escaped as above) into out, NUL-terminated; cut before an escape that
 * does not fit. */
void rt_metrics_label_escape(char *out, size_t cap, const char *s);

typedef enum { RT_MT_COUNTER = 0, RT_MT_GAUGE, RT_MT_HISTOGRAM } rt_mtype;

typedef struct {
    rt_buf *b;     /* what the exposition is appended to */
    int rc;        /* 0, or TD_ENOMEM once an append failed */
    char name[96]; /* the family open now */
} rt_mw;

/* A writer appending to b (rc 0, no family open). */
rt_mw rt_mw_start(rt_buf *b);
/* Open family `name`: `# HELP name help` and `# TYPE name type`. */
void rt_mw_family(rt_mw *w, const char *name, rt_mtype type, const char *help);
/* One sample of the open family, `name{labels} value` (l NULL or empty: no braces): an
 * unsigned count (%llu), a signed integer (%lld), a real with `digits` significant digits
 * (%.*g: 6 is printf's %g). */
void rt_mw_uint(rt_mw *w, const rt_labels *l, uint64_t v);
void rt_mw_int(rt_mw *w, const rt_labels *l, long long v);
void rt_mw_real(rt_mw *w, const rt_labels *l, double v, int digits);
/* One series of the open histogram family: bounds and sum multiplied by scale (a unit
 * change: 1000 renders seconds as milliseconds), 15 significant digits. */
void rt_mw_hist(rt_mw *w, const rt_labels *l, const rt_hist *h, rt_bounds bd, double scale);
/* A histogram family with one series: rt_mw_family, then rt_mw_hist. */
void rt_mw_hist_family(rt_mw *w, const char *name, const char *help, const rt_labels *l,
                       const rt_hist *h, rt_bounds bd, double scale);

#endif
