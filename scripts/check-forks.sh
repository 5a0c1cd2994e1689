#!/usr/bin/env bash
# Checks that every fork() (and vfork()) in the project's C sources is followed, in the
# child, only by calls that are safe there and ends in _exit: the exec family, open,
# dup2, close, close_range, write, setsid, setpgid, sigprocmask (chaos_exec is dup2,
# execv and _exit). The child of a threaded process inherits every lock another thread
# held at the fork; GCC 12's ASan has no fork handler for its allocator, so a child that
# allocates can wait for that lock forever (CI saw test_wal hang so). Code a child must
# run goes through exec: TU_CHILD_MAIN in tests/testutil.h.
#
# The one form it reads: the fork assigned to a variable, and the child's branch an
# `if (VAR == 0)`, `if (0 == VAR)` or `if (!VAR)` within the next lines. Any other form
# fails. A fork made before the process starts any thread says so on its line:
# /* no thread yet */ (a reviewer's claim, not checked).
#   bash scripts/check-forks.sh [ROOT]      # ROOT: a source tree, default this one
# Fails (exit 1) naming file:line and the reason. Python 3 standard library only.
set -euo pipefail
root=${1:-"$(dirname "$0")/.."}
exec python3 - "$root" <<'PY'
import os, re, sys

root = sys.argv[1]
os.chdir(root)
SAFE = {'execv', 'execl', 'execvp', 'execve', 'execle', 'execlp', 'open', 'dup2', 'close',
        'close_range', 'write', 'setsid', 'setpgid', 'sigprocmask', '_exit', 'chaos_exec'}
KEYWORDS = {'if', 'while', 'for', 'switch', 'return', 'sizeof'}
# comments and the insides of string and char literals: blanked, newlines kept, so that
# neither a brace nor a call in them counts and line numbers hold
LEXEMES = re.compile(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)


def blank(m):
    t = m.group(0)
    inner = re.sub(r'[^\n]', ' ', t[1:-1])
    return ' ' + inner + ' ' if t[0] == '/' else t[0] + inner + t[-1]


def block_end(code, open_at):
    depth = 0
    for k in range(open_at, len(code)):
        depth += {'{': 1, '}': -1}.get(code[k], 0)
        if depth == 0:
            return k
    return len(code) - 1


def check(path, raw, code, at):
    """The reason the fork at offset `at` is not safe, or None."""
    line_start = code.rfind('\n', 0, at) + 1
    assigned = re.search(r'([A-Za-z_][\w.>-]*)\s*=\s*$', code[line_start:at])
    if assigned is None:
        return 'fork() not assigned to a variable (write: pid = fork(); if (pid == 0) {...})'
    var = re.escape(assigned.group(1))
    child = re.compile(r'\bif\s*\(\s*(?:' + var + r'\s*==\s*0|0\s*==\s*' + var + r'|!\s*' +
                       var + r')\s*\)\s*\{')
    window_end = at
    for _ in range(6):
        window_end = code.find('\n', window_end + 1)
        if window_end < 0:
            window_end = len(code)
            break
    m = child.search(code, at, window_end)
    if m is None:
        return 'no child branch (if (%s == 0) {) within 5 lines of the fork' % assigned.group(1)
    end = block_end(code, m.end() - 1)
    body = code[m.end():end]
    for c in re.finditer(r'\b([A-Za-z_]\w*)\s*\(|\)\s*\(', body):
        name = c.group(1)
        if name is None:
            return 'a call through a pointer in the child of a fork'
        if name not in SAFE and name not in KEYWORDS:
            return '%s() in the child of a fork' % name
    statements = [s.strip() for s in body.split(';') if s.strip()]
    if not statements or not re.match(r'(_exit|chaos_exec)\s*\(', statements[-1]):
        return "the child's branch does not end in _exit() (it would run the parent's code)"
    return None


bad, forks = [], 0
for top in ('src', 'include', 'tests', 'chaos', 'tools', 'bench', 'examples', 'interceptors'):
    for d, _, files in os.walk(top):
        for f in sorted(files):
            if not f.endswith(('.c', '.h')):
                continue
            path = os.path.join(d, f)
            raw = open(path, encoding='utf-8').read()
            code = LEXEMES.sub(blank, raw)
            raw_lines = raw.split('\n')
            for m in re.finditer(r'\bv?fork\s*\(\s*\)', code):
                forks += 1
                line = code.count('\n', 0, m.start())
                if 'no thread yet' in raw_lines[line]:
                    continue
                why = check(path, raw, code, m.start())
                if why is not None:
                    bad.append('%s:%d: %s' % (path, line + 1, why))
for b in bad:
    print(b)
if bad:
    print('check-forks: run it through exec instead (TU_CHILD_MAIN, tests/testutil.h)')
    sys.exit(1)
print('check-forks: %d forks, each child only safe calls, ending in _exit' % forks)
PY
