/* pf_y.h (fixture) */
int pf_y(void);
