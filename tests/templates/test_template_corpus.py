#!/usr/bin/env python3
"""test_template_corpus.py: every template of the corpus, and every chat template of the given
model files, renders byte for byte as jinja2 does (issue 41; tests/templates/README.md).

For each template DIR/templates/*.jinja (scripts/fetch_corpus.py) and each conversation
fixture tests/templates/conversations/*.json, the reference rendering (tests/ref/
template_reference.py, in this process: transformers' apply_chat_template environment, strftime_now
at a fixed instant) is compared with

  TANDEM template --template FILE --messages M.json [--tools T.json] [--add-generation-prompt]
                  [--kwargs JSON] --bos '<s>' --eos '</s>' --now 1764979200

run once per case (10 s timeout). With --model FILE.gguf the templates are the file's own:
tokenizer.chat_template and each tokenizer.chat_template.NAME (read with the gguf package),
rendered by the reference with bos_token/eos_token = the tokenizer.ggml.tokens entries of
tokenizer.ggml.bos_token_id/eos_token_id (undefined where the file has no such key), and by

  TANDEM template --model FILE [--name NAME] --messages M.json ... --now 1764979200

(no --bos/--eos: tandem takes them from the file's vocabulary, which is what is checked). A
file without tokenizer.chat_template is a case the reference raises on (as apply_chat_template
does), so tandem must refuse it. Outcomes:
  match          tandem exited 0 and its stdout equals the reference's bytes
  both refuse    the reference raised and tandem exited non-zero with a message on stderr
  excused        tandem refused (non-zero exit, message on stderr) a case the reference
                 renders, and tests/templates/exceptions.txt lists it (a known limitation)
  FAIL           anything else: different bytes (a short diff around the first difference is
                 printed), a refusal that is not listed or gives no message, a rendering
                 where the reference raised, a crash (signal) or a timeout
Prints a per-template table and totals; exit 0 only when nothing failed (2: bad usage).

Usage: test_template_corpus.py --tandem PATH/TO/tandem (--corpus DIR | --model FILE.gguf ...)
         [--only GLOB] [--fixture GLOB] [--verbose]
       test_template_corpus.py (--corpus DIR | --model FILE.gguf ...) --reference-only [--verbose]
         (no tandem: renders every case with the reference alone and lists where it raises)
       test_template_corpus.py (--corpus DIR | --model FILE.gguf ...) --self-test
         (the harness checked against itself: the "tandem" run is template_reference.py's CLI
         with its jinja2-only backend, so every case must match or both refuse)
--model may be repeated, and given with --corpus. A model's templates are named FILE.gguf and
FILE.gguf:NAME. --only and --fixture take a name (with or without its .jinja/.json) or a glob
on it. exceptions.txt covers corpus templates only: a model's own template has no excuse.
"""
import argparse
import difflib
import fnmatch
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "ref"))
import template_reference  # noqa: E402  (tests/ref is not a package)

FIXTURES_DIR = os.path.join(HERE, "conversations")
EXCEPTIONS_FILE = os.path.join(HERE, "exceptions.txt")
REFERENCE_CLI = os.path.join(HERE, "..", "ref", "template_reference.py")
BOS, EOS = "<s>", "</s>"
NOW = 1764979200  # 2025-12-06 00:00:00 UTC: templates that print the date print this one
TIMEOUT_S = 10
DIFF_LINES = 24  # at most this many diff lines per failure: enough to see the first difference


class UsageError(Exception):
    pass


class Template(NamedTuple):
    """One template to render with every fixture."""
    label: str            # its name in the table: the corpus file name, or FILE.gguf[:NAME]
    text: Optional[str]   # None: the model file has no such template
    args: list            # what names it to tandem (with --bos/--eos for a corpus file)
    bos: Optional[str]    # the reference's bos_token/eos_token; None: undefined
    eos: Optional[str]
    path: Optional[str]   # a file holding text, for the reference CLI (--self-test)


MODEL_KEY = "tokenizer.chat_template"


def _vocab_piece(fields, key):
    """The tokenizer.ggml.tokens entry that an id key names, as transformers' tokenizer holds
    the special token (its text, not the bytes a normal token decodes to); None (undefined)
    without the key, without a vocabulary or for an id outside it. tandem's vocabulary differs
    there: it falls back to llama.cpp's default ids (gpt2: 11, llama: 1 and 2), so such a file
    would show as a difference wherever its template prints the token."""
    f, toks = fields.get(key), fields.get("tokenizer.ggml.tokens")
    if f is None or toks is None:
        return None
    i = int(f.contents())
    return toks.contents(i) if 0 <= i < len(toks.data) else None


def read_model(path, tmp):
    """[Template] of a GGUF file: tokenizer.chat_template, then every tokenizer.chat_template.NAME
    in name order, each also written to tmp for the reference CLI. Only the metadata is read
    (GGUFReader memory-maps the file; the tensors are never touched)."""
    import gguf  # only this mode needs it; the corpus mode runs without it
    try:
        fields = gguf.GGUFReader(path).fields
    except (OSError, ValueError) as e:
        raise UsageError(f"--model {path}: {e}")
    bos = _vocab_piece(fields, "tokenizer.ggml.bos_token_id")
    eos = _vocab_piece(fields, "tokenizer.ggml.eos_token_id")
    base = os.path.basename(path)
    names = [None] + sorted(k[len(MODEL_KEY) + 1:] for k in fields
                            if k.startswith(MODEL_KEY + "."))
    out = []
    for name in names:
        f = fields.get(MODEL_KEY + (f".{name}" if name else ""))
        text = str(f.contents()) if f is not None else None
        tpath = None
        if text is not None:
            fd, tpath = tempfile.mkstemp(suffix=".jinja", dir=tmp)
            with open(fd, "w", encoding="utf-8", newline="") as fh:
                fh.write(text)  # as is: read_template keeps the line ends too
        out.append(Template(f"{base}:{name}" if name else base, text,
                            ["--model", path] + (["--name", name] if name else []), bos, eos,
                            tpath))
    have = [n or "default" for n, t in zip(names, out) if t.text is not None]
    print(f"{base}: bos_token {bos!r}, eos_token {eos!r}; templates: "
          f"{', '.join(have) or 'none'}", flush=True)
    return out


def _matches(name, pattern):
    stem = os.path.splitext(name)[0]
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(stem, pattern)


def load_fixtures(pattern):
    """[(name, fixture dict)] sorted by name; name is the file name without .json."""
    out = []
    for f in sorted(os.listdir(FIXTURES_DIR)):
        if not f.endswith(".json") or (pattern and not _matches(f, pattern)):
            continue
        with open(os.path.join(FIXTURES_DIR, f), encoding="utf-8") as fh:
            fx = json.load(fh)
        if not isinstance(fx.get("messages"), list):
            raise UsageError(f"{f}: no \"messages\" array")
        out.append((f[:-len(".json")], fx))
    if not out:
        raise UsageError(f"no fixture in {FIXTURES_DIR} matches {pattern!r}")
    return out


def load_exceptions(templates, fixtures):
    """{(template file name, fixture name or "*"): reason} from exceptions.txt. Each line:
    TEMPLATE_FILE_NAME FIXTURE|*  reason; '#' starts a comment. Names are checked against the
    corpus and the fixture directory, so a typo cannot excuse nothing silently."""
    out = {}
    if not os.path.exists(EXCEPTIONS_FILE):
        return out
    with open(EXCEPTIONS_FILE, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split(None, 2)
            where = f"{EXCEPTIONS_FILE}:{n}"
            if len(parts) < 3:
                raise UsageError(f"{where}: expected 'TEMPLATE FIXTURE|* reason'")
            tpl, fx = parts[0], parts[1]
            if not tpl.endswith(".jinja"):
                tpl += ".jinja"
            if fx.endswith(".json"):
                fx = fx[:-len(".json")]
            if tpl not in templates:
                raise UsageError(f"{where}: no template {tpl} in the corpus")
            if fx != "*" and fx not in fixtures:
                raise UsageError(f"{where}: no fixture {fx} in {FIXTURES_DIR}")
            out[(tpl, fx)] = parts[2]
    return out


def write_inputs(fixtures, tmp):
    """Writes each fixture's messages and tools as the files tandem reads; returns
    {name: (messages path, tools path or None)}. UTF-8 as is (ensure_ascii=False), so the C
    side parses the characters themselves, not only \\u escapes; keys keep their order."""
    paths = {}
    for name, fx in fixtures:
        m = os.path.join(tmp, f"{name}.messages.json")
        with open(m, "w", encoding="utf-8") as f:
            json.dump(fx["messages"], f, ensure_ascii=False)
        t = None
        if fx.get("tools") is not None:
            t = os.path.join(tmp, f"{name}.tools.json")
            with open(t, "w", encoding="utf-8") as f:
                json.dump(fx["tools"], f, ensure_ascii=False)
        paths[name] = (m, t)
    return paths


def reference(tpl, fx):
    """(True, rendering bytes) or (False, "ExceptionType: message")."""
    if tpl.text is None:  # apply_chat_template's own refusal when there is no template
        return False, f"ValueError: no {MODEL_KEY} in {tpl.label}"
    try:
        out = template_reference.render(tpl.text, fx["messages"], fx.get("tools"),
                                        bool(fx.get("add_generation_prompt")), fx.get("kwargs"),
                                        tpl.bos, tpl.eos, NOW)
        return True, out.encode("utf-8")
    except Exception as e:  # the template's own error, whatever its type
        msg = str(e).strip().splitlines()
        return False, f"{type(e).__name__}: {msg[0] if msg else ''}"


def run_tandem(cmd, source, fx, inputs):
    """(exit status or None on timeout, stdout bytes, stderr text) of one tandem run; source:
    the arguments that name the template (Template.args)."""
    m, t = inputs
    args = [*cmd, *source, "--messages", m]
    if t:
        args += ["--tools", t]
    if fx.get("add_generation_prompt"):
        args.append("--add-generation-prompt")
    if fx.get("kwargs"):
        args += ["--kwargs", json.dumps(fx["kwargs"], ensure_ascii=False)]
    args += ["--now", str(NOW)]
    # its own process group, so a timeout kills whatever it started too
    p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = p.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        return None, b"", f"timed out after {TIMEOUT_S} s"
    return p.returncode, out, err.decode("utf-8", "replace").strip()


def _visible(line):
    # whitespace is most of what templates get wrong, so a diff must show it
    return (line.replace("\\", "\\\\").replace("\t", "\\t").replace("\r", "\\r")
            .replace("\n", "\\n"))


def short_diff(want, got):
    """The first hunk of a unified diff of the two renderings (as text, whitespace made
    visible), headed by the byte offset of the first difference."""
    i = next((k for k in range(min(len(want), len(got))) if want[k] != got[k]),
             min(len(want), len(got)))
    a = want.decode("utf-8", "replace").splitlines(keepends=True)
    b = got.decode("utf-8", "replace").splitlines(keepends=True)
    lines = [f"first difference at byte {i} (reference {len(want)} bytes, tandem {len(got)})"]
    hunk = 0
    for d in difflib.unified_diff(a, b, "reference", "tandem", n=2):
        if d.startswith("@@"):
            hunk += 1
            if hunk > 1:
                break
        if d.startswith(("---", "+++", "@@")):
            lines.append(d.rstrip("\n"))
        else:
            lines.append(d[0] + _visible(d[1:]))
        if len(lines) > DIFF_LINES:
            lines.append("...")
            break
    return "\n".join("    " + x for x in lines)


def _sanitizer_report(err):
    """The sanitizer's first report line in stderr, or None. Under ASan/UBSan (scripts/test.sh's
    build-asan) a memory error exits 1 like a refusal would, so it must be told apart."""
    for line in err.splitlines():
        if "ERROR: AddressSanitizer" in line or "ERROR: LeakSanitizer" in line or \
                re.search(r"\.[ch]:\d+:\d+: runtime error:", line):
            return line.strip()
    return None


def _first_line(err):
    return next((x.strip() for x in err.splitlines() if x.strip()), "")[:300]


def judge(ref_ok, ref_out, rc, out, err, excuse):
    """(outcome, detail): outcome is "match", "both", "excused" or "FAIL"."""
    if rc is None:
        return "FAIL", err
    if rc < 0:
        return "FAIL", f"tandem died of signal {-rc}: {err[-500:]}"
    san = _sanitizer_report(err)
    if san:
        return "FAIL", f"tandem (exit {rc}): {san}"
    if rc == 0 and not ref_ok:
        return "FAIL", f"tandem rendered what the reference refuses ({ref_out})"
    if rc == 0:
        if out == ref_out:
            return "match", ""
        return "FAIL", "rendering differs:\n" + short_diff(ref_out, out)
    # tandem refused (rc > 0)
    if not err:
        return "FAIL", f"tandem exited {rc} with nothing on stderr"
    if not ref_ok:
        return "both", f"reference: {ref_out}; tandem: {_first_line(err)}"
    if excuse is not None:
        return "excused", f"{excuse}; tandem: {_first_line(err)}"
    return "FAIL", f"tandem refused (exit {rc}) a case the reference renders: {_first_line(err)}"


def print_table(rows, cols):
    """rows: [(template, {outcome: n})]; prints one line per template and the totals."""
    width = max([len(r[0]) for r in rows] + [len("total")])
    head = "".join(f"{c:>10}" for c in cols)
    print(f"\n{'template':<{width}}{head}")
    totals = dict.fromkeys(cols, 0)
    for name, counts in rows:
        print(f"{name:<{width}}" + "".join(f"{counts.get(c, 0):>10}" for c in cols))
        for c in cols:
            totals[c] += counts.get(c, 0)
    print(f"{'total':<{width}}" + "".join(f"{totals[c]:>10}" for c in cols))
    return totals


def reference_only(templates, fixtures, verbose):
    """Renders every case with the reference alone; lists the cases where it raises."""
    rows = []
    for tpl in templates:
        counts = {"renders": 0, "raises": 0}
        for name, fx in fixtures:
            ok, out = reference(tpl, fx)
            counts["renders" if ok else "raises"] += 1
            if not ok:
                print(f"raises  {tpl.label} {name}: {out}")
            elif verbose:
                print(f"renders {tpl.label} {name}: {len(out)} bytes")
        rows.append((tpl.label, counts))
    print_table(rows, ["renders", "raises"])
    return 0


def corpus_templates(corpus):
    """[Template] of DIR/templates/*.jinja, in name order; tandem gets the file and the
    harness's own special tokens."""
    tdir = os.path.join(corpus, "templates")
    try:
        names = sorted(f for f in os.listdir(tdir) if f.endswith(".jinja"))
    except OSError as e:
        raise UsageError(f"--corpus: {e}")
    if not names:
        raise UsageError(f"no *.jinja in {tdir}")
    out = []
    for n in names:
        path = os.path.join(tdir, n)
        out.append(Template(n, template_reference.read_template(path),
                            ["--template", path, "--bos", BOS, "--eos", EOS], BOS, EOS, path))
    return out


def self_test_args(tpl, tmp):
    """The reference CLI's arguments for what tpl.args tells tandem: the template as a file,
    bos/eos spelled out. A model without a template: a file that does not exist, which the CLI
    refuses as tandem must."""
    args = ["--template", tpl.path or os.path.join(tmp, "no-template.jinja")]
    for flag, v in (("--bos", tpl.bos), ("--eos", tpl.eos)):
        if v is not None:
            args += [flag, v]
    return args


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tandem", help="the tandem binary")
    ap.add_argument("--corpus",
                    help="the corpus directory (scripts/fetch_corpus.py), holding templates/")
    ap.add_argument("--model", action="append", default=[],
                    help="a GGUF file whose own chat templates to check (repeatable)")
    ap.add_argument("--only", help="templates to run: a name or a glob")
    ap.add_argument("--fixture", help="fixtures to run: a name or a glob")
    ap.add_argument("--verbose", action="store_true", help="a line for every case")
    ap.add_argument("--reference-only", action="store_true",
                    help="no tandem: list where the reference itself raises")
    ap.add_argument("--self-test", action="store_true",
                    help="compare with template_reference.py's CLI (jinja2 backend), not tandem")
    a = ap.parse_args()
    if not a.tandem and not (a.reference_only or a.self_test):
        ap.error("--tandem is required (or --reference-only / --self-test)")
    if not a.corpus and not a.model:
        ap.error("give --corpus, --model or both")
    with tempfile.TemporaryDirectory(prefix="tandem-tpl-") as tmp:
        return run(a, tmp)


def run(a, tmp):
    """main's work on its arguments a; tmp holds the fixtures' input files and the models'
    templates for the reference CLI. The time printed includes reading the models."""
    t0 = time.monotonic()
    try:
        fixtures = load_fixtures(a.fixture)
        templates, excuses = [], {}
        if a.corpus:
            templates = corpus_templates(a.corpus)
            excuses = load_exceptions({t.label for t in templates},
                                      {n for n, _ in load_fixtures(None)})
        for m in a.model:
            templates += read_model(m, tmp)
    except (UsageError, OSError, ValueError) as e:
        print(f"test_template_corpus: {e}", file=sys.stderr)
        return 2
    templates = [t for t in templates if not a.only or _matches(t.label, a.only)]
    if not templates:
        print(f"test_template_corpus: no template matches --only {a.only!r}", file=sys.stderr)
        return 2
    print(f"reference: {template_reference.backend_name()}; {len(templates)} templates x "
          f"{len(fixtures)} fixtures", flush=True)
    if a.reference_only:
        return reference_only(templates, fixtures, a.verbose)

    if a.self_test:
        cmd = [sys.executable, REFERENCE_CLI, "--backend", "jinja2"]
    else:
        cmd = [os.path.abspath(a.tandem), "template"]
    rows, fails, used = [], 0, set()
    inputs = write_inputs(fixtures, tmp)
    for tpl in templates:
        source = self_test_args(tpl, tmp) if a.self_test else tpl.args
        counts = {}
        for name, fx in fixtures:
            # exceptions.txt names corpus files only, so a model's label never finds an excuse
            key = (tpl.label, name) if (tpl.label, name) in excuses else (tpl.label, "*")
            ref_ok, ref_out = reference(tpl, fx)
            rc, out, err = run_tandem(cmd, source, fx, inputs[name])
            outcome, detail = judge(ref_ok, ref_out, rc, out, err, excuses.get(key))
            if outcome == "excused":
                used.add(key)
            counts[outcome] = counts.get(outcome, 0) + 1
            if outcome == "FAIL":
                fails += 1
                print(f"FAIL {tpl.label} {name}: {detail}", flush=True)
            elif a.verbose:
                print(f"{outcome:<7} {tpl.label} {name}" + (f": {detail}" if detail else ""),
                      flush=True)
        rows.append((tpl.label, counts))
    totals = print_table(rows, ["match", "both", "excused", "FAIL"])
    # a listed limitation that no longer shows is worth deleting from the file
    ran = {t.label for t in templates}
    for key in sorted(excuses):
        if key not in used and key[0] in ran and not a.only and not a.fixture:
            print(f"note: exceptions.txt lists {key[0]} {key[1]}, which no longer needs it")
    what = "template_corpus" if a.corpus else "template_models"
    print(f"{what}: {totals['match']} match, {totals['both']} both refuse, "
          f"{totals['excused']} excused, {fails} failed ({len(templates) * len(fixtures)} cases, "
          f"{time.monotonic() - t0:.1f} s)")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
