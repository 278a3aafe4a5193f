/* pf_x.h (fixture) */
int pf_x(void);
