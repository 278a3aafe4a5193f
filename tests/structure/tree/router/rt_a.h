/* rt_a.h (fixture) */
#ifndef RT_A_H
#define RT_A_H
int rt_a(void);
#endif
