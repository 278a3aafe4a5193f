/* jn_chat.c: transformers' preparation of a conversation for its chat template (jn_chat.h). */
#include "jn_chat.h"

#include <stdio.h>
#include <stdlib.h>
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

/* One message as transformers makes it: null-valued keys dropped, then the reasoning (the
 * first of reasoning_content, thinking, reasoning that is set) as
 * {"thinking": r, **message, "reasoning_content": r}: `thinking` first unless the message
 * has its own, `reasoning_content` in its place or last. */
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
        /* the message's own `thinking` wins over the copy (Python's {"thinking": r, **m}) */
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

/* ---- built-in templates ---- */

static const char chatml[] =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}";

static const char llama3[] =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = "
    "bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

static const char llama2[] =
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set "
    "system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if "
    "(message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation "
    "roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 "
    "== 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] "
    "%}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() "
    "+ ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + "
    "eos_token }}{% endif %}{% endfor %}";

static const char gemma[] =
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = "
    "messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}{% else %}{% set "
    "first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}{% for message in "
    "loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ "
    "raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set "
    "role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n' + "
    "(first_user_prefix if loop.first else '') }}{{ message['content'] | trim }}{{ "
    "'<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' "
    "}}{% endif %}";

const char *jn_family_template(const char *family)
{
    if (!family) return NULL;
    if (!strcmp(family, "chatml")) return chatml;
    if (!strcmp(family, "llama3")) return llama3;
    if (!strcmp(family, "llama2")) return llama2;
    if (!strcmp(family, "gemma")) return gemma;
    return NULL;
}

/* ---- special tokens ---- */

int jn_special_init(jn_special *s, const td_tokenizer *tok)
{
    *s = (jn_special){0};
    int32_t ids[2] = {td_tok_bos(tok), td_tok_eos(tok)};
    char **dst[2] = {&s->bos, &s->eos};
    for (int k = 0; k < 2; k++) {
        size_t n;
        const char *p = ids[k] >= 0 ? td_tok_piece(tok, ids[k], &n) : NULL;
        if (p && !(*dst[k] = strndup(p, n))) {
            jn_special_fini(s);
            return TD_ENOMEM;
        }
    }
    return 0;
}

void jn_special_fini(jn_special *s)
{
    free(s->bos);
    free(s->eos);
    *s = (jn_special){0};
}

int jn_chat_render_user(const char *tmpl, size_t len, const char *user, const jn_special *s,
                        char **out, jn_error *err)
{
    *out = NULL;
    jn_template *t = NULL;
    int rc = jn_parse(tmpl, len, &t, err);
    if (rc) return rc;
    json_t *msgs = json_pack("[{s:s, s:s}]", "role", "user", "content", user);
    if (!msgs) rc = TD_ENOMEM;
    jn_chat chat = {.messages = msgs,
                    .add_generation_prompt = true,
                    .bos_token = s ? s->bos : NULL,
                    .eos_token = s ? s->eos : NULL};
    if (!rc) rc = jn_chat_render(t, &chat, NULL, out, NULL, err);
    json_decref(msgs);
    jn_template_free(t);
    return rc;
}
