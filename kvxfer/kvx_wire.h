/* kvx_wire.h: kvxfer's internal byte encoding: little-endian fields, a bounds-checked
 * reader, and the frame (magic, version, kind, payload length, checksum) every exported
 * blob starts with.
 *
 * Invariants: a reader never touches a byte past its end; once a read fails the reader
 * stays failed (ok == false) and every later read returns zero, so a decoder checks ok
 * once at the end. A writer never writes past cap; it records overflow the same way.
 * Threading: plain values, no shared state.
 * Ownership: readers and writers borrow the caller's buffer.
 */
#ifndef KVX_WIRE_H
#define KVX_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t *buf;
    size_t cap, len;
    bool ok;
} kvx_wr;

typedef struct {
    const uint8_t *buf;
    size_t len, off;
    bool ok;
} kvx_rd;

static inline void kvx_wr_init(kvx_wr *w, void *buf, size_t cap)
{
    w->buf = buf;
    w->cap = buf ? cap : 0;
    w->len = 0;
    w->ok = true;
}

static inline void kvx_wr_bytes(kvx_wr *w, const void *p, size_t n)
{
    if (!w->ok || n > w->cap - w->len) {
        w->ok = false;
        return;
    }
    if (n) memcpy(w->buf + w->len, p, n);
    w->len += n;
}

static inline void kvx_wr_u64(kvx_wr *w, uint64_t v)
{
    uint8_t b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    kvx_wr_bytes(w, b, 8);
}

static inline void kvx_wr_u32(kvx_wr *w, uint32_t v)
{
    uint8_t b[4];
    for (int i = 0; i < 4; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    kvx_wr_bytes(w, b, 4);
}

static inline void kvx_rd_init(kvx_rd *r, const void *buf, size_t len)
{
    r->buf = buf;
    r->len = buf ? len : 0;
    r->off = 0;
    r->ok = true;
}

static inline const uint8_t *kvx_rd_bytes(kvx_rd *r, size_t n)
{
    if (!r->ok || n > r->len - r->off) {
        r->ok = false;
        return NULL;
    }
    const uint8_t *p = r->buf + r->off;
    r->off += n;
    return p;
}

static inline uint64_t kvx_rd_u64(kvx_rd *r)
{
    const uint8_t *b = kvx_rd_bytes(r, 8);
    uint64_t v = 0;
    if (b)
        for (int i = 0; i < 8; i++)
            v |= (uint64_t)b[i] << (8 * i);
    return v;
}

static inline uint32_t kvx_rd_u32(kvx_rd *r)
{
    const uint8_t *b = kvx_rd_bytes(r, 4);
    uint32_t v = 0;
    if (b)
        for (int i = 0; i < 4; i++)
            v |= (uint32_t)b[i] << (8 * i);
    return v;
}

/* FNV-1a, 32 bits: catches truncated or corrupted blobs (not an authenticator). */
static inline uint32_t kvx_fnv1a(const void *p, size_t n)
{
    const uint8_t *b = p;
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 16777619u;
    return h;
}

/* Frame: magic u32, version u32, kind u32, payload length u32, checksum u32, payload. */
#define KVX_FRAME_HDR    20
#define KVX_WIRE_VERSION 2u          /* 2: keys in rkeys, targets and messages (issue 44) */
#define KVX_MAGIC_ADDR   0x4158564bu /* "KVXA" */
#define KVX_MAGIC_RKEY   0x4b58564bu /* "KVXK" */
#define KVX_MAGIC_TARGET 0x5458564bu /* "KVXT" */
#define KVX_MAGIC_MSG    0x4d58564bu /* "KVXM" */
#define KVX_KIND_UCX     1u
#define KVX_KIND_FAKE    2u

/* Write a frame around payload; returns false if cap is too small (len is then the size
 * that would be needed). */
static inline bool kvx_frame_write(void *buf, size_t cap, uint32_t magic, uint32_t kind,
                                   const void *payload, size_t n, size_t *len)
{
    *len = KVX_FRAME_HDR + n;
    if (n > UINT32_MAX || !buf || cap < *len) return false;
    kvx_wr w;
    kvx_wr_init(&w, buf, cap);
    kvx_wr_u32(&w, magic);
    kvx_wr_u32(&w, KVX_WIRE_VERSION);
    kvx_wr_u32(&w, kind);
    kvx_wr_u32(&w, (uint32_t)n);
    kvx_wr_u32(&w, kvx_fnv1a(payload, n));
    kvx_wr_bytes(&w, payload, n);
    return w.ok;
}

/* Check a frame; on success *payload and *n describe its payload (inside buf). Returns 0,
 * or -1 if the magic, version, kind, length or checksum is wrong. */
static inline int kvx_frame_read(const void *buf, size_t len, uint32_t magic, uint32_t kind,
                                 const void **payload, size_t *n)
{
    kvx_rd r;
    kvx_rd_init(&r, buf, len);
    uint32_t m = kvx_rd_u32(&r), v = kvx_rd_u32(&r), k = kvx_rd_u32(&r);
    uint32_t pl = kvx_rd_u32(&r), sum = kvx_rd_u32(&r);
    if (!r.ok || m != magic || v != KVX_WIRE_VERSION || k != kind) return -1;
    if (pl != len - KVX_FRAME_HDR) return -1;
    const uint8_t *p = kvx_rd_bytes(&r, pl);
    if (!r.ok || kvx_fnv1a(p, pl) != sum) return -1;
    *payload = p;
    *n = pl;
    return 0;
}

#endif
