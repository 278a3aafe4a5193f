#!/usr/bin/env python3
"""check_structure.py: the structure rules of Tandem's C code (issue 12), checked in CI.

Rules (docs/contributing.md explains each one and how to fix a violation):
  function-length    no function longer than 120 lines (opening to closing brace, inclusive)
  file-length        a report, not a failure: .c files longer than 900 lines are listed
                     (files are split by reason to change, never by a line count; a long file
                     is a prompt to look for a second concern in it, no more)
  monotonic-clock    at most two files read CLOCK_MONOTONIC directly (common/td_clock.c is one);
                     choosing it for a condition variable (pthread_condattr_setclock) is no read
  duplicate-function no function defined in two modules (exported .c functions, header inlines)
  static-clash       no static function named like another module's exported function or inline
  duplicate-type     no typedef name or struct/union/enum tag defined in two headers, nor a
                     header's type defined again in another module's .c file
  type-prefix        every type defined in a header carries its module's prefix (PREFIXES)
  include-cycle      no cycle between a module's files through quoted #includes, other than
                     through its own private header (*_int.h, *_internal.h)
  layer-order        a module includes headers of its own layer's modules or lower ones only
                     (LAYERS: common below the backend contract below kvmem below the
                     kernels, and so on up to tools; a module's include/ folder, its public
                     headers, may have a layer of its own below the module's); a module not
                     in LAYERS is not checked
  public-header      the folders in PUBLIC_ONLY (the nodes, the router, the planner, grammar,
                     jinja, kvxfer) export only their include/ folder: another module includes
                     only headers from there, and a header there includes none of its own
                     module's others

A module is a top-level directory. tests/ is left out of every rule, and generated code
(*.pb-c.c, files that say "generated ... do not edit" at the top) of the length rules.
The scan is C-aware but not a compiler: comments, string and character literals,
preprocessor lines and all but one branch of each #if are blanked, then braces are matched
at file scope.

Usage:
  check_structure.py [--root DIR]    every violation as FILE:LINE: [rule] reason; exit 1 if any
                                     (the report-only rules print "note:" lines and never fail)
  check_structure.py --list          the longest functions and .c files with their sizes
  check_structure.py --self-test     runs the rules over tests/structure/tree, whose
                                     "EXPECT: rule" comments say which lines must be reported

Python 3 standard library only: it runs with the system python3 on a fresh machine.
"""

import argparse
import bisect
import os
import re
import subprocess
import sys
from collections import defaultdict

MAX_FUNCTION_LINES = 120
MAX_FILE_LINES = 900
MAX_CLOCK_PLACES = 2
CLOCK_HOME = "common/td_clock.c"  # the designated place; the second one is free

# Type-name prefixes allowed in each module's headers (from what each module uses).
PREFIXES = {
    "common": ("td_",),
    "backend": ("kn_",),
    "kvmem": ("kn_",),
    "kernels": ("kn_",),
    "kvxfer": ("kvx_", "kvxi_"),
    "decode-node": ("dc_",),
    "prefill-node": ("pf_",),
    "router": ("rt_",),
    "tools": ("cli_", "up_"),
    "grammar": ("gr_",),
    "jinja": ("jn_", "jv"),
    "planner": ("pl_",),
}

# The modules from the bottom up: a module may include headers of modules in its own layer
# or below, never above (docs/architecture.md, "Layers"). Modules of one layer do not
# include each other today; the rule allows it. "X/include" is module X's public headers
# (its libraries' interfaces) where they sit lower than the rest of X: the nodes' libraries
# that the planner uses (prefill-node's pf_core, decode-node's dc_shm) are below the planner,
# the node binaries above it.
LAYERS = (
    ("common", "proto"),
    ("backend",),  # the device-backend contract, a header
    ("kvmem",),  # the KV memory: pool, tier, cache, kv_mem
    ("kernels", "grammar", "jinja", "kvxfer"),
    ("decode-node/include", "prefill-node/include"),  # dc_shm.h; pf_core's public headers
    ("planner",),
    ("decode-node", "prefill-node", "router"),
    ("tools",),
)

# Modules whose libraries export only their include/ folder (CMake: PUBLIC include/, PRIVATE
# the folder): other modules include only the headers there (the router has none), and a
# header there includes no other header of its module (it would not compile from outside).
PUBLIC_ONLY = ("grammar", "jinja", "kvxfer", "decode-node", "prefill-node", "router", "planner")

# Exported names every program defines once (one per binary, so several modules have one).
PER_PROGRAM = {"main"}

PRIVATE_HEADER = re.compile(r"_(int|internal|impl|priv|private)\.h$")
GENERATED_NAME = re.compile(r"\.pb-c\.[ch]$")
GENERATED_MARK = re.compile(r"generated.*do not edit|do not edit.*generated", re.I | re.S)

C_KEYWORDS = {
    "auto", "break", "case", "char", "const", "continue", "default", "do", "double", "else",
    "enum", "extern", "float", "for", "goto", "if", "inline", "int", "long", "register",
    "restrict", "return", "short", "signed", "sizeof", "static", "struct", "switch",
    "typedef", "union", "unsigned", "void", "volatile", "while", "_Alignas", "_Alignof",
    "_Atomic", "_Bool", "_Complex", "_Generic", "_Imaginary", "_Noreturn", "_Static_assert",
    "_Thread_local", "__attribute__", "__attribute", "__declspec", "__extension__",
    "__inline", "__inline__", "__restrict", "__restrict__", "__asm__", "asm", "__thread",
    "__typeof__", "typeof", "alignas", "noreturn", "static_assert", "thread_local",
}
ATTRIBUTE_WORDS = {"__attribute__", "__attribute", "__declspec", "_Alignas", "alignas"}
AGGREGATE_WORDS = {"struct", "union", "enum"}


class Violation:
    def __init__(self, path, line, rule, reason):
        self.path, self.line, self.rule, self.reason = path, line, rule, reason

    def key(self):
        return (self.path, self.line, self.rule)

    def __str__(self):
        return "%s:%d: [%s] %s" % (self.path, self.line, self.rule, self.reason)


# --- lexing -------------------------------------------------------------------------------------


def _blank(chars, i, j):
    """Replaces chars[i:j] with spaces, keeping newlines (so lines and columns stay)."""
    for k in range(i, j):
        if chars[k] != "\n":
            chars[k] = " "


def lex(src):
    """Returns (nocomment, code, nostr), each as long as src with its newlines: src with
    comments blanked (string literals kept, for #include); with comments, the contents of
    string and character literals and preprocessor lines blanked (for the brace scan); and
    with comments and literal contents blanked but directives kept (for the clock scan)."""
    nocom = list(src)
    nostr = list(src)
    n = len(src)
    i = 0
    line_start = True  # only whitespace since the last newline (a directive may start)
    while i < n:
        c = src[i]
        if c == "\n":
            line_start = True
            i += 1
            continue
        if line_start and c == "#":
            # #error / #warning text may hold apostrophes: not character literals
            m = re.match(r"#\s*(error|warning|pragma)\b[^\n]*", src[i:])
            if m:
                i += m.end()
                line_start = False
                continue
        if c == "/" and i + 1 < n and src[i + 1] == "*":
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            _blank(nocom, i, j)
            _blank(nostr, i, j)
            i = j
            continue
        if c == "/" and i + 1 < n and src[i + 1] == "/":
            j = i
            while True:  # a backslash-newline continues a // comment
                e = src.find("\n", j)
                if e < 0:
                    e = n
                    break
                if src[e - 1] == "\\":
                    j = e + 1
                    continue
                break
            _blank(nocom, i, e)
            _blank(nostr, i, e)
            i = e
            continue
        if c in "\"'":
            j = i + 1
            while j < n and src[j] != c and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            _blank(nostr, i + 1, min(j, n))
            i = j + 1
            line_start = False
            continue
        if not c.isspace():
            line_start = False
        i += 1
    nocomment = "".join(nocom)
    nostr_text = "".join(nostr)
    lines = nostr_text.split("\n")
    raw_lines = src.split("\n")
    # Blank directives, and the other branches of each #if group: both arms of
    # "#if X / if (a) { / #else / if (b) { / #endif" would unbalance the braces. One branch
    # is kept: the first, or the second after "#if 0" or "#ifdef __cplusplus" (this is C).
    stack = []  # per open #if: [keeping this branch, a branch was kept already]
    k = 0
    while k < len(lines):
        stripped = lines[k].lstrip()
        if stripped.startswith("#"):
            m = re.match(r"#\s*(\w*)\s*(.*)", stripped)
            word, arg = m.group(1), m.group(2).strip()
            if word in ("if", "ifdef", "ifndef"):
                keep = not ((word == "if" and arg == "0")
                            or (word == "ifdef" and arg == "__cplusplus")
                            or (word == "if" and re.fullmatch(r"defined\s*\(?\s*__cplusplus\s*\)?", arg)))
                stack.append([keep, keep])
            elif word in ("elif", "else") and stack:
                stack[-1][0] = not stack[-1][1]
                stack[-1][1] = True
            elif word == "endif" and stack:
                stack.pop()
            while True:  # the directive and its continuation lines
                cont = raw_lines[k].rstrip().endswith("\\")
                lines[k] = ""
                k += 1
                if not cont or k >= len(lines):
                    break
            continue
        if not all(keep for keep, _ in stack):
            lines[k] = ""
        k += 1
    return nocomment, "\n".join(lines), nostr_text


TOKEN = re.compile(r"[A-Za-z_]\w*|\d[\w.]*|->|\S")


class Tok:
    __slots__ = ("text", "line")

    def __init__(self, text, line):
        self.text, self.line = text, line


def tokenize(code):
    starts = [0] + [m.end() for m in re.finditer("\n", code)]
    return [Tok(m.group(0), bisect.bisect_right(starts, m.start()))
            for m in TOKEN.finditer(code)]


def is_ident(t):
    return (t[0].isalpha() or t[0] == "_") and t not in C_KEYWORDS


# --- file-scope items: functions, aggregates, typedefs --------------------------------------------


def drop_attributes(toks):
    """toks without __attribute__((...)) / alignas(...) groups."""
    out, k = [], 0
    while k < len(toks):
        if toks[k].text in ATTRIBUTE_WORDS and k + 1 < len(toks) and toks[k + 1].text == "(":
            depth = 0
            k += 1
            while k < len(toks):
                depth += {"(": 1, ")": -1}.get(toks[k].text, 0)
                k += 1
                if depth == 0:
                    break
            continue
        out.append(toks[k])
        k += 1
    return out


def _match_back(toks, close):
    """Index of the '(' matching the ')' at toks[close]."""
    depth = 0
    for k in range(close, -1, -1):
        if toks[k].text == ")":
            depth += 1
        elif toks[k].text == "(":
            depth -= 1
            if depth == 0:
                return k
    return -1


def _strip_trailing_attributes(head):
    """head without trailing __attribute__((...)) groups."""
    while len(head) >= 2 and head[-1].text == ")":
        p = _match_back(head, len(head) - 1)
        if p > 0 and head[p - 1].text in ATTRIBUTE_WORDS:
            head = head[:p - 1]
        else:
            break
    return head


def function_name(head):
    """(name token index, name) of the function whose definition head (tokens before '{',
    ending with its parameter list) is head; (-1, None) when it is no declarator."""
    p = _match_back(head, len(head) - 1)
    if p <= 0:
        return -1, None
    before = head[p - 1].text
    if is_ident(before):
        return p - 1, before
    if before == ")":  # int (*f(void))(int): the name is inside the group before
        q = _match_back(head, p - 1)
        for k in range(q + 1, p - 1):
            if is_ident(head[k].text) and head[k + 1].text == "(":
                return k, head[k].text
    return -1, None


def classify(head):
    texts = [t.text for t in head]
    depth = 0
    for t in texts:
        if t in "([":
            depth += 1
        elif t in ")]":
            depth -= 1
        elif t == "=" and depth == 0:
            return "initializer"
    stripped = _strip_trailing_attributes(head)
    if stripped and stripped[-1].text == ")":
        return "function"
    if AGGREGATE_WORDS & set(texts):
        return "aggregate"
    return "block"


def _split_top(toks, sep=","):
    parts, cur, depth = [], [], 0
    for t in toks:
        if t.text in "([{":
            depth += 1
        elif t.text in ")]}":
            depth -= 1
        if t.text == sep and depth == 0:
            parts.append(cur)
            cur = []
        else:
            cur.append(t)
    parts.append(cur)
    return parts


def declarator_name(toks):
    """The identifier a declarator declares (toks may start with type specifiers)."""
    toks = [t for t in drop_attributes(toks)
            if t.text not in ("const", "volatile", "restrict", "__restrict")]
    for k, t in enumerate(toks):
        if t.text == "(" and (k == 0 or toks[k - 1].text not in ATTRIBUTE_WORDS):
            if k + 1 < len(toks) and toks[k + 1].text in ("*", "^"):
                for u in toks[k + 1:]:  # (*name)(...)
                    if is_ident(u.text):
                        return u
                return None
            if k > 0 and is_ident(toks[k - 1].text):  # name(...): a function type
                return toks[k - 1]
            return None
    depth = 0
    last = None
    for t in toks:
        if t.text in "([":
            depth += 1
        elif t.text in ")]":
            depth -= 1
        elif depth == 0 and is_ident(t.text):
            last = t
    return last


class Func:
    def __init__(self, name, line, specifiers, open_line, close_line):
        self.name, self.line, self.specifiers = name, line, specifiers
        self.open_line, self.close_line = open_line, close_line
        self.static = "static" in specifiers  # load() adds the macros that say static

    @property
    def length(self):
        return self.close_line - self.open_line + 1


BODY = "\x00body"  # stands for an aggregate's or initializer's braces in a declaration


def scan(tokens):
    """Returns (functions, typedef names, defined tags): the file-scope function definitions,
    the typedef'd names (Tok) and the struct/union/enum tags defined with a body (Tok)."""
    funcs, typedefs, tags = [], [], []
    depth = 0
    head, body, kind, open_tok = [], [], None, None

    def tags_in(toks):
        toks = drop_attributes(toks)
        for k in range(len(toks) - 2):
            if (toks[k].text in AGGREGATE_WORDS and is_ident(toks[k + 1].text)
                    and toks[k + 2].text == "{"):
                tags.append(toks[k + 1])

    def declaration(toks):
        texts = [t.text for t in toks]
        while texts and texts[0] == "__extension__":
            toks, texts = toks[1:], texts[1:]
        if not texts or texts[0] != "typedef":
            return
        rest = toks[1:]
        last_body = max((k for k, t in enumerate(rest) if t.text == BODY), default=-1)
        decls = rest[last_body + 1:]
        for part in _split_top(decls):
            t = declarator_name(part)
            if t is not None:
                typedefs.append(t)

    for tok in tokens:
        t = tok.text
        if depth == 0:
            if t == "{":
                kind = classify(head)
                open_tok = tok
                body = []
                depth = 1
            elif t == ";":
                declaration(head)
                head = []
            elif t == "}":
                head = []  # unbalanced: start over
            else:
                head.append(tok)
            continue
        if t == "{":
            depth += 1
        elif t == "}":
            depth -= 1
            if depth == 0:
                if kind == "function":
                    k, name = function_name(_strip_trailing_attributes(head))
                    if name is not None:
                        specs = {x.text for x in head[:k]}
                        funcs.append(Func(name, head[k].line, specs, open_tok.line, tok.line))
                    head = []
                else:
                    tags_in(head + [open_tok] + body)
                    head = head + [Tok(BODY, tok.line)]
                continue
        body.append(tok)
    return funcs, typedefs, tags


# --- the tree -----------------------------------------------------------------------------------


class SourceFile:
    def __init__(self, root, rel):
        self.rel = rel
        self.module = rel.split("/", 1)[0] if "/" in rel else "."
        self.is_header = rel.endswith(".h")
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            self.src = f.read()
        self.n_lines = self.src.count("\n") + (0 if self.src.endswith("\n") or not self.src else 1)
        head = "\n".join(self.src.split("\n")[:8])
        self.generated = bool(GENERATED_NAME.search(rel) or GENERATED_MARK.search(head))
        self.nocomment, code, self.nostr = lex(self.src)
        self.funcs, self.typedefs, self.tags = scan(tokenize(code))


def list_files(root):
    """The .c and .h files of the tree, relative to root, tests/ and build trees left out.
    Uses git (tracked and untracked-but-not-ignored files) when root is a checkout."""
    rels = None
    try:
        out = subprocess.run(
            ["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=True).stdout
        rels = [r for r in out.decode("utf-8", "replace").split("\0") if r]
    except (OSError, subprocess.CalledProcessError):
        pass
    if rels is None:
        rels = []
        for d, dirs, files in os.walk(root):
            top = os.path.samefile(d, root)
            dirs[:] = sorted(x for x in dirs if not x.startswith(".")
                             and not (top and x.startswith("build"))  # .gitignore's build*/
                             and not os.path.exists(os.path.join(d, x, "CMakeCache.txt")))
            for f in files:
                rels.append(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"))
    keep = []
    for r in sorted(set(rels)):
        if not r.endswith((".c", ".h")) or r.startswith("tests/"):
            continue
        if os.path.isfile(os.path.join(root, r)):  # tracked but deleted in the worktree
            keep.append(r)
    return keep


STATIC_MACRO = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)[ \t]+[^\n]*\bstatic\b", re.M)


def load(root):
    """The tree's files, scanned. A function whose specifiers hold an object-like macro that
    says static (#define KN_ALWAYS_INLINE static inline ...) is static."""
    files = [SourceFile(root, r) for r in list_files(root)]
    static_macros = {m.group(1) for f in files for m in STATIC_MACRO.finditer(f.nocomment)}
    for f in files:
        for fn in f.funcs:
            fn.static = fn.static or bool(fn.specifiers & static_macros)
    return files


# --- rules --------------------------------------------------------------------------------------


def check_lengths(files, max_fn, max_file):
    out = []
    for f in files:
        if f.generated:
            continue
        for fn in f.funcs:
            if fn.length > max_fn:
                out.append(Violation(f.rel, fn.line, "function-length",
                                     "%s is %d lines (max %d)" % (fn.name, fn.length, max_fn)))
        if not f.is_header and f.n_lines > max_file:
            out.append(Violation(f.rel, 1, "file-length",
                                 "%d lines (max %d): split it by concern" % (f.n_lines, max_file)))
    return out


CLOCK_CALL = re.compile(r"\b(clock_gettime|timespec_get)\s*\(([^,)]*)(,([^,)]*))?")
NOT_MONOTONIC = re.compile(r"^\s*(CLOCK_REALTIME\w*|CLOCK_PROCESS_CPUTIME_ID|CLOCK_THREAD_CPUTIME_ID"
                           r"|CLOCK_TAI|TIME_UTC)\s*$")


def clock_reads(f):
    """Lines of f that read the monotonic clock: clock_gettime on CLOCK_MONOTONIC* or
    CLOCK_BOOTTIME, or on a clock id passed in (a clock helper); timespec_get(TIME_MONOTONIC)."""
    lines = []
    for m in CLOCK_CALL.finditer(f.nostr):
        clock = m.group(2) if m.group(1) == "clock_gettime" else (m.group(4) or "")
        if not NOT_MONOTONIC.match(clock):
            lines.append(f.nostr.count("\n", 0, m.start()) + 1)
    return lines


def check_clock(files, max_places):
    places = {f.rel: clock_reads(f) for f in files}
    places = {k: v for k, v in places.items() if v}
    if len(places) <= max_places:
        return []
    out = []
    for rel, lines in sorted(places.items()):
        if rel == CLOCK_HOME:
            continue
        for ln in lines:
            out.append(Violation(rel, ln, "monotonic-clock",
                                 "reads the monotonic clock directly (one of %d files, max %d): "
                                 "use td_now_ns/ms or td_deadline_ts (common/td_clock.h)"
                                 % (len(places), max_places)))
    return out


def check_names(files):
    out = []
    # the module-level interface: exported .c functions and header functions, by name
    interface = defaultdict(list)  # name -> [(file, func, what)]
    for f in files:
        for fn in f.funcs:
            if f.is_header:
                interface[fn.name].append((f, fn, "inline" if fn.static else "header function"))
            elif not fn.static and fn.name not in PER_PROGRAM:
                interface[fn.name].append((f, fn, "exported function"))
    for name, defs in sorted(interface.items()):
        if len({f.module for f, _, _ in defs}) < 2:
            continue
        for f, fn, what in defs:
            others = ", ".join("%s:%d" % (g.rel, gn.line) for g, gn, _ in defs if g is not f)
            out.append(Violation(f.rel, fn.line, "duplicate-function",
                                 "%s %s is also defined in %s" % (what, name, others)))
    for f in files:
        if f.is_header:
            continue
        for fn in f.funcs:
            if not fn.static:
                continue
            clash = [(g, gn, what) for g, gn, what in interface.get(fn.name, ())
                     if g.module != f.module]
            if clash:
                g, gn, what = clash[0]
                out.append(Violation(f.rel, fn.line, "static-clash",
                                     "static %s has the name of %s's %s (%s:%d): rename it"
                                     % (fn.name, g.module, what, g.rel, gn.line)))

    # types: typedef names and tags are separate namespaces; one definition each
    header_types = defaultdict(list)  # (namespace, name) -> [(file, tok)]
    for f in files:
        if not f.is_header:
            continue
        seen = set()
        for ns, toks in (("typedef", f.typedefs), ("tag", f.tags)):
            for t in toks:
                if (ns, t.text) not in seen:  # #if alternatives in one header are one type
                    seen.add((ns, t.text))
                    header_types[(ns, t.text)].append((f, t))
    dups = defaultdict(dict)  # (header, name) -> {other header: line}, both namespaces merged
    first = {}
    for (ns, name), defs in sorted(header_types.items()):
        if len(defs) < 2:
            continue
        for f, t in defs:
            key = (f.rel, name)
            first[key] = min(first.get(key, t.line), t.line)
            for g, u in defs:
                if g is not f:
                    dups[key].setdefault(g.rel, u.line)
    for (rel, name), others in sorted(dups.items()):
        out.append(Violation(rel, first[(rel, name)], "duplicate-type",
                             "type %s is also defined in %s"
                             % (name, ", ".join("%s:%d" % o for o in sorted(others.items())))))
    for f in files:
        if f.is_header:
            continue
        for ns, toks in (("typedef", f.typedefs), ("tag", f.tags)):
            for t in toks:
                foreign = [(g, u) for g, u in header_types.get((ns, t.text), ())
                           if g.module != f.module]
                if foreign:
                    g, u = foreign[0]
                    out.append(Violation(f.rel, t.line, "duplicate-type",
                                         "%s is %s's header type (%s:%d): rename this one"
                                         % (t.text, g.module, g.rel, u.line)))

    # prefixes of header types
    for f in files:
        if not f.is_header or f.generated:
            continue
        prefixes = PREFIXES.get(f.module)
        done = set()
        for t in f.typedefs + f.tags:
            if t.text in done:
                continue
            done.add(t.text)
            if prefixes is None:
                out.append(Violation(f.rel, t.line, "type-prefix",
                                     "module %s has no type prefix: add it to PREFIXES in "
                                     "scripts/check_structure.py" % f.module))
            elif not t.text.startswith(prefixes):
                out.append(Violation(f.rel, t.line, "type-prefix",
                                     "header type %s lacks %s's prefix (%s)"
                                     % (t.text, f.module, "/".join(prefixes))))
    return out


INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def _sccs(nodes, edges):
    """Tarjan's strongly connected components (iterative)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                elif nxt in on:
                    low[v] = min(low[v], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def _cycle_in(comp, edges):
    """One cycle through comp's first node, as a node list (first node repeated at the end)."""
    start = comp[0]
    inside = set(comp)
    prev = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges.get(v, ())):
            if w not in inside:
                continue
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return [start, start]


def check_includes(files):
    out = []
    by_module = defaultdict(list)
    for f in files:
        by_module[f.module].append(f)
    for module, mfiles in sorted(by_module.items()):
        by_rel = {f.rel: f for f in mfiles}
        by_base = defaultdict(list)
        for f in mfiles:
            by_base[os.path.basename(f.rel)].append(f.rel)
        # file edges: (from, to) -> line of the #include
        fedges = {}
        for f in mfiles:
            for m in INCLUDE.finditer(f.nocomment):
                inc = m.group(1)
                here = os.path.normpath(os.path.join(os.path.dirname(f.rel), inc))
                if here in by_rel:
                    to = here
                elif len(by_base.get(os.path.basename(inc), ())) == 1:
                    to = by_base[os.path.basename(inc)][0]
                else:
                    continue  # another module's header or a system one
                line = f.nocomment.count("\n", 0, m.start()) + 1
                fedges.setdefault((f.rel, to), line)

        def unit(rel):  # a .c file and its same-named header are one node; private headers alone
            return rel if PRIVATE_HEADER.search(rel) else rel.rsplit(".", 1)[0]

        def report(comp, edges, what, via):
            cyc = _cycle_in(comp, edges)
            hops = []
            for a, b in zip(cyc, cyc[1:]):
                src, dst = via[(a, b)]
                hops.append((src, fedges[(src, dst)], dst))
            names = " -> ".join(os.path.basename(n) for n in cyc)
            detail = "; ".join("%s:%d includes %s" % (os.path.basename(s), ln, os.path.basename(d))
                               for s, ln, d in hops)
            src, ln, _ = hops[0]
            out.append(Violation(src, ln, "include-cycle", "%s %s (%s)" % (what, names, detail)))

        # 1. cycles between units that do not pass through a private header
        uedges, uvia = defaultdict(set), {}
        for (a, b) in sorted(fedges):
            ua, ub = unit(a), unit(b)
            if ua == ub or PRIVATE_HEADER.search(a) or PRIVATE_HEADER.search(b):
                continue
            uedges[ua].add(ub)
            uvia.setdefault((ua, ub), (a, b))
        unodes = sorted({unit(f.rel) for f in mfiles if not PRIVATE_HEADER.search(f.rel)})
        for comp in _sccs(unodes, uedges):
            if len(comp) > 1:
                report(comp, uedges, "files include each other:", uvia)
        # 2. header cycles through a private header (other header cycles are caught above)
        hedges, hvia = defaultdict(set), {}
        for (a, b) in sorted(fedges):
            if a.endswith(".h") and b.endswith(".h"):
                hedges[a].add(b)
                hvia[(a, b)] = (a, b)
        hnodes = sorted(f.rel for f in mfiles if f.is_header)
        for comp in _sccs(hnodes, hedges):
            selfloop = len(comp) == 1 and comp[0] in hedges.get(comp[0], ())
            if (len(comp) > 1 or selfloop) and any(PRIVATE_HEADER.search(c) for c in comp):
                report(comp, hedges, "headers include each other:", hvia)
    return out


def layer_unit(rel, layer):
    """The LAYERS entry rel belongs to: "X/include" for a file under X/include/ where LAYERS
    names it, else its module X."""
    module = rel.split("/", 1)[0]
    pub = module + "/include"
    return pub if rel.startswith(pub + "/") and pub in layer else module


def is_public(rel):
    """A header under its module's include/ folder."""
    parts = rel.split("/")
    return len(parts) > 2 and parts[1] == "include"


def check_layers(files):
    """layer-order: every quoted #include that resolves to a header of another module must go
    to a module (or a module's include/) of the same layer or a lower one.
    public-header: one that resolves to a header of a PUBLIC_ONLY module must go to its
    include/ folder; a header in a module's include/ includes none of its module's others."""
    layer = {m: i for i, mods in enumerate(LAYERS) for m in mods}
    home = defaultdict(list)  # header basename -> the headers of that name
    for f in files:
        if f.is_header:
            home[os.path.basename(f.rel)].append(f.rel)
    out = []
    for f in files:
        here = layer_unit(f.rel, layer)
        for m in INCLUDE.finditer(f.nocomment):
            found = home.get(os.path.basename(m.group(1)), [])
            line = f.nocomment.count("\n", 0, m.start()) + 1
            own = [h for h in found if h.split("/", 1)[0] == f.module]
            if own:  # a header of its own module
                for h in own:
                    if is_public(f.rel) and not is_public(h) and f.module in PUBLIC_ONLY:
                        out.append(Violation(f.rel, line, "public-header",
                                             "public header includes %s, private to %s: make "
                                             "it public (move it to %s/include/) or drop the "
                                             "include" % (h, f.module, f.module)))
                continue
            for h in sorted(found):
                o, ou = h.split("/", 1)[0], layer_unit(h, layer)
                if here in layer and ou in layer and layer[ou] > layer[here]:
                    out.append(Violation(f.rel, line, "layer-order",
                                         "%s (layer %d) includes %s of %s (layer %d, above it)"
                                         % (here, layer[here], m.group(1), ou, layer[ou])))
                if o in PUBLIC_ONLY and not is_public(h):
                    out.append(Violation(f.rel, line, "public-header",
                                         "includes %s, private to %s (other modules use "
                                         "%s/include/ only)" % (h, o, o)))
    return out


def check(files, max_fn=MAX_FUNCTION_LINES, max_file=MAX_FILE_LINES, max_clock=MAX_CLOCK_PLACES):
    v = (check_lengths(files, max_fn, max_file) + check_clock(files, max_clock)
         + check_names(files) + check_includes(files) + check_layers(files))
    return sorted(v, key=lambda x: (x.path, x.line, x.rule, x.reason))


# --- modes --------------------------------------------------------------------------------------


def list_sizes(files, max_fn, max_file):
    fns = [(fn.length, f.rel, fn.line, fn.name) for f in files if not f.generated
           for fn in f.funcs if fn.length > max_fn * 2 // 3]
    print("functions over %d lines (limit %d):" % (max_fn * 2 // 3, max_fn))
    for n, rel, line, name in sorted(fns, key=lambda x: (-x[0], x[1], x[2])):
        print("  %5d  %s:%d %s%s" % (n, rel, line, name, "  OVER" if n > max_fn else ""))
    cs = [(f.n_lines, f.rel) for f in files
          if not f.generated and not f.is_header and f.n_lines > max_file * 2 // 3]
    print(".c files over %d lines (limit %d):" % (max_file * 2 // 3, max_file))
    for n, rel in sorted(cs, key=lambda x: (-x[0], x[1])):
        print("  %5d  %s%s" % (n, rel, "  OVER" if n > max_file else ""))


EXPECT = re.compile(r"EXPECT:\s*([\w-]+(?:\s*,\s*[\w-]+)*)")
SELF_TEST_LIMITS = dict(max_fn=20, max_file=60, max_clock=2)
# reported, never a failure (issue 40: a file-size limit made files split by line count)
REPORT_ONLY = ("file-length",)
RULES = ("function-length", "file-length", "monotonic-clock", "duplicate-function",
         "static-clash", "duplicate-type", "type-prefix", "include-cycle", "layer-order",
         "public-header")


def self_test(root):
    """Every rule over tests/structure/tree: exactly the lines marked "EXPECT: rule" must be
    reported, and every rule must fire at least once (a check that cannot fail is a defect)."""
    tree = os.path.join(root, "tests", "structure", "tree")
    files = load(tree)
    if not files:
        print("self-test: no files under %s" % tree)
        return 1
    got = {v.key(): v for v in check(files, **SELF_TEST_LIMITS)}
    want = set()
    for d, _, names in os.walk(tree):
        for name in names:
            rel = os.path.relpath(os.path.join(d, name), tree).replace(os.sep, "/")
            with open(os.path.join(d, name), encoding="utf-8") as fh:
                for ln, text in enumerate(fh, 1):
                    for m in EXPECT.finditer(text):
                        for rule in m.group(1).split(","):
                            want.add((rel, ln, rule.strip()))
    bad = 0
    for k in sorted(want - set(got)):
        print("self-test: missed %s:%d: [%s]" % k)
        bad += 1
    for k in sorted(set(got) - want):
        print("self-test: unexpected %s" % got[k])
        bad += 1
    for rule in RULES:
        if not any(r == rule for _, _, r in want):
            print("self-test: no fixture makes [%s] fire" % rule)
            bad += 1
    print("self-test: %d files, %d expected violations, %d problems"
          % (len(files), len(want), bad))
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                    help="the source tree (default: this script's repository)")
    ap.add_argument("--list", action="store_true",
                    help="list the long functions and .c files with their sizes (no check)")
    ap.add_argument("--self-test", action="store_true",
                    help="check the rules against the fixtures in tests/structure/tree")
    ap.add_argument("--max-function-lines", type=int, default=MAX_FUNCTION_LINES)
    ap.add_argument("--max-file-lines", type=int, default=MAX_FILE_LINES)
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    if args.self_test:
        return self_test(root)
    files = load(root)
    if not files:
        print("check_structure: no C files under %s" % root, file=sys.stderr)
        return 2
    if args.list:
        list_sizes(files, args.max_function_lines, args.max_file_lines)
        return 0
    found = check(files, args.max_function_lines, args.max_file_lines)
    notes = [v for v in found if v.rule in REPORT_ONLY]
    violations = [v for v in found if v.rule not in REPORT_ONLY]
    for v in notes:
        print("note: %s" % v)
    for v in violations:
        print(v)
    print("check_structure: %d files, %d violations, %d notes"
          % (len(files), len(violations), len(notes)))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
