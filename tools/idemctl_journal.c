/* idemctl's views of the step journals (downstream.h, idem_journal_*): the calls the
 * re-driver holds (journals), and the journal of a record's request (show). */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include <idemrpc/idemrpc.h>

#include "idemctl.h"
#include "json.h"

/* The compensation's failure message as idemctl_escaped prints it: a handler's text. */
static const char *failure_text(const idem_journal_info *j,
                                char out[4 * IDEM_JOURNAL_MAX_MESSAGE + 1])
{
    idemctl_escape(j->failure_msg, strlen(j->failure_msg), IDEM_JOURNAL_MAX_MESSAGE, out);
    return out;
}

/* The journal's fields as one JSON object (no newline). */
static void journal_json(const idem_journal_info *j)
{
    char msg[4 * IDEM_JOURNAL_MAX_MESSAGE + 1];
    printf("{\"state\":\"%s\",\"steps\":%u,\"undone\":%u,\"fence\":%" PRIu64
           ",\"listed\":%s,\"runs\":%u,\"failure\":",
           idem_journal_state_name(j->state), j->steps, j->undone, j->fence,
           j->listed ? "true" : "false", j->runs);
    if (j->failure == IDEM_OK) {
        fputs("null,\"failure_message\":null}", stdout);
        return;
    }
    printf("\"%s\",\"failure_message\":", idem_code_name(j->failure));
    idem__json_fputs(stdout, failure_text(j, msg));
    putchar('}');
}

static void journal_text(const idem_journal_info *j)
{
    char msg[4 * IDEM_JOURNAL_MAX_MESSAGE + 1];
    printf("journal      %s, %u step%s recorded (last by owner %" PRIu64 "), %s",
           idem_journal_state_name(j->state), j->steps, j->steps == 1 ? "" : "s", j->fence,
           j->listed ? "held by the re-driver" : "not listed (waits for a retry)");
    if (j->listed) {
        printf(", %u re-run%s", j->runs, j->runs == 1 ? "" : "s");
    }
    putchar('\n');
    if (j->failure != IDEM_OK) {
        printf("compensation %u of %u undone, answering %s: %s\n", j->undone, j->steps,
               idem_code_name(j->failure), failure_text(j, msg));
    }
}

/* show: the journal of rec's request, after its record (JSON: the value of "journal"). */
bool idemctl_show_journal(idem_store *st, const idem_key_ref *k, const idem_record *rec, bool json)
{
    idem_journal_info j;
    idem_code code = idem_journal_get(st, k, rec->fingerprint, &j);
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        fprintf(stderr, "idemctl: journal: %s\n", idem_errmsg());
        fputs(json ? "null" : "journal      unreadable\n", stdout);
        return false;
    }
    if (code == IDEM_NOT_FOUND) {
        fputs(json ? "null" : "journal      none\n", stdout);
    } else if (json) {
        journal_json(&j);
    } else {
        journal_text(&j);
    }
    return true;
}

/* One listed call's record as the journals verb shows it: its state, owner, lease and
 * age on the store's clock; "none" when a re-run released it (the re-driver runs it). */
static void record_fields(idem_store *st, const idem_journal_info *j, bool json)
{
    idem_key_ref k = {j->caller, j->method, j->key};
    idem_record rec;
    idem_code code = idem_store_get(st, &k, &rec);
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        fprintf(stderr, "idemctl: the record of %s %s: %s\n", j->method, j->key, idem_errmsg());
    }
    const char *state = code == IDEM_NOT_FOUND            ? "none"
                        : code != IDEM_OK                 ? "unreadable"
                        : rec.state == IDEM_REC_COMPLETED ? "completed"
                                                          : "in_progress";
    const char *lease = code == IDEM_OK ? idemctl_lease_name(&rec) : "-";
    uint64_t owner = code == IDEM_OK ? rec.owner : 0;
    uint64_t now = code == IDEM_OK ? idemctl_store_now(&rec) : 0;
    uint64_t age = code == IDEM_OK && now > rec.first_at_ms ? now - rec.first_at_ms : 0;
    if (json) {
        printf(",\"record\":\"%s\",\"owner\":%" PRIu64 ",\"lease\":\"%s\",\"age_ms\":", state,
               owner, lease);
        printf(code == IDEM_OK ? "%" PRIu64 : "null", age);
    } else {
        printf(" %-11s %-8" PRIu64 " %-6s ", state, owner, lease);
        printf(code == IDEM_OK ? "%" PRIu64 "s\n" : "-\n", age / 1000);
    }
    if (code == IDEM_OK) {
        idem_record_clear(&rec);
    }
}

static void journal_row(idem_store *st, const idem_journal_info *j, bool json, long shown)
{
    if (json) {
        fputs(shown ? ",\n {" : "[\n {", stdout);
        idemctl_json_key(j->caller, j->method, j->key);
        fputs(",\"journal\":", stdout);
        journal_json(j);
        record_fields(st, j, true);
        putchar('}');
        return;
    }
    if (shown == 0) {
        printf("%-16s %-32s %-32s %-12s %-5s %-6s %-4s %-11s %-8s %-6s %s\n", "CALLER", "METHOD",
               "KEY", "STATE", "STEPS", "UNDONE", "RUNS", "RECORD", "OWNER", "LEASE", "AGE");
    }
    printf("%-16s %-32s %-32s %-12s %-5u %-6u %-4u", j->caller[0] ? j->caller : "-", j->method,
           j->key, idem_journal_state_name(j->state), j->steps, j->undone, j->runs);
    record_fields(st, j, false);
}

/* journals: the calls the re-driver holds (listed), at most --limit. An entry that
 * cannot be read is reported and passed over; the exit status is then 1. */
int idemctl_journals(idem_store *st, const args *a)
{
    uint8_t cursor[IDEM_JOURNAL_CURSOR] = {0};
    idem_journal_info j;
    long shown = 0;
    int rc = 0;
    idem_code code;
    while (shown < a->limit && (code = idem_journal_next(st, cursor, &j)) != IDEM_NOT_FOUND) {
        if (code != IDEM_OK) {
            fprintf(stderr, "idemctl: %s\n", idem_errmsg());
            rc = 1;
            if (code != IDEM_DATA_LOSS && code != IDEM_UNIMPLEMENTED) {
                break; /* the store's error: the cursor did not move */
            }
            continue;
        }
        journal_row(st, &j, a->json, shown++);
    }
    if (a->json) {
        fputs(shown ? "\n]\n" : "[]\n", stdout);
    } else if (shown == 0) {
        puts("no journals");
    }
    return rc;
}

static bool listed_match(const args *a, const idem_journal_info *j)
{
    return strcmp(a->method, j->method) == 0 && strcmp(a->key, j->key) == 0 &&
           (!a->caller_set || strcmp(a->caller, j->caller) == 0);
}

static void listed_print(const idem_journal_info *j, bool json, bool first)
{
    if (json) {
        fputs("{", stdout);
        idemctl_json_key(j->caller, j->method, j->key);
        fputs(",\"state\":null,\"journal\":", stdout);
        journal_json(j);
        puts("}");
        return;
    }
    printf("%scaller       %s\nmethod       %s\nkey          %s\n", first ? "" : "\n",
           j->caller[0] ? j->caller : "-", j->method, j->key);
    puts("state        no record (released: the re-driver runs the call again)");
    journal_text(j);
}

bool idemctl_show_listed(idem_store *st, const args *a)
{
    uint8_t cursor[IDEM_JOURNAL_CURSOR] = {0};
    idem_journal_info j;
    long shown = 0;
    idem_code code;
    while (shown < a->limit && (code = idem_journal_next(st, cursor, &j)) != IDEM_NOT_FOUND) {
        if (code == IDEM_OK && listed_match(a, &j)) {
            listed_print(&j, a->json, shown++ == 0);
        } else if (code != IDEM_OK && code != IDEM_DATA_LOSS && code != IDEM_UNIMPLEMENTED) {
            break; /* the store's error: show reports the missing record */
        }
    }
    return shown > 0;
}
