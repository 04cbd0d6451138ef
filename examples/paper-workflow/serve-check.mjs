// Stage 8 of examples/paper-workflow.sh: query a running `sigma serve` with the official openai
// client (the npm package pinned by tests/serve_e2e/package-lock.json) and compare the served
// log-probabilities with `sigma eval`'s held-out loss on the same window.
// Usage: node serve-check.mjs CHECKS.json > RESULT.json
//   CHECKS.json: {"base_url", "api_key", "checks": [{"model", "domain", "ids": [T+1 token ids],
//                 "eval_loss": number}], "prompts": [{"model", "prompt"}]}
import OpenAI from 'openai';
import fs from 'node:fs';

const spec = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
const client = new OpenAI({ baseURL: spec.base_url, apiKey: spec.api_key, maxRetries: 0, timeout: 120000 });
const out = { models: [], checks: [], completions: [] };

out.models = (await client.models.list()).data.map((m) => m.id);
for (const c of spec.checks) {
  // Scoring through the server (docs/serving.md): echo the window, generate nothing.
  const r = await client.completions.create({ model: c.model, prompt: c.ids, max_tokens: 0, echo: true, logprobs: 0 });
  const lp = r.choices[0].logprobs.token_logprobs;
  if (lp.length !== c.ids.length || lp[0] !== null) throw new Error(`${c.model}: ${lp.length} log-probabilities for ${c.ids.length} tokens`);
  let sum = 0;  // in order, in doubles, as sigma eval sums its per-token losses
  for (let i = 1; i < lp.length; i++) sum -= lp[i];
  const served = sum / (lp.length - 1);
  out.checks.push({ model: c.model, domain: c.domain, tokens: lp.length - 1, served_loss: served,
                    eval_loss: c.eval_loss, equal: served === c.eval_loss, diff: served - c.eval_loss });
}
for (const p of spec.prompts) {
  const r = await client.completions.create({ model: p.model, prompt: p.prompt, max_tokens: 24, temperature: 0 });
  out.completions.push({ model: p.model, prompt: p.prompt, text: r.choices[0].text, finish_reason: r.choices[0].finish_reason });
}
console.log(JSON.stringify(out, null, 1));
