/* kvx_netdev.c: the network devices that carry an instance's configured host address
 * (kvx_net_devices_for_host, kvx_pipe.h): what kvx_pipe_ucx_create gives UCX as its
 * NET_DEVICES so that the KV plane listens and connects on the cluster's addresses only. */
#include "kvx_pipe.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

static bool is_loopback(const struct sockaddr *sa)
{
    if (sa->sa_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr) >> 24) == 127;
    if (sa->sa_family == AF_INET6)
        return IN6_IS_ADDR_LOOPBACK(&((const struct sockaddr_in6 *)sa)->sin6_addr) ||
               (IN6_IS_ADDR_V4MAPPED(&((const struct sockaddr_in6 *)sa)->sin6_addr) &&
                ((const struct sockaddr_in6 *)sa)->sin6_addr.s6_addr[12] == 127);
    return false;
}

static bool is_wildcard(const struct sockaddr *sa)
{
    if (sa->sa_family == AF_INET)
        return ((const struct sockaddr_in *)sa)->sin_addr.s_addr == htonl(INADDR_ANY);
    if (sa->sa_family == AF_INET6)
        return IN6_IS_ADDR_UNSPECIFIED(&((const struct sockaddr_in6 *)sa)->sin6_addr);
    return false;
}

static bool same_addr(const struct sockaddr *a, const struct sockaddr *b)
{
    if (a->sa_family != b->sa_family) return false;
    if (a->sa_family == AF_INET)
        return ((const struct sockaddr_in *)a)->sin_addr.s_addr ==
               ((const struct sockaddr_in *)b)->sin_addr.s_addr;
    if (a->sa_family == AF_INET6)
        return !memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr,
                       &((const struct sockaddr_in6 *)b)->sin6_addr, sizeof(struct in6_addr));
    return false;
}

/* Append name to the comma-separated list in buf unless it is there. */
static int add_name(char *buf, size_t cap, const char *name)
{
    size_t n = strlen(name), len = strlen(buf);
    for (const char *p = buf; *p;) {
        const char *e = strchr(p, ',');
        size_t k = e ? (size_t)(e - p) : strlen(p);
        if (k == n && !strncmp(p, name, n)) return 0;
        p += k + (e ? 1 : 0);
    }
    if (len + (len ? 1 : 0) + n + 1 > cap) return TD_ERANGE;
    snprintf(buf + len, cap - len, "%s%s", len ? "," : "", name);
    return 0;
}

int kvx_net_devices_for_host(const char *host, char *buf, size_t cap)
{
    if (!cap) return TD_ERANGE;
    buf[0] = 0;
    if (!host || !host[0]) return TD_EINVAL;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    if (getaddrinfo(host, NULL, &hints, &res) || !res) return TD_ENOENT;
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs)) {
        freeaddrinfo(res);
        return TD_EIO;
    }
    int rc = 0;
    bool wildcard = false;
    for (struct addrinfo *a = res; a && !rc; a = a->ai_next) {
        if (is_wildcard(a->ai_addr)) {
            wildcard = true;
            continue;
        }
        bool loop = is_loopback(a->ai_addr);
        for (struct ifaddrs *i = ifs; i && !rc; i = i->ifa_next) {
            if (!i->ifa_addr || !(i->ifa_flags & IFF_UP)) continue;
            /* a loopback address (127.0.0.0/8 and ::1 all live on lo) -> the loopback
               device; any other -> the interfaces that hold that very address */
            bool hit =
                loop ? (i->ifa_flags & IFF_LOOPBACK) != 0 : same_addr(i->ifa_addr, a->ai_addr);
            if (hit) rc = add_name(buf, cap, i->ifa_name);
        }
    }
    freeifaddrs(ifs);
    freeaddrinfo(res);
    if (rc) return rc;
    if (buf[0]) return 0;
    return wildcard ? TD_EINVAL : TD_ENOENT;
}
