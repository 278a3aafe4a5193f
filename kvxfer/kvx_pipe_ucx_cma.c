/* kvx_pipe_ucx_cma.c: puts over shared memory as one-sided copies into the peer's memory,
 * where UCX 1.13 would emulate them.
 *
 * Why: on a shared-memory pipe (posix,cma,self) UCX 1.13 has no remote-memory lane for
 * memory it did not allocate itself (posix can put only into its own segments; cma offers
 * zero-copy puts, but neither the v1 nor the v2 protocols of 1.13 select it for ucp_put:
 * UCX_PROTO_INFO shows "software emulation"), so each put travels as 8 KiB active-message
 * fragments through the receiver's FIFO: the sender copies every byte in, the receiver's
 * progress thread copies it out again, and each put is answered by a completion message.
 * With 3 decode ranks that was half of ucx_perftest's rate (BENCHMARKS.md, kvxfer). Here
 * the sender copies each byte once, straight into the registered region, and the receiver
 * does nothing until the connector's notice. Two ways, the first that works:
 *   mapped  the region is a shared mapping of a file (a decode rank's KV pool: a shm
 *           segment or memfd, kvx_pipe_mem_reg_fd): the importer of the rkey takes a copy
 *           of the peer's descriptor through its pidfd (pidfd_getfd) and maps the file
 *           itself; a put is a memcpy into that mapping (what ucx_perftest's posix puts do
 *           into memory UCX allocated). About 2.5x faster per byte than the writes below
 *           on this project's machine (the kernel pins and copies page by page).
 *   writes  anonymous memory: process_vm_writev (Linux's cross-memory attach), queued per
 *           peer and written with one call per KVXI_CMA_IOV puts when the queue is full,
 *           before the peer's next flush, and before any message to it, so a message sent
 *           after a put (the connector's DONE notice) finds the bytes there (kvx_pipe.h
 *           keeps a put's source borrowed until a later flush completed; one call per put
 *           cost ~3 us each). A write that failed fails the next flush.
 *
 * Keys: on a shared-memory pipe a packed rkey carries, in front of UCX's bytes, the
 * registering process's pid, the region's [base, base + len) in its address space and its
 * file (descriptor number and offset, or -1). The importer keeps them when the pid is its
 * peer's (from the peer's address), and every put is bounds-checked against them: outside
 * the region is TD_EINVAL and nothing is copied. UCX's rkey is still unpacked (the fallback
 * needs it). Completion: a copy or write is done when the call returns, so a later flush
 * (UCX's, of an endpoint with nothing in flight) covers it.
 *
 * Fallback: a mapping that cannot be made (pidfd_getfd refused, a short file) is said once
 * and the writes are used; a kernel or a sandbox that refuses the writes (EPERM: another
 * user, or ptrace restricted; ENOSYS) turns them off for the pipe, logged once, and the puts
 * go through UCX again. KVX_UCX_PUTS=cma in the environment skips the mapping, rma skips
 * both (measurements). A peer that died: a write fails with TD_EIO (ESRCH), a copy into the
 * mapping lands in memory nobody reads; the pidfd reports the death as before. Pid reuse:
 * liveness is checked through the pidfd in every progress call, so a dead peer's pid is
 * written to only inside the window between its death and the next progress, and only by
 * a process allowed to ptrace the newcomer.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "kvx_pipe_ucx_int.h"
#include "kvx_wire.h"
#include "td_err.h"

#define CMA_HDR 32 /* pid u32, base u64, len u64, fd i32, file offset u64 */

size_t kvxi_ucx_cma_key_write(const kvx_mem *m, void *buf, size_t cap)
{
    if (cap < CMA_HDR) return 0;
    kvx_wr w;
    kvx_wr_init(&w, buf, cap);
    kvx_wr_u32(&w, (uint32_t)getpid());
    kvx_wr_u64(&w, (uint64_t)(uintptr_t)m->base);
    kvx_wr_u64(&w, (uint64_t)m->len);
    kvx_wr_u32(&w, (uint32_t)m->fd);
    kvx_wr_u64(&w, m->fd_off);
    return w.ok ? CMA_HDR : 0;
}

/* Map the peer's file fd (a descriptor number in its process) at off..off+len, read-write,
 * shared: a copy of its descriptor through the pidfd (pidfd_getfd, the same permission as
 * the writes), checked to be long enough. NULL (said once) if anything refuses. */
static void map_peer_file(kvxi_ucx_pipe *p, kvx_rkey *rk, const kvxi_ucx_peer *pr, int fd,
                          uint64_t off)
{
    const char *why = NULL;
    int lfd = pr->pidfd >= 0 ? (int)syscall(SYS_pidfd_getfd, pr->pidfd, fd, 0) : -1;
    struct stat st;
    long page = sysconf(_SC_PAGESIZE);
    uint64_t lead = off % (uint64_t)page;
    if (lfd < 0) {
        why = strerror(errno);
    } else if (fstat(lfd, &st) || st.st_size < 0 || (uint64_t)st.st_size < off + rk->cma_len) {
        why = "the file is shorter than the region";
    } else {
        void *a = mmap(NULL, rk->cma_len + lead, PROT_READ | PROT_WRITE, MAP_SHARED, lfd,
                       (off_t)(off - lead));
        if (a == MAP_FAILED) {
            why = strerror(errno);
        } else {
            rk->map_addr = a;
            rk->map_len = rk->cma_len + lead;
            rk->map = (uint8_t *)a + lead;
        }
    }
    if (lfd >= 0) close(lfd);
    if (why && !p->map_logged) {
        p->map_logged = true;
        TD_LOG_WARN("kvx ucx: cannot map peer process %u's KV memory (%s): its puts are written "
                    "into the process instead",
                    pr->pid, why);
    }
}

size_t kvxi_ucx_cma_key_read(kvxi_ucx_pipe *p, kvx_rkey *rk, const kvxi_ucx_peer *pr,
                             const void *buf, size_t len)
{
    if (len < CMA_HDR) return 0;
    kvx_rd rd;
    kvx_rd_init(&rd, buf, len);
    uint32_t pid = kvx_rd_u32(&rd);
    uint64_t base = kvx_rd_u64(&rd), n = kvx_rd_u64(&rd);
    int32_t fd = (int32_t)kvx_rd_u32(&rd);
    uint64_t off = kvx_rd_u64(&rd);
    if (!rd.ok || base + n < base || off + n < off) return 0;
    /* only the peer's own memory: a key passed on from a third process is UCX's alone */
    if (pid == pr->pid && n) {
        rk->cma_base = base;
        rk->cma_len = n;
        if (fd >= 0 && p->map_puts) map_peer_file(p, rk, pr, fd, off);
    }
    return CMA_HDR;
}

void kvxi_ucx_cma_unmap(kvx_rkey *rk)
{
    if (rk->map_addr) munmap(rk->map_addr, rk->map_len);
    rk->map_addr = rk->map = NULL;
}

/* The queue of pr, allocated on first use. */
static kvxi_cma_queue *queue_of(kvxi_ucx_peer *pr)
{
    if (!pr->cq) pr->cq = calloc(1, sizeof(*pr->cq));
    return pr->cq;
}

int kvxi_ucx_cma_put(kvxi_ucx_pipe *p, kvxi_ucx_peer *pr, const void *src, size_t len,
                     uint64_t raddr, kvx_rkey *rk)
{
    if (raddr < rk->cma_base || len > rk->cma_len || raddr - rk->cma_base > rk->cma_len - len) {
        TD_LOG_ERR("kvx ucx: put of %zu bytes at 0x%llx is outside the peer's region", len,
                   (unsigned long long)raddr);
        return TD_EINVAL;
    }
    if (!len) return 0;
    if (rk->map) { /* the peer's memory is mapped here: a plain copy, done */
        memcpy(rk->map + (raddr - rk->cma_base), src, len);
        return 0;
    }
    kvxi_cma_queue *q = queue_of(pr);
    if (!q) return TD_ENOMEM;
    if (q->n == KVXI_CMA_IOV) {
        int err = kvxi_ucx_cma_drain(p, pr);
        if (err) q->err = q->err ? q->err : err; /* the next flush reports it */
    }
    if (!p->cma_puts) return kvxi_ucx_rma_put(pr->ep, src, len, raddr, rk); /* refused above */
    q->l[q->n] = (struct iovec){.iov_base = (void *)src, .iov_len = len};
    q->r[q->n] = (struct iovec){.iov_base = (void *)(uintptr_t)raddr, .iov_len = len};
    q->rk[q->n] = rk;
    q->n++;
    return 0;
}

/* Skip `n` written bytes of the queue from entry *i on (the last one maybe in part). */
static void advance(kvxi_cma_queue *q, int *i, size_t n)
{
    while (n && *i < q->n) {
        size_t l = q->l[*i].iov_len;
        if (n < l) {
            q->l[*i].iov_base = (uint8_t *)q->l[*i].iov_base + n;
            q->r[*i].iov_base = (uint8_t *)q->r[*i].iov_base + n;
            q->l[*i].iov_len = q->r[*i].iov_len = l - n;
            return;
        }
        n -= l;
        (*i)++;
    }
}

int kvxi_ucx_cma_drain(kvxi_ucx_pipe *p, kvxi_ucx_peer *pr)
{
    kvxi_cma_queue *q = pr->cq;
    if (!q) return 0;
    int err = q->err, i = 0;
    q->err = 0;
    while (i < q->n && !err) {
        ssize_t n = pr->status
                        ? -1
                        : process_vm_writev((pid_t)pr->pid, q->l + i, (unsigned long)(q->n - i),
                                            q->r + i, (unsigned long)(q->n - i), 0);
        int e = pr->status ? ESRCH : n < 0 ? errno : n == 0 ? EFAULT : 0;
        if (!e) {
            advance(q, &i, (size_t)n);
        } else if (e == EINTR) {
            continue;
        } else if (e == EPERM || e == ENOSYS) {
            TD_LOG_WARN("kvx ucx: writes into peer process %u refused (%s): puts go through "
                        "UCX's emulation instead (slower; kvxfer/README.md)",
                        pr->pid, strerror(e));
            p->cma_puts = false;
            for (; i < q->n && !err; i++)
                err = !pr->ep ? TD_EIO
                              : kvxi_ucx_rma_put(pr->ep, q->l[i].iov_base, q->l[i].iov_len,
                                                 (uint64_t)(uintptr_t)q->r[i].iov_base, q->rk[i]);
        } else if (e == ESRCH) {
            err = pr->status ? pr->status : TD_EIO; /* the pidfd tells the rest */
        } else {
            TD_LOG_ERR("kvx ucx: write into peer process %u: %s", pr->pid, strerror(e));
            err = e == EFAULT ? TD_EINVAL : TD_EIO;
        }
    }
    q->n = 0;
    return err;
}

void kvxi_ucx_cma_free(kvxi_ucx_peer *pr)
{
    free(pr->cq);
    pr->cq = NULL;
}
