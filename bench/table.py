#!/usr/bin/env python3
"""README's performance tables from several `idemrpc-bench --csv` runs of the default grid.

    bench/table.py run1.csv run2.csv run3.csv
    bench/table.py --scale z1.csv z2.csv z3.csv   (--scale-csv files of scenario z)

Each cell is "median (min-max)" over the runs: calls/s for a, f and v, the ratio to a
of the same run for the others. Then the issue-29 targets and issue 39's (c/d, c/a, c/r
and s/e against the Redis peer, switches per new key, c at 1 client), each with its verdict. Runs of
other scenarios may be added (e.g. `--scenarios a,e,i,q --clients 16` with
$IDEMRPC_BENCH_PG for the PostgreSQL replay rows): ratios between two scenarios are taken
within each file, so a file without one of them adds nothing to that target.
Only the standard library: python3 is all it needs."""
import csv
import statistics
import sys


def load(paths):
    rows = {}  # (scenario letter, transport, clients, payload) -> [row per run]
    for run, path in enumerate(paths):
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                key = (r["scenario"][0], r["transport"], int(r["clients"]), int(r["payload"]))
                r["run"] = run
                rows.setdefault(key, []).append(r)
    return rows


def values(rows, key, field):
    return [float(r[field]) for r in rows.get(key, []) if r[field] not in ("", "-")]


def cell(vals, digits):
    if not vals:
        return "-"
    fmt = "{:,.0f}" if digits == 0 else "{:.%df}" % digits
    med, lo, hi = statistics.median(vals), min(vals), max(vals)
    s = fmt.format(med).replace(",", " ")
    return s if len(vals) == 1 else "%s (%s–%s)" % (s, fmt.format(lo).replace(",", " "),
                                                     fmt.format(hi).replace(",", " "))


NAMES = {
    "a": "a: bare nng echo (calls/s)",
    "b": "b: new keys, durable, one commit per write",
    "c": "c: new keys, durable, group commit (default)",
    "d": "d: new keys, MDB_NOSYNC",
    "e": "e: replay of stored results",
    "i": "i: PostgreSQL replay (a round trip)",
    "q": "q: PostgreSQL replay, replay cache on",
    "r": "r: Redis peer, new keys, appendfsync always",
    "s": "s: Redis peer, replay, always",
    "t": "t: Redis peer, new keys, everysec",
    "u": "u: Redis peer, replay, everysec",
}


def grid(rows, payload, letters, transports, clients):
    cols = [(t, k) for t in transports for k in clients]
    print("| scenario (%s payload) | %s |" % (size(payload), " | ".join("%s %d" % c for c in cols)))
    print("|---|%s" % ("---|" * len(cols)))
    for l in letters:
        field, digits = ("calls_per_s", 0) if l == "a" else ("ratio_vs_a", 2)
        cells = [cell(values(rows, (l, t, k, payload), field), digits) for t, k in cols]
        if any(c != "-" for c in cells):
            print("| %s | %s |" % (NAMES[l], " | ".join(cells)))
    print()


def size(n):
    return "%d MiB" % (n >> 20) if n >= 1 << 20 else "%d KiB" % (n >> 10) if n >= 1024 else "%d B" % n


def cost(rows, transport, clients):
    print("| cost per call (%s, %d clients, 64 B) | CPU µs | vcsw | ivcsw | rwsys | allocs |" %
          (transport, clients))
    print("|---|---|---|---|---|---|")
    for l in "acdrse":
        key = (l, transport, clients, 64)
        if key in rows:
            print("| %s | %s | %s | %s | %s | %s |" % (NAMES[l].split(" (")[0], *(
                cell(values(rows, key, f), d) for f, d in (("cpu_us_per_call", 0),
                    ("vcsw_per_call", 1), ("ivcsw_per_call", 1), ("rw_syscalls_per_call", 1),
                    ("allocs_per_call", 0)))))
    print()


def measures(rows, transport):
    """The medians the targets read, on one transport: med (a field of one cell), vs (x's
    calls/s over y's within each run, i.e. file) and ctx (switches per call)."""
    def med(l, k, p=64, field="ratio_vs_a"):
        v = values(rows, (l, transport, k, p), field)
        return statistics.median(v) if v else None

    def vs(x, y, k, p=64):
        ys = {r["run"]: float(r["calls_per_s"]) for r in rows.get((y, transport, k, p), [])}
        v = [float(r["calls_per_s"]) / ys[r["run"]] for r in rows.get((x, transport, k, p), [])
             if ys.get(r["run"])]
        return statistics.median(v) if v else None

    def ctx(l, k):
        v = [float(r["vcsw_per_call"]) + float(r["ivcsw_per_call"])
             for r in rows.get((l, transport, k, 64), [])]
        return statistics.median(v) if v else None

    return med, vs, ctx


def verdicts(title, checks):
    """One table: each check (name, measured or None, goal or None, op) with its verdict."""
    print("| %s | goal | measured | |" % title)
    print("|---|---|---|---|")
    for name, got, goal, op in checks:
        want = "" if goal is None else "%s %s" % (op.replace(">=", "≥").replace("<=", "≤"), goal)
        if got is None:
            print("| %s | %s | not run | |" % (name, want))
            continue
        ok = goal is None or (got >= goal if op == ">=" else got <= goal)
        print("| %s | %s | %.2f | %s |" % (name, want, got,
                                           "" if goal is None else "met" if ok else "missed"))
    print()


def targets(rows, transport):
    med, vs, ctx = measures(rows, transport)
    checks = [("c/a, 16 clients", med("c", 16), 0.5, ">="),
              ("c/d, 16 clients (the price of durability under load)", vs("c", "d", 16), 0.9, ">="),
              ("d/a, 16 clients", med("d", 16), 0.55, ">="),
              ("context switches per new key (c, 16 clients, client + server)", ctx("c", 16), 6, "<="),
              ("e/a, 64 B, 16 clients", med("e", 16), 0.93, ">="),
              ("e/a, 64 B, 64 clients", med("e", 64), 0.93, ">="),
              ("e/a, 1 MiB, 1 client", med("e", 1, 1 << 20), 0.5, ">="),
              ("allocations per new key (c, 16 clients)", med("c", 16, field="allocs_per_call"), 30, "<="),
              ("allocations per replay (e, 16 clients)", med("e", 16, field="allocs_per_call"), 16, "<="),
              ("PostgreSQL replay ÷ LMDB replay, 16 clients: i (a round trip)", vs("i", "e", 16), 0.6, ">="),
              ("PostgreSQL replay ÷ LMDB replay, 16 clients: q (replay cache)", vs("q", "e", 16), 0.6, ">=")]
    verdicts("target (%s, medians)" % transport, checks)


def targets39(rows, transports):
    """Issue 39's targets, 16 clients, 64 B, each ratio taken within each run."""
    checks = []
    for t in transports:
        med, vs, ctx = measures(rows, t)
        checks += [("c/d, %s (the price of durability)" % t, vs("c", "d", 16), 0.85, ">="),
                   ("c/a, %s" % t, med("c", 16), 0.45, ">="),
                   ("c/r, %s (ahead of the Redis peer, AOF always)" % t, vs("c", "r", 16), 1.5, ">="),
                   ("s/e, %s (the Redis peer's replay ÷ ours)" % t, vs("s", "e", 16), None, ""),
                   ("context switches per new key, %s (c, client + server)" % t, ctx("c", 16), 6, "<="),
                   ("c at 1 client / a, %s" % t, med("c", 1), 0.25, ">=")]
    verdicts("issue 39 target (medians)", checks)


SCALE_TARGETS = [("new", 1, 0.8), ("new", 16, 0.8), ("ordered", 1, 0.8), ("ordered", 16, 0.8),
                 ("replay", 1, 0.95), ("replay", 16, 0.95)]
SCALE_LABELS = {"new": "new key (random)", "ordered": "new key (time-ordered)", "replay": "replay"}


def scale_load(paths):
    rows = []  # (run index, row)
    for i, path in enumerate(paths):
        with open(path, newline="") as f:
            rows += [(i, r) for r in csv.DictReader(f)]
    return rows


def scale_ratios(rows, kind, clients, n, base):
    """calls/s at n over the same cell at base, of the same run and round: one per pair."""
    cells = {}
    for run, r in rows:
        if r["kind"] == kind and int(r["clients"]) == clients:
            cells[(run, r.get("round", "0"), int(r["records"]))] = float(r["calls_per_s"])
    return [v / cells[(run, rd, base)] for (run, rd, m), v in cells.items()
            if m == n and (run, rd, base) in cells and cells[(run, rd, base)] > 0]


def scale(paths):
    rows = scale_load(paths)
    sizes = sorted({int(r["records"]) for _, r in rows if not r["kind"].startswith("grown")})
    base = sizes[0]
    print("%d runs: %s\n" % (len(paths), ", ".join(paths)))
    print("| cell (64 B) | records | calls/s | ratio to %d | CPU µs/call | faults/call (minor, major) "
          "| depth | RSS MiB |" % base)
    print("|---|---|---|---|---|---|---|---|")
    for kind in ("new", "replay", "ordered"):
        for k in (1, 16):
            for n in sizes:
                sel = [r for _, r in rows if r["kind"] == kind and int(r["clients"]) == k
                       and int(r["records"]) == n]
                if not sel:
                    continue
                col = lambda f: [float(r[f]) for r in sel if r[f] not in ("", "nan")]
                ratio = "-" if n == base else cell(scale_ratios(rows, kind, k, n, base), 2)
                print("| %s, %d client%s | %s | %s | %s | %s | %s, %s | %s | %s |" % (
                    kind, k, "s" if k > 1 else "", "{:,}".format(n).replace(",", " "),
                    cell(col("calls_per_s"), 0), ratio, cell(col("cpu_us_per_call"), 0),
                    cell(col("minflt_per_call"), 2), cell(col("majflt_per_call"), 3),
                    cell(col("records_depth"), 0), cell(col("rss_mib"), 0)))
    print()
    top = sizes[-1]
    grown = {kind: [float(r["bytes_per_record"]) for _, r in rows if r["kind"] == kind]
             for kind in ("grown", "grown-ordered")}
    loaded = [float(r["bytes_per_record"]) for _, r in rows
              if not r["kind"].startswith("grown") and int(r["records"]) == top]
    print("| target (medians of all runs and rounds) | goal | measured | |")
    print("|---|---|---|---|")
    for kind, k, goal in SCALE_TARGETS:
        v = scale_ratios(rows, kind, k, top, base)
        got = statistics.median(v) if v else None
        print("| %s at %d records ÷ at %d, %d client%s | ≥ %s | %s | %s |" % (
            SCALE_LABELS[kind], top, base, k, "s" if k > 1 else "", goal,
            "not run" if got is None else cell(v, 2),
            "" if got is None else "met" if got >= goal else "missed"))
    for kind, keys in (("grown", "random"), ("grown-ordered", "time-ordered")):
        if grown[kind]:
            g = statistics.median(grown[kind])
            print("| bytes on disk per record, store grown by %s keys (64 B result) | ≤ 300 | "
                  "%.0f | %s |" % (keys, g, "met" if g <= 300 else "missed"))
    if loaded:
        print("| bytes on disk per record, the preloaded %d-record store | | %.0f | |" % (
            top, statistics.median(loaded)))
    print()


def main(paths):
    rows = load(paths)
    transports = [t for t in ("tcp", "ipc") if any(k[1] == t for k in rows)]
    print("%d runs: %s\n" % (len(paths), ", ".join(paths)))
    grid(rows, 64, "abcdeiqrsut", transports, (1, 16, 64))
    for p in (4096, 65536, 1 << 20):
        if any(k[3] == p for k in rows):
            grid(rows, p, "aes", transports, (1,))
    lim = [(l, p) for l in "fv" for p in (64,) if (l, "-", 1, p) in rows]
    if lim:
        print("| the disk's limits (64 B, 1 thread) | ops/s |\n|---|---|")
        for l, p in lim:
            label = "f: raw LMDB put + durable commit" if l == "f" else "v: pwrite + fdatasync"
            print("| %s | %s |" % (label, cell(values(rows, (l, "-", 1, p), "calls_per_s"), 0)))
        print()
    for t in transports:
        cost(rows, t, 16)
    for t in transports:
        targets(rows, t)
    targets39(rows, transports)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--scale":
        scale(sys.argv[2:])
    elif len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: bench/table.py RUN.csv [RUN.csv ...] | --scale Z.csv [Z.csv ...]")
    else:
        main(sys.argv[1:])
