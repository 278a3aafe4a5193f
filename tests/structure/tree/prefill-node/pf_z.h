/* pf_z.h (fixture) */
#include "pf_int.h"
int pf_z(void);
