#!/usr/bin/env bash
# Builds idemrpc and runs the whole test suite (unit + integration against live servers).
#   bash scripts/test.sh           # normal build in build/
#   bash scripts/test.sh --asan    # ASan+UBSan build in build-asan/
# Exits non-zero when any test fails. The last lines are the criterion totals over all
# test programs and a plain "N passed, N failed" line.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/bootstrap.sh

builddir=build
setup_args=()
if [ "${1:-}" = "--asan" ]; then
    builddir=build-asan
    setup_args=(-Db_sanitize=address,undefined -Db_lundef=false -Dbuildtype=debug)
    # detect_stack_use_after_return: a callback reading a frame that has returned (an
    # undo_arg on a handler's stack) is reported, not read silently.
    export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1}
    export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
fi
# The PostgreSQL and Redis tests need servers: use the ones named in the environment
# (as .ci/run starts them), else start throwaway ones on loopback for this run.
if [ -z "${IDEMRPC_TEST_PG:-}" ]; then
    export IDEMRPC_SERVICES_DIR=${IDEMRPC_SERVICES_DIR:-/tmp/idemrpc-services-$$}
    if env_lines=$(bash scripts/services.sh start); then
        eval "$env_lines"
        trap 'bash scripts/services.sh stop' EXIT
    else
        echo "test.sh: PostgreSQL/Redis not started; their tests will be skipped" >&2
    fi
fi

[ -f "$builddir/build.ninja" ] || meson setup "$builddir" "${setup_args[@]}"
meson compile -C "$builddir"

status=0
meson test -C "$builddir" --print-errorlogs --num-processes 2 || status=$?

# Criterion prints one "Synthesis" line per test program into the meson log; add them up.
python3 - "$builddir/meson-logs/testlog.json" <<'PY'
import json, re, sys
tot = dict(Tested=0, Passing=0, Failing=0, Crashing=0)
for line in open(sys.argv[1]):
    t = json.loads(line)
    out = (t.get("stdout") or "") + (t.get("stderr") or "")
    bad = 0
    for m in re.finditer(r"Synthesis: Tested: (\d+) \| Passing: (\d+) \| Failing: (\d+) \| Crashing: (\d+)", out):
        for k, v in zip(tot, m.groups()):
            tot[k] += int(v)
        bad += int(m.group(3)) + int(m.group(4))
    ok = t.get("result") in ("OK", "SKIP")
    if "Synthesis" not in out:  # a script test (e.g. external_encode): counts as one
        tot["Tested"] += 1; tot["Passing"] += ok; tot["Failing"] += (not ok)
    elif not ok and bad == 0:  # every test passed but the program failed (a sanitizer at exit)
        tot["Crashing"] += 1
print(f"[====] Synthesis: Tested: {tot['Tested']} | Passing: {tot['Passing']} | "
      f"Failing: {tot['Failing']} | Crashing: {tot['Crashing']} ")
print(f"{tot['Passing']} passed, {tot['Failing'] + tot['Crashing']} failed")
PY
exit $status
