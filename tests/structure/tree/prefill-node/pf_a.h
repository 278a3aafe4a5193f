/* pf_a.h (fixture): two headers that include each other. */
#include "pf_b.h" /* EXPECT: include-cycle */
int pf_a(void);
