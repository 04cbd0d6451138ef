#!/usr/bin/env python3
"""docs/scaling.md's step-time model applied to the simulated cluster, against measured runs
(issue 38). bench/step_model_check.sh measures and writes one JSON line per run; this script
predicts each run's step time and bytes per step and prints prediction against measurement.

    python3 bench/step_model_sim.py RUNS.jsonl [--hide]

The model, per step, 2 hosts x 2 ranks, fp32 everywhere (what Sigma's CPU ranks send):
- compute: the measured reference (the same per-rank work with the cores shared as in the run,
  tp's exchanges inside the host included) [M]; for RRE a single process with 1 expert per
  group, its rows in one product per group as an experts-parallel rank of 4 runs them
  (bench/step_model_check.sh);
- data parallel: ZeRO's exchange with the shards' owners, scaling_model.grad_exchange_bytes of
  each rank's shared parameters (its tp slice), the share to dp peers on the other host crossing
  the host's link; host-first (dist/host_first.h, the default; "host_first": false in a run's
  line for SIGMA_HOST_FIRST=0) where a data group holds several ranks of a host that tree_sum
  adds first: each host sends one partial sum per owner away and each owner's slice once to
  each other host (dp_host_bytes);
- experts (RRE, expert parallel, dist.placement spread): scaling_model.expert_exchange_bytes of
  each rank's tokens, the rows whose expert lives on the other host crossing the link (groups
  drawn uniformly, experts within a group uniformly: the random routing table);
- the exchange's cost on this machine's cores, [M] per operation, measured with the links
  unshaped (those runs are the calibration, not checks), once blocking and once overlapped:
  ZeRO's exchange per byte out of a host, per path (below; ranks that share
  2 cores by 2 wait for each other to be scheduled before a message moves, and the kernel's TCP,
  Open MPI's copies and the owners' sums run on those cores); the experts' exchange per
  all-to-all round (the RRE layout's unshaped runs, less their ZeRO part): each of its 4 rounds
  per RRE block makes all 4 ranks meet, so its cost on shared cores is a wait for the slowest
  rank's turn more than bytes (10 KiB-1 MiB a round here), and it also takes in what the RRE
  reference gets wrong of an experts-parallel rank's expert work (a single process runs other
  products than a rank of 4: docs/scaling.md);
- the wire: a host's bytes out at the shaped rate (tc tbf counts Ethernet frames: 1,448 bytes of
  TCP payload per 1,514, MTU 1,500), added to the exchange's cost: Open MPI's TCP transport
  moves a rank's messages only while the rank runs, so the two alternate more than they overlap
  (docs/scaling.md's rule: nothing overlapped unless a line says so);
- latency: the step's rounds of messages (2 per dp exchange, 4 per RRE block) x 2 x one-way.
With overlap (dist.overlap), measured on this machine: the link time is added as without
overlap (each layout's runs at 1 Gbit/s with overlap are slower than its unshaped ones with
overlap by about the link's time; docs/scaling.md), so the overlapped runs differ from the
blocking ones only in the exchange's cost, calibrated apart. `--hide` predicts instead what
overlap would give with a core to spare: the dp link time hidden behind the compute (the
reduce-scatter behind backward, the gather behind the next forward) except each one's last
stage; the experts' exchange is not overlapped either way.

ZeRO's exchange is calibrated per path (dist/host_first.h): host-first sums (a data group with
several ranks of a host: a partial sum inside each host, then across) and direct (one rank of
the group per host, or SIGMA_HOST_FIRST=0), each on the first unshaped dense run that takes it;
the unshaped runs of another dense layout on a path already calibrated are checks.
"""
import json
import statistics
import sys

import scaling_model as sm

BYTES = 4                 # fp32
WIRE_EFF = 1448 / 1514    # TCP payload per Ethernet frame at MTU 1500


def cross_share_experts(groups, hosts, slots):
    """Mean share of a token's expert rows that go to another host (spread placement)."""
    R = hosts * slots
    shares = []
    for K in groups:
        owner = []
        for m in range(R):
            owner += [m] * (K * (m + 1) // R - K * m // R)
        for r in range(R):
            shares.append(sum(o // slots != r // slots for o in owner) / K)
    return sum(shares) / len(shares)


def tree_blocks(host, lo, hi):
    """The maximal subtrees of tree_sum's rank-order tree over [lo, hi) whose ranks share a host
    (dist/host_first.cpp, host_blocks)."""
    if len(set(host[lo:hi])) == 1:
        return [(lo, hi)]
    left = 1
    while left * 2 < hi - lo:
        left *= 2
    return tree_blocks(host, lo, lo + left) + tree_blocks(host, lo + left, hi)


def dp_host_bytes(x, shared_bytes):
    """Bytes out of the busiest host per step for ZeRO's reduce-scatter and all-gather of each
    rank's `shared_bytes` (its tp slice), over the tp data groups (world rank = tp x data rank +
    tp rank, hosts of `slots` ranks in rank order), each owner's slice shared_bytes / dp."""
    hosts, slots, tp, dp = x["hosts"], x["slots"], x["tp"], x["dp"]
    out = [0.0] * hosts
    for t in range(tp):
        host = [(d * tp + t) // slots for d in range(dp)]
        members = {h: host.count(h) for h in set(host)}
        blocks = tree_blocks(host, 0, dp)
        first = x.get("host_first", True) and len(members) > 1
        sums = first and any(hi - lo > 1 for lo, hi in blocks)
        gathers = first and any(n > 1 for n in members.values())
        for h, n in members.items():
            away = dp - n                                  # owners on other hosts
            senders = sum(host[lo] == h for lo, hi in blocks) if sums else n
            reach = len(members) - 1 if gathers else away  # copies of each of h's slices sent away
            out[h] += (senders * away + n * reach) * shared_bytes / dp
    return max(out)


HIDE = False  # --hide: the dp link time hidden behind compute (a spare core), see above


def dp_path(x):
    """"host-first" where a data group holds several ranks of a host (and SIGMA_HOST_FIRST is
    not 0), else "direct": the path dist/host_first.h takes."""
    hosts = [[(d * x["tp"] + t) // x["slots"] for d in range(x["dp"])] for t in range(x["tp"])]
    aligned = any(len(set(h)) > 1 and any(hi - lo > 1 for lo, hi in tree_blocks(h, 0, len(h)))
                  for h in hosts)
    return "host-first" if x.get("host_first", True) and aligned else "direct"


def predict(x, cost):
    """cost: {"dp": {(path, overlap): seconds per byte out of a host}, "ep": {overlap: seconds
    per all-to-all round of the experts' exchange}}; a missing entry counts 0."""
    hosts, slots = x["hosts"], x["slots"]
    rank_ep = 0.0
    if x["rre"]:
        rank_ep = sm.expert_exchange_bytes(x["rre"], x["tokens_per_rank"], 1, x["d"], BYTES) * \
            cross_share_experts(x["groups"], hosts, slots)
    host_dp, host_ep = dp_host_bytes(x, x["params_local"] * BYTES), slots * rank_ep
    host = host_dp + host_ep
    wire = (lambda b: b * 8 / (x["rate_bps"] * WIRE_EFF)) if x["rate_bps"] else (lambda b: 0.0)
    ep_rounds = 4 * x["rre"]
    stack = host_dp * cost.get("dp", {}).get((dp_path(x), x["overlap"]), 0.0) + \
        ep_rounds * cost.get("ep", {}).get(x["overlap"], 0.0)
    latency = (2 + ep_rounds) * 2 * x.get("latency_s", 0.0)
    ref = x["ref_ms"] / 1e3
    if not (x["overlap"] and HIDE):
        exposed_wire = wire(host)
    else:
        stages = x["layers"] + 2
        exposed_wire = max(wire(host_dp) - ref * (stages - 1) / stages, wire(host_dp) / stages) + \
            wire(host_ep)
    return dict(step_ms=(ref + stack + exposed_wire + latency) * 1e3, host_bytes=host,
                host_dp=host_dp, ep_rounds=ep_rounds, wire_ms=exposed_wire * 1e3,
                stack_ms=stack * 1e3)


def calibrations(runs):
    """The runs that measure the machine's costs (see the top): per (path, overlap) the first
    unshaped dense run on it, per overlap the first unshaped RRE run."""
    seen, out = set(), []
    for r in runs:
        key = ("ep", r["overlap"]) if r["rre"] else (dp_path(r), r["overlap"])
        if r["link"] == "none" and key not in seen:
            seen.add(key)
            out.append(r)
    return out


def median_over_rounds(lines):
    """One run per (layout, link, overlap): the medians of the rounds' measured figures."""
    runs = {}
    for l in lines:
        runs.setdefault((l["layout"], l["link"], l["overlap"]), []).append(l)
    out = []
    for same in runs.values():
        r = dict(same[0])
        for k in ("ref_ms", "measured_ms", "measured_host_bytes"):
            r[k] = statistics.median(x[k] for x in same)
        r["rounds"] = [x["measured_ms"] for x in same]
        out.append(r)
    return out


def main():
    global HIDE
    HIDE = "--hide" in sys.argv[1:]
    sys.argv = [a for a in sys.argv if a != "--hide"]
    runs = median_over_rounds([json.loads(l) for l in open(sys.argv[1]) if l.strip()])
    cal = calibrations(runs)
    cost = {"dp": {}, "ep": {}}
    for c in sorted(cal, key=lambda r: r["rre"]):  # ZeRO's costs first: the RRE runs use them
        mode = "on" if c["overlap"] else "off"
        p = predict(c, cost)
        if not c["rre"]:
            cost["dp"][(dp_path(c), c["overlap"])] = (c["measured_ms"] - c["ref_ms"]) / 1e3 / p["host_dp"]
            print(f"calibration: {c['layout']}, links unshaped, overlap {mode} ({dp_path(c)}): "
                  f"measured {c['measured_ms']:.0f} ms, reference {c['ref_ms']:.0f} ms, "
                  f"{p['host_dp'] / 2**20:.1f} MiB out of each host a step -> "
                  f"{cost['dp'][(dp_path(c), c['overlap'])] * 1e9:.2f} ns per byte")
        else:
            cost["ep"][c["overlap"]] = (c["measured_ms"] - p["step_ms"]) / 1e3 / p["ep_rounds"]
            print(f"calibration: {c['layout']}, links unshaped, overlap {mode}: measured "
                  f"{c['measured_ms']:.0f} ms, reference {c['ref_ms']:.0f} ms, ZeRO's exchange "
                  f"{p['stack_ms']:.0f} ms, {p['ep_rounds']} expert rounds -> "
                  f"{cost['ep'][c['overlap']] * 1e3:.1f} ms per round")
    print("| layout | link | overlap | compute (ref) ms | predicted ms (exchange / wire exposed) | measured ms "
          "| measured ms per round | predicted / measured | MiB out of a host per step: predicted / measured |")
    print("|---|---|---|---:|---:|---:|---|---:|---:|")
    worst = 0.0
    for r in runs:
        if any(r is c for c in cal):
            continue
        p = predict(r, cost)
        ratio = p["step_ms"] / r["measured_ms"]
        worst = max(worst, abs(ratio - 1))
        mb = r.get("measured_host_bytes")
        print(f"| {r['layout']} | {r['link']} | {'on' if r['overlap'] else 'off'} | {r['ref_ms']:.0f} | "
              f"{p['step_ms']:.0f} ({p['stack_ms']:.0f} / {p['wire_ms']:.0f}) | {r['measured_ms']:.0f} | "
              f"{', '.join(f'{m:.0f}' for m in r['rounds'])} | {ratio:.2f} | {p['host_bytes'] / 2**20:.1f} / "
              f"{mb / 2**20 if mb is not None else float('nan'):.1f} |")
    print(f"largest |predicted / measured - 1|: {worst:.0%} (goal: within 25 %)")


if __name__ == "__main__":
    main()
