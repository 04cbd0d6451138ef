#!/usr/bin/python3
"""PyTorch peer for the training benchmark of issue 2 (docs/benchmarks.md).

The same dense PanGu-alpha model as DESIGN.md section 1, written in plain PyTorch 1.13 (Debian's
python3-torch; run it with /usr/bin/python3, not a pyenv python3):

  h0 = E[x_i] + P[i]                                    (one embedding slot)
  blocks 1..L-1 (pre-LN):  h += Attn(LN1(h));  h += FFN(LN2(h))
  block L (query layer):   a = LN1(h);  h += Attn(q = Qtop[i], k = a, v = a);  h += FFN(LN2(h))
  logits = LNf(h) @ E^T   (tied head),  loss = mean token cross-entropy

Attn: fused QKV projection [d, 3d] with bias, causal multi-head attention written with matmuls
(torch 1.13 has no fused SDPA), softmax in fp32, scale 1/sqrt(d/h), output projection with bias.
In the query layer the Q third of the fused projection is applied to Qtop, the K and V thirds to
a. FFN: d -> 4d, FastGelu x*sigmoid(1.702x), 4d -> d, with biases.

Optimiser: torch.optim.AdamW, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices only
(not on biases, LayerNorm or the embedding/position/query tables, as DESIGN section 3 says).
Data: uniform random tokens from a seeded torch.Generator (drawn outside the timed region).

--bf16 runs PyTorch's best CPU mode: forward under torch.autocast("cpu", dtype=torch.bfloat16)
(matmuls with bf16 inputs on oneDNN, fp32 master weights and AdamW; softmax and the loss are
cast to fp32 above), backward through autograd as autocast records it.

Prints one JSON line:
  {"impl":"pytorch","tokens_per_s":..,"step_ms":..,"flops_per_token":..,"achieved_gflops":..,
   "params":..,...}
tokens_per_s and step_ms come from the median timed step (zero_grad + forward + backward +
optimizer step); step_ms_min / tokens_per_s_best from the fastest one (on a shared machine,
interference only ever adds time). FLOPs per token (PaLM's MFU convention, attention not discounted for the
causal mask):
  flops_per_token = 6 * N_nonembed + 6 * V * d + 12 * L * T * d
where N_nonembed counts every parameter except the tables E, P and Qtop (weights, biases and
LayerNorm gains/shifts of all L blocks and the final LayerNorm), 6*V*d is the tied head's matmul
(forward 2Vd, backward 4Vd) and 12*L*T*d is QK^T and AV (forward 2*2*T*d per token per layer,
backward twice that).
"""
import argparse
import json
import math
import os
import resource
import statistics
import sys
import time

# OpenBLAS (the BLAS behind Debian's torch when libopenblas0 is installed) keeps its own thread
# pool; give it the same thread count as torch unless the caller chose one.
for _i, _a in enumerate(sys.argv):
    if _a == "--threads" and _i + 1 < len(sys.argv):
        os.environ.setdefault("OPENBLAS_NUM_THREADS", sys.argv[_i + 1])
    elif _a.startswith("--threads="):
        os.environ.setdefault("OPENBLAS_NUM_THREADS", _a.split("=", 1)[1])
os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")

import torch
import torch.nn as nn
import torch.nn.functional as F


def fast_gelu(x):
    return x * torch.sigmoid(1.702 * x)


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        assert d % heads == 0
        self.d, self.h, self.dh = d, heads, d // heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, a, causal_bias, query=None):
        B, T, d = a.shape
        h, dh = self.h, self.dh
        if query is None:
            q, k, v = self.qkv(a).split(d, dim=-1)
        else:
            w_q, w_kv = self.qkv.weight.split([d, 2 * d], dim=0)
            b_q, b_kv = self.qkv.bias.split([d, 2 * d], dim=0)
            q = F.linear(query, w_q, b_q).unsqueeze(0).expand(B, T, d)   # Qtop rows, not normalised
            k, v = F.linear(a, w_kv, b_kv).split(d, dim=-1)
        q = q.reshape(B, T, h, dh).transpose(1, 2)                     # [B, h, T, dh]
        k = k.reshape(B, T, h, dh).transpose(1, 2)
        v = v.reshape(B, T, h, dh).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(dh))   # [B, h, T, T]
        probs = torch.softmax(scores.float() + causal_bias, dim=-1).to(v.dtype)  # fp32 softmax
        ctx = torch.matmul(probs, v)                                    # [B, h, T, dh]
        ctx = ctx.transpose(1, 2).reshape(B, T, d)
        return self.out(ctx)


class FFN(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.w_in = nn.Linear(d, f)
        self.w_out = nn.Linear(f, d)

    def forward(self, x):
        return self.w_out(fast_gelu(self.w_in(x)))


class Block(nn.Module):
    def __init__(self, d, heads, query_layer=False):
        super().__init__()
        self.ln1 = nn.LayerNorm(d, eps=1e-5)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d, eps=1e-5)
        self.ffn = FFN(d, 4 * d)
        self.query_layer = query_layer

    def forward(self, h, causal_bias, qtop=None):
        h = h + self.attn(self.ln1(h), causal_bias, query=qtop if self.query_layer else None)
        return h + self.ffn(self.ln2(h))


class PanGuAlpha(nn.Module):
    def __init__(self, vocab, d, layers, heads, T):
        super().__init__()
        assert layers >= 1
        self.embed = nn.Parameter(torch.empty(vocab, d))
        self.pos = nn.Parameter(torch.empty(T, d))
        self.qtop = nn.Parameter(torch.empty(T, d))
        self.blocks = nn.ModuleList(
            [Block(d, heads) for _ in range(layers - 1)] + [Block(d, heads, query_layer=True)])
        self.lnf = nn.LayerNorm(d, eps=1e-5)
        mask = torch.full((T, T), float("-inf")).triu(1)               # 0 on/below diagonal
        self.register_buffer("causal_bias", mask, persistent=False)
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif ".ln" in name or name.startswith("lnf"):
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, x, y):
        B, T = x.shape
        h = F.embedding(x, self.embed) + self.pos[:T]
        bias = self.causal_bias[:T, :T]
        for blk in self.blocks:
            h = blk(h, bias, self.qtop[:T])
        logits = F.linear(self.lnf(h), self.embed)                     # tied head, [B, T, V]
        return F.cross_entropy(logits.reshape(B * T, -1).float(), y.reshape(B * T))


def loaded_blas():
    """Path of the BLAS library this process loaded (Debian's torch links libblas.so.3, which is
    the reference BLAS or OpenBLAS depending on what is installed / on LD_LIBRARY_PATH)."""
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return "unknown"
    blas = sorted(p for p in libs if "blas" in os.path.basename(p).lower())
    main = [p for p in blas if "openblas" in os.path.basename(p).lower()] or blas
    return main[0] if main else "none"


def table_names():
    return ("embed", "pos", "qtop")


def flops_per_token(n_nonembed, vocab, d, layers, T):
    return 6 * n_nonembed + 6 * vocab * d + 12 * layers * T * d


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--verbose", action="store_true", help="per-step times on stderr")
    ap.add_argument("--bf16", action="store_true",
                    help="forward under torch.autocast('cpu', dtype=torch.bfloat16)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = PanGuAlpha(args.vocab, args.d, args.layers, args.heads, args.T)

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if name in table_names() or p.dim() < 2:
            no_decay.append(p)
        else:
            decay.append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    n_params = sum(p.numel() for p in model.parameters())
    n_tables = sum(p.numel() for n, p in model.named_parameters() if n in table_names())
    n_nonembed = n_params - n_tables
    fpt = flops_per_token(n_nonembed, args.vocab, args.d, args.layers, args.T)

    gen = torch.Generator().manual_seed(args.seed)
    tokens = args.batch * args.T
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        seq = torch.randint(0, args.vocab, (args.batch, args.T + 1), generator=gen)
        x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if step >= args.warmup:
            times.append(dt)
        if args.verbose:
            tag = "timed" if step >= args.warmup else "warmup"
            print(f"step {step} ({tag}) {dt * 1e3:.0f} ms loss {losses[-1]:.4f} "
                  f"{tokens / dt:.0f} tok/s", file=sys.stderr, flush=True)

    step_s = statistics.median(times)
    tps = tokens / step_s
    print(json.dumps({
        "impl": "pytorch-bf16" if args.bf16 else "pytorch",
        "precision": "bf16" if args.bf16 else "fp32",
        "tokens_per_s": round(tps, 2),
        "step_ms": round(step_s * 1e3, 2),
        "step_ms_min": round(min(times) * 1e3, 2),
        "tokens_per_s_best": round(tokens / min(times), 2),
        "step_ms_all": [round(t * 1e3, 1) for t in times],
        "flops_per_token": fpt,
        "achieved_gflops": round(fpt * tps / 1e9, 3),
        "params": n_params,
        "params_nonembed": n_nonembed,
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
        "config": {"d": args.d, "layers": args.layers, "heads": args.heads, "T": args.T,
                   "batch": args.batch, "vocab": args.vocab, "steps": args.steps,
                   "warmup": args.warmup, "threads": args.threads},
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "torch": torch.__version__,
        "blas": loaded_blas(),
        "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS", ""),
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE", ""),
    }), flush=True)


if __name__ == "__main__":
    main()
