/* kvx_pipe.h (fixture): an opaque type, its body in the private header; #if alternatives. */
#ifndef KVX_PIPE_H
#define KVX_PIPE_H

typedef struct kvx_pipe kvx_pipe;
typedef int kvx_fn_t(int);              /* a function type */
typedef void (*kvx_done_cb)(void *arg); /* a function pointer type */
typedef void (*done_cb)(void *arg);     /* EXPECT: type-prefix */

#if defined(__AVX2__)
typedef float kvx_vf;
#elif defined(__AVX512F__)
typedef double kvx_vf;
#else
typedef int kvx_vf;
#endif

typedef struct __attribute__((packed)) kvx_hdr {
    int a;
} __attribute__((aligned(4))) kvx_hdr;
typedef struct {
    int a;
} __attribute__((packed)) wire_hdr; /* EXPECT: type-prefix */

enum kvx_state { KVX_IDLE, KVX_BUSY };
enum state { IDLE, BUSY }; /* EXPECT: type-prefix */

#endif
