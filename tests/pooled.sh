#!/bin/sh
# Runs a PostgreSQL test program through PgBouncer in transaction mode: the store is
# opened with idem_pg_opts.pooler, IDEMRPC_TEST_PG points at the pooler. Skipped (77)
# when scripts/services.sh started no pgbouncer.
[ -n "${IDEMRPC_TEST_PGBOUNCER:-}" ] || { echo "IDEMRPC_TEST_PGBOUNCER not set: skipped"; exit 77; }
IDEMRPC_TEST_PG=$IDEMRPC_TEST_PGBOUNCER IDEMRPC_TEST_PG_POOLER=1 exec "$@"
