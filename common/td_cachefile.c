/* td_cachefile.c: cache keys' identities, the cache directory, whole-file read and atomic
 * write (td_cachefile.h). */
#define _GNU_SOURCE
#include "td_cachefile.h"

#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gguf.h"
#include "td_err.h"

#define BUILD_ID_MAX 64 /* bytes of a build id note (SHA-1 ones are 20) */

/* ---- build ids ---- */

typedef struct {
    uintptr_t addr; /* find the object mapping this address; 0: the first (the executable) */
    bool found;
    char hex[2 * BUILD_ID_MAX + 1];
} build_id_q;

static void note_build_id(const struct dl_phdr_info *info, build_id_q *q)
{
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_NOTE) continue;
        const unsigned char *p = (const unsigned char *)(info->dlpi_addr + ph->p_vaddr);
        size_t off = 0;
        while (off + sizeof(ElfW(Nhdr)) <= ph->p_memsz) {
            ElfW(Nhdr) nh;
            memcpy(&nh, p + off, sizeof nh);
            size_t name_off = off + sizeof nh;
            size_t desc_off = name_off + ((nh.n_namesz + 3u) & ~3u);
            size_t next = desc_off + ((nh.n_descsz + 3u) & ~3u);
            if (next > ph->p_memsz || next <= off) break;
            if (nh.n_type == NT_GNU_BUILD_ID && nh.n_namesz == 4 &&
                !memcmp(p + name_off, "GNU", 4) && nh.n_descsz > 0 && nh.n_descsz <= BUILD_ID_MAX) {
                for (size_t k = 0; k < nh.n_descsz; k++)
                    snprintf(q->hex + 2 * k, 3, "%02x", p[desc_off + k]);
                q->found = true;
                return;
            }
            off = next;
        }
    }
}

static int find_object(struct dl_phdr_info *info, size_t size, void *arg)
{
    (void)size;
    build_id_q *q = arg;
    bool hit = q->addr == 0;
    for (int i = 0; i < info->dlpi_phnum && !hit; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        uintptr_t lo = info->dlpi_addr + ph->p_vaddr;
        hit = ph->p_type == PT_LOAD && q->addr >= lo && q->addr < lo + ph->p_memsz;
    }
    if (!hit) return 0;
    note_build_id(info, q);
    return 1; /* stop: this is the object */
}

void td_build_identity(uintptr_t addr, char *out, size_t cap)
{
    build_id_q q = {.addr = addr};
    dl_iterate_phdr(find_object, &q);
    if (q.found) {
        snprintf(out, cap, "%s", q.hex);
        return;
    }
    char exe[512];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    struct stat st;
    if (addr == 0 && n > 0) {
        exe[n] = 0;
        if (!stat(exe, &st)) {
            snprintf(out, cap, "%s:%lld:%lld.%09ld", exe, (long long)st.st_size,
                     (long long)st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
            return;
        }
    }
    snprintf(out, cap, "unknown");
}

uint64_t td_fnv_gguf_tensors(uint64_t h, const td_gguf *g)
{
    const size_t nt = td_gguf_n_tensors(g);
    for (size_t i = 0; i < nt; i++) {
        const td_gguf_tensor *t = td_gguf_tensor_at(g, i);
        h = td_fnv(h, t->name, strlen(t->name) + 1);
        h = td_fnv_i64(h, t->type);
        h = td_fnv_i64(h, t->n_dims);
        for (int d = 0; d < 4; d++)
            h = td_fnv_i64(h, t->ne[d]);
    }
    return h;
}

void td_cpu_model_name(char *out, size_t cap)
{
    snprintf(out, cap, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10)) continue;
        char *v = strchr(line, ':');
        if (!v) continue;
        v++;
        while (*v == ' ' || *v == '\t')
            v++;
        size_t k = 0;
        for (; v[k] && v[k] != '\n' && k + 1 < cap; k++)
            out[k] = (v[k] >= 0x20 && v[k] < 0x7f) ? v[k] : '?';
        out[k] = 0;
        break;
    }
    fclose(f);
}

/* ---- files ---- */

int td_cache_dir(const char *sub, char *buf, size_t cap)
{
    const char *base = getenv("TANDEM_CACHE");
    int n;
    if (base && *base)
        n = snprintf(buf, cap, "%s/%s", base, sub);
    else if ((base = getenv("HOME")) && *base)
        n = snprintf(buf, cap, "%s/.cache/tandem/%s", base, sub);
    else
        return TD_ENOENT;
    return n < 0 || (size_t)n >= cap ? TD_ERANGE : 0;
}

/* mkdir -p of the directory part of path. Returns 0 or -1 (errno set). */
static int make_parents(const char *path)
{
    char d[4096];
    size_t n = strlen(path);
    if (n >= sizeof d) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(d, path, n + 1);
    char *slash = strrchr(d, '/');
    if (!slash || slash == d) return 0;
    *slash = 0;
    for (char *p = d + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(d, 0755) && errno != EEXIST) return -1;
        *p = '/';
    }
    if (mkdir(d, 0755) && errno != EEXIST) return -1;
    return 0;
}

int td_cache_read(const char *path, size_t max, char **text_out, size_t *len, char *why,
                  size_t why_cap)
{
    *text_out = NULL;
    *len = 0;
    if (why && why_cap) why[0] = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT) return TD_ENOENT;
        snprintf(why, why_cap, "cannot open: %s", strerror(errno));
        return TD_EIO;
    }
    struct stat st;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode) || (size_t)st.st_size > max) {
        close(fd);
        snprintf(why, why_cap, "not a regular file of at most %zu bytes", max);
        return TD_EFORMAT;
    }
    char *text = malloc((size_t)st.st_size + 1);
    if (!text) {
        close(fd);
        return TD_ENOMEM;
    }
    size_t got = 0;
    while (got < (size_t)st.st_size) {
        ssize_t r = read(fd, text + got, (size_t)st.st_size - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
    }
    close(fd);
    if (got != (size_t)st.st_size) {
        free(text);
        snprintf(why, why_cap, "short read (%zu of %lld bytes)", got, (long long)st.st_size);
        return TD_EIO;
    }
    text[got] = 0;
    if (strlen(text) != got) {
        free(text);
        snprintf(why, why_cap, "NUL byte in the file");
        return TD_EFORMAT;
    }
    *text_out = text;
    *len = got;
    return 0;
}

static int write_all(int fd, const char *b, size_t n)
{
    while (n) {
        ssize_t w = write(fd, b, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

int td_cache_write(const char *path, const char *b, size_t len, char *why, size_t why_cap)
{
    if (why && why_cap) why[0] = 0;
    char tmp[4200];
    if (make_parents(path)) {
        snprintf(why, why_cap, "cannot create the directory of %s: %s", path, strerror(errno));
        return TD_EIO;
    }
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof tmp)
        return TD_ERANGE;
    unlink(tmp); /* a left-over of a crashed process that had our pid */
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
        snprintf(why, why_cap, "cannot create %s: %s", tmp, strerror(errno));
        return TD_EIO;
    }
    int rc = 0;
    if (write_all(fd, b, len) || fsync(fd)) {
        snprintf(why, why_cap, "cannot write %s: %s", tmp, strerror(errno));
        rc = TD_EIO;
    }
    if (close(fd) && !rc) {
        snprintf(why, why_cap, "cannot write %s: %s", tmp, strerror(errno));
        rc = TD_EIO;
    }
    if (!rc && rename(tmp, path)) {
        snprintf(why, why_cap, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
        rc = TD_EIO;
    }
    if (rc) unlink(tmp);
    return rc;
}

int td_cache_lock(const char *path)
{
    char lp[4200];
    if (snprintf(lp, sizeof lp, "%s.lock", path) >= (int)sizeof lp || make_parents(lp)) return -1;
    int fd = open(lp, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return -1;
    while (flock(fd, LOCK_EX) && errno == EINTR) {
    }
    return fd;
}
