#!/usr/bin/env python3
"""template_reference.py: renders a chat template as HF transformers' apply_chat_template does.

The reference side of issue 41 (tests/templates/README.md): the C engine's rendering of a
template must equal this one byte for byte.

What apply_chat_template(conversation, tools=..., add_generation_prompt=..., tokenize=False,
**kwargs) does, and so what this does:
  - drops the message keys whose value is None (`"content": null` is the same as no content);
  - renders with the environment transformers compiles (`_compile_jinja_template`):
    ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=
    [AssistantTracker ({% generation %}), loopcontrols]), its own `tojson` (json.dumps,
    ensure_ascii=False, with indent/separators/sort_keys), the globals raise_exception,
    strftime_now, `dict` and a `namespace` that refuses underscore names;
  - passes messages, tools (None when there are none), documents (None), add_generation_prompt,
    the tokenizer's special tokens (here bos_token and eos_token, when given) and every extra
    keyword (chat_template_kwargs such as enable_thinking; they win over the special tokens);
  - copies a message's reasoning (reasoning_content, thinking or reasoning) under both
    `reasoning_content` and `thinking` (transformers >= 5: `_alias_reasoning_fields`).
With transformers importable its own functions do all of this (`render_jinja_template`), so
the reference follows the installed version; without it, a copy of the same environment made
here from jinja2 alone (`backend="jinja2"`, written after transformers 5.23.0) takes its place.

The one change: strftime_now uses a fixed instant when `now` (Unix seconds) is given, in UTC
(datetime.fromtimestamp(now, timezone.utc)), so renderings that print the date are
reproducible; the C side's `--now EPOCH` means the same. Without `now` it is transformers' own
(the local time, now).

Usage: template_reference.py --template FILE [--messages FILE.json] [--tools FILE.json]
         [--add-generation-prompt] [--kwargs JSON] [--bos S] [--eos S] [--now EPOCH]
         [--backend auto|hf|jinja2]
  --messages: a JSON array of messages (or an object with a "messages" key, such as a
  tests/templates/conversations fixture); --tools: a JSON array of tools; --kwargs: a JSON
  object of extra template variables. Writes the rendering to stdout as UTF-8, nothing added.
  Exit status 0; 3 when the template raised (its exception type and message on stderr);
  2 on bad usage or unreadable inputs.
As a module: render(template_text, messages, tools, add_generation_prompt, kwargs, bos, eos,
now) -> str, which raises whatever the template raises.
"""
import argparse
import datetime
import json
import os
import sys

# transformers logs an advisory on import when PyTorch is absent; it would land in the
# CLI's stderr, which the harness shows as the reference's error text
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _strftime_now(now):
    """The strftime_now global: at the fixed instant `now` in UTC, or transformers' own
    (local time, now) when `now` is None."""
    if now is None:
        return lambda fmt: datetime.datetime.now().strftime(fmt)
    at = datetime.datetime.fromtimestamp(now, datetime.timezone.utc)
    return lambda fmt: at.strftime(fmt)


def _hf_module():
    """transformers' chat template module, or None when transformers cannot be imported."""
    try:
        from transformers.utils import chat_template_utils
    except Exception:  # ImportError, or a broken install: either way, not usable
        return None
    if not hasattr(chat_template_utils, "render_jinja_template"):
        return None  # older than 4.43: no separate rendering function to reuse
    return chat_template_utils


# ---- the jinja2-only copy of transformers' environment -------------------------------------
# Used where transformers is missing. It follows transformers 5.23.0's
# _cached_compile_jinja_template; `backend="jinja2"` exercises it next to the real one.
_JINJA_CACHE = {}


def _jinja2_compile(template_text):
    if template_text in _JINJA_CACHE:
        return _JINJA_CACHE[template_text]
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        # {% generation %}...{% endgeneration %} marks assistant text for training masks;
        # when rendering it only renders its body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                    f"but got {name!r}. Please rename the attribute.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now(None)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    tmpl = env.from_string(template_text)
    _JINJA_CACHE[template_text] = tmpl
    return tmpl


def _alias_reasoning(messages):
    # transformers 5's _alias_reasoning_fields, key order included (a template iterating over
    # a message's items sees `thinking` first)
    out = []
    for m in messages:
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _jinja2_render(template_text, messages, tools, add_generation_prompt, template_kwargs, now):
    tmpl = _jinja2_compile(template_text)
    tmpl.environment.globals["strftime_now"] = _strftime_now(now)
    # render_jinja_template works on a fresh copy; the JSON round trip makes one of plain types
    messages = _alias_reasoning(json.loads(json.dumps(messages)))
    return tmpl.render(messages=messages, tools=tools, documents=None,
                       add_generation_prompt=add_generation_prompt, **template_kwargs)


def _hf_render(hf, template_text, messages, tools, add_generation_prompt, template_kwargs, now):
    # render_jinja_template compiles through the lru_cached _compile_jinja_template, so the
    # template object fetched here is the one it renders with: its environment (made for this
    # template alone) gets the fixed clock
    tmpl = hf._compile_jinja_template(template_text)
    tmpl.environment.globals["strftime_now"] = _strftime_now(now)
    out = hf.render_jinja_template(conversations=[messages], tools=tools,
                                   chat_template=template_text,
                                   add_generation_prompt=add_generation_prompt, **template_kwargs)
    rendered = out[0] if isinstance(out, tuple) else out  # (renderings, generation indices)
    return rendered[0]


def render(template_text, messages, tools=None, add_generation_prompt=False, kwargs=None,
           bos=None, eos=None, now=None, backend="auto"):
    """The template's rendering of the conversation, as apply_chat_template(tokenize=False)
    returns it. tools: a list or None; kwargs: extra template variables (dict or None);
    bos/eos: the special tokens, left undefined when None; now: Unix seconds for strftime_now
    (UTC), or None for the real clock. backend: "hf" (transformers, required), "jinja2" (the
    copy here), "auto" (transformers when importable). Raises what the template raises."""
    # apply_chat_template's own normalization, before anything else sees the messages
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    template_kwargs = {}
    if bos is not None:
        template_kwargs["bos_token"] = bos
    if eos is not None:
        template_kwargs["eos_token"] = eos
    template_kwargs.update(kwargs or {})  # as in transformers, kwargs win over special tokens
    if backend not in ("auto", "hf", "jinja2"):
        raise ValueError(f"unknown backend {backend!r}")
    hf = None if backend == "jinja2" else _hf_module()
    if hf is None and backend == "hf":
        raise ImportError("transformers (with render_jinja_template) is not importable")
    if hf is not None:
        return _hf_render(hf, template_text, messages, tools, add_generation_prompt,
                          template_kwargs, now)
    return _jinja2_render(template_text, messages, tools, add_generation_prompt, template_kwargs,
                          now)


def backend_name(backend="auto"):
    """Which implementation render(backend=backend) uses, for logs: "transformers X.Y.Z" or
    "jinja2 X.Y.Z (transformers' environment copied)"."""
    if backend != "jinja2" and _hf_module() is not None:
        import transformers
        return f"transformers {transformers.__version__}"
    import jinja2
    return f"jinja2 {jinja2.__version__} (transformers' environment copied)"


def read_template(path):
    """The template file's text as transformers gets it from tokenizer_config.json: UTF-8,
    line ends untouched (newline='' keeps a \\r\\n for jinja's own lexer to normalize)."""
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def _load_json(path, what):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(_usage_error(f"{what} {path}: {e}"))


def _usage_error(msg):
    print(f"template_reference: {msg}", file=sys.stderr)
    return 2


def main(argv=None):
    ap = argparse.ArgumentParser(description="render a chat template as transformers does")
    ap.add_argument("--template", required=True, help="the .jinja file")
    ap.add_argument("--messages", help="JSON array of messages (default: [])")
    ap.add_argument("--tools", help="JSON array of tools (default: none, tools=None)")
    ap.add_argument("--add-generation-prompt", action="store_true")
    ap.add_argument("--kwargs", help="JSON object of extra template variables")
    ap.add_argument("--bos", help="bos_token (default: undefined)")
    ap.add_argument("--eos", help="eos_token (default: undefined)")
    ap.add_argument("--now", type=int, help="Unix seconds for strftime_now, in UTC")
    ap.add_argument("--backend", default="auto", choices=("auto", "hf", "jinja2"))
    a = ap.parse_args(argv)
    try:
        text = read_template(a.template)
    except (OSError, UnicodeDecodeError) as e:
        return _usage_error(f"template {a.template}: {e}")
    messages = _load_json(a.messages, "messages") if a.messages else []
    if isinstance(messages, dict) and "messages" in messages:
        messages = messages["messages"]
    tools = _load_json(a.tools, "tools") if a.tools else None
    try:
        kwargs = json.loads(a.kwargs) if a.kwargs else {}
    except ValueError as e:
        return _usage_error(f"--kwargs: {e}")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return _usage_error("messages must be a JSON array of objects")
    if tools is not None and not isinstance(tools, list):
        return _usage_error("tools must be a JSON array")
    if not isinstance(kwargs, dict):
        return _usage_error("--kwargs must be a JSON object")
    try:
        out = render(text, messages, tools, a.add_generation_prompt, kwargs, a.bos, a.eos, a.now,
                     a.backend)
    except ImportError as e:
        return _usage_error(str(e))
    except Exception as e:  # whatever the template raised: syntax, undefined, raise_exception...
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 3
    sys.stdout.buffer.write(out.encode("utf-8"))
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
