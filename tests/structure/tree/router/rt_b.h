/* rt_b.h (fixture) */
#ifndef RT_B_H
#define RT_B_H
int rt_b(void);
#endif
