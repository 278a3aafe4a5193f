/* rt_format.c: response_format -> the request's grammar (rt_format.h). */
#include "rt_format.h"

#include <stdlib.h>
#include <string.h>

#include "gr_grammar.h"
#include "td_err.h"

static int bad_format(rt_error *e, const char *msg)
{
    return rt_error_set(e, 400, "response_format", NULL, "%s", msg);
}

/* json_schema's object: name (string), description (string), schema (object), strict */
static int parse_json_schema(json_t *js, td_sampling *sp, char **text, rt_error *e)
{
    if (!json_is_object(js))
        return bad_format(e, "response_format 'json_schema' must be an object with a 'schema'");
    const char *key;
    json_t *v;
    json_object_foreach(js, key, v)
    {
        if (strcmp(key, "name") && strcmp(key, "description") && strcmp(key, "schema") &&
            strcmp(key, "strict"))
            return rt_error_set(e, 400, "response_format", "unsupported_parameter",
                                "'response_format.json_schema.%.64s' is not supported", key);
    }
    v = json_object_get(js, "name");
    if (v && !json_is_string(v))
        return bad_format(e, "response_format.json_schema.name must be a string");
    json_t *strict = json_object_get(js, "strict"), *schema = json_object_get(js, "schema");
    if (strict && !json_is_boolean(strict) && !json_is_null(strict))
        return bad_format(e, "response_format.json_schema.strict must be a boolean");
    if (!json_is_object(schema))
        return bad_format(e, "response_format.json_schema.schema must be a JSON schema object");
    bool is_strict = json_is_true(strict);
    char err[256];
    gr_grammar *g = NULL;
    int rc = gr_compile_schema(schema, is_strict, &g, err, sizeof err);
    gr_grammar_unref(g);
    if (rc == TD_ENOMEM) return rt_error_set(e, 500, NULL, NULL, "out of memory");
    if (rc)
        return rt_error_set(e, 400, "response_format",
                            rc == TD_EUNSUPP ? "unsupported_parameter" : NULL,
                            "response_format.json_schema.schema: %s", err);
    *text = json_dumps(schema, JSON_COMPACT);
    if (!*text) return rt_error_set(e, 500, NULL, NULL, "out of memory");
    if (strlen(*text) > GR_MAX_TEXT)
        return rt_error_set(e, 400, "response_format", NULL,
                            "response_format.json_schema.schema is longer than %d bytes",
                            GR_MAX_TEXT);
    sp->grammar_kind = is_strict ? TD_GRAMMAR_JSON_SCHEMA_STRICT : TD_GRAMMAR_JSON_SCHEMA;
    sp->grammar = *text;
    return 0;
}

int rt_format_parse(json_t *o, td_sampling *sp, char **text, rt_error *e)
{
    json_t *rf = json_object_get(o, "response_format");
    if (!rf || json_is_null(rf)) return 0;
    json_t *t = json_object_get(rf, "type");
    if (!json_is_object(rf) || !json_is_string(t))
        return bad_format(e, "'response_format' must be an object with a 'type'");
    const char *type = json_string_value(t), *key;
    json_t *v;
    json_object_foreach(rf, key, v)
    {
        if (strcmp(key, "type") &&
            !(strcmp(type, "json_schema") == 0 && !strcmp(key, "json_schema")))
            return rt_error_set(e, 400, "response_format", "unsupported_parameter",
                                "'response_format.%.64s' is not supported with type '%.32s'", key,
                                type);
    }
    if (!strcmp(type, "text")) return 0;
    if (!strcmp(type, "json_object")) {
        sp->grammar_kind = TD_GRAMMAR_JSON_OBJECT;
        return 0;
    }
    if (!strcmp(type, "json_schema"))
        return parse_json_schema(json_object_get(rf, "json_schema"), sp, text, e);
    return rt_error_set(e, 400, "response_format", NULL,
                        "response_format type '%.32s' is not one of text, json_object, json_schema",
                        type);
}
