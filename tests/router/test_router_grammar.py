#!/usr/bin/env python3
"""test_router_grammar.py: structured output (response_format json_object / json_schema) with
the official `openai` client against tandem-router + one tp1 decode instance (colocated):
20 seeded samples at temperature 1.0 per schema all parse with json.loads and validate with
`jsonschema`, streamed and not, chat and completions; json_object outputs parse; an
unsupported schema keyword is a 400 that names it.

usage: test_router_grammar.py --router BIN --decode BIN --tandem BIN --synth GGUF --model GGUF
"""
import argparse
import concurrent.futures
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
import jsonschema  # noqa: E402
import openai  # noqa: E402
from rtlib import Cluster  # noqa: E402
from tdtest.checks import FAILS, check  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "city": {"type": ["string", "null"], "maxLength": 20},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "city", "tags", "role"],
    "additionalProperties": False,
}

# $ref through $defs and definitions, anyOf, const; recursion is covered by the unit tests
# (a 135M model nests a recursive schema until max_tokens)
TREE = {
    "$ref": "#/$defs/node",
    "$defs": {"node": {"type": "object", "properties": {
        "kind": {"const": "node"},
        "value": {"anyOf": [{"type": "number"}, {"type": "boolean"}]},
        "children": {"type": "array", "items": {"$ref": "#/definitions/leaf"}, "maxItems": 2}},
        "required": ["kind", "value", "children"], "additionalProperties": False}},
    "definitions": {"leaf": {"type": "object", "properties": {
        "label": {"type": "string", "maxLength": 16}, "on": {"type": "boolean"}},
        "required": ["label"], "additionalProperties": False}},
}


def fmt(schema, strict=True):
    return {"type": "json_schema",
            "json_schema": {"name": "t", "schema": schema, "strict": strict}}


def sample(client, mid, chat, rf, seed, stream, max_tokens=160):
    kw = dict(model=mid, max_tokens=max_tokens, temperature=1.0, seed=seed)
    if chat:
        r = client.chat.completions.create(
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            stream=stream, response_format=rf, **kw)
    else:  # the client's completions have no response_format argument (vLLM's extra_body)
        r = client.completions.create(prompt="A JSON record:", stream=stream,
                                      extra_body={"response_format": rf}, **kw)
    if not stream:
        c = r.choices[0]
        return (c.message.content if chat else c.text), c.finish_reason
    text, fin = "", None
    for ch in r:
        if not ch.choices:
            continue
        c = ch.choices[0]
        text += (c.delta.content or "") if chat else (c.text or "")
        fin = c.finish_reason or fin
    return text, fin


def check_schema(client, mid, name, schema, strict):
    bad = []
    # 8 at a time: the decode node batches them (a 2-core ASan run would take minutes one by
    # one); each output is checked on its own, so batching changes nothing checked here
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(lambda i: sample(client, mid, i % 2 == 0, fmt(schema, strict),
                                            1000 + i, i % 4 < 2), range(20)))
    for i, (text, fin) in enumerate(outs):
        try:
            jsonschema.validate(json.loads(text), schema)
            if fin != "stop":
                bad.append((i, f"finish {fin}", text))
        except (ValueError, jsonschema.ValidationError) as e:
            bad.append((i, str(e)[:80], text))
    check(not bad, f"{name}: 20 sampled outputs at temperature 1.0 parse and validate"
          + ("" if not bad else f": {bad[:2]}"))


def run(args):
    with Cluster(args, args.model) as cl:
        client = openai.OpenAI(base_url=cl.url + "/v1", api_key="unused", max_retries=0,
                               timeout=300)
        mid = client.models.list().data[0].id
        check_schema(client, mid, "person (strict)", PERSON, True)
        check_schema(client, mid, "tree ($ref recursion, anyOf)", TREE, False)
        bad = []
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            outs = list(ex.map(lambda i: sample(client, mid, i % 2 == 0, {"type": "json_object"},
                                                2000 + i, i % 3 == 0, max_tokens=200), range(20)))
        for i, (text, fin) in enumerate(outs):
            try:
                ok = isinstance(json.loads(text), dict) and fin == "stop"
            except ValueError:
                ok = fin == "length"  # cut by max_tokens: a prefix, as vLLM
            if not ok:
                bad.append((i, fin, text))
        check(not bad, "json_object: outputs parse (or were cut by max_tokens)"
              + ("" if not bad else f": {bad[:2]}"))
        # max_tokens cuts the document: finish_reason length, the output a prefix
        text, fin = sample(client, mid, True, fmt(PERSON), 7, False, max_tokens=5)
        check(fin == "length" and text.startswith("{"),
              f"max_tokens 5 cuts it: length, a prefix ({fin}, {text!r})")
        for rf, word in [(fmt({"type": "string", "pattern": "^a"}), "'pattern'"),
                         (fmt({"type": "object", "properties": {
                             "x": {"type": "number", "minimum": 1}}}), "'minimum'"),
                         ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
                         ({"type": "yaml"}, "yaml")]:
            try:
                client.chat.completions.create(model=mid, messages=[{"role": "user",
                                                                     "content": "x"}],
                                               max_tokens=4, response_format=rf)
                check(False, f"an unsupported response_format is a 400 naming {word}")
            except openai.BadRequestError as e:
                msg = (e.body or {}).get("message", "") if isinstance(e.body, dict) else ""
                check(e.status_code == 400 and word in msg,
                      f"an unsupported response_format is a 400 naming {word} ({msg})")
        r = client.chat.completions.create(model=mid, messages=[{"role": "user", "content": "x"}],
                                           max_tokens=4, temperature=0,
                                           response_format={"type": "text"})
        check(r.choices[0].finish_reason in ("stop", "length"), "response_format text works")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--router", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--synth", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    t0 = time.time()
    run(args)
    print(f"{len(FAILS)} failures, {time.time() - t0:.1f} s")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
