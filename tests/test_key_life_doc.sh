#!/usr/bin/env bash
# docs/semantics.md's table "A key's life" is the one src/core/key_life.c holds: the
# lines between its markers are what key_life_table prints.
#   test_key_life_doc.sh KEY_LIFE_TABLE SEMANTICS_MD
# To update the document: run KEY_LIFE_TABLE and paste its output between the markers.
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: test_key_life_doc.sh KEY_LIFE_TABLE SEMANTICS_MD" >&2; exit 2; }
begin='<!-- key_life_table: printed by tests/key_life_table.c; do not edit by hand -->'
end='<!-- end key_life_table -->'
grep -qxF "$begin" "$2" || { echo "FAIL: $2 has no line: $begin" >&2; exit 1; }
grep -qxF "$end" "$2" || { echo "FAIL: $2 has no line: $end" >&2; exit 1; }
doc=$(awk -v b="$begin" -v e="$end" '$0 == e { on = 0 } on { print } $0 == b { on = 1 }' "$2")
if ! diff -u <(printf '%s\n' "$doc") <("$1") >&2; then
    echo "FAIL: the table in $2 differs from key_life_table's (- doc, + code)" >&2
    exit 1
fi
echo "ok: $(printf '%s\n' "$doc" | grep -c '^| ') lines of $2's key table match the code"
