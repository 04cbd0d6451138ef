// Continuous batching gain of `sigma serve` (docs/benchmarks.md): total decode tokens/s with 1
// request at a time against `slots` concurrent requests, on one server started with --slots.
// Rounds alternate 1 and N so that load from other processes hits both alike; medians.
// Usage: node bench/serve_batching.mjs SIGMA CKPT [slots=4] [max_tokens=128] [rounds=5]
import { spawn } from 'node:child_process';

const [sigma, ckpt, slotsArg = '4', tokensArg = '128', roundsArg = '5'] = process.argv.slice(2);
if (!sigma || !ckpt) {
  console.error('usage: node bench/serve_batching.mjs SIGMA CKPT [slots] [max_tokens] [rounds]');
  process.exit(2);
}
const slots = Number(slotsArg), maxTokens = Number(tokensArg), rounds = Number(roundsArg);
const proc = spawn(sigma, ['serve', '--ckpt', ckpt, '--port', '0', '--slots', String(slots)],
                   { stdio: ['ignore', 'pipe', 'inherit'] });
const url = await new Promise((resolve) => {
  let out = '';
  proc.stdout.on('data', (d) => {
    out += d;
    const m = out.match(/listening on (http:\/\/[\d.]+:\d+)/);
    if (m) resolve(m[1]);
  });
});
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
while ((await fetch(`${url}/health`).catch(() => ({ status: 0 }))).status !== 200) await sleep(50);

const metrics = async () => {
  const text = await (await fetch(`${url}/metrics`)).text();
  const get = (name) => Number(text.match(new RegExp(`^${name} ([0-9.e+-]+)$`, 'm'))[1]);
  return { tokens: get('sigma_generated_tokens_total'), decodeS: get('sigma_decode_seconds_total') };
};
// One request: greedy, a short token-id prompt, exactly maxTokens new tokens (no stop token).
const request = (i) => fetch(`${url}/v1/completions`, {
  method: 'POST', headers: { 'Content-Type': 'application/json' },
  body: JSON.stringify({ prompt: [1 + (i % 7), 2, 3], max_tokens: maxTokens, temperature: 0 }),
}).then((r) => r.json());

async function wave(concurrent) {
  const m0 = await metrics();
  const t0 = performance.now();
  const rs = await Promise.all(Array.from({ length: concurrent }, (_, i) => request(i)));
  const wall = (performance.now() - t0) / 1000;
  const m1 = await metrics();
  const tokens = rs.reduce((a, r) => a + r.usage.completion_tokens, 0);
  return { wall: tokens / wall, decode: (m1.tokens - m0.tokens) / (m1.decodeS - m0.decodeS) };
}

await wave(slots);  // warm-up: every batch size's buffers
const res = { 1: [], [slots]: [] };
for (let r = 0; r < rounds; r++)
  for (const c of [1, slots]) res[c].push(await wave(c));
const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];
for (const c of [1, slots]) {
  console.log(`${c} concurrent: ${median(res[c].map((x) => x.wall)).toFixed(1)} tokens/s end to end, ` +
              `${median(res[c].map((x) => x.decode)).toFixed(1)} tokens/s in decode steps ` +
              `(rounds: ${res[c].map((x) => x.wall.toFixed(0)).join(' ')})`);
}
const gain = median(res[slots].map((x) => x.wall)) / median(res[1].map((x) => x.wall));
console.log(`batching gain (${slots} concurrent / 1, end to end): ${gain.toFixed(2)}x`);
proc.kill('SIGTERM');
