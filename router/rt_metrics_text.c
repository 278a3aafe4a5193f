/* rt_metrics_text.c: the Prometheus text exposition writer (rt_metrics_text.h): families,
 * escaped label sets, sample lines, histograms. Number formats are the ones /metrics has
 * always had (%llu counts, le bounds and sums in %.15g), since dashboards and tests match
 * the text. */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "rt_metrics_text.h"

void rt_hist_observe(rt_hist *h, rt_bounds bd, double v)
{
    int b = 0;
    while (b < bd.n && v > bd.le[b])
        b++;
    h->counts[b]++;
    h->sum += v;
    h->n++;
}

void rt_metrics_label_escape(char *out, size_t cap, const char *s)
{
    size_t w = 0;
    for (; *s; s++) {
        bool esc = *s == '\\' || *s == '"' || *s == '\n';
        if (w + 1 + esc >= cap) break;
        if (esc) out[w++] = '\\';
        out[w++] = *s == '\n' ? 'n' : *s;
    }
    if (cap) out[w] = '\0';
}

void rt_labels_reset(rt_labels *l)
{
    l->s[0] = '\0';
    l->n = 0;
}

void rt_labels_add(rt_labels *l, const char *key, const char *val)
{
    size_t klen = strlen(key);
    /* [,]key="" and the NUL must fit, or the label is left out whole */
    if (l->n + 1 + klen + 3 + 1 > sizeof l->s) return;
    size_t w = l->n;
    if (w) l->s[w++] = ',';
    memcpy(l->s + w, key, klen);
    w += klen;
    l->s[w++] = '=';
    l->s[w++] = '"';
    rt_metrics_label_escape(l->s + w, sizeof l->s - w - 1, val); /* room for the quote */
    w += strlen(l->s + w);
    l->s[w++] = '"';
    l->s[w] = '\0';
    l->n = w;
}

void rt_labels_add_int(rt_labels *l, const char *key, long long val)
{
    char v[24];
    snprintf(v, sizeof v, "%lld", val);
    rt_labels_add(l, key, v);
}

rt_mw rt_mw_start(rt_buf *b)
{
    return (rt_mw){.b = b};
}

static void put(rt_mw *w, const char *s)
{
    if (!w->rc) w->rc = rt_buf_puts(w->b, s);
}

void rt_mw_family(rt_mw *w, const char *name, rt_mtype type, const char *help)
{
    static const char *const types[] = {"counter", "gauge", "histogram"};
    snprintf(w->name, sizeof w->name, "%s", name);
    put(w, "# HELP ");
    put(w, name);
    put(w, " ");
    put(w, help);
    put(w, "\n# TYPE ");
    put(w, name);
    put(w, " ");
    put(w, types[type]);
    put(w, "\n");
}

/* name+suffix{labels[,extra]} value: the one place a sample line is written */
static void sample(rt_mw *w, const char *suffix, const rt_labels *l, const char *extra,
                   const char *value)
{
    bool has = l && l->n;
    put(w, w->name);
    put(w, suffix);
    if (has || extra) {
        put(w, "{");
        if (has) put(w, l->s);
        if (has && extra) put(w, ",");
        if (extra) put(w, extra);
        put(w, "}");
    }
    put(w, " ");
    put(w, value);
    put(w, "\n");
}

void rt_mw_uint(rt_mw *w, const rt_labels *l, uint64_t v)
{
    char s[24];
    snprintf(s, sizeof s, "%llu", (unsigned long long)v);
    sample(w, "", l, NULL, s);
}

void rt_mw_int(rt_mw *w, const rt_labels *l, long long v)
{
    char s[24];
    snprintf(s, sizeof s, "%lld", v);
    sample(w, "", l, NULL, s);
}

void rt_mw_real(rt_mw *w, const rt_labels *l, double v, int digits)
{
    char s[40];
    snprintf(s, sizeof s, "%.*g", digits, v);
    sample(w, "", l, NULL, s);
}

void rt_mw_hist(rt_mw *w, const rt_labels *l, const rt_hist *h, rt_bounds bd, double scale)
{
    char le[48], v[40];
    uint64_t cum = 0;
    for (int i = 0; i <= bd.n; i++) {
        cum += h->counts[i];
        if (i < bd.n)
            snprintf(le, sizeof le, "le=\"%.15g\"", bd.le[i] * scale);
        else
            snprintf(le, sizeof le, "le=\"+Inf\"");
        snprintf(v, sizeof v, "%llu", (unsigned long long)cum);
        sample(w, "_bucket", l, le, v);
    }
    snprintf(v, sizeof v, "%.15g", h->sum * scale);
    sample(w, "_sum", l, NULL, v);
    snprintf(v, sizeof v, "%llu", (unsigned long long)h->n);
    sample(w, "_count", l, NULL, v);
}

void rt_mw_hist_family(rt_mw *w, const char *name, const char *help, const rt_labels *l,
                       const rt_hist *h, rt_bounds bd, double scale)
{
    rt_mw_family(w, name, RT_MT_HISTOGRAM, help);
    rt_mw_hist(w, l, h, bd, scale);
}
