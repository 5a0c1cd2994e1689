/* The broker topology's parts, shared by chaos_nats.c (processes, faults),
 * chaos_nats_run.c (load, settling, the stream's dump) and its checker
 * (chaos_nats_check.c, chaos_nats_faultlog.c). */
#ifndef IDEMRPC_CHAOS_NATS_H
#define IDEMRPC_CHAOS_NATS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chaos.h"

enum { NP_PRODUCER0, NP_PRODUCER1, NP_CONSUMER0, NP_CONSUMER1, NP_BROKER, NP_COUNT };

/* Picks the broker's port, starts the broker; false if it did not start. */
bool chaos_nats_setup(const chaos_cfg *cfg);
/* Starts process i (NP_*) and waits for it to be ready. */
bool chaos_nats_start(size_t i);
const char *chaos_nats_url(void);
const char *chaos_nats_producer_url(size_t i);
/* The seeded fault schedule until *stop; returns the number of faults. */
uint64_t chaos_nats_faults(const chaos_cfg *cfg, const volatile bool *stop);
/* SIGCONT to a stopped process, starts every one that is down. */
void chaos_nats_heal(void);
/* Stops the producers and consumers (SIGTERM; SIGKILL after 10 s), then the broker. */
void chaos_nats_stop(bool broker_too);

/* The checker's faults in time order: log one (in history order), and the kind of the
 * last one at most within_ms before t (-1: none); forget them all. */
void chaos_nats_log_fault(uint64_t t, int kind);
int chaos_nats_fault_before(uint64_t t, uint64_t within_ms);
void chaos_nats_forget_faults(void);

#endif
