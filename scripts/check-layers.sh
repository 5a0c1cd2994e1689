#!/usr/bin/env bash
# Checks the layer rules of docs/architecture.md against every include and every use of
# an idem__ name in the library's sources (the layer folders of that document: include/,
# src/*, interceptors/, tools/).
#   bash scripts/check-layers.sh [ROOT]      # ROOT: a source tree, default this one
# The layer order is read from the first code block of ROOT/docs/architecture.md (each
# line that starts with a folder name, lowest first; an indented folder such as lmdb/ is
# part of the layer above it), the include path from ROOT/meson.build (inc =
# include_directories(...)). A file's layer is the deepest listed folder its path is in.
# It fails (exit 1), naming file:line, when
#   - a file includes a header of a higher layer;
#   - a file names an idem__ function, macro or global defined in a higher layer (a
#     call, a declaration, or its address taken);
#   - files of one folder call each other's idem__ functions in a circle (each .c file
#     is a node, a call of a function defined in another .c file of the folder an
#     edge; an ops table that takes the functions' addresses is not a call).
# Python 3 standard library only; one pass over the files, well under a second.
set -euo pipefail
root=${1:-"$(dirname "$0")/.."}
exec python3 - "$root" <<'PY'
import os, re, sys

root = sys.argv[1]
os.chdir(root)

# ---- the layer order, lowest first
doc = open('docs/architecture.md', encoding='utf-8').read()
blocks = doc.split('```')
if len(blocks) < 3:
    sys.exit('check-layers: docs/architecture.md has no code block with the layers')
layers, parent = [], None
for line in blocks[1].splitlines():
    m = re.match(r'^(\s*)([\w.-]+(?:/[\w.-]+)*)/(\s|$)', line)
    if not m:
        continue
    if m.group(1) == '':
        parent = m.group(2)
        layers.append(parent)
    elif parent is not None:
        layers.append(parent + '/' + m.group(2))  # a sub-folder: the same layer
rank, tops = {}, []
for d in layers:
    if not any(d.startswith(t + '/') for t in tops):
        tops.append(d)
for i, t in enumerate(tops):
    for d in layers:
        if d == t or d.startswith(t + '/'):
            rank[d] = i

def folder_of(path):
    best = None
    for d in layers:
        if (path.startswith(d + '/')) and (best is None or len(d) > len(best)):
            best = d
    return best

def layer_name(d):
    return next(t for t in tops if d == t or d.startswith(t + '/'))

# ---- the include path
meson = open('meson.build', encoding='utf-8').read()
m = re.search(r'^inc\s*=\s*include_directories\((.*?)\)', meson, re.S | re.M)
inc_dirs = re.findall(r"'([^']+)'", m.group(1)) if m else ['include']

# ---- the sources
files = []
for top in tops:
    for dp, dn, fn in os.walk(top):
        dn.sort()
        for f in sorted(fn):
            if f.endswith(('.c', '.h')):
                files.append(os.path.normpath(os.path.join(dp, f)))

def blank(text):
    """Comments and string/char literals as spaces (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith('/*', i):
            j = text.find('*/', i + 2)
            j = n if j < 0 else j + 2
        elif text.startswith('//', i):
            j = text.find('\n', i)
            j = n if j < 0 else j
        elif text[i] in '"\'':
            q, j = text[i], i + 1
            while j < n and text[j] != q and text[j] != '\n':
                j += 2 if text[j] == '\\' else 1
            out.append(q + re.sub(r'[^\n]', ' ', text[i + 1:j]) + q)
            i = j + 1
            continue
        else:
            j = i + 1
            while j < n and text[j] not in '/"\'':
                j += 1
            out.append(text[i:j])
            i = j
            continue
        out.append(re.sub(r'[^\n]', ' ', text[i:j]))
        i = j
    return ''.join(out)

NAME = re.compile(r'\bidem__\w+')
PREPROC = re.compile(r'^[ \t]*#(?:[^\n]*\\\n)*[^\n]*', re.M)
src, defs, defsite = {}, {}, set()

def define(name, f, pos, local):
    defsite.add((f, pos))
    if not local:
        defs.setdefault(name, set()).add(f)

for f in files:
    raw = open(f, encoding='utf-8', errors='replace').read()
    s = blank(raw)
    src[f] = (raw, s)
    for m in re.finditer(r'^[ \t]*#[ \t]*define[ \t]+(idem__\w+)', s, re.M):
        define(m.group(1), f, m.start(1), False)
    t = PREPROC.sub(lambda m: re.sub(r'[^\n]', ' ', m.group(0)), s)
    depth, stmt, i, n = 0, 0, 0, len(t)
    for m in re.finditer(r'[{};]|\bidem__\w+', t):
        tok, i = m.group(0), m.start()
        if tok == '{':
            depth += 1
        elif tok == '}':
            depth -= 1
            stmt = m.end()
        elif tok == ';':
            if depth == 0:
                stmt = m.end()
        elif depth == 0:
            j = m.end()
            while j < n and t[j] in ' \t\n':
                j += 1
            head = t[stmt:i]
            local = f.endswith('.c') and re.search(r'\bstatic\b', head) is not None
            if j < n and t[j] == '(':
                d, k = 0, j
                while k < n:
                    d += (t[k] == '(') - (t[k] == ')')
                    if d == 0:
                        break
                    k += 1
                k += 1
                while k < n and t[k] in ' \t\n':
                    k += 1
                if k < n and t[k] == '{':  # a function definition
                    define(tok, f, i, local)
            elif j < n and t[j] in '=[' and not re.search(r'\b(extern|typedef)\b', head):
                define(tok, f, i, local)  # a global

def resolve(f, name, angle):
    for d in ([] if angle else [os.path.dirname(f)]) + inc_dirs:
        p = os.path.normpath(os.path.join(d, name))
        if p in src:
            return p
    return None

def lineno(s, pos):
    return s.count('\n', 0, pos) + 1

bad, edges = [], {}
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"]+)[>"]', re.M)
for f in files:
    raw, s = src[f]
    lf = folder_of(f)
    for m in INCLUDE.finditer(raw):
        if not s[m.start():m.end()].lstrip().startswith('#'):
            continue  # inside a comment
        h = resolve(f, m.group(2), m.group(1) == '<')
        if h is not None and rank[folder_of(h)] > rank[lf]:
            bad.append('%s:%d: includes %s: %s/ is above %s/' % (
                f, lineno(raw, m.start()), h, layer_name(folder_of(h)), layer_name(lf)))
    for m in NAME.finditer(s):
        name = m.group(0)
        owners = defs.get(name)
        if not owners or f in owners or (f, m.start()) in defsite:
            continue
        low = min(owners, key=lambda o: rank[folder_of(o)])
        if rank[folder_of(low)] > rank[lf]:
            bad.append('%s:%d: uses %s of %s: %s/ is above %s/' % (
                f, lineno(s, m.start()), name, low, layer_name(folder_of(low)),
                layer_name(lf)))
        if f.endswith('.c') and re.match(r'\s*\(', s[m.end():m.end() + 200]):
            for o in owners:
                if o.endswith('.c') and os.path.dirname(o) == os.path.dirname(f):
                    edges.setdefault(f, {}).setdefault(o, (name, lineno(s, m.start())))

# ---- circles of calls between the .c files of one folder (Tarjan's SCCs)
index, low, stack, on, comps = {}, {}, [], set(), []
def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(edges.get(v, {})):
        if w not in index:
            visit(w)
            low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop()
            on.discard(w)
            comp.append(w)
            if w == v:
                break
        if len(comp) > 1:
            comps.append(sorted(comp))
sys.setrecursionlimit(10000)
for v in sorted(edges):
    if v not in index:
        visit(v)
for comp in comps:
    for a in comp:
        for b, (name, ln) in sorted(edges[a].items()):
            if b in comp:
                bad.append('%s:%d: calls %s of %s, in a circle of %s' % (
                    a, ln, name, b, ' '.join(os.path.basename(c) for c in comp)))

for line in bad:
    print(line)
print('check-layers: %d files, %d layers (%s): %s' % (
    len(files), len(tops), ' < '.join(tops),
    '%d violations' % len(bad) if bad else 'ok'), file=sys.stderr)
sys.exit(1 if bad else 0)
PY
