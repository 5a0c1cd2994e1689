#!/usr/bin/env bash
# Every test a document cites exists. README.md, docs/*.md and examples/*/README.md name
# the tests that prove their promises; a renamed or removed test must not leave a row
# pointing at nothing.
#   test_docs.sh SRCDIR
# Citations:
#   suite/test_name, suite::test_name   a criterion test: tests/*.c has
#                                        `Test(suite, test_name`. A `*` in the name is a
#                                        glob (`crash/*_kill_before_claim_runs_once`,
#                                        `storm/*`: at least one test matches; `codec/*`:
#                                        every test of tests/test_codec.c). A suite
#                                        cited with the suffix of the meson test that
#                                        runs it again (`crash_pg`, `pg_pooled`,
#                                        `payments_nats_pg`) is that suite.
#   tests/NAME.sh, tests/NAME.c         a test file (shell-script tests are cited this
#                                        way: `tests/test_http.sh`): it exists, and a
#                                        shell script is one tests/meson.build runs.
# Only `word/word` pairs whose name has an underscore or a `*` are citations (test names
# are snake_case sentences), and not paths of the tree (src/…, bench/…, chaos/…).
# The check first proves it can fail: a made-up citation must be reported.
# And one version: CHANGELOG.md lists meson.build's ($IDEMRPC_VERSION) and the documents
# name its soname ($IDEMRPC_SOVERSION), as the tools and the .pc do (test_tools.sh,
# test_install.sh).
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: test_docs.sh SRCDIR" >&2; exit 2; }
src=$1
work=$(mktemp -d "${TMPDIR:-/tmp}/idemrpc-docs-XXXXXX")
trap 'rm -rf "$work"' EXIT

# "suite name" of every criterion test
grep -hoP '^\s*Test\(\s*\K[A-Za-z0-9_]+\s*,\s*[A-Za-z0-9_]+' "$src"/tests/*.c |
    sed 's/ *, */ /' | sort -u >"$work/tests"
[ -s "$work/tests" ] || { echo "FAIL: no Test( found in $src/tests/*.c" >&2; exit 1; }

tree_dirs=" src tests bench chaos examples docs include tools scripts interceptors proto build share "

declare -A suites=() tests=()
while read -r s n; do
    suites[$s]+=" $n"
    tests["$s $n"]=1
done <"$work/tests"

# A suite as cited -> the suite in tests/*.c ("" when there is none).
suite_of() {
    local s=$1
    while :; do
        [ -n "${suites[$s]+x}" ] && { echo "$s"; return; }
        case $s in
        *_pg) s=${s%_pg} ;;
        *_pooled) s=${s%_pooled} ;;
        *_nats) s=${s%_nats} ;;
        *) echo ""; return ;;
        esac
    done
}

# Does suite $1 have a test whose name matches $2 (a glob)?
has_test() {
    local n
    [[ $2 != *'*'* ]] && { [ -n "${tests["$1 $2"]+x}" ]; return; }
    for n in ${suites[$1]}; do
        # shellcheck disable=SC2053 # $2 is a glob on purpose
        [[ $n == $2 ]] && return 0
    done
    return 1
}

# check_files FILE...: prints one line per citation that names nothing; fails if any.
check_files() {
    local bad=0 f cite suite name suite_c path
    for f in "$@"; do
        # criterion tests
        while IFS= read -r cite; do
            suite_c=${cite%%[:/]*}
            name=${cite##*[:/]}
            case $name in *_* | *'*'*) ;; *) continue ;; esac
            case $tree_dirs in *" $suite_c "*) continue ;; esac
            suite=$(suite_of "$suite_c")
            # `prog/*`: every test of the meson test prog (tests/test_prog.c)
            if [ "$name" = '*' ] && [ -f "$src/tests/test_$suite_c.c" ]; then
                continue
            fi
            if [ -z "$suite" ]; then
                echo "$f: $cite: no suite '$suite_c' in tests/*.c"
                bad=1
            elif ! has_test "$suite" "$name"; then
                echo "$f: $cite: no Test($suite, $name) in tests/*.c"
                bad=1
            fi
        done < <(grep -oP '(?<![A-Za-z0-9_./:*-])[a-z][a-z0-9_]*(/|::)[A-Za-z0-9_*]+(?![A-Za-z0-9_.*/:-])' "$f" |
            sort -u)
        # test files (shell-script tests among them)
        while IFS= read -r path; do
            path=${path%.}
            case $path in *.c | *.sh) ;; *) continue ;; esac
            # shellcheck disable=SC2086 # a cited glob (tests/test_nats*.c) expands here
            if ! compgen -G "$src/$path" >/dev/null; then
                echo "$f: $path: no such file"
                bad=1
            elif [[ $path == *.sh ]] && ! grep -q "'$(basename "$path")'" "$src/tests/meson.build"; then
                echo "$f: $path: not a test tests/meson.build runs"
                bad=1
            fi
        done < <(grep -oP '(?<![A-Za-z0-9_./-])tests/[A-Za-z0-9_*./-]+' "$f" | sort -u)
    done
    return $bad
}

# It can fail: made-up citations of each kind are reported, real ones are not.
cat >"$work/made_up.md" <<'EOF'
| a row | what happens | `integration/no_such_test_anywhere_in_tests` | `nosuchsuite/runs_once` |
Also crash_pg::claim_kill_after_effect_is_at_least_once_after_lease, `crash/*_no_such_suffix`
and `tests/test_no_such_script.sh`; real: `integration/same_key_ten_times_runs_handler_once`.
EOF
if check_files "$work/made_up.md" >"$work/out"; then
    echo "FAIL: the check passed a document citing made-up tests" >&2
    exit 1
fi
for want in no_such_test_anywhere_in_tests nosuchsuite 'crash/\*_no_such_suffix' \
    test_no_such_script.sh; do
    grep -q -- "$want" "$work/out" || { echo "FAIL: made-up citation $want not reported" >&2; exit 1; }
done
if grep -q -- 'same_key_ten_times\|claim_kill_after_effect' "$work/out"; then
    echo "FAIL: a real citation was reported: $(cat "$work/out")" >&2
    exit 1
fi

docs=("$src/README.md" "$src"/docs/*.md "$src"/examples/*/README.md)
if ! check_files "${docs[@]}" >"$work/out"; then
    sed "s|^$src/||" "$work/out" >&2
    echo "FAIL: documents cite tests that do not exist (above)" >&2
    exit 1
fi
# One version: CHANGELOG.md has a release of meson.build's version, and the documents
# name the current soname (docs/upgrading.md and CHANGELOG.md tell the history too).
: "${IDEMRPC_VERSION:?the docs test needs IDEMRPC_VERSION and IDEMRPC_SOVERSION (tests/meson.build)}"
: "${IDEMRPC_SOVERSION:?the docs test needs IDEMRPC_SOVERSION (tests/meson.build)}"
grep -qF "## [$IDEMRPC_VERSION]" "$src/CHANGELOG.md" ||
    { echo "FAIL: CHANGELOG.md has no '## [$IDEMRPC_VERSION]' (meson.build's version)" >&2; exit 1; }
for f in "${docs[@]}"; do
    [ "$f" = "$src/docs/upgrading.md" ] && continue
    if grep -oP 'libidemrpc\.so\.\K[0-9]+' "$f" | grep -vqx "$IDEMRPC_SOVERSION"; then
        echo "FAIL: ${f#"$src/"} names a soname other than libidemrpc.so.$IDEMRPC_SOVERSION" >&2
        exit 1
    fi
done

n=$(for f in "${docs[@]}"; do
    grep -oP '(?<![A-Za-z0-9_./:*-])[a-z][a-z0-9_]*(/|::)[A-Za-z0-9_*]*(_|\*)[A-Za-z0-9_*]*(?![A-Za-z0-9_.*/:-])' "$f"
done | sort -u | wc -l)
echo "test_docs: ${#docs[@]} documents, $n distinct citations, every one names a test;" \
    "version $IDEMRPC_VERSION, soname $IDEMRPC_SOVERSION"
