#!/usr/bin/env python3
"""Step-time model of PanGu-Sigma's 1.085 T configuration on 512 Ascend 910 devices, RRE
against a learned top-2 gate (docs/scaling.md explains every input and where it comes from).

    python3 bench/scaling_model.py            # the tables of docs/scaling.md
    python3 bench/scaling_model.py --eta 0.3 --host-gbs 300 --imbalance 1.2

Every time is per step and per server (8 devices), the slowest part of a synchronous step.
The paper's layout ([S], its System section): 8-way op-level model parallelism (tp) inside a
server, 64-way expert parallelism without replicas and 64-way data parallelism for the rest.
--tp moves the first axis (dp = 512 / tp); --tp-table prints the step at tp = 1..16.
Tags: [S] stated by the paper or the vendor, [D] derived here from stated figures, [M] measured
on Sigma's machine (docs/benchmarks.md), [A] assumed.
"""
import argparse

GB = 1e9


def inputs(a):
    d, L = 5120, 40                        # [S] PanGu-alpha 13B shape
    return dict(
        d=d, L=L, T=1024, V=40064,         # [S]
        rre_blocks=8, experts=640,         # [D] N = 8 from 1.085 T; 640 experts [S] (Fig. 11)
        groups=40, per_group=16,           # [S] 640 experts in 40 domain groups; 16 = the mean
        group_devices=16,                  # [D] 64-way expert parallel [S]: 10 experts per
                                           #     server and block, a group of 16 over 2 servers
        devices=512, per_server=8,         # [S] 64 nodes x 8 Ascend 910
        tp=a.tp,                           # [S] 8-way model parallel (the default)
        tokens_per_step=512 * 1024,        # [S] global batch 512 x sequence length 1024
        peak=256e12,                       # [S] Ascend 910 fp16 FLOP/s
        eta=a.eta,                         # [A] from [M] 0.51-0.74 of GEMM peak for a whole step
        hccs=30 * GB,                      # [S] one 240 Gb/s HCCS port; a device has 3
        hccs_ports=3,
        roce=25 * GB,                      # [S] 2 x 100 Gb/s RoCE per device
        pcie=32 * GB,                      # [S] PCIe 4.0 x16, per direction
        host=a.host_gbs * GB,              # [A] in-place host memory bandwidth per server
        adam_bytes=28,                     # [M] bytes per parameter of the store's Adam
        adam_frac=0.997,                   # [M] Adam / in-place probe bandwidth
        a2a_eff=a.a2a_eff,                 # [A] all-to-all / link rate ([M] 0.1-0.2 on loopback)
        count_latency=a.count_us * 1e-6,   # [A] one small all-to-all over 512 devices
        cf=1.25, k=2,                      # [S] capacity factor and top-k of the baseline
        imbalance=a.imbalance,             # [M] RRE expert load max/mean (random tables)
        bytes_per=2,                       # fp16 rows and weights
    )


def grad_exchange_bytes(shared_bytes, dp):
    """Bytes one device sends per step to reduce its shard of the shared gradients over dp
    replicas and gather the updated values back: reduce-scatter + all-gather (a ring all-reduce,
    or ZeRO's exchange with the shards' owners), 2 (dp - 1) / dp of its shard each."""
    return 2 * (dp - 1) / dp * shared_bytes


def expert_exchange_bytes(rre_blocks, tokens, rows, d, bytes_per):
    """Bytes of one device's token rows in the expert all-to-alls of a step: 4 per RRE block
    (dispatch and combine, forward and backward), each of its tokens' rows once."""
    return rre_blocks * 4 * tokens * rows * d * bytes_per


def model(p, router, active):
    """Seconds per step for one server. router: 'rre'; 'top2-group' (Sigma's gate, inside the
    group, experts on the group's server); 'top2-global' (GShard: one gate over all 640 experts
    of a block, spread over all devices). Both gates compute the padded capacity slots (dense
    dispatch). active: the fraction of groups a step's batch draws from."""
    d, L, T = p["d"], p["L"], p["T"]
    ffn = 8 * d * d                                       # one expert's weights (no biases)
    dense_params = L * 12 * d * d + p["V"] * d            # what one token multiplies, RRE
    expert_params = p["rre_blocks"] * p["experts"] * ffn
    servers = p["devices"] // p["per_server"]
    tp = p["tp"]                                          # devices sharing one model replica
    dp = p["devices"] // tp                               # replicas of the shared part
    n = p["tokens_per_step"] / servers                    # tokens per server and step
    flops_dense = 6 * (dense_params - p["rre_blocks"] * ffn) + 12 * L * T * d
    expert_flops = 6 * p["rre_blocks"] * ffn              # one expert per token and RRE block
    rows = 1.0 if router == "rre" else p["k"] * p["cf"]
    load = p["imbalance"] if router == "rre" else 1.0     # the gate's capacity caps the load
    server_flops = p["peak"] * p["eta"] * p["per_server"]
    t = {}
    t["dense compute"] = n * flops_dense / server_flops
    t["expert compute"] = n * expert_flops * rows * load / server_flops
    # Op-level model parallelism (Megatron's split): 2 all-reduces of a replica's [tokens, d]
    # per block forward and 2 backward, ring over its tp devices: on HCCS inside a server, on
    # RoCE once tp spans servers. A server runs 8 / tp replicas side by side (tp <= 8).
    if tp > 1:
        replica_tokens = p["tokens_per_step"] / dp
        ar = replica_tokens * d * p["bytes_per"] * 2 * (tp - 1) / tp
        link = p["hccs"] * p["hccs_ports"] if tp <= p["per_server"] else p["roce"]
        t["op-parallel all-reduce (HCCS)"] = 4 * L * ar / (link * p["a2a_eff"])
    else:
        t["op-parallel all-reduce (HCCS)"] = 0.0
    # Data-parallel gradient all-reduce of the shared parameters over the dp replicas (RoCE),
    # each device its 1/tp shard.
    shared = (dense_params - p["rre_blocks"] * ffn + T * d) * p["bytes_per"] / tp
    t["gradient all-reduce (RoCE)"] = grad_exchange_bytes(shared, dp) / (p["roce"] * p["a2a_eff"])
    # Expert exchange: 4 all-to-alls per block (dispatch and combine, forward and backward) of
    # each device's tokens' rows, to the devices holding the experts. RRE and the group's gate:
    # a group's experts on its own devices (group_devices, over 1-2 servers), the rows leave
    # the device over HCCS (same server) or RoCE (the other server) in parallel. Global gate:
    # experts over all devices, nearly every row leaves the server over RoCE.
    per_device = n / p["per_server"]
    vol_row = expert_exchange_bytes(p["rre_blocks"], per_device, rows, d, p["bytes_per"])
    span = p["devices"] if router == "top2-global" else p["group_devices"]
    hccs_share = (p["per_server"] - 1) / span
    roce_share = (span - p["per_server"]) / span
    vol = vol_row * (hccs_share + roce_share)
    t["expert all-to-all"] = max(vol_row * hccs_share / (p["hccs"] * p["hccs_ports"]),
                                 vol_row * roce_share / p["roce"]) / p["a2a_eff"]
    t["count exchange"] = 0.0 if router == "rre" else p["rre_blocks"] * p["count_latency"]
    # ECSS: the host's Adam over the active experts' records, weights in and gradients out over
    # PCIe. With n tokens per server every expert of a drawn group is active; a global gate
    # sends any token to any expert, so every expert is active whatever the groups drawn.
    mine = expert_params / servers * (1.0 if router == "top2-global" else active)
    t["ECSS host Adam"] = mine * p["adam_bytes"] / (p["host"] * p["adam_frac"])
    pcie = mine * p["bytes_per"] / (p["pcie"] * p["per_server"])
    t["ECSS weights in + grads out (PCIe)"] = 2 * pcie
    return t, dict(shared_bytes=shared, n=n, flops_dense=flops_dense, expert_flops=expert_flops, rows=rows, vol=vol,
                   mine=mine, dense_params=dense_params, expert_params=expert_params)


def table(p, active):
    routers = ["rre", "top2-group", "top2-global"]
    ts = {r: model(p, r, active)[0] for r in routers}
    print("| part (s per step, per server) | " + " | ".join(routers) + " |")
    print("|---|" + "---:|" * len(routers))
    for part in ts["rre"]:
        print(f"| {part} | " + " | ".join(f"{ts[r][part]:.3f}" for r in routers) + " |")
    totals = {r: sum(ts[r].values()) for r in routers}
    ecss = {r: ts[r]["ECSS host Adam"] + ts[r]["ECSS weights in + grads out (PCIe)"] for r in routers}
    overl = {r: max(totals[r] - ecss[r], ecss[r]) for r in routers}
    tok = p["tokens_per_step"]
    device = {r: totals[r] - ecss[r] for r in routers}
    rows = [("**step, nothing overlapped**", totals, "**{:.2f}**"),
            ("device work alone (ECSS hidden or free)", device, "{:.2f}"),
            ("RRE's throughput / this one's, device work alone", {r: device[r] / device["rre"] for r in routers}, "{:.2f}"),
            ("step, ECSS overlapped with the device work", overl, "{:.2f}"),
            ("tokens/s, nothing overlapped", {r: tok / totals[r] for r in routers}, "{:,.0f}"),
            ("tokens/s, ECSS overlapped", {r: tok / overl[r] for r in routers}, "{:,.0f}"),
            ("RRE's throughput / this one's, nothing overlapped", {r: totals[r] / totals["rre"] for r in routers}, "{:.2f}"),
            ("the same, ECSS overlapped", {r: overl[r] / overl["rre"] for r in routers}, "{:.2f}")]
    for name, v, f in rows:
        print(f"| {name} | " + " | ".join(f.format(v[r]) for r in routers) + " |")


def rre_step(a, tp, active):
    a.tp = tp
    p = inputs(a)
    t, info = model(p, "rre", active)
    ecss = t["ECSS host Adam"] + t["ECSS weights in + grads out (PCIe)"]
    total = sum(t.values())
    return p, t, info, total, max(total - ecss, ecss)


def tp_table(a):
    print("| tp | dp | active groups | dense compute | op-parallel all-reduce | gradient all-reduce "
          "| step, nothing overlapped | tokens/s | ECSS overlapped: tokens/s | shared fp16 weights + "
          "grads per device |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for active in (1.0, 0.1):
        for tp in (1, 2, 4, 8, 16):
            p, t, info, total, overl = rre_step(a, tp, active)
            gib = 2 * info["shared_bytes"] / 2**30
            print(f"| {tp} | {p['devices'] // tp} | {active:.0%} | {t['dense compute']:.3f} | "
                  f"{t['op-parallel all-reduce (HCCS)']:.3f} | {t['gradient all-reduce (RoCE)']:.3f} | "
                  f"{total:.2f} | {p['tokens_per_step'] / total:,.0f} | "
                  f"{p['tokens_per_step'] / overl:,.0f} | {gib:.1f} GiB |")


def paper(a):
    """The paper's own figures against the model at its layout (tp 8, dp 64, ep 64)."""
    measured = 69905                               # [S] tokens/s, Introduction
    print("| the model at tp 8 x dp 64 | step s | tokens/s | model / paper's 69,905 |")
    print("|---|---:|---:|---:|")
    steps = {}
    for name, active, overlap in (("every group active, nothing overlapped", 1.0, False),
                                  ("every group active, ECSS overlapped", 1.0, True),
                                  ("stage 1: 4 of 40 groups active (0.1), nothing overlapped", 0.1, False),
                                  ("stage 1, ECSS overlapped", 0.1, True)):
        p, t, info, total, overl = rre_step(a, 8, active)
        s = overl if overlap else total
        steps[(active, overlap)] = s
        print(f"| {name} | {s:.2f} | {p['tokens_per_step'] / s:,.0f} | {p['tokens_per_step'] / s / measured:.2f} |")
    print(f"\nvanilla heterogeneous training (every expert through the host each step) / ECSS at "
          f"0.1 active, nothing overlapped: {steps[(1.0, False)] / steps[(0.1, False)]:.2f}x "
          f"(the paper: 6.3x with every technique combined)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eta", type=float, default=0.5, help="fraction of the fp16 peak a step's FLOPs reach")
    ap.add_argument("--host-gbs", type=float, default=150, help="host in-place memory GB/s per server")
    ap.add_argument("--a2a-eff", type=float, default=0.5, help="collective rate / stated link rate")
    ap.add_argument("--count-us", type=float, default=200, help="one count all-to-all, microseconds")
    ap.add_argument("--imbalance", type=float, default=1.5, help="RRE expert load max/mean")
    ap.add_argument("--active", type=float, nargs="*", default=[1.0, 0.25],
                    help="fractions of the groups one step draws from (one table each)")
    ap.add_argument("--tp", type=int, default=8, help="op-level model-parallel degree (1-16)")
    ap.add_argument("--tp-table", action="store_true",
                    help="RRE's step at tp = 1, 2, 4, 8, 16 (every group active, and 0.1 active)")
    ap.add_argument("--paper", action="store_true",
                    help="the model's throughput against the paper's measured 69,905 tokens/s")
    a = ap.parse_args()
    p = inputs(a)
    if a.tp_table:
        tp_table(a)
        return
    if a.paper:
        paper(a)
        return
    _, info = model(p, "rre", 1.0)
    shared = info["dense_params"] - p["rre_blocks"] * 8 * p["d"] ** 2
    print(f"parameters: shared {shared:.4g}, experts {info['expert_params']:.4g}, total "
          f"{shared + info['expert_params']:.4g}; tokens per server and step {info['n']:.0f}; "
          f"FLOPs per token: dense part {info['flops_dense'] / 1e9:.2f} G, one expert per RRE "
          f"block {info['expert_flops'] / 1e9:.2f} G")
    for f in a.active:
        print(f"\nA step draws from {f:.0%} of the groups:\n")
        table(p, f)


if __name__ == "__main__":
    main()
