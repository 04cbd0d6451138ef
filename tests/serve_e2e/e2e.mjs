// End-to-end test of `sigma serve` with the official openai client (docs/serving.md).
// Builds a small text model with the CLI in a temp dir (tokenizer, shards, training, an
// extract), serves it on a free loopback port and checks what a client sees. Bounded: every
// request is small, the load test is a fixed count, and the whole run takes well under a minute.
// Usage: node e2e.mjs SIGMA_BINARY
import OpenAI from 'openai';
import assert from 'node:assert/strict';
import { execFileSync, spawn } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

const sigma = process.argv[2];
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'sigma-serve-e2e-'));
const servers = [];
process.on('exit', () => {
  for (const s of servers) if (s.exitCode === undefined) s.proc.kill('SIGKILL');
  fs.rmSync(tmp, { recursive: true, force: true });
});
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const T = 128;  // the model's context
const KEY = 'e2e-key';

function cli(...args) {
  return execFileSync(sigma, args, { cwd: tmp, encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
}

// ---- a small text model, built as a user would -------------------------------------------
function buildModel() {
  const lines = [];
  for (let i = 0; i < 150; i++) {
    lines.push(JSON.stringify({ domain: 'prose', text: `the cat sat on the mat number ${i % 17} and the dog ran to the park.` }));
    lines.push(JSON.stringify({ domain: 'code', text: `def f${i % 13}(x):\n    return x + ${i % 7}\n` }));
  }
  fs.writeFileSync(`${tmp}/corpus.jsonl`, lines.join('\n') + '\n');
  cli('tokenizer', 'train', '--corpus', `${tmp}/corpus.jsonl`, '--vocab-size', '320', '--out', `${tmp}/tok.json`);
  writeDataConfig('data.json', 'corpus.jsonl');
  cli('prepare', '--config', `${tmp}/data.json`, '--out', `${tmp}/shards`);
  cli('train', '--quiet', '--set', 'data.source=shards', '--set', `data.path=${tmp}/shards`,
      '--set', 'model.d_model=32', '--set', 'model.heads=2', '--set', 'model.layers=2',
      '--set', `model.context=${T}`, '--set', 'train.batch=4', '--set', 'train.steps=40',
      '--set', 'train.eval_rows=4', '--set', 'optim.warmup=2', '--set', 'model.rre_layers=1',
      '--set', 'model.groups=[{"name":"prose","experts":2},{"name":"code","experts":3}]',
      '--out', `${tmp}/run`);
  cli('extract', '--ckpt', `${tmp}/run/checkpoints`, '--domain', 'code', '--out', `${tmp}/code`);
}

function writeDataConfig(name, corpus) {
  fs.writeFileSync(`${tmp}/${name}`, JSON.stringify({
    tokenizer: 'tok.json', corpus: [corpus],
    domains: [{ name: 'prose', slot: 0 }, { name: 'code', slot: 1, prefix: ['<Python>'] }],
  }));
}

// ---- servers -----------------------------------------------------------------------------
// Starts `sigma serve --port 0` and resolves once it prints the port it bound.
function startServer(ckpt, ...extra) {
  const model = ckpt.endsWith('/code') ? 'code' : 'run';  // the name sigma serve gives it (its folder)
  return new Promise((resolve, reject) => {
    const proc = spawn(sigma, ['serve', '--ckpt', ckpt, '--port', '0', '--api-key', KEY, ...extra],
                       { stdio: ['ignore', 'pipe', 'pipe'] });
    const srv = { proc, port: 0, out: '', err: '', exitCode: undefined, model };
    srv.exited = new Promise((done) => proc.on('exit', (code) => { srv.exitCode = code; done(code); }));
    proc.stdout.on('data', (d) => {
      srv.out += d;
      const m = srv.out.match(/listening on http:\/\/127\.0\.0\.1:(\d+)/);
      if (m && !srv.port) { srv.port = Number(m[1]); resolve(srv); }
    });
    proc.stderr.on('data', (d) => { srv.err += d; });
    proc.on('exit', () => { if (!srv.port) reject(new Error(`sigma serve exited: ${srv.err}`)); });
    servers.push(srv);
  });
}

async function ready(srv) {
  const url = `http://127.0.0.1:${srv.port}`;
  for (let i = 0; i < 400; i++) {
    try {
      const r = await fetch(`${url}/health`);
      if (r.status === 200) break;
      assert.equal(r.status, 503);
      assert.equal((await r.json()).status, 'loading');
    } catch (e) { if (e instanceof assert.AssertionError) throw e; }
    await sleep(25);
  }
  srv.url = url;
  srv.client = new OpenAI({ baseURL: `${url}/v1`, apiKey: KEY, maxRetries: 0, timeout: 60000 });
  return srv;
}

async function metric(srv, name) {
  const text = await (await fetch(`${srv.url}/metrics`)).text();
  const m = text.match(new RegExp(`^${name} ([0-9.e+-]+)$`, 'm'));
  assert.ok(m, `metric ${name} missing:\n${text}`);
  return Number(m[1]);
}

function rssKiB(srv) {
  const s = fs.readFileSync(`/proc/${srv.proc.pid}/status`, 'utf8');
  return Number(s.match(/VmRSS:\s+(\d+)/)[1]);
}

// The client must surface a refusal as an APIError with this status and message.
async function refuses(promise, status, says) {
  try {
    await promise;
  } catch (e) {
    assert.ok(e instanceof OpenAI.APIError, `not an APIError: ${e}`);
    assert.equal(e.status, status, `status ${e.status}: ${e.message}`);
    assert.ok(String(e.error?.message ?? e.message).includes(says), `'${e.message}' lacks '${says}'`);
    return e;
  }
  assert.fail(`expected HTTP ${status} (${says})`);
}

async function rawPost(srv, route, body, headers = {}) {
  const r = await fetch(`${srv.url}${route}`, {
    method: 'POST', body, headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${KEY}`, ...headers },
  });
  const j = await r.json();  // every refusal is JSON
  return { status: r.status, j };
}

const complete = (srv, body, opts) => srv.client.completions.create({ model: srv.model, ...body }, opts);
const textOf = async (srv, body) => (await complete(srv, body)).choices[0].text;

// ---- the checks ----------------------------------------------------------------------------
const tests = [];
const test = (name, fn) => tests.push({ name, fn });
let full, sub;

test('models lists the model, each domain and each --model extract', async () => {
  const list = await full.client.models.list();
  assert.deepEqual(list.data.map((m) => m.id), ['run', 'run:prose', 'run:code', 'code', 'code:code']);
  assert.deepEqual(list.data[0].domains, ['prose', 'code']);
});

test('a domain selected by model equals the domain field; an unknown model is NotFoundError', async () => {
  const body = { prompt: 'def f2(x):\n    return', max_tokens: 0, echo: true, logprobs: 2 };
  const byModel = await full.client.completions.create({ ...body, model: 'run:code' });
  const byDomain = await full.client.completions.create({ ...body, model: 'run', domain: 'code' });
  const byProse = await full.client.completions.create({ ...body, model: 'run:prose' });
  assert.deepEqual(byModel.choices[0].logprobs, byDomain.choices[0].logprobs);
  assert.notDeepEqual(byModel.choices[0].logprobs.token_logprobs, byProse.choices[0].logprobs.token_logprobs);
  assert.equal(byModel.model, 'run:code');
  const gen = { prompt: 'def f3(x):', max_tokens: 16, temperature: 0 };
  // The extract loaded with --model code=DIR gives the full model's code-domain text.
  assert.equal(await textOf(full, { ...gen, model: 'code' }), await textOf(full, { ...gen, model: 'run:code' }));
  const e = await refuses(full.client.completions.create({ ...gen, model: 'python' }), 404, "the model 'python' does not exist");
  assert.ok(e instanceof OpenAI.NotFoundError);
  await refuses(full.client.completions.create({ ...gen, model: 'run:code', domain: 'prose' }), 400, "'model' names domain 'code'");
});

test('OpenAI fields: honoured, or refused by name', async () => {
  // max_completion_tokens (EOT banned through logit_bias, so the count is exact).
  let r = await complete(full, { prompt: 'the', max_completion_tokens: 40, logit_bias: { 0: -100 }, temperature: 0 });
  assert.equal(r.usage.completion_tokens, 40);
  const chat = await full.client.chat.completions.create({ model: 'run', messages: [{ role: 'user', content: 'the cat' }],
                                                           max_completion_tokens: 30, logit_bias: { 0: -100 }, temperature: 0 });
  assert.ok(chat.usage.completion_tokens > 16, `${chat.usage.completion_tokens} tokens`);
  // Streams carry logprobs and, when asked, usage; both equal the plain response's.
  const body = { prompt: 'the dog', max_tokens: 20, temperature: 0, logprobs: 2 };
  const plain = await complete(full, body);
  let tokens = [], lps = [], usage = null;
  for await (const c of await complete(full, { ...body, stream: true, stream_options: { include_usage: true } })) {
    if (c.usage) usage = c.usage;
    for (const ch of c.choices) { tokens.push(...ch.logprobs.tokens); lps.push(...ch.logprobs.token_logprobs); }
  }
  assert.deepEqual(tokens, plain.choices[0].logprobs.tokens);
  assert.deepEqual(lps, plain.choices[0].logprobs.token_logprobs);
  assert.deepEqual(usage, plain.usage);
  // top_logprobs never merges two tokens into one key.
  r = await complete(full, { prompt: 'the', max_tokens: 4, temperature: 0, logprobs: 20 });
  for (const top of r.choices[0].logprobs.top_logprobs) assert.equal(Object.keys(top).length, 20);
  // No seed: fresh entropy, so two samples differ.
  const free = { prompt: 'the', max_tokens: 24, temperature: 1, logit_bias: { 0: -100 } };
  assert.notEqual(await textOf(full, free), await textOf(full, free));
  // stop: "" stops nothing.
  const g = { prompt: 'the cat', max_tokens: 12, temperature: 0 };
  assert.equal(await textOf(full, { ...g, stop: '' }), await textOf(full, g));
  // response_format json_object: a finished answer parses as a JSON object.
  const j = await full.client.chat.completions.create({ model: 'run', messages: [{ role: 'user', content: 'give json' }],
                                                        max_tokens: 120, temperature: 0.7, seed: 1,
                                                        response_format: { type: 'json_object' } });
  if (j.choices[0].finish_reason === 'stop') assert.equal(typeof JSON.parse(j.choices[0].message.content), 'object');
  else assert.ok(j.choices[0].message.content.trimStart().startsWith('{'));
  await refuses(complete(full, { prompt: 'a', best_of: 3 }), 400, "'best_of' is not supported");
  await refuses(complete(full, { prompt: 'a', suffix: 'end' }), 400, "'suffix' is not supported");
  await refuses(full.client.chat.completions.create({ model: 'run', messages: [{ role: 'user', content: 'x' }],
    tools: [{ type: 'function', function: { name: 'f' } }] }), 400, "'tools' is not supported");
  await refuses(complete(full, { prompt: 'a', frobnicate: 1 }), 400, "unsupported field 'frobnicate'");
  const big = await rawPost(full, '/v1/completions', '{"prompt": "a", "temperature": 1e400}');
  assert.equal(big.status, 400);
});

test('completion, usage and finish_reason', async () => {
  const r = await complete(full, { prompt: 'the cat', max_tokens: 10, temperature: 0 });
  assert.equal(typeof r.choices[0].text, 'string');
  assert.equal(r.object, 'text_completion');
  assert.equal(r.usage.completion_tokens + r.usage.prompt_tokens, r.usage.total_tokens);
  assert.ok(r.usage.completion_tokens >= 1 && r.usage.completion_tokens <= 10);
  assert.ok(['length', 'stop'].includes(r.choices[0].finish_reason));
  // The same greedy continuation as `sigma generate` (which prints prompt + continuation,
  // and the <EOT> it stopped at, which the server leaves out of the text).
  const gen = cli('generate', '--ckpt', `${tmp}/run/checkpoints`, '--prompt', 'the cat', '--max-new', '10');
  assert.equal(gen.replace(/<EOT>\n$/, '\n'), `the cat${r.choices[0].text}\n`);
});

test('streamed completion equals the plain one', async () => {
  const body = { prompt: 'the dog', max_tokens: 24, temperature: 0 };
  const plain = await textOf(full, body);
  const stream = await complete(full, { ...body, stream: true });
  let text = '', finish = null, chunks = 0;
  for await (const chunk of stream) {
    text += chunk.choices[0].text;
    finish = chunk.choices[0].finish_reason ?? finish;
    chunks++;
  }
  assert.equal(text, plain);
  assert.ok(chunks > 2, `${chunks} chunks`);
  assert.ok(finish);
});

test('chat completion, plain and streamed', async () => {
  const body = { model: 'run', messages: [{ role: 'user', content: 'the cat' }], max_tokens: 16, temperature: 0 };
  const r = await full.client.chat.completions.create(body);
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(typeof r.choices[0].message.content, 'string');
  let text = '';
  for await (const c of await full.client.chat.completions.create({ ...body, stream: true }))
    text += c.choices[0].delta.content ?? '';
  assert.equal(text, r.choices[0].message.content);
});

test('greedy and seeded output is the same alone and batched', async () => {
  const bodies = [
    { prompt: 'the cat sat', max_tokens: 30, temperature: 0 },
    { prompt: 'def f', max_tokens: 30, temperature: 0.9, seed: 7, domain: 'code' },
    { prompt: 'the', max_tokens: 30, temperature: 1, top_p: 0.9, top_k: 20, seed: 3 },
    { prompt: 'number 5 and', max_tokens: 30, temperature: 0.7, frequency_penalty: 0.5, seed: 11 },
  ];
  const alone = [];
  for (const b of bodies) alone.push(await textOf(full, b));
  const batched = await Promise.all(bodies.map((b) => textOf(full, b)));
  assert.deepEqual(batched, alone);
  const again = await Promise.all([...bodies, ...bodies].map((b) => textOf(full, b)));
  assert.deepEqual(again, [...alone, ...alone]);
});

test('echo + logprobs sums to sigma eval\'s loss on the same text', async () => {
  // A held-out document one window long: T+1 <= tokens (with its <EOT>) < 2T+1, so sigma eval
  // --rows 1 scores exactly its first T+1 tokens.
  let text = '', ids = [];
  for (let i = 0; ids.length + 1 < T + 1; i++) {
    text += `${i ? ' ' : ''}the dog ${i % 5} sat on a mat and the cat ran.`;
    ids = (await rawPost(full, '/tokenize', JSON.stringify({ text }))).j.tokens;
  }
  fs.writeFileSync(`${tmp}/heldout.jsonl`, JSON.stringify({ domain: 'prose', text }) + '\n');
  writeDataConfig('heldout.json', 'heldout.jsonl');
  cli('prepare', '--config', `${tmp}/heldout.json`, '--out', `${tmp}/heldout`);
  const ev = JSON.parse(cli('eval', '--ckpt', `${tmp}/run/checkpoints`, '--data', `${tmp}/heldout`,
                            '--domains', 'prose', '--rows', '1', '--batch', '1', '--json'));
  assert.equal(ev.domains.prose.tokens, T);
  const window = [...ids, 0].slice(0, T + 1);  // 0 = <EOT>
  const r = await complete(full, { prompt: window, max_tokens: 0, echo: true, logprobs: 0 });
  const lp = r.choices[0].logprobs.token_logprobs;
  assert.equal(lp.length, T + 1);
  assert.equal(lp[0], null);
  const sum = lp.slice(1).reduce((a, b) => a + b, 0);
  const diff = Math.abs(-sum / T - ev.domains.prose.loss);
  console.log(`  mean -logprob ${(-sum / T).toFixed(9)} vs sigma eval ${ev.domains.prose.loss.toFixed(9)}: |diff| = ${diff.toExponential(2)}`);
  assert.ok(diff <= 1e-5, `differs by ${diff}`);
});

test('extracted sub-model serves its domain, like the full model', async () => {
  const list = await sub.client.models.list();
  assert.deepEqual(list.data.map((m) => m.id), ['code', 'code:code']);
  assert.deepEqual(list.data[0].domains, ['code']);
  const body = { prompt: 'def f3(x):', max_tokens: 24, temperature: 0 };
  const fromSub = await textOf(sub, body);  // default: the extract's only domain
  assert.equal(fromSub, await textOf(full, { ...body, domain: 'code', model: 'run' }));
  assert.equal(await textOf(sub, { ...body, domain: 'code' }), fromSub);
  await refuses(complete(sub, { ...body, domain: 'prose' }), 400, "unknown domain 'prose'");
});

test('bad input is an API error with the right status', async () => {
  await refuses(complete(full, { prompt: 'a', max_tokens: 'ten' }), 400, "'max_tokens' must be an integer");
  await refuses(complete(full, { prompt: 'a', temperature: 'hot' }), 400, "'temperature' must be a number");
  await refuses(complete(full, { prompt: 'a', domain: 'law' }), 400, "unknown domain 'law'");
  await refuses(complete(full, { prompt: 'x '.repeat(300) }), 400, `the model's context is ${T}`);
  await refuses(complete(full, { prompt: 'a', max_tokens: 100000 }), 400, "'max_tokens' = 100000 is out of range");
  await refuses(complete(full, { prompt: 'a'.repeat(70000) }), 413, 'larger than the limit of 65536 bytes');
  await refuses(full.client.chat.completions.create({ model: 'run', messages: [{ role: 'robot', content: 'x' }] }), 400, "role 'robot'");
  const wrongKey = new OpenAI({ baseURL: `${full.url}/v1`, apiKey: 'wrong', maxRetries: 0 });
  const e = await refuses(wrongKey.completions.create({ model: 'run', prompt: 'a' }), 401, 'API key');
  assert.ok(e instanceof OpenAI.AuthenticationError);
  assert.ok(await refuses(full.client.models.retrieve('nope'), 404, 'no route GET /v1/models/nope') instanceof OpenAI.NotFoundError);
  // What the client cannot send: malformed JSON and invalid UTF-8.
  let r = await rawPost(full, '/v1/completions', '{"prompt": "a", ');
  assert.equal(r.status, 400);
  assert.match(r.j.error.message, /not valid JSON/);
  r = await rawPost(full, '/v1/completions', Buffer.from('{"prompt": "\xff\xfe"}', 'latin1'));
  assert.equal(r.status, 400);
  assert.match(r.j.error.message, /UTF-8/);
  assert.equal(await metric(full, 'sigma_busy_slots'), 0);
});

test('a client that leaves mid-stream frees its slot', async () => {
  const srv = await ready(await startServer(`${tmp}/run/checkpoints`, '--slots', '1'));
  const ctl = new AbortController();
  const stream = await complete(srv, { prompt: 'the', max_tokens: 120, temperature: 1, seed: 1, stream: true }, { signal: ctl.signal });
  for await (const _ of stream) { ctl.abort(); break; }
  for (let i = 0; i < 100 && (await metric(srv, 'sigma_busy_slots')) !== 0; i++) await sleep(20);
  assert.equal(await metric(srv, 'sigma_busy_slots'), 0);
  assert.equal((await complete(srv, { prompt: 'the', max_tokens: 4 })).choices.length, 1);  // the one slot serves again
  srv.proc.kill('SIGTERM');
  assert.equal(await srv.exited, 0);
});

test('a full queue answers 503 with Retry-After', async () => {
  const srv = await ready(await startServer(`${tmp}/run/checkpoints`, '--slots', '1', '--queue', '1'));
  const results = await Promise.allSettled(
    Array.from({ length: 12 }, () => complete(srv, { prompt: 'the', max_tokens: 120, temperature: 1, seed: 2 })));
  const refused = results.filter((r) => r.status === 'rejected');
  assert.ok(refused.length > 0, 'no request was refused');
  for (const r of refused) {
    assert.ok(r.reason instanceof OpenAI.APIError, String(r.reason));
    assert.equal(r.reason.status, 503);
    assert.equal(r.reason.headers.get('retry-after'), '1');
  }
  const served = results.filter((r) => r.status === 'fulfilled').map((r) => r.value.choices[0].text);
  assert.ok(served.length >= 2);
  assert.ok(served.every((t) => t === served[0]), 'same seed, same text');
  srv.proc.kill('SIGTERM');
  assert.equal(await srv.exited, 0);
});

test('SIGTERM finishes the stream in flight and exits 0', async () => {
  const srv = await ready(await startServer(`${tmp}/run/checkpoints`, '--slots', '2'));
  const body = { prompt: 'the cat', max_tokens: 100, temperature: 0 };
  const expected = await textOf(srv, body);
  const stream = await complete(srv, { ...body, stream: true });
  let text = '', first = true;
  for await (const c of stream) {
    if (first) { srv.proc.kill('SIGTERM'); first = false; }
    text += c.choices[0].text;
  }
  assert.equal(text, expected);
  assert.equal(await srv.exited, 0);
  assert.match(srv.err, /SIGTERM received/);
  await assert.rejects(fetch(`${srv.url}/health`));  // no longer listening
});

test('bounded load: no failures, flat memory; decode tokens/s by slots', async () => {
  const rates = {};
  for (const slots of [1, 2]) {
    const srv = await ready(await startServer(`${tmp}/run/checkpoints`, '--slots', String(slots), '--queue', '64'));
    const body = (i) => ({ prompt: `the cat ${i % 9}`, max_tokens: 64, temperature: 0.8, seed: i });
    const wave = async (n) => {
      const t0 = performance.now();
      const rs = await Promise.all(Array.from({ length: n }, (_, i) => complete(srv, body(i))));
      return { tokens: rs.reduce((a, r) => a + r.usage.completion_tokens, 0), s: (performance.now() - t0) / 1000 };
    };
    await wave(16);  // warm-up
    const rssWarm = rssKiB(srv);
    let tokens = 0, s = 0;
    for (let k = 0; k < 4; k++) { const w = await wave(16); tokens += w.tokens; s += w.s; }
    const rssEnd = rssKiB(srv);
    rates[slots] = tokens / s;
    console.log(`  --slots ${slots}: ${tokens} tokens in ${s.toFixed(2)} s = ${rates[slots].toFixed(0)} tokens/s; ` +
                `RSS ${rssWarm} -> ${rssEnd} KiB; server decode rate ${(await metric(srv, 'sigma_decode_tokens_per_second')).toFixed(0)}`);
    assert.ok(rssEnd <= rssWarm * 1.05 + 4096, `RSS grew from ${rssWarm} to ${rssEnd} KiB`);
    srv.proc.kill('SIGTERM');
    assert.equal(await srv.exited, 0);
  }
  console.log(`  2 slots / 1 slot: ${(rates[2] / rates[1]).toFixed(2)}x`);
});

// ---- run ---------------------------------------------------------------------------------
const t0 = performance.now();
buildModel();
console.log(`built the model in ${((performance.now() - t0) / 1000).toFixed(1)} s`);
full = await ready(await startServer(`${tmp}/run/checkpoints`, '--slots', '4', '--max-body', '65536',
                                    '--model', `code=${tmp}/code`));
sub = await ready(await startServer(`${tmp}/code`, '--slots', '2'));
let failed = 0;
for (const t of tests) {
  try {
    await t.fn();
    console.log(`ok - ${t.name}`);
  } catch (e) {
    failed++;
    console.log(`FAIL - ${t.name}\n  ${e.stack ?? e}`);
  }
}
for (const s of [full, sub]) s.proc.kill('SIGTERM');
const codes = await Promise.all([full.exited, sub.exited]);
if (codes.some((c) => c !== 0)) { failed++; console.log(`FAIL - servers exited with ${codes}: ${full.err}${sub.err}`); }
console.log(`${tests.length - failed}/${tests.length} passed in ${((performance.now() - t0) / 1000).toFixed(1)} s`);
process.exit(failed ? 1 : 0);
