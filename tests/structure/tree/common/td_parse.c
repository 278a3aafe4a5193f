/* td_parse.c (fixture): an exported function another module's static must not shadow. */
int td_parse(const char *s)
{
    return s[0];
}

int main(void) /* main: one per program, in several modules */
{
    return td_parse("x");
}
