/* jn_chat.c: transformers' preparation of a conversation for its chat template (jn_chat.h). */
#include "jn_chat.h"

#include <stdio.h>
#include <string.h>

#include "td_err.h"

static json_t *fail(jn_error *err, const char *msg)
{
    if (err) {
        err->line = 0;
        snprintf(err->msg, sizeof err->msg, "%s", msg);
    }
    return NULL;
}

/* One message: null-valued keys dropped; reasoning under `thinking` (first) and
 * `reasoning_content` (in its place, or last). */
static json_t *message(const json_t *m)
{
    static const char *const fields[] = {"reasoning_content", "thinking", "reasoning"};
    json_t *reasoning = NULL, *out = json_object();
    if (!out) return NULL;
    for (int i = 0; i < 3 && !reasoning; i++) {
        json_t *r = json_object_get(m, fields[i]);
        if (r && !json_is_null(r)) reasoning = r;
    }
    if (reasoning && json_object_set(out, "thinking", reasoning)) goto oom;
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)m, k, v)
    {
        if (json_is_null(v)) continue;
        if (reasoning && (!strcmp(k, "thinking") || !strcmp(k, "reasoning_content"))) v = reasoning;
        if (json_object_set(out, k, v)) goto oom;
    }
    if (reasoning && json_object_set(out, "reasoning_content", reasoning)) goto oom;
    return out;
oom:
    json_decref(out);
    return NULL;
}

json_t *jn_chat_vars(const jn_chat *chat, jn_error *err)
{
    if (!json_is_array(chat->messages)) return fail(err, "messages must be an array");
    if (chat->tools && !json_is_array(chat->tools)) return fail(err, "tools must be an array");
    if (chat->kwargs && !json_is_object(chat->kwargs))
        return fail(err, "chat_template_kwargs must be an object");
    json_t *vars = json_object(), *msgs = json_array();
    if (!vars || !msgs) goto oom;
    for (size_t i = 0; i < json_array_size(chat->messages); i++) {
        json_t *m = json_array_get(chat->messages, i);
        if (!json_is_object(m)) {
            json_decref(vars);
            json_decref(msgs);
            return fail(err, "each message must be an object");
        }
        if (json_array_append_new(msgs, message(m))) goto oom;
    }
    if (json_object_set_new(vars, "messages", msgs)) {
        msgs = NULL;
        goto oom;
    }
    msgs = NULL;
    if (json_object_set_new(vars, "tools",
                            chat->tools ? json_incref((json_t *)chat->tools) : json_null()) ||
        json_object_set_new(vars, "documents", json_null()) ||
        json_object_set_new(vars, "add_generation_prompt",
                            json_boolean(chat->add_generation_prompt)))
        goto oom;
    if (chat->bos_token && json_object_set_new(vars, "bos_token", json_string(chat->bos_token)))
        goto oom;
    if (chat->eos_token && json_object_set_new(vars, "eos_token", json_string(chat->eos_token)))
        goto oom;
    if (chat->kwargs && json_object_update(vars, (json_t *)chat->kwargs)) goto oom;
    return vars;
oom:
    json_decref(vars);
    json_decref(msgs);
    return fail(err, "out of memory");
}

int jn_chat_render(const jn_template *t, const jn_chat *chat, const jn_opts *opts, char **out,
                   size_t *len, jn_error *err)
{
    *out = NULL;
    json_t *vars = jn_chat_vars(chat, err);
    if (!vars) return err && strcmp(err->msg, "out of memory") ? TD_EINVAL : TD_ENOMEM;
    int rc = jn_render(t, vars, opts, out, len, err);
    json_decref(vars);
    return rc;
}
