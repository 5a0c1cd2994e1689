#!/usr/bin/env bash
# Checks that every fork() in the project's C sources is followed, in the child, only by
# calls that are safe there: open, dup2, close, the exec family and _exit (chaos_exec is
# those).
# The child of a threaded process inherits every lock another thread held at the fork;
# GCC 12's ASan has no fork handler for its allocator, so a child that allocates can wait
# for that lock forever (CI saw test_wal hang so). Code a child must run goes through
# exec: TU_CHILD_MAIN in tests/testutil.h. A fork made before the process starts any
# thread says so on its line: /* no thread yet */.
#   bash scripts/check-forks.sh [ROOT]      # ROOT: a source tree, default this one
# Fails (exit 1) naming file:line and the call. Python 3 standard library only.
set -euo pipefail
root=${1:-"$(dirname "$0")/.."}
exec python3 - "$root" <<'PY'
import os, re, sys

root = sys.argv[1]
os.chdir(root)
SAFE = {'dup2', 'close', 'open', 'execv', 'execl', 'execvp', 'execve', 'execle', '_exit',
        'chaos_exec'}
NOT_CALLS = {'if', 'while', 'for', 'switch', 'return', 'sizeof'}
bad, forks = [], 0
for top in ('src', 'tests', 'chaos', 'tools', 'bench', 'examples', 'interceptors'):
    for d, _, files in os.walk(top):
        for f in sorted(files):
            if not f.endswith('.c'):
                continue
            path = os.path.join(d, f)
            raw = open(path, encoding='utf-8').read()
            # comments out, newlines kept (line numbers hold)
            code = re.sub(r'/\*.*?\*/|//[^\n]*',
                          lambda m: re.sub(r'[^\n]', ' ', m.group(0)), raw, flags=re.S)
            lines, raw = code.split('\n'), raw.split('\n')
            for i, line in enumerate(lines):
                if not re.search(r'\bfork\(\)', line) or 'no thread yet' in raw[i]:
                    continue
                forks += 1
                # the child's branch: the next `if (... == 0) {` and its block
                start = next((j for j in range(i, min(i + 4, len(lines)))
                              if re.search(r'==\s*0\)\s*\{', lines[j])), None)
                if start is None:
                    bad.append(f'{path}:{i + 1}: no child branch (if (pid == 0) {{) after fork()')
                    continue
                depth, j = 0, start
                while True:
                    depth += lines[j].count('{') - lines[j].count('}')
                    body = lines[j].split('{', 1)[1] if j == start else lines[j]
                    for name in re.findall(r'\b([A-Za-z_]\w*)\s*\(', body):
                        if name not in SAFE and name not in NOT_CALLS:
                            bad.append(f'{path}:{j + 1}: {name}() in the child of a fork')
                    if depth <= 0 or j + 1 >= len(lines):
                        break
                    j += 1
for b in bad:
    print(b)
if bad:
    print('check-forks: run it through exec instead (TU_CHILD_MAIN, tests/testutil.h)')
    sys.exit(1)
print(f'check-forks: {forks} forks, each child only open/dup2/close/exec/_exit')
PY
