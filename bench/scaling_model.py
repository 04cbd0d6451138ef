#!/usr/bin/env python3
"""Step-time model of PanGu-Sigma's 1.085 T configuration on 512 Ascend 910 devices, RRE
against a learned top-2 gate (docs/scaling.md explains every input and where it comes from).

    python3 bench/scaling_model.py            # the tables of docs/scaling.md
    python3 bench/scaling_model.py --eta 0.3 --host-gbs 300 --imbalance 1.2

Every time is per step and per server (8 devices), the slowest part of a synchronous step.
Tags: [S] stated by the paper or the vendor, [D] derived here from stated figures, [M] measured
on Sigma's machine (docs/benchmarks.md), [A] assumed.
"""
import argparse

GB = 1e9


def inputs(a):
    d, L = 5120, 40                        # [S] PanGu-alpha 13B shape
    return dict(
        d=d, L=L, T=1024, V=40064,         # [S]
        rre_blocks=8, experts=640,         # [D] the only round (N, E) that gives 1.085 T
        groups=40, per_group=16,           # [A] one group per domain, 40 domains [S]
        group_devices=16,                  # [A] a group's 128 experts (26.8 G) on 2 servers
        devices=512, per_server=8,         # [S]
        tokens_per_step=512 * 1024,        # [A] global batch 512 x 1024
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
    n = p["tokens_per_step"] / servers                    # tokens per server and step
    flops_dense = 6 * (dense_params - p["rre_blocks"] * ffn) + 12 * L * T * d
    expert_flops = 6 * p["rre_blocks"] * ffn              # one expert per token and RRE block
    rows = 1.0 if router == "rre" else p["k"] * p["cf"]
    load = p["imbalance"] if router == "rre" else 1.0     # the gate's capacity caps the load
    server_flops = p["peak"] * p["eta"] * p["per_server"]
    t = {}
    t["dense compute"] = n * flops_dense / server_flops
    t["expert compute"] = n * expert_flops * rows * load / server_flops
    # Op-level model parallelism inside the server: 2 all-reduces of [n, d] per block forward
    # and 2 backward, ring over the 8 devices on HCCS.
    ar = n * d * p["bytes_per"] * 2 * (p["per_server"] - 1) / p["per_server"]
    t["op-parallel all-reduce (HCCS)"] = 4 * L * ar / (p["hccs"] * p["hccs_ports"] * p["a2a_eff"])
    # Data-parallel gradient all-reduce of the shared parameters over the servers (RoCE), each
    # device its 1/8 shard.
    shared = (dense_params - p["rre_blocks"] * ffn + T * d) * p["bytes_per"] / p["per_server"]
    t["gradient all-reduce (RoCE)"] = 2 * (servers - 1) / servers * shared / (p["roce"] * p["a2a_eff"])
    # Expert exchange: 4 all-to-alls per block (dispatch and combine, forward and backward) of
    # each device's tokens' rows, to the devices holding the experts. RRE and the group's gate:
    # a group's experts on its own devices (group_devices, over 1-2 servers), the rows leave
    # the device over HCCS (same server) or RoCE (the other server) in parallel. Global gate:
    # experts over all devices, nearly every row leaves the server over RoCE.
    per_device = n / p["per_server"]
    vol_row = p["rre_blocks"] * 4 * per_device * rows * d * p["bytes_per"]
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
    return t, dict(n=n, flops_dense=flops_dense, expert_flops=expert_flops, rows=rows, vol=vol,
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eta", type=float, default=0.5, help="fraction of the fp16 peak a step's FLOPs reach")
    ap.add_argument("--host-gbs", type=float, default=150, help="host in-place memory GB/s per server")
    ap.add_argument("--a2a-eff", type=float, default=0.5, help="collective rate / stated link rate")
    ap.add_argument("--count-us", type=float, default=200, help="one count all-to-all, microseconds")
    ap.add_argument("--imbalance", type=float, default=1.5, help="RRE expert load max/mean")
    ap.add_argument("--active", type=float, nargs="*", default=[1.0, 0.25],
                    help="fractions of the groups one step draws from (one table each)")
    a = ap.parse_args()
    p = inputs(a)
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
