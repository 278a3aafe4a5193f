/* pf_b.h (fixture) */
#include "pf_a.h"
int pf_b(void);
