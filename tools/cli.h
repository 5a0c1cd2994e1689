/* Command-line helpers shared by the tools (idemrpc-demo, idemrpc-call, idemctl) and
 * the bench programs (idemrpc-bench, idemrpc-soak), so that all five treat a bad number
 * the same way.
 *
 * The convention of every program: options are parsed with getopt_long, `--help`
 * prints the usage on stdout and exits 0, and a usage error (an unknown option, a
 * missing argument, a bad number, a bad positional argument) prints one line that
 * names the culprit, then the usage on stderr, and exits CLI_USAGE_ERROR. The installed
 * tools (idemrpc-demo, idemrpc-call, idemctl) also take `--version`: it prints
 * "PROG VERSION" (cli_print_version) on stdout and exits 0. */
#ifndef IDEMRPC_TOOLS_CLI_H
#define IDEMRPC_TOOLS_CLI_H

#include <stdbool.h>
#include <stdint.h>

#define CLI_USAGE_ERROR 2
/* getopt_long's value for --version (beyond every short option's character). */
#define CLI_OPT_VERSION 256

/* Parses arg as a decimal number in [min, max] into *out: digits only (no sign, no
 * leading blanks, nothing after), no overflow. On failure prints
 * "prog: OPT: 'ARG' is not a number from MIN to MAX" on stderr, leaves *out alone and
 * returns false. opt names the option for that message ("--limit"). */
bool cli_parse_u64(const char *prog, const char *opt, const char *arg, uint64_t min, uint64_t max,
                   uint64_t *out);

/* Prints "prog VERSION" on stdout: the project version meson.build names (-D define). */
void cli_print_version(const char *prog);

#endif
