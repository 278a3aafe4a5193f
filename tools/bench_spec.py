#!/usr/bin/env python3
"""bench_spec.py: speculative decoding by prompt lookup (decode[].speculative, method ngram)
on input-grounded chat requests (or by a draft model on code completion: --draft,
--prompt-set), against itself turned off and against llama.cpp's llama-server with and
without its own lookup decoding (or draft model), on one machine (BENCHMARKING.md:
every figure is a ratio of runs made in the same invocation).

Workload: PROMPTS below, 8 fixed code-editing requests (rename a variable, add type hints,
loops to comprehensions, var to const and arrow functions, print to logging, %-format to
f-strings, wrap Go errors, rename a C field), each with a 36-59 line snippet that the
answer mostly copies; system message SYSTEM; greedy (temperature 0); at most --max-tokens
output tokens (no ignore_eos: after its answer a model would ramble, which lookup would
flatter or not). --prompt-set complete: COMPLETE_PROMPTS instead, 8 code-completion
requests (a signature and a docstring to complete: new code, the draft model's case).
Streamed /v1/chat/completions over http.client, one connection a request (the client's CPU
stays small next to the servers' on the shared cores).

Configurations (--configs), each a fresh server, in the order given (default: k4 on off k8
llama_spec llama_off, so that each pair of a ratio runs close together), reversed every
other round (A B C D, D C B A) so that drift hits all alike:
  on          Tandem, speculative {method: ngram} (adaptive; max_tokens 8, ngram 2..4)
  k4, k8      Tandem, {method: ngram, adaptive: false, max_tokens: 4 | 8} (pinned k)
  n8, n1      Tandem, {method: ngram, ngram_max: 8} | {method: ngram, ngram_min: 1} (adaptive:
              longer suffixes looked up, or single tokens too)
  draft       Tandem, {method: draft, draft: --draft GGUF} (adaptive; e.g. Qwen2.5-Coder-0.5B)
  mtp         Tandem, {method: mtp}: the model's own multi-token prediction block (a deepseek2
              GGUF with nextn layers, e.g. make_synth.py's deepseek2-mtp-echo at bench size)
  nogate, mtp_nogate  on and mtp without the measured gate ({gate: false}: the cost model's
              choice alone)
  off         Tandem, {method: off}
  off2        the same as off in a process of its own: the control (off2/off is the spread
              between two servers of one build doing the same work)
  llama_spec  llama-server with --llama-spec (default LLAMA_SPEC_DEFAULT: see LLAMA_SWEEP)
  llama_off   llama-server without speculation
  llama_draft llama-server with a draft model (--llama-draft GGUF, e.g. Qwen2.5-Coder-0.5B;
              --llama-draft-args): a reference figure only, not in the default set
  llama_mtp   llama-server with the model's MTP block (--spec-type draft-mtp
              --spec-draft-n-max 8)
Tandem: `tandem up --no-restart --port FREE` on a copy of --config
(deploy/local-colocated.yaml) with model: --model, every decode instance's threads:
--threads and its speculative block as above (--spec-key omit leaves it out, for a build
that does not parse it: every configuration then runs the build's default), cpu_act:
--cpu-act when given (else the config's, else TANDEM_CPU_ACT, else f32). llama-server: -m
--model -t/-tb --threads -np (largest batch) -c (largest batch x --slot-ctx) on 127.0.0.1,
its defaults otherwise (flash attention auto, prompt cache on). The YAML copies, run
directories and logs go to ~/.cache/tandem/bench-spec/roundN/.

Each server: a warm-up request (another prompt, 32 tokens), then for each of --batches:
  1   every prompt once, one after the other: prompts the server has not seen
  B   B concurrent clients, B x --per-client requests, prompt k mod len(PROMPTS) (the set
      cycled). The batch-1 phase prefilled these prompts: Tandem's prefix cache then holds
      all of them, llama-server's only in the slots that served them (it prefills the
      others again). --fresh: a tag at the start of each request's system message, so no
      two requests share a prefix (both servers prefill every request).
Per run: out tok/s (completion tokens / the phase's wall time, prefill included), stream
tok/s (sum of (tokens - 1) / sum of (last chunk - first chunk) over the requests: the decode
rate one stream sees, prefill excluded), TTFT p50, tokens per request, wall time, the
1-minute load average before the phase (other jobs show there), llama-server's draft
acceptance (its timings: draft_n_accepted / draft_n) and any router /metrics series named
*spec* (their change over the phase). Then per batch the medians over rounds and the
ratios (median, and each round's) of the configurations that ran: on/off, draft/off,
draft/on, k4/off, k8/off, n8/off, n1/off, n8/on, n1/on, llama_spec/llama_off,
llama_draft/llama_off, on/llama_spec, draft/llama_draft, off/llama_off, on/llama_off, mtp/off,
llama_mtp/llama_off, mtp/llama_mtp, off2/off, on/off2.
Text check: each answer of on, k4, k8, n8 and n1 at batch 1 must equal off's answer to the same
prompt in the same round, byte for byte (speculation must not change greedy output); a
difference prints MISMATCH with where it starts, and the exit status is 2. Batched, the
comparison is information only: a prompt's prefill rows share steps with other requests'
(decode[].deterministic false) and their rounding may change its text whatever the
speculation (off itself answered a prompt two ways in one batch-16 run). The agreement
of llama_spec with llama_off and of off with llama_off is printed as information.

llama-server's lookup decoding (llama.cpp of the llama-cpp-python 0.3.36 sdist, `--help`,
common/speculative.cpp, common/ngram-*.cpp, docs/speculative.md): --spec-type ngram-simple
| ngram-map-k | ngram-map-k4v | ngram-mod | ngram-cache (also draft-simple with -md). All
draft from the slot's whole context (prompt + output); ngram-mod's hash pool is shared by
all slots and kept across requests (it would learn earlier answers to the cycled prompts);
--spec-draft-n-max bounds only draft models (the ngram types use their own size_m / n_max).
--sweep-llama runs batch 1 with each LLAMA_SWEEP setting and without (one round unless
--rounds; --sweep-set NAMES for some of them) to choose --llama-spec.

usage: tools/bench_spec.py [--build build] [--config deploy/local-colocated.yaml]
         [--model GGUF] [--llama-bin DIR] [--configs k4,on,off,k8,llama_spec,llama_off]
         [--configs-batched on,off,llama_spec,llama_off] [--batches 1,16] [--rounds 2]
         [--max-tokens 256] [--prompts N|NAMES] [--per-client 1] [--fresh] [--threads 2]
         [--cpu-act f32|q8|auto] [--spec-key set|omit] [--llama-spec FLAGS]
         [--draft GGUF] [--prompt-set edit|complete]
         [--llama-draft GGUF] [--llama-args FLAGS] [--json-out FILE]
       tools/bench_spec.py --sweep-llama [--sweep-set NAMES] [--prompts ...] [--max-tokens N]
"""
import argparse
import atexit
import concurrent.futures as cf
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from tdtest.ports import free_port  # noqa: E402
from tdtest.procs import alive  # noqa: E402

SYSTEM = ("You are a careful coding assistant. Answer with the complete modified code in one "
          "fenced code block and nothing else.")
WARMUP = ("Write a Python function that returns the n-th Fibonacci number.", 32)

# (name, language, instruction, code): the input-grounded requests; the answer copies most
# of the code, so prompt lookup has something to find.
PROMPTS = [
    ("rename", "python",
     "Rename the variable `x` to `total_weight` everywhere in this function. Change nothing else.",
     '''def summarize_shipments(shipments, max_weight=1000.0):
    """Group shipments by destination and flag the overweight ones."""
    by_dest = {}
    flagged = []
    x = 0.0
    for s in shipments:
        dest = s.get("destination", "unknown")
        weight = float(s.get("weight", 0.0))
        if weight < 0:
            raise ValueError(f"negative weight in shipment {s.get('id')}")
        x += weight
        entry = by_dest.setdefault(dest, {"count": 0, "weight": 0.0, "ids": []})
        entry["count"] += 1
        entry["weight"] += weight
        entry["ids"].append(s.get("id"))
        if weight > max_weight:
            flagged.append((s.get("id"), dest, weight))
    report = []
    for dest in sorted(by_dest):
        entry = by_dest[dest]
        share = entry["weight"] / x if x else 0.0
        report.append({
            "destination": dest,
            "count": entry["count"],
            "weight": round(entry["weight"], 2),
            "share": round(share, 4),
            "ids": entry["ids"],
        })
    heaviest = max(report, key=lambda r: r["weight"]) if report else None
    return {
        "total": round(x, 2),
        "destinations": report,
        "heaviest": heaviest["destination"] if heaviest else None,
        "flagged": flagged,
        "mean": x / len(shipments) if shipments else 0.0,
    }
'''),
    ("type_hints", "python",
     "Add type hints to every function signature in this module (parameters and return "
     "types). Keep the code otherwise unchanged.",
     '''import json
import os
from collections import defaultdict


def load_config(path, defaults=None):
    cfg = dict(defaults or {})
    if os.path.exists(path):
        with open(path) as f:
            cfg.update(json.load(f))
    return cfg


def parse_line(line, sep=","):
    parts = [p.strip() for p in line.split(sep)]
    if len(parts) < 3:
        return None
    name, count, price = parts[0], int(parts[1]), float(parts[2])
    return name, count, price


def read_orders(path, sep=","):
    orders = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip() or line.startswith("#"):
                continue
            rec = parse_line(line, sep)
            if rec is None:
                print(f"{path}:{lineno}: skipped")
                continue
            orders.append(rec)
    return orders


def totals_by_name(orders):
    totals = defaultdict(float)
    for name, count, price in orders:
        totals[name] += count * price
    return dict(totals)


def top_items(totals, n=5):
    ranked = sorted(totals.items(), key=lambda kv: kv[1], reverse=True)
    return [name for name, _ in ranked[:n]]


def write_report(path, totals, top):
    with open(path, "w") as f:
        json.dump({"totals": totals, "top": top}, f, indent=2, sort_keys=True)
'''),
    ("comprehension", "python",
     "Convert the loops that build lists or dicts in this code into list or dict "
     "comprehensions where that is possible. Keep the behaviour identical.",
     '''def active_user_emails(users):
    emails = []
    for u in users:
        if u["active"] and u.get("email"):
            emails.append(u["email"].lower())
    return emails


def squares_of_odds(numbers):
    result = []
    for n in numbers:
        if n % 2 == 1:
            result.append(n * n)
    return result


def index_by_id(records):
    index = {}
    for r in records:
        index[r["id"]] = r
    return index


def word_lengths(text):
    lengths = {}
    for word in text.split():
        word = word.strip(".,;:!?").lower()
        if word:
            lengths[word] = len(word)
    return lengths


def flatten(matrix):
    flat = []
    for row in matrix:
        for value in row:
            flat.append(value)
    return flat


def pairs_below(limit):
    pairs = []
    for a in range(limit):
        for b in range(a + 1, limit):
            if a * b < limit:
                pairs.append((a, b))
    return pairs


def celsius_to_fahrenheit(readings):
    converted = []
    for name, celsius in readings:
        converted.append((name, celsius * 9 / 5 + 32))
    return converted
'''),
    ("rename_c", "c",
     "Rename the struct field `len` to `count` and the function `rb_put` to `ring_push` "
     "everywhere in this C code. Change nothing else.",
     '''#include <stdbool.h>
#include <stddef.h>
#include <string.h>

#define RB_CAP 64

typedef struct {
    int items[RB_CAP];
    size_t head; /* index of the oldest item */
    size_t len;  /* items held */
} ring;

void rb_init(ring *r)
{
    memset(r, 0, sizeof *r);
}

bool rb_full(const ring *r)
{
    return r->len == RB_CAP;
}

bool rb_empty(const ring *r)
{
    return r->len == 0;
}

bool rb_put(ring *r, int v)
{
    if (rb_full(r)) return false;
    r->items[(r->head + r->len) % RB_CAP] = v;
    r->len++;
    return true;
}

bool rb_get(ring *r, int *out)
{
    if (rb_empty(r)) return false;
    *out = r->items[r->head];
    r->head = (r->head + 1) % RB_CAP;
    r->len--;
    return true;
}

size_t rb_put_many(ring *r, const int *v, size_t n)
{
    size_t i = 0;
    while (i < n && rb_put(r, v[i])) i++;
    return i;
}

int rb_sum(const ring *r)
{
    int s = 0;
    for (size_t i = 0; i < r->len; i++) s += r->items[(r->head + i) % RB_CAP];
    return s;
}
'''),
    ("js_modern", "javascript",
     "Modernize this JavaScript: replace `var` with `const` or `let` as appropriate and turn "
     "the anonymous `function` callbacks into arrow functions. Keep the logic the same.",
     '''var express = require("express");
var fs = require("fs");
var path = require("path");

var app = express();
var DATA_DIR = path.join(__dirname, "data");

function readJson(file, callback) {
  fs.readFile(path.join(DATA_DIR, file), "utf8", function (err, text) {
    if (err) {
      return callback(err);
    }
    var parsed;
    try {
      parsed = JSON.parse(text);
    } catch (e) {
      return callback(e);
    }
    callback(null, parsed);
  });
}

app.get("/items", function (req, res) {
  readJson("items.json", function (err, items) {
    if (err) {
      res.status(500).send({ error: err.message });
      return;
    }
    var limit = parseInt(req.query.limit || "20", 10);
    var visible = items.filter(function (item) {
      return !item.hidden;
    });
    var names = visible.map(function (item) {
      return { id: item.id, name: item.name };
    });
    res.send(names.slice(0, limit));
  });
});

app.get("/items/:id", function (req, res) {
  readJson("items.json", function (err, items) {
    if (err) {
      res.status(500).send({ error: err.message });
      return;
    }
    var found = items.find(function (item) {
      return String(item.id) === req.params.id;
    });
    if (!found) {
      res.status(404).send({ error: "not found" });
      return;
    }
    res.send(found);
  });
});

app.listen(3000, function () {
  console.log("listening on 3000");
});
'''),
    ("logging", "python",
     "Replace every print call in this code with a call to a module-level logger "
     "(`log = logging.getLogger(__name__)`): errors with log.error, the rest with log.info. "
     "Add the needed import and keep everything else as it is.",
     '''import csv
import sys
import time


class Importer:
    def __init__(self, db, batch_size=500):
        self.db = db
        self.batch_size = batch_size
        self.inserted = 0
        self.failed = 0

    def import_file(self, path):
        start = time.time()
        print(f"importing {path}")
        batch = []
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                try:
                    batch.append(self.convert(row))
                except (KeyError, ValueError) as e:
                    self.failed += 1
                    print(f"bad row {row!r}: {e}")
                    continue
                if len(batch) >= self.batch_size:
                    self.flush(batch)
                    batch = []
        if batch:
            self.flush(batch)
        print(f"{path}: {self.inserted} rows in {time.time() - start:.1f} s")
        return self.inserted

    def convert(self, row):
        return {
            "sku": row["sku"].strip(),
            "qty": int(row["qty"]),
            "price": float(row["price"]),
        }

    def flush(self, batch):
        try:
            self.db.insert_many("stock", batch)
            self.inserted += len(batch)
            print(f"flushed {len(batch)} rows")
        except Exception as e:
            self.failed += len(batch)
            print(f"insert failed: {e}")


if __name__ == "__main__":
    from db import connect
    imp = Importer(connect())
    for p in sys.argv[1:]:
        imp.import_file(p)
    print(f"done: {imp.inserted} inserted, {imp.failed} failed")
'''),
    ("fstrings", "python",
     "Convert every %-formatting and str.format call in this code to f-strings. "
     "Change nothing else.",
     '''import datetime


def format_invoice(invoice):
    lines = []
    lines.append("Invoice %s" % invoice["number"])
    lines.append("Date: {}".format(invoice["date"].strftime("%Y-%m-%d")))
    lines.append("Customer: %s <%s>" % (invoice["customer"], invoice["email"]))
    lines.append("")
    total = 0.0
    for item in invoice["items"]:
        amount = item["qty"] * item["unit_price"]
        total += amount
        lines.append("%-20s %4d x %8.2f = %10.2f" % (item["name"], item["qty"],
                                                     item["unit_price"], amount))
    tax = total * invoice.get("tax_rate", 0.2)
    lines.append("")
    lines.append("Subtotal: {:.2f}".format(total))
    lines.append("Tax ({:.0%}): {:.2f}".format(invoice.get("tax_rate", 0.2), tax))
    lines.append("Total: {:.2f} {}".format(total + tax, invoice.get("currency", "EUR")))
    return "\\n".join(lines)


def overdue_notice(invoice, today=None):
    today = today or datetime.date.today()
    days = (today - invoice["due"]).days
    if days <= 0:
        return "Invoice %s is not overdue." % invoice["number"]
    return "Invoice {} is {} day(s) overdue; please pay {:.2f} {}.".format(
        invoice["number"], days, invoice["balance"], invoice.get("currency", "EUR"))


def summary(invoices):
    paid = sum(1 for i in invoices if i["balance"] == 0)
    open_ = len(invoices) - paid
    owed = sum(i["balance"] for i in invoices)
    return "%d invoices: %d paid, %d open, %.2f owed" % (len(invoices), paid, open_, owed)
'''),
    ("go_errors", "go",
     "In this Go code, wrap every error that is returned unchanged with fmt.Errorf and %w, "
     "adding a short description of the failed step. Keep everything else as it is.",
     '''package store

import (
	"database/sql"
	"encoding/json"
	"fmt"
	"os"
)

type Item struct {
	ID    int64   `json:"id"`
	Name  string  `json:"name"`
	Price float64 `json:"price"`
}

func LoadItems(path string) ([]Item, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var items []Item
	if err := json.Unmarshal(data, &items); err != nil {
		return nil, err
	}
	return items, nil
}

func SaveItems(db *sql.DB, items []Item) error {
	tx, err := db.Begin()
	if err != nil {
		return err
	}
	stmt, err := tx.Prepare("INSERT INTO items (id, name, price) VALUES (?, ?, ?)")
	if err != nil {
		tx.Rollback()
		return err
	}
	defer stmt.Close()
	for _, it := range items {
		if _, err := stmt.Exec(it.ID, it.Name, it.Price); err != nil {
			tx.Rollback()
			return err
		}
	}
	if err := tx.Commit(); err != nil {
		return err
	}
	fmt.Printf("saved %d items\\n", len(items))
	return nil
}

func Import(db *sql.DB, path string) error {
	items, err := LoadItems(path)
	if err != nil {
		return err
	}
	return SaveItems(db, items)
}
'''),
]

# (name, language, instruction, code) for --prompt-set complete: code completion (the answer
# writes new code from a signature and a docstring; little of it copies the prompt, so a
# draft model, not prompt lookup, has something to propose).
COMPLETE_PROMPTS = [
    ("csv_line", "python", "Complete the function.",
     'def split_csv_line(line, sep=","):\n'
     '    """Split one CSV line into fields: fields may be quoted with double quotes, a quoted\n'
     '    field may contain the separator and doubled quotes ("") for a quote. Return a list of\n'
     '    strings; raise ValueError on an unterminated quote."""\n'),
    ("lru_cache", "python", "Complete the class.",
     'class LRUCache:\n'
     '    """A least-recently-used cache of at most capacity entries, get and put in O(1),\n'
     '    with a dict and a doubly linked list of nodes."""\n\n'
     '    def __init__(self, capacity):\n'),
    ("intervals", "python", "Complete the function.",
     'def merge_intervals(intervals):\n'
     '    """Merge overlapping closed intervals [(start, end), ...] and return them sorted by\n'
     '    start; touching intervals (end == next start) merge too. Include doctest examples."""\n'),
    ("bst", "python", "Complete the class with insert, contains, delete and in-order iteration.",
     'class BinarySearchTree:\n'
     '    """An unbalanced binary search tree of unique keys."""\n\n'
     '    class _Node:\n'
     '        __slots__ = ("key", "left", "right")\n\n'),
    ("list_reverse", "c", "Complete the file: the functions declared, then a main that tests them.",
     '#include <stdio.h>\n#include <stdlib.h>\n\n'
     'struct node {\n    int value;\n    struct node *next;\n};\n\n'
     '/* Push value at the head; returns the new head (NULL on allocation failure). */\n'
     'struct node *push(struct node *head, int value);\n'
     '/* Reverse the list in place; returns the new head. */\n'
     'struct node *reverse(struct node *head);\n'
     '/* Free every node. */\nvoid free_list(struct node *head);\n'),
    ("debounce", "javascript", "Complete the function and add a short usage example.",
     '/**\n * Returns a debounced version of fn: calls are delayed until wait ms have passed\n'
     ' * without a new call; the last call\'s arguments win. The returned function has\n'
     ' * cancel() and flush() methods.\n */\nfunction debounce(fn, wait) {\n'),
    ("tokenize", "python", "Complete the function.",
     'def tokenize(expr):\n'
     '    """Tokenize an arithmetic expression into numbers (int or float), identifiers,\n'
     '    the operators + - * / ^ and parentheses; skip spaces; raise ValueError with the\n'
     '    position of an unexpected character."""\n'),
    ("matrix", "python", "Complete the class.",
     'class Matrix:\n'
     '    """A dense matrix of floats: construction from nested lists, shape, +, -, * (matrix\n'
     '    product and scalar), transpose, equality and a readable repr."""\n\n'
     '    def __init__(self, rows):\n'),
]

# llama-server's lookup settings tried by --sweep-llama (this version's --spec-type list:
# ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache; the n-gram types draft
# from the whole context, prompt included; --spec-draft-n-max bounds only draft models).
LLAMA_SWEEP = {
    "ngram-simple": "--spec-type ngram-simple",  # lookup 12 tokens, drafts 48
    "ngram-simple-n4m16": "--spec-type ngram-simple --spec-ngram-simple-size-n 4 "
                          "--spec-ngram-simple-size-m 16",
    "ngram-simple-n3m8": "--spec-type ngram-simple --spec-ngram-simple-size-n 3 "
                         "--spec-ngram-simple-size-m 8",
    "ngram-simple-n4m32": "--spec-type ngram-simple --spec-ngram-simple-size-n 4 "
                          "--spec-ngram-simple-size-m 32",
    "ngram-simple-n8m24": "--spec-type ngram-simple --spec-ngram-simple-size-n 8 "
                          "--spec-ngram-simple-size-m 24",
    "ngram-map-k": "--spec-type ngram-map-k",  # lookup 12, drafts 48
    "ngram-map-k-n4m16": "--spec-type ngram-map-k --spec-ngram-map-k-size-n 4 "
                         "--spec-ngram-map-k-size-m 16",
    "ngram-mod": "--spec-type ngram-mod",  # = --spec-default: match 24, drafts 48..64
    # ngram-mod: one hash pool for all slots, kept across requests (cycled prompts: it
    # drafts from earlier answers to the same prompt)
    "ngram-mod-m16": "--spec-type ngram-mod --spec-ngram-mod-n-match 16 "
                     "--spec-ngram-mod-n-min 4 --spec-ngram-mod-n-max 16",
    "ngram-mod-m8": "--spec-type ngram-mod --spec-ngram-mod-n-match 16 "
                    "--spec-ngram-mod-n-min 2 --spec-ngram-mod-n-max 8",
    "ngram-map-k-n8m16": "--spec-type ngram-map-k --spec-ngram-map-k-size-n 8 "
                         "--spec-ngram-map-k-size-m 16",
    "ngram-cache": "--spec-type ngram-cache",
}
# The default of --llama-spec: with --sweep-llama on the 2-core machine (batch 1, all 8
# prompts, 128 tokens) ngram-map-k, ngram-mod-m16 and ngram-simple-n8m24 were the three
# best, within a few % of each other; ngram-map-k is the one never slower than no
# speculation on any prompt, and unlike ngram-mod it drafts from the request's own tokens
# only. The small lookups (n 3-4) were slower than no speculation, and so, in one noisy
# round, were the long drafts (ngram-simple's and ngram-mod's defaults) and ngram-cache.
LLAMA_SPEC_DEFAULT = LLAMA_SWEEP["ngram-map-k"]

TANDEM_SPEC = {"on": {"method": "ngram"},
               "k4": {"method": "ngram", "adaptive": "false", "max_tokens": 4},
               "k8": {"method": "ngram", "adaptive": "false", "max_tokens": 8},
               "n8": {"method": "ngram", "ngram_max": 8},
               "n1": {"method": "ngram", "ngram_min": 1},
               "draft": None,  # {method: draft, draft: --draft}, set from the arguments
               "mtp": {"method": "mtp"},
               "nogate": {"method": "ngram", "gate": "false"},
               "mtp_nogate": {"method": "mtp", "gate": "false"},
               "off": {"method": "off"},
               "off2": {"method": "off"}}
LLAMA = ("llama_spec", "llama_off", "llama_draft", "llama_mtp")
LOG_DIR = os.path.expanduser("~/.cache/tandem/bench-spec")

args = None  # the parsed options (main)
REQLOG = []  # every request of every phase, for --json-out


def messages(i, tag=None):
    name, lang, instr, code = PROMPTS[i]
    system = SYSTEM if tag is None else f"[request {tag}] {SYSTEM}"
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"{instr}\n\n```{lang}\n{code}```"}]


def load1():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def get(port, path, timeout=2):
    """(status, body) of GET path on 127.0.0.1:port; (None, b"") when nothing answers."""
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        c.request("GET", path)
        r = c.getresponse()
        body = r.read()
        c.close()
        return r.status, body
    except (OSError, http.client.HTTPException):
        return None, b""


def chat(port, msgs, max_tokens):
    """One streamed greedy chat completion: {t0, ttft, t_last (s, from t0), text, n
    (usage.completion_tokens), finish, timings (llama-server's, or None)}."""
    body = json.dumps({"messages": msgs, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=args.request_timeout_s)
    t0 = time.perf_counter()
    try:
        c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        first = last = None
        parts, usage, timings, finish = [], None, None, None
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("error"):
                raise RuntimeError(f"error event: {ev['error']}")
            usage = ev.get("usage") or usage
            timings = ev.get("timings") or timings
            for ch in ev.get("choices") or []:
                finish = ch.get("finish_reason") or finish
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    last = time.perf_counter() - t0
                    first = last if first is None else first
                    parts.append(piece)
    finally:
        c.close()
    if first is None or usage is None:
        raise RuntimeError(f"no content or no usage (usage {usage})")
    return {"t0": t0, "ttft": first, "t_last": last, "text": "".join(parts),
            "n": usage["completion_tokens"], "finish": finish, "timings": timings}


def phase(port, batch, reqs, max_tokens):
    """reqs: [(prompt index, tag or None)], batch 1 one after the other, else batch at once
    (a thread a client, each taking the next request). Returns (records, wall s)."""
    t0 = time.perf_counter()
    if batch == 1:
        out = [dict(chat(port, messages(i, tag), max_tokens), prompt=i, tag=tag)
               for i, tag in reqs]
    else:
        # no `with`: on an error or a signal, return at once (the server's stop then ends
        # the other requests) instead of waiting for every request in flight
        ex = cf.ThreadPoolExecutor(max_workers=batch)
        try:
            futs = [ex.submit(chat, port, messages(i, tag), max_tokens) for i, tag in reqs]
            out = [dict(f.result(), prompt=i, tag=tag) for f, (i, tag) in zip(futs, reqs)]
        finally:
            ex.shutdown(wait=False, cancel_futures=True)
    return out, time.perf_counter() - t0


def summary(recs, wall):
    n = sum(r["n"] for r in recs)
    dec_n = sum(r["n"] - 1 for r in recs if r["n"] > 1)
    dec_s = sum(r["t_last"] - r["ttft"] for r in recs if r["n"] > 1)
    s = {"out_tok_s": n / wall, "stream_tok_s": dec_n / dec_s if dec_s > 0 else float("nan"),
         "ttft_ms_p50": 1000 * statistics.median(r["ttft"] for r in recs),
         "tok_req": n / len(recs), "wall_s": wall, "acc": None}
    tm = [r["timings"] for r in recs if r["timings"] and r["timings"].get("draft_n")]
    if tm:
        s["acc"] = sum(t.get("draft_n_accepted", 0) for t in tm) / sum(t["draft_n"] for t in tm)
    return s


def line(s):
    acc = f"  accept {100 * s['acc']:.0f} %" if s.get("acc") is not None else ""
    return (f"out {s['out_tok_s']:6.2f} tok/s  stream {s['stream_tok_s']:6.2f} tok/s  TTFT p50 "
            f"{s['ttft_ms_p50']:7.0f} ms  {s['tok_req']:5.1f} tok/req  wall {s['wall_s']:6.1f} s"
            + acc)


# ---- servers: each in its own session; stop() is safe to call twice and from atexit ----

RUNNING = []


def _killpg(pid, sig):
    try:
        os.killpg(pid, sig)
    except OSError:
        pass


class Server:
    def __init__(self, name, log_dir):
        self.name, self.log_dir, self.proc, self.port = name, log_dir, None, None

    def _spawn(self, cmd, env=None):
        self.log = open(os.path.join(self.log_dir, f"{self.name}.log"), "w")
        self.log.write(" ".join(cmd) + "\n")
        self.log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        RUNNING.append(self)
        end = time.time() + args.startup_s
        while time.time() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while "
                                   f"starting (log {self.log.name}):\n{self.tail()}")
            if get(self.port, "/health")[0] == 200:
                return
            time.sleep(1)
        raise RuntimeError(f"{self.name} did not answer /health within {args.startup_s} s "
                           f"(log {self.log.name})")

    def tail(self, n=15):
        try:
            with open(self.log.name, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self):
        if self.proc is None:
            return
        if self.proc.poll() is None:
            _killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                try:
                    self.hard_stop()
                except (OSError, subprocess.SubprocessError) as e:
                    print(f"  {self.name}: {e}", flush=True)
                _killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.after_stop()
        self.proc = None
        self.log.close()
        if self in RUNNING:
            RUNNING.remove(self)

    def hard_stop(self):
        pass

    def after_stop(self):
        pass


class Tandem(Server):
    """`tandem up` (foreground, --no-restart) on a copy of --config; its processes run in
    their own sessions, so stopping is SIGTERM to `tandem up` (it stops them), then
    `tandem down`, then SIGKILL to whatever the run directory's pid files still name."""

    def __init__(self, name, log_dir, spec):
        super().__init__(name, log_dir)
        self.spec = spec

    def start(self):
        self.cfg = os.path.join(self.log_dir, f"{self.name}.yaml")
        self.run_dir = os.path.join(self.log_dir, f"run-{self.name}")
        with open(self.cfg, "w") as f:
            f.write(tandem_yaml(self.spec, self.run_dir))
        self.port = free_port(n=16)
        bin_dir = os.path.abspath(os.path.join(args.build, "bin"))
        self._spawn([os.path.join(bin_dir, "tandem"), "up", self.cfg, "--port", str(self.port),
                     "--timeout", str(args.startup_s), "--no-restart"],
                    env=dict(os.environ, TANDEM_BIN=bin_dir))

    def hard_stop(self):
        subprocess.run([os.path.join(args.build, "bin", "tandem"), "down", self.cfg, "--port",
                        str(self.port)], stdout=self.log, stderr=subprocess.STDOUT, timeout=120,
                       check=False)

    def after_stop(self):
        """SIGKILL to processes still named by pid files ("PID STARTTIME RESTARTS") whose
        start time matches (the pid was not reused)."""
        for root, _, files in os.walk(self.run_dir):
            for fn in files:
                if not fn.endswith(".pid"):
                    continue
                try:
                    with open(os.path.join(root, fn)) as f:
                        pid, start = (int(x) for x in f.read().split()[:2])
                    with open(f"/proc/{pid}/stat") as f:
                        same = int(f.read().rsplit(")", 1)[1].split()[19]) == start
                except (OSError, ValueError, IndexError):
                    continue
                if pid > 0 and same and alive(pid):
                    print(f"  {self.name}: {fn} (pid {pid}) outlived the stop: SIGKILL",
                          flush=True)
                    _killpg(pid, signal.SIGKILL)
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass


class Llama(Server):
    def __init__(self, name, log_dir, extra):
        super().__init__(name, log_dir)
        self.extra = extra

    def start(self):
        self.port = free_port()
        slots = max(args.batches)
        ctx = slots * args.slot_ctx
        self._spawn([os.path.join(args.llama_bin, "llama-server"), "-m", args.model, "-t",
                     str(args.threads), "-tb", str(args.threads), "-np", str(slots),
                     "-c", str(ctx), "--host", "127.0.0.1", "--port", str(self.port)]
                    + self.extra + args.llama_args.split())


def _cleanup(*_):
    for s in list(RUNNING):
        s.stop()


def _on_signal(sig, _frame):
    raise SystemExit(128 + sig)


def tandem_yaml(spec, run_dir):
    """--config's text with model, run_dir, cpu_act (when given) and, in every decode
    instance, threads and the speculative block (spec; None: left out) replaced. A line
    editor, not a YAML parser: top-level keys start in column 0, a decode instance is a
    `- ` item under `decode:` whose keys line up after the dash (deploy/*.yaml)."""
    with open(args.config) as f:
        lines = f.read().splitlines()
    top = {"model": args.model, "run_dir": run_dir}
    if args.cpu_act:
        top["cpu_act"] = args.cpu_act
    out, i, section = [], 0, None
    while i < len(lines):
        ln = lines[i]
        m = re.match(r"^([A-Za-z_]\w*):", ln)
        if m:
            section = m.group(1)
            if section in top:
                out.append(f"{section}: {top.pop(section)}")
                i += 1
                continue
        item = re.match(r"^(\s*)-(\s+)(\S.*)$", ln)
        if section == "decode" and item:
            ind = " " * (len(item.group(1)) + 1 + len(item.group(2)))
            entry = [ln]
            i += 1
            while i < len(lines) and not re.match(r"^(\S|\s*-\s)", lines[i]):
                entry.append(lines[i])
                i += 1
            out += decode_entry(entry, ind, spec)
            continue
        out.append(ln)
        i += 1
    out += [f"{k}: {v}" for k, v in top.items()]
    return "\n".join(out) + "\n"


def decode_entry(entry, ind, spec):
    """One decode instance's lines with threads and speculative (and what nests under it)
    dropped, then set after its first line."""
    kept, skip = [entry[0]], False
    for ln in entry[1:]:
        m = re.match(r"^(\s*)(\w+):", ln)
        if m and len(m.group(1)) <= len(ind):
            skip = m.group(2) in ("threads", "speculative")
        if not skip:
            kept.append(ln)
    add = [f"{ind}threads: {args.threads}"]
    if spec is not None:
        add.append(f"{ind}speculative:")
        add += [f"{ind}  {k}: {v}" for k, v in spec.items()]
    return kept[:1] + add + kept[1:]


def make_server(name, log_dir):
    if name == "draft" and not args.draft:
        raise SystemExit("the configuration draft needs --draft GGUF")
    if name in TANDEM_SPEC:
        spec = None if args.spec_key == "omit" else TANDEM_SPEC[name]
        if name == "draft":
            spec = {"method": "draft", "draft": os.path.abspath(args.draft)}
        return Tandem(name, log_dir, spec)
    if name == "llama_off":
        return Llama(name, log_dir, [])
    if name == "llama_spec":
        return Llama(name, log_dir, args.llama_spec.split())
    if name == "llama_draft":
        return Llama(name, log_dir, ["-md", args.llama_draft] + args.llama_draft_args.split())
    if name == "llama_mtp":
        return Llama(name, log_dir, ["--spec-type", "draft-mtp", "--spec-draft-n-max", "8"])
    if name.startswith("llama:"):
        return Llama(name.replace(":", "_"), log_dir, LLAMA_SWEEP[name[6:]].split())
    raise ValueError(name)


def spec_metrics(port):
    """The router's /metrics series whose name mentions spec (summed over labels), if any."""
    st, body = get(port, "/metrics", timeout=10)
    out = {}
    if st == 200:
        for ln in body.decode(errors="replace").splitlines():
            m = re.match(r"^(\w*spec\w*)(\{[^}]*\})?\s+(\S+)$", ln)
            if m:
                try:
                    out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
                except ValueError:
                    pass
    return out


def requests_of(batch):
    """Batch 1: every prompt once; batch B: B x --per-client requests, the prompts cycled
    (tagged with --fresh, so that no two share a prefix)."""
    n = len(PROMPTS) if batch == 1 else batch * args.per_client
    tag = batch != 1 and args.fresh
    return [(k % len(PROMPTS), f"{k}" if tag else None) for k in range(n)]


def run_server(name, rnd, batches, results, texts):
    """Start one configuration, warm it up, run its phases, stop it."""
    log_dir = os.path.join(LOG_DIR, f"round{rnd + 1}")
    os.makedirs(log_dir, exist_ok=True)
    srv = make_server(name, log_dir)
    t0 = time.time()
    try:
        srv.start()
        chat(srv.port, [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": WARMUP[0]}], WARMUP[1])
        for b in batches:
            m0 = spec_metrics(srv.port) if isinstance(srv, Tandem) else {}
            load = load1()
            recs, wall = phase(srv.port, b, requests_of(b), args.max_tokens)
            s = summary(recs, wall)
            s["load"] = load
            m1 = spec_metrics(srv.port) if isinstance(srv, Tandem) else {}
            s["spec_metrics"] = {k: v - m0.get(k, 0.0) for k, v in m1.items()}
            results.setdefault((b, name), []).append(s)
            texts[(rnd, b, name)] = [((r["prompt"], r["tag"]), r["text"], r["n"]) for r in recs]
            print(f"round {rnd + 1} batch {b:2d} {name:12s} load {load:4.2f}  {line(s)}",
                  flush=True)
            early_check(texts, rnd, b, name)
            if s["spec_metrics"]:
                print("    " + "  ".join(f"{k} {v:g}" for k, v in s["spec_metrics"].items()),
                      flush=True)
            if args.json_out:
                REQLOG.append(
                    {"round": rnd + 1, "batch": b, "config": name,
                     "requests": [{k: r[k] for k in ("prompt", "tag", "ttft", "t_last", "n",
                                                     "finish", "timings", "text")}
                                  for r in recs]})
    finally:
        srv.stop()
    print(f"    ({name}: {time.time() - t0:.0f} s with start and stop)", flush=True)


def early_check(texts, rnd, b, name):
    """As soon as a speculative configuration and off both ran a batch-1 phase: MISMATCH if
    any answer differs (check_texts says which at the end)."""
    if name not in TANDEM_SPEC or (rnd, b, "off") not in texts or b != 1:
        return
    ref = {key: t for key, t, _ in texts[(rnd, b, "off")]}
    for other in TANDEM_SPEC:
        if other == "off" or (rnd, b, other) not in texts or name not in (other, "off"):
            continue
        diff = sum(t != ref[key] for key, t, _ in texts[(rnd, b, other)])
        if diff:
            print(f"MISMATCH: round {rnd + 1} batch {b}: {diff} answer(s) of {other} differ "
                  f"from off's (details at the end)", flush=True)


def first_diff(a, b):
    k = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
    return k, a[max(0, k - 30):k + 30], b[max(0, k - 30):k + 30]


def check_texts(texts, rounds, batches):
    """Tandem's speculative configurations against off (same round, batch, request: prompt
    and tag) must be byte-identical; returns the number of differences. Prints llama-server's
    agreement, and notes where off itself differs between requests or batches."""
    bad = 0
    for rnd in range(rounds):
        for b in batches:
            if (rnd, b, "off") not in texts:
                continue
            refs = {}
            for key, t, n in texts[(rnd, b, "off")]:
                if key in refs and refs[key][0] != t:
                    print(f"note: round {rnd + 1} batch {b}: off answered prompt {key[0]} "
                          f"({PROMPTS[key[0]][0]}) differently in two requests")
                refs.setdefault(key, (t, n))
            for name in TANDEM_SPEC:
                if name == "off" or (rnd, b, name) not in texts:
                    continue
                got = texts[(rnd, b, name)]
                same = sum(t == refs[key][0] for key, t, _ in got)
                print(f"text check: round {rnd + 1} batch {b}: {name} equals off in {same} of "
                      f"{len(got)} answers")
                for key, t, n in got:
                    if t != refs[key][0]:
                        # batched, a prompt's prefill rows share steps with other requests'
                        # and take the batched kernels (decode[].deterministic is false):
                        # their rounding, and so the text, may depend on the batch whatever
                        # the speculation (off itself differs between requests there): only
                        # batch 1 must be identical (the tests check batches with every row
                        # solo, tests/decode/test_sched.c)
                        bad += b == 1
                        k, x, y = first_diff(refs[key][0], t)
                        print(f"{'MISMATCH' if b == 1 else 'info: batched, not comparable:'} "
                              f"round {rnd + 1} batch {b} {name} vs off, prompt "
                              f"{key[0]} ({PROMPTS[key[0]][0]}): {n} vs {refs[key][1]} "
                              f"tokens, first difference at character {k}:\n    off:  {x!r}"
                              f"\n    {name + ':':5s} {y!r}")
    for rnd in range(rounds):
        for b in batches:
            for x, y in (("llama_spec", "llama_off"), ("off", "llama_off")):
                if (rnd, b, x) in texts and (rnd, b, y) in texts:
                    ry = {key: t for key, t, _ in texts[(rnd, b, y)]}
                    same = sum(t == ry[key] for key, t, _ in texts[(rnd, b, x)])
                    print(f"info: round {rnd + 1} batch {b}: {x} and {y} agree on {same} of "
                          f"{len(texts[(rnd, b, x)])} answers")
    # off at batch 1 against the larger batches (same prompts unless --fresh): not
    # speculation, but batch-dependent numerics if it happens
    for rnd in range(rounds):
        if (rnd, 1, "off") in texts and not args.fresh:
            r1 = {key[0]: t for key, t, _ in texts[(rnd, 1, "off")]}
            for b in batches:
                if b != 1 and (rnd, b, "off") in texts:
                    diff = sum(t != r1[key[0]] for key, t, _ in texts[(rnd, b, "off")])
                    if diff:
                        print(f"note: round {rnd + 1}: off at batch {b} differs from batch 1 "
                              f"in {diff} answers")
    return bad


RATIOS = [("on", "off"), ("draft", "off"), ("draft", "on"), ("k4", "off"), ("k8", "off"),
          ("n8", "off"), ("n1", "off"), ("n8", "on"), ("n1", "on"), ("llama_spec", "llama_off"),
          ("llama_draft", "llama_off"), ("on", "llama_spec"), ("draft", "llama_draft"),
          ("off", "llama_off"), ("on", "llama_off"), ("off2", "off"), ("on", "off2"), ("mtp", "off"), ("llama_mtp", "llama_off"),
          ("mtp", "llama_mtp"), ("on", "nogate"), ("nogate", "off"), ("mtp", "mtp_nogate"),
          ("mtp_nogate", "off")]


def report(results, batches, names):
    keys = ("out_tok_s", "stream_tok_s", "ttft_ms_p50", "tok_req")
    for b in batches:
        print(f"== batch {b}: medians over rounds")
        for n in names:
            rs = results.get((b, n))
            if not rs:
                continue
            med = {k: statistics.median(r[k] for r in rs) for k in keys}
            acc = [r["acc"] for r in rs if r["acc"] is not None]
            med["acc"] = statistics.median(acc) if acc else None
            med["wall_s"] = statistics.median(r["wall_s"] for r in rs)
            print(f"  {n:12s} {line(med)}")
        sweep = [n for n in names if n.startswith("llama:")]
        pairs = RATIOS + [(n, "llama_off") for n in sweep]
        for x, y in pairs:
            rx, ry = results.get((b, x)), results.get((b, y))
            if not rx or not ry:
                continue
            parts = []
            for k in ("out_tok_s", "stream_tok_s"):
                per = [u[k] / v[k] for u, v in zip(rx, ry)]
                parts.append(f"{k[:-6]} {statistics.median(per):.2f}x ("
                             + ", ".join(f"{v:.2f}" for v in per) + ")")
            print(f"  {x + '/' + y:22s} " + "   ".join(parts))


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build", help="Tandem build directory (bin/tandem)")
    ap.add_argument("--config", default=os.path.join(HERE, "..", "deploy",
                                                      "local-colocated.yaml"))
    ap.add_argument("--model", default=os.path.expanduser(
        "~/.cache/tandem/models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf"))
    ap.add_argument("--llama-bin", default="/work/llamacpp/llama_cpp_python-0.3.36/vendor/"
                    "llama.cpp/build/bin", help="directory with llama-server")
    ap.add_argument("--configs", default="k4,on,off,k8,llama_spec,llama_off",
                    help=f"of {','.join(list(TANDEM_SPEC) + list(LLAMA))}")
    ap.add_argument("--configs-batched", default="on,off,llama_spec,llama_off",
                    help="the configurations that also run the batches > 1")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rounds", type=int, help="default 2 (--sweep-llama: 1)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompts", help="the first N prompts, or a comma list of their names "
                    f"({','.join(p[0] for p in PROMPTS)}); default all")
    ap.add_argument("--per-client", type=int, default=1,
                    help="requests per client at batch > 1")
    ap.add_argument("--fresh", action="store_true",
                    help="batch > 1: no two requests share a prefix (caches defeated)")
    ap.add_argument("--threads", type=int, default=2,
                    help="decode threads of every Tandem decode instance; llama-server -t/-tb")
    ap.add_argument("--cpu-act", choices=("f32", "q8", "auto"),
                    help="Tandem's cpu_act key (default: the config's, else TANDEM_CPU_ACT)")
    ap.add_argument("--spec-key", choices=("set", "omit"), default="set",
                    help="omit: leave decode[].speculative out of the YAML (older builds)")
    ap.add_argument("--llama-spec", default=LLAMA_SPEC_DEFAULT,
                    help="llama-server's flags for llama_spec")
    ap.add_argument("--draft", help="draft GGUF for Tandem's configuration draft")
    ap.add_argument("--prompt-set", choices=("edit", "complete"), default="edit",
                    help="edit: the input-grounded requests (PROMPTS); complete: code completion "
                         "(COMPLETE_PROMPTS)")
    ap.add_argument("--llama-draft", help="draft GGUF for llama_draft (adds it to --configs)")
    ap.add_argument("--llama-draft-args", default="--spec-type draft-simple --spec-draft-n-max 8",
                    help="more flags for llama_draft")
    ap.add_argument("--llama-args", default="",
                    help="more flags for every llama-server (with =: --llama-args='-fa off')")
    ap.add_argument("--slot-ctx", type=int, default=2048, help="llama-server context per slot")
    ap.add_argument("--sweep-llama", action="store_true",
                    help="batch 1, llama-server with each LLAMA_SWEEP setting and without")
    ap.add_argument("--sweep-set", help="--sweep-llama: these LLAMA_SWEEP names only")
    ap.add_argument("--startup-s", type=int, default=600)
    ap.add_argument("--request-timeout-s", type=int, default=1800)
    ap.add_argument("--json-out")
    a = ap.parse_args()
    a.batches = [int(x) for x in a.batches.split(",") if x]
    a.configs = [c for c in a.configs.split(",") if c]
    a.configs_batched = [c for c in a.configs_batched.split(",") if c]
    if a.llama_draft and "llama_draft" not in a.configs:
        a.configs.append("llama_draft")
        a.configs_batched.append("llama_draft")
    if a.prompt_set == "complete":
        PROMPTS[:] = COMPLETE_PROMPTS
    if a.rounds is None:
        a.rounds = 1 if a.sweep_llama else 2
    if a.sweep_llama:
        sweep = a.sweep_set.split(",") if a.sweep_set else list(LLAMA_SWEEP)
        a.configs = ["llama_off"] + [f"llama:{k}" for k in sweep]
        a.batches = [1]
    known = list(TANDEM_SPEC) + list(LLAMA)
    bad = [c for c in a.configs + a.configs_batched
           if c not in known and not (c.startswith("llama:") and c[6:] in LLAMA_SWEEP)]
    if bad:
        ap.error(f"unknown configuration(s) {bad} (known: {', '.join(known)})")
    if not a.batches or min(a.batches) < 1 or a.rounds < 1 or a.max_tokens < 1:
        ap.error("--batches, --rounds and --max-tokens must be >= 1")
    names = [q[0] for q in PROMPTS]
    if a.prompts is None:
        a.prompts = names
    elif a.prompts.isdigit() and 1 <= int(a.prompts) <= len(PROMPTS):
        a.prompts = names[:int(a.prompts)]
    else:
        a.prompts = a.prompts.split(",")
        if not a.prompts or any(n not in names for n in a.prompts):
            ap.error(f"--prompts: 1..{len(PROMPTS)} or names of {','.join(names)}")
    if "llama_draft" in a.configs and not (a.llama_draft and os.path.isfile(a.llama_draft)):
        ap.error("llama_draft needs --llama-draft GGUF")
    if any(c in TANDEM_SPEC for c in a.configs):
        if not os.access(os.path.join(a.build, "bin", "tandem"), os.X_OK):
            ap.error(f"no {a.build}/bin/tandem (build first, or give --build)")
        if not os.path.isfile(a.config):
            ap.error(f"no config {a.config}")
    if any(c not in TANDEM_SPEC for c in a.configs):
        if not os.access(os.path.join(a.llama_bin, "llama-server"), os.X_OK):
            ap.error(f"no {a.llama_bin}/llama-server (--llama-bin)")
    if not os.path.isfile(a.model):
        ap.error(f"no model file {a.model}")
    a.model = os.path.abspath(a.model)
    return a


def main():
    global args
    args = parse()
    PROMPTS[:] = [q for q in PROMPTS if q[0] in args.prompts]
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    os.makedirs(LOG_DIR, exist_ok=True)
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    act = args.cpu_act or os.environ.get("TANDEM_CPU_ACT") or "the config's cpu_act, else f32"
    print(f"{cpu}, {os.cpu_count()} CPUs; model {args.model}; {len(PROMPTS)} prompts, greedy, "
          f"max_tokens {args.max_tokens}; batches {args.batches} (batched: "
          f"{'fresh prompts' if args.fresh else 'prompts cached by the batch-1 phase'}); "
          f"{args.rounds} round(s); threads {args.threads}; Tandem {args.config} (cpu_act "
          f"{act}); llama_spec: {args.llama_spec}; logs {LOG_DIR}", flush=True)
    results, texts = {}, {}
    t0, status = time.time(), 0
    try:
        for rnd in range(args.rounds):
            order = args.configs if rnd % 2 == 0 else args.configs[::-1]
            for name in order:
                batches = [b for b in args.batches if b == 1 or name in args.configs_batched]
                if batches:
                    run_server(name, rnd, batches, results, texts)
    except (RuntimeError, OSError, http.client.HTTPException, ValueError) as e:
        print(f"error: {e}\n(the figures below are those of the runs before it)",
              file=sys.stderr)
        status = 1
    except KeyboardInterrupt:
        print("interrupted: servers stopped (the figures below are those of the runs before)",
              file=sys.stderr)
        status = 130
    finally:
        _cleanup()
    print(f"== {time.time() - t0:.0f} s in all")
    report(results, args.batches, args.configs)
    bad = check_texts(texts, args.rounds, args.batches)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "cpu": cpu, "prompts": [p[0] for p in PROMPTS],
                       "runs": [{"batch": b, "config": n, "rounds": rs}
                                for (b, n), rs in results.items()],
                       "requests": REQLOG}, f, indent=1)
    if bad:
        print(f"MISMATCH: {bad} answer(s) of Tandem's speculative configurations differ from "
              f"off: speculation changed greedy output")
        return 2
    return status


if __name__ == "__main__":
    atexit.register(_cleanup)
    sys.exit(main())
