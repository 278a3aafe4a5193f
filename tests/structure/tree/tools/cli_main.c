/* cli_main.c (fixture): a static named like common's exported td_parse; tools include
 * another module's public headers only. */
#include "pf_pub.h"
#include "rt_b.h" /* EXPECT: public-header */

static int td_parse(const char *s) /* EXPECT: static-clash */
{
    return s[0] - '0';
}

int main(void)
{
    return td_parse("0");
}
