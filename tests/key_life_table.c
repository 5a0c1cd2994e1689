/* Prints the key's life table (src/core/key_life.c) as the markdown docs/semantics.md
 * holds in its section "A key's life"; the key_life_doc test compares the two. */
#include <stdio.h>

#include "key_life.h"

int main(void)
{
    size_t n;
    const idem__key_life_row *rows = idem__key_life_rows(&n);
    printf("| state | event | action | answer | test |\n|---|---|---|---|---|\n");
    for (size_t i = 0; i < n; i++) {
        const idem__key_life_row *r = &rows[i];
        const char *sep = "| ";
        for (int s = 0; s < IDEM__KL_STATE_COUNT; s++) {
            if (r->states & IDEM__KL_S(s)) {
                printf("%s%s", sep, idem__kl_state_name(s));
                sep = "; ";
            }
        }
        printf(" | %s | %s | ", idem__kl_event_name(r->event), idem__kl_action_name(r->action));
        if (r->code != IDEM__KL_NO_CODE) {
            printf("`%s` ", idem_code_name(r->code));
        }
        printf("%s | `%s` |\n", r->answer, r->test);
    }
    return ferror(stdout) ? 1 : 0;
}
