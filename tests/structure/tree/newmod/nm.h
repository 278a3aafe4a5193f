/* nm.h (fixture): a module with no entry in PREFIXES. */
typedef struct {
    int a;
} nm_thing; /* EXPECT: type-prefix */
