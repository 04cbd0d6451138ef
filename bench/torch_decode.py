#!/usr/bin/python3
"""PyTorch peer for batch-1 decoding with a KV cache (issue 12; bench/decode_bench.sh,
docs/benchmarks.md "Serving: batch-1 decode").

The same PanGu-alpha decoder as DESIGN.md section 1 and bench/torch_peer.py, at inference: one
sequence, greedy, a token per step, keys and values of earlier positions cached per block.
Shapes as Sigma's model (the weights are random: speed does not depend on them):

  h = E[x] + P[pos]
  blocks 1..L-1:  h += Attn(LN1(h));  h += FFN(LN2(h))
  block L (query layer): a = LN1(h);  h += Attn(q = Qtop[pos] W_q + b_q, k, v from a);  h += FFN(LN2(h))
  logits = LNf(h) @ E^T

--rre-layers N --experts K: the top N blocks' FFN is one of K experts, picked by a routing table
of the token id (Random Routed Experts; one expert runs per token, as in an extracted sub-model).

Precision: fp32, or bf16 (every weight and activation in bf16: PyTorch's bf16 inference on CPU,
oneDNN/OpenBLAS matmuls with bf16 inputs). Both under torch.inference_mode().

Prints one JSON line: {"impl":"pytorch","precision":..,"tokens_per_s":..,"step_ms":..,
"weight_bytes_per_token":..,"params":..,...}; tokens_per_s from the median of --rounds timed
decodes of --tokens steps each (after a warm-up decode).
Run with /usr/bin/python3 (Debian's python3-torch).
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

for _i, _a in enumerate(sys.argv):
    if _a == "--threads" and _i + 1 < len(sys.argv):
        os.environ.setdefault("OPENBLAS_NUM_THREADS", sys.argv[_i + 1])
os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")

import torch
import torch.nn.functional as F


def fast_gelu(x):
    return x * torch.sigmoid(1.702 * x)


class Decoder:
    """Weights as plain tensors in nn.Linear's [out, in] layout (F.linear reads rows)."""

    def __init__(self, a, dtype):
        g = torch.Generator().manual_seed(a.seed)
        d, f, V, T, L = a.d, 4 * a.d, a.vocab, a.context, a.layers

        def w(*shape):
            return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

        def z(*shape):
            return torch.zeros(*shape, dtype=dtype)

        def o(*shape):
            return torch.ones(*shape, dtype=dtype)

        self.d, self.h, self.L, self.T = d, a.heads, L, T
        self.E, self.P, self.Qtop = w(V, d), w(T, d), w(T, d)
        self.blocks = []
        for l in range(L):
            rre = l >= L - a.rre_layers
            K = a.experts if rre else 1
            self.blocks.append({
                "ln1": (o(d), z(d)), "ln2": (o(d), z(d)),
                "qkv": (w(3 * d, d), z(3 * d)), "out": (w(d, d), z(d)),
                "w_in": [w(f, d) for _ in range(K)], "b_in": [z(f) for _ in range(K)],
                "w_out": [w(d, f) for _ in range(K)], "b_out": [z(d) for _ in range(K)],
                "route": torch.randint(0, K, (V,), generator=g).tolist() if rre else None,
            })
        self.lnf = (o(d), z(d))
        self.dtype = dtype
        self.k = [z(T, d) for _ in range(L)]
        self.v = [z(T, d) for _ in range(L)]

    def params(self):
        n = self.E.numel() + self.P.numel() + self.Qtop.numel() + 2 * self.d
        for b in self.blocks:
            for key in ("ln1", "ln2", "qkv", "out"):
                n += sum(t.numel() for t in b[key])
            for key in ("w_in", "b_in", "w_out", "b_out"):
                n += sum(t.numel() for t in b[key])
        return n

    def weight_bytes_per_token(self):
        """Bytes of weights one decode step reads: every matrix (one expert per RRE block),
        the tied head's V x d table, the biases and LayerNorms; the looked-up rows of E, P and
        Qtop are left out (3d values)."""
        e = self.E.element_size()
        n = self.E.numel() + 2 * self.d
        for b in self.blocks:
            n += sum(t.numel() for key in ("ln1", "ln2", "qkv", "out") for t in b[key])
            n += b["w_in"][0].numel() + b["b_in"][0].numel() + b["w_out"][0].numel() + b["b_out"][0].numel()
        return n * e

    def attend(self, l, q, pos):
        """q [d] against cached keys/values 0..pos of block l (causal: pos is the newest)."""
        h, dh = self.h, self.d // self.h
        k = self.k[l][: pos + 1].view(pos + 1, h, dh).transpose(0, 1)  # [h, p, dh]
        v = self.v[l][: pos + 1].view(pos + 1, h, dh).transpose(0, 1)
        s = torch.matmul(k, q.view(h, dh, 1)).squeeze(-1) / math.sqrt(dh)  # [h, p]
        p = torch.softmax(s.float(), dim=-1).to(self.dtype)
        return torch.matmul(p.unsqueeze(1), v).reshape(self.d)

    def step(self, token, pos):
        """Feeds `token` at `pos`; returns the logits [V] of the next position."""
        d = self.d
        x = self.E[token] + self.P[pos]
        for l, b in enumerate(self.blocks):
            a = F.layer_norm(x, (d,), *b["ln1"])
            w, bias = b["qkv"]
            if l < self.L - 1:
                q, k, v = F.linear(a, w, bias).split(d)
            else:  # the query layer: queries from the learned position table
                k, v = F.linear(a, w[d:], bias[d:]).split(d)
                q = F.linear(self.Qtop[pos], w[:d], bias[:d])
            self.k[l][pos] = k
            self.v[l][pos] = v
            x = x + F.linear(self.attend(l, q, pos), *b["out"])
            a = F.layer_norm(x, (d,), *b["ln2"])
            e = b["route"][token] if b["route"] else 0
            x = x + F.linear(fast_gelu(F.linear(a, b["w_in"][e], b["b_in"][e])),
                             b["w_out"][e], b["b_out"][e])
        return F.linear(F.layer_norm(x, (d,), *self.lnf), self.E).float()

    def decode(self, prompt, n):
        """Greedy: the prompt a token per step, then n new tokens; returns (tokens, seconds of
        the n decode steps)."""
        pos, logits = 0, None
        for t in prompt:
            logits = self.step(t, pos)
            pos += 1
        out = [int(torch.argmax(logits))]
        t0 = time.perf_counter()
        for _ in range(n - 1):
            logits = self.step(out[-1], pos)
            pos += 1
            out.append(int(torch.argmax(logits)))
        return out, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=42)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rre-layers", type=int, default=0)
    ap.add_argument("--experts", type=int, default=1)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--tokens", type=int, default=250, help="new tokens per timed decode")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.tokens + 3 > a.context or a.tokens < 2:
        sys.exit("torch_decode: --tokens must be in [2, context - 3]")
    torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32
    with torch.inference_mode():
        m = Decoder(a, dtype)
        prompt = [1, 2, 3]
        m.decode(prompt, 8)  # warm-up
        secs = [m.decode(prompt, a.tokens)[1] for _ in range(a.rounds)]
    med = statistics.median(secs)
    steps = a.tokens - 1
    print(json.dumps({
        "impl": "pytorch", "torch": torch.__version__, "precision": a.precision,
        "threads": a.threads, "tokens_per_s": round(steps / med, 2),
        "step_ms": round(1e3 * med / steps, 3),
        "rounds_tokens_per_s": [round(steps / s, 2) for s in secs],
        "weight_bytes_per_token": m.weight_bytes_per_token(), "params": m.params(),
    }))


if __name__ == "__main__":
    main()
