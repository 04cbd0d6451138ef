#!/usr/bin/python3
"""PyTorch's CPU Adam on the sizes bench_adam uses, for docs/benchmarks.md (issue 5).

Usage: /usr/bin/python3 bench/bench_adam_torch.py [N=100000000] [STEPS=9] [THREADS=2]
(Debian's python3-torch 1.13 is importable only from /usr/bin/python3.)

Times optimizer.step() of torch.optim.Adam (betas 0.9/0.95, eps 1e-8, no weight decay) over N
fp32 parameters whose gradients are already set, for foreach=False, foreach=True and fused=True
(1.13 accepts the flag but implements fused Adam for CUDA only; the script reports what happens
on CPU). The parameters are held either as one tensor (like bench_adam) or as 100 tensors of
N/100 (where foreach can batch its per-tensor kernels). Medians of STEPS steps after one warm-up
step; params/s = N / median.
"""
import os
import statistics
import sys
import time

N = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000_000
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 9
THREADS = int(sys.argv[3]) if len(sys.argv) > 3 else 2

import torch  # noqa: E402

torch.set_num_threads(THREADS)


def loadavg():
    return " ".join(open("/proc/loadavg").read().split()[:3])


def make_params(chunks):
    size = N // chunks
    ps = []
    for c in range(chunks):
        p = torch.nn.Parameter(torch.empty(size).uniform_(-0.02, 0.02))
        p.grad = torch.empty(size).uniform_(-1e-3, 1e-3)
        ps.append(p)
    return ps


def bench(chunks, **flags):
    params = make_params(chunks)
    try:
        opt = torch.optim.Adam(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, **flags)
        opt.step()  # warm-up: allocates exp_avg, exp_avg_sq
    except Exception as e:  # fused=True on CPU in 1.13
        return None, f"{type(e).__name__}: {str(e).splitlines()[0]}"
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    del opt, params
    return statistics.median(times), ""


def main():
    print(f"bench_adam_torch: torch {torch.__version__}, n = {N}, {torch.get_num_threads()} "
          f"thread(s), {STEPS} steps, load average {loadavg()}")
    print(f"{'variant':<44} {'ms':>9} {'Gparam/s':>10} {'GB/s (28 B/param)':>18}")
    for chunks in (1, 100):
        for name, flags in (("foreach=False", {"foreach": False}),
                            ("foreach=True", {"foreach": True}),
                            ("fused=True", {"fused": True})):
            label = f"torch.optim.Adam {name}, {chunks} tensor(s)"
            sec, err = bench(chunks, **flags)
            if sec is None:
                print(f"{label:<44} not available: {err}")
            else:
                print(f"{label:<44} {sec * 1e3:>9.1f} {N / sec * 1e-9:>10.3f} "
                      f"{N * 28 / sec * 1e-9:>18.1f}")
    print(f"load average after: {loadavg()}")


if __name__ == "__main__":
    main()
