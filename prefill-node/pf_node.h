/* pf_node.h: one stage of a prefill instance (the tandem-prefill process).
 *
 * Purpose: run pipeline stage `stage` of prefill instance `instance` of the YAML: load the
 * stage's layers, join the instance (stages s > 0 say StageHello to stage 0's control
 * socket until stage 0 answers with the StageTable), then loop: stage 0 takes Prefill
 * requests from the router, cuts prompts into chunks (dynamic chunking, pf_chunk.h) and
 * sends each chunk's hidden states down the stage chain (pf_wire.h, pf_link.h); every
 * stage computes its layers, pushes the chunk's KV to the decode ranks (kvxfer connector)
 * and forwards the chunk; the last stage samples the first token; after its last chunk
 * every stage finishes its transfer and reports to stage 0, which tells the router
 * (PrefillDone or ErrorEvent). docs/prefill.md explains the protocol.
 * Stage 0 profiles its stage at start-up for dynamic chunking, or loads the profile it
 * cached on disk for the same model, layers, threads, build and CPU (pf_pcache.h).
 * Threading: one main thread per process; the activation pipe and the kvxfer connector
 * each have a progress thread. Returns when *stop becomes non-zero (SIGTERM; honoured in
 * every phase, the profile included) or on a fatal error.
 */
#ifndef PF_NODE_H
#define PF_NODE_H

#include <signal.h>
#include <stdbool.h>

#include "config.h"

typedef struct {
    const td_cfg *cfg;
    const char *instance;      /* the instance's name (--name, else --instance) */
    const char *template_name; /* the YAML prefill instance its settings come from */
    const char *advertise;     /* stage 0: the host in the URL it announces to the router
                                  (router.membership); NULL: hosts[0]. Every stage: the
                                  host whose device its KV plane uses; NULL: hosts[stage] */
    int stage;
    const char *listen; /* stage 0: control URL instead of the YAML's; NULL: the YAML's */
    const char *leader; /* stages > 0: stage 0's control URL; NULL: from the YAML */
    bool reprofile;     /* stage 0: measure the stage profile even if one is cached */
    volatile sig_atomic_t *stop;
    volatile sig_atomic_t *profiling; /* stage 0 sets it to 1 while it profiles (the signal
                                       * handler may then end the process, pf_main.c); or
                                       * NULL */
} pf_node_params;

int pf_node_run(const pf_node_params *p);

#endif
