/* up_config.h: the ports of a cluster under `tandem up`: the copy of the YAML that
 * `--port N` moves, and the check that every port the cluster listens on is free before
 * anything starts.
 *
 * Port layout under --port N: the router on N (router.listen keeps its host), decode
 * instance i (file order) on control port N+1+i, prefill instance j on N+1+n_decode+j
 * (its stage 0 listens there). deploy/local.yaml with --port 8100: router 8100, d0 8101,
 * p0 8102.
 * Invariants: the copy holds every key of the original with the same values but those
 * ports (comments are not kept); it passes td_cfg_load whenever the original did and no
 * derived port is above 65535.
 * Threading: none (`tandem up` is single-threaded).
 * Ownership: nothing is kept; the caller owns the paths and buffers it passes.
 */
#ifndef TANDEM_UP_CONFIG_H
#define TANDEM_UP_CONFIG_H

#include <stddef.h>

#include "config.h"

/* Writes to dst (atomically: dst.tmp, then rename) the YAML of src with the ports moved
 * for --port N as above; its first line names src. src must have passed td_cfg_load.
 * Returns 0, or TD_ERANGE (a derived port above 65535), TD_EIO (read/write), TD_EFORMAT
 * (src no longer parses), TD_ENOMEM, with "src: message" in err. Prints nothing. */
int up_config_derive(const char *src, int port, const char *dst, char *err, size_t errcap);

/* Every address the processes of cfg listen on under `tandem up` (router.listen, the
 * control port of each decode instance's rank 0 on its host and of each prefill
 * instance's stage 0 on hosts[0]) can be bound now (SO_REUSEADDR, as the servers bind).
 * Prints the first one that cannot, naming its key and the reason, to stderr: TD_ESTATE
 * (in use), TD_EINVAL (not an address of this machine, unknown host, or not permitted). */
int up_ports_check(const td_cfg *cfg);

#endif
