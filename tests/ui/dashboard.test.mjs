// End-to-end test of idem's dashboard (/ui) in headless Chromium.
//
// Starts a real gateway (`idem serve`, the debug binary by default) on a free
// port with SQLite in a temporary directory, an admin key and two tenants,
// in front of four providers: the built-in mock (instant), `idem
// mock-upstream` answering after 400 ms, another answering JSON that keeps
// a route's contract, and a socket here that accepts calls and never
// answers (its attempts end `unknown`, and its circuit opens), and one that
// answers every call with a 500 (an error burst that opens its circuit).
// The gateway's `slow` route is priced (gpt-4o-mini's built-in price), the
// `mock` route is not (its cost is unknown). Then it drives
// Debian's Chromium with playwright-core: signs in with the admin key, reads
// the figures, fires waves of identical requests and a few jobs, and checks
// that what the page shows moved by exactly what was sent.
//
// Environment:
//   IDEM_BIN                 the idem binary (default: ../../target/debug/idem)
//   CHROMIUM                 the browser (default: /usr/bin/chromium)
//   IDEM_UI_REDIS            a Redis URL: coalesce through Redis (the page then shows it)
//   IDEM_UI_SCREENSHOT_DIR   where dashboard.png, dashboard-narrow.png, job.png and keys.png go
//                            (default: ../../target/ui-test)
//
// Run: `npm ci && npm test` in this folder (.ci/ui-test does it all).

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import net from 'node:net';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';

const here = path.dirname(fileURLToPath(import.meta.url));
const repo = path.resolve(here, '..', '..');
const IDEM = process.env.IDEM_BIN || path.join(repo, 'target', 'debug', 'idem');
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
const REDIS = process.env.IDEM_UI_REDIS || '';
const SHOTS = path.resolve(process.env.IDEM_UI_SCREENSHOT_DIR || path.join(repo, 'target', 'ui-test'));

const ADMIN = 'admin-' + randomBytes(16).toString('hex');
const ACME = 'sk-acme-' + randomBytes(12).toString('hex');
const BETA = 'sk-beta-' + randomBytes(12).toString('hex');
const RUN = randomBytes(4).toString('hex'); // keeps prompts and Redis keys apart across runs
const WAVE = 50;

const children = [];
const sockets = new Set();
let work;
let base;
let silent;
let browser;
let page;
const foreignRequests = [];
const pageErrors = [];

// ----------------------------------------------------------------- helpers

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/** Polls `probe` until it returns a truthy value; fails with `what` and the last value seen. */
async function until(what, probe, timeoutMs = 15000) {
  const deadline = Date.now() + timeoutMs;
  let last;
  for (;;) {
    last = await probe();
    if (last && last.ok !== false) return last;
    if (Date.now() > deadline) {
      assert.fail(`${what}: not reached within ${timeoutMs} ms (last seen: ${JSON.stringify(last)})`);
    }
    await sleep(100);
  }
}

/** Starts a child process and resolves with the first stdout/stderr line matching `pattern`. */
function startProcess(name, args, env, pattern) {
  return new Promise((resolve, reject) => {
    // idem reads IDEM_* variables as config overrides: only ours count here.
    const clean = Object.fromEntries(Object.entries(process.env).filter(([k]) => !k.startsWith('IDEM_')));
    const child = spawn(IDEM, args, { env: { ...clean, ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
    children.push(child);
    let output = '';
    let done = false;
    const timer = setTimeout(() => finish(new Error(`${name} did not start in 20 s:\n${output}`)), 20000);
    function finish(err, value) {
      if (done) return;
      done = true;
      clearTimeout(timer);
      if (err) reject(err);
      else resolve(value);
    }
    const onData = (chunk) => {
      output += chunk.toString();
      if (output.length > 200000) output = output.slice(-100000);
      const m = pattern.exec(output);
      if (m) finish(null, m);
    };
    child.stdout.on('data', onData);
    child.stderr.on('data', onData);
    child.on('error', (e) => finish(new Error(`${name}: cannot run ${IDEM}: ${e.message}`)));
    child.on('exit', (code, signal) => finish(new Error(`${name} exited (${code ?? signal}) before it was ready:\n${output}`)));
  });
}

async function http(method, urlPath, { key, body, headers = {} } = {}) {
  const h = { ...headers };
  if (key) h.authorization = 'Bearer ' + key;
  if (body !== undefined) h['content-type'] = 'application/json';
  const resp = await fetch(base + urlPath, { method, headers: h, body: body === undefined ? undefined : JSON.stringify(body) });
  const text = await resp.text();
  let json = null;
  try {
    json = JSON.parse(text);
  } catch {
    // not JSON (the page, its assets)
  }
  return { status: resp.status, headers: resp.headers, text, json };
}

function chat(model, content, key = ACME, headers = {}) {
  return http('POST', '/v1/chat/completions', {
    key,
    headers,
    body: { model, messages: [{ role: 'user', content }] },
  });
}

/** `n` identical requests at once; every answer must be 200. */
async function wave(model, content, n = WAVE) {
  const answers = await Promise.all(Array.from({ length: n }, () => chat(model, content)));
  const statuses = answers.map((a) => a.status);
  assert.deepEqual(statuses, Array(n).fill(200), `every request of the wave is answered: ${statuses}`);
  return answers.map((a) => a.headers.get('idem-outcome'));
}

/** The raw number behind a figure on the page (its data-value). */
async function figure(id) {
  const v = await page.locator('#' + id).getAttribute('data-value');
  if (v === null || v === '') return null;
  return Number(v);
}

/**
 * Several figures from one rendering of the page: read in one evaluation,
 * which runs between two of the page's renders, never across one (read one
 * by one, a poll landing between two reads paired a total from one poll with
 * its parts from the next).
 */
async function figures(...ids) {
  const raw = await page.evaluate((ids) => ids.map((id) => {
    const el = document.getElementById(id);
    return el ? el.getAttribute('data-value') : null;
  }), ids);
  const out = {};
  ids.forEach((id, i) => {
    out[id] = raw[i] === null || raw[i] === '' ? null : Number(raw[i]);
  });
  return out;
}

/** Waits until the page shows a fresh poll (its `at` changed). */
async function nextPoll() {
  const at = await page.locator('#last-update').getAttribute('data-value');
  await until('the page polls again', async () => {
    const now = await page.locator('#last-update').getAttribute('data-value');
    return { ok: now !== null && now !== at, at: now };
  }, 10000);
}

// ------------------------------------------------------------ the gateway

before(async () => {
  assert.ok(existsSync(IDEM), `no idem binary at ${IDEM} (build it with \`cargo build\`, or set IDEM_BIN)`);
  assert.ok(existsSync(CHROMIUM), `no Chromium at ${CHROMIUM} (apt-get install -y chromium, or set CHROMIUM)`);
  work = mkdtempSync(path.join(tmpdir(), 'idem-ui-test-'));

  // A provider that takes 400 ms: waves on it really coalesce.
  const mock = await startProcess('mock-upstream',
    ['mock-upstream', '--listen', '127.0.0.1:0', '--latency-ms', '400'], {},
    /mock-upstream listening on (http:\/\/\S+)/);
  const upstreamUrl = mock[1];
  // A provider whose every answer keeps the `support` route's contract.
  const keeper = await startProcess('mock-upstream (contract keeper)',
    ['mock-upstream', '--listen', '127.0.0.1:0', '--content', '{"answer": "It is on its way.", "category": "delivery"}'], {},
    /mock-upstream listening on (http:\/\/\S+)/);
  const keeperUrl = keeper[1];
  // A provider that answers every call with a 500.
  const erratic = await startProcess('mock-upstream (500s)',
    ['mock-upstream', '--listen', '127.0.0.1:0', '--fail-status', '500'], {},
    /mock-upstream listening on (http:\/\/\S+)/);
  const erraticUrl = erratic[1];

  // A provider that accepts the call and never answers: attempts on it
  // time out after sending, which idem records as `unknown`.
  silent = net.createServer((socket) => {
    sockets.add(socket);
    socket.on('error', () => {});
    socket.on('close', () => sockets.delete(socket));
  });
  await new Promise((resolve) => silent.listen(0, '127.0.0.1', resolve));
  const silentUrl = `http://127.0.0.1:${silent.address().port}/v1`;

  writeFileSync(path.join(work, 'reply.schema.json'), JSON.stringify({
    type: 'object',
    properties: { answer: { type: 'string' }, category: { type: 'string' } },
    required: ['answer', 'category'],
  }));
  writeFileSync(path.join(work, 'support.toml'), `
schema = "reply.schema.json"
required = ["answer", "category"]
runs_per_case = 1
[checks.category]
enum = ["billing", "delivery", "other"]
[[cases]]
name = "order status"
messages = [{ role = "user", content = "Where is my order 1234?" }]
expect = { category = "delivery" }
`);
  const config = `
[server]
listen = "127.0.0.1:0"
[storage]
url = "sqlite://${path.join(work, 'idem.db')}"
[coalescing]
backend = "${REDIS || 'memory'}"
redis_prefix = "idem-ui-test-${RUN}"
[jobs]
poll_interval = "200ms"
reconcile_interval = "200ms"
[log]
format = "json"
requests = "off"
[admin]
api_keys = ["${ADMIN}"]
[[tenants]]
name = "acme"
api_keys = ["${ACME}"]
[[tenants]]
name = "beta"
api_keys = ["${BETA}"]
[[providers]]
name = "builtin-mock"
kind = "mock"
[[providers]]
name = "upstream"
kind = "openai"
base_url = "${upstreamUrl}"
timeout = "10s"
[[providers]]
name = "keeper"
kind = "openai"
base_url = "${keeperUrl}"
timeout = "10s"
[[providers]]
name = "erratic"
kind = "openai"
base_url = "${erraticUrl}"
timeout = "10s"
[providers.breaker]
failures = 3
cooldown = "10m"
[[providers]]
name = "silent"
kind = "openai"
base_url = "${silentUrl}"
timeout = "1s"
[providers.breaker]
failures = 1
cooldown = "10m"
[[routes]]
model = "mock"
targets = [{ provider = "builtin-mock", model = "mock-1" }]
[[routes]]
model = "slow"
targets = [{ provider = "upstream", model = "gpt-4o-mini" }, { provider = "builtin-mock", model = "mock-1" }]
[routes.coalesce]
max_wait = "5s"
[routes.attempts]
hedge_after = "150ms"
[[routes]]
model = "fragile"
targets = [{ provider = "silent", model = "never" }]
[routes.attempts]
max = 1
timeout = "300ms"
late_result_window = "1s"
[[routes]]
model = "flaky"
targets = [{ provider = "erratic", model = "gpt-4o-mini" }]
[routes.attempts]
max = 1
[[providers]]
name = "erratic-again"
kind = "openai"
base_url = "${erraticUrl}"
timeout = "10s"
[[routes]]
model = "refusing"
targets = [{ provider = "erratic-again", model = "gpt-4o-mini" }]
[routes.attempts]
max = 1
[[routes]]
model = "support"
contract = "support.toml"
targets = [{ provider = "builtin-mock", model = "mock-1" }, { provider = "keeper", model = "json-1" },
           { provider = "builtin-mock", model = "mock-2" }]
`;
  const configPath = path.join(work, 'idem.toml');
  writeFileSync(configPath, config);
  const serve = await startProcess('idem serve', ['serve', '--config', configPath], {},
    /"message":"idem listening".*?"addr":"([^"]+)"|"addr":"([^"]+)".*?"message":"idem listening"/);
  base = 'http://' + (serve[1] || serve[2]);

  browser = await chromium.launch({
    executablePath: CHROMIUM,
    headless: true,
    // Offline machine: no background connections to Google's hosts.
    args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  });
  const context = await browser.newContext({ viewport: { width: 1400, height: 1000 } });
  page = await context.newPage();
  page.on('request', (r) => {
    if (!r.url().startsWith(base + '/') && !r.url().startsWith('data:')) foreignRequests.push(r.url());
  });
  page.on('pageerror', (e) => pageErrors.push(String(e)));
  page.on('console', (m) => {
    // A refused key is an expected 401/403 on the sign-in test.
    if (m.type() === 'error' && !/Failed to load resource/.test(m.text())) pageErrors.push(m.text());
  });
});

after(async () => {
  if (browser) await browser.close().catch(() => {});
  for (const child of children) {
    if (child.exitCode === null) child.kill('SIGTERM');
  }
  await Promise.all(children.map((child) => (child.exitCode !== null ? null
    : new Promise((resolve) => {
      const t = setTimeout(() => { child.kill('SIGKILL'); resolve(); }, 5000);
      child.on('exit', () => { clearTimeout(t); resolve(); });
    }))));
  for (const s of sockets) s.destroy();
  if (silent) silent.close();
  if (work) rmSync(work, { recursive: true, force: true });
});

// ------------------------------------------------------------------ tests

test('the page is public; its data needs the admin key', async () => {
  const ui = await http('GET', '/ui');
  assert.equal(ui.status, 200);
  assert.match(ui.headers.get('content-type'), /^text\/html/);
  assert.match(ui.headers.get('content-security-policy'), /script-src 'self'/);
  for (const asset of ['/ui/app.js', '/ui/app.css']) {
    assert.equal((await http('GET', asset)).status, 200, asset);
  }
  assert.equal((await http('GET', '/ui/nope.js')).status, 404);
  for (const p of ['/v1/admin/jobs', '/v1/admin/routes']) {
    assert.equal((await http('GET', p)).status, 401, `${p} without a key`);
    assert.equal((await http('GET', p, { key: ACME })).status, 403, `${p} with a tenant key`);
    assert.equal((await http('GET', p, { key: ADMIN })).status, 200, `${p} with the admin key`);
  }
});

test('without an admin key (the embedded default), the sign-in card says how to set one', async () => {
  // `idem serve` as a newcomer runs it: no config file, no admin key.
  const served = await startProcess('idem serve (embedded default)', ['serve'], {
    IDEM_SERVER__LISTEN: '127.0.0.1:0',
    IDEM_STORAGE__URL: `sqlite://${path.join(work, 'default.db')}`,
  }, /idem listening addr=(\S+)/);
  const plain = 'http://' + served[1];
  const other = await browser.newPage();
  try {
    await other.goto(plain + '/ui');
    await other.locator('#login').waitFor({ state: 'visible' });
    await other.locator('#no-admin-key').waitFor({ state: 'visible' });
    const hint = await other.textContent('#no-admin-key');
    assert.match(hint, /no admin key/);
    assert.match(hint, /IDEM_ADMIN__API_KEYS='\["[^"]+"\]' idem serve/);
    assert.match(hint, /\[admin\]/);
    // Any key is the open tenant's, never an admin's: the refusal says why.
    await other.fill('#admin-key', 'whatever-i-type');
    await other.click('#sign-in');
    await other.locator('#login-error').waitFor({ state: 'visible' });
    assert.match(await other.textContent('#login-error'), /not an admin key \(403\): this gateway has no admin key/);
    assert.ok(await other.locator('#dashboard').isHidden());
  } finally {
    await other.close();
  }
});

test('signing in: a tenant key is refused, the admin key opens the dashboard', async () => {
  await page.goto(base + '/ui');
  await page.locator('#login').waitFor({ state: 'visible' });
  // This gateway has an admin key: no setup hint.
  await until('the page has asked whether an admin key exists', async () => ({
    ok: (await page.evaluate(() => performance.getEntriesByType('resource').some((r) => r.name.endsWith('/ui/sign-in')))),
  }));
  assert.ok(await page.locator('#no-admin-key').isHidden());

  await page.fill('#admin-key', ACME);
  await page.click('#sign-in');
  await page.locator('#login-error').waitFor({ state: 'visible' });
  assert.match(await page.textContent('#login-error'), /not an admin key/);
  assert.equal(await page.evaluate(() => sessionStorage.getItem('idem.adminKey')), null);

  await page.fill('#admin-key', ADMIN);
  await page.click('#sign-in');
  await page.locator('#dashboard').waitFor({ state: 'visible' });
  await until('the page is live', async () => ({ ok: (await page.textContent('#connection')) === 'live' }));
  await until('the first figures', async () => ({ ok: (await figure('incoming')) !== null }));
  assert.ok(!page.url().includes(ADMIN), 'the key is not in the URL');
  assert.equal(await page.evaluate(() => sessionStorage.getItem('idem.adminKey')), ADMIN);
  assert.equal(await page.inputValue('#admin-key'), '', 'the key is not left in the form');

  // Nothing priced was counted yet: the dollars are unknown, never $0.
  await until('the money figures', async () => ({ ok: (await page.textContent('#saved-usd')) !== '–' }));
  for (const id of ['saved-usd', 'spent-usd', 'saved-usd-hour', 'spent-usd-hour']) {
    assert.equal(await page.textContent('#' + id), 'unknown', id);
    assert.equal(await page.getAttribute('#' + id, 'data-unknown'), 'true', id);
  }
  // No job is held: the table is collapsed.
  assert.equal(await page.locator('#held-panel').evaluate((n) => n.open), false);
  assert.equal(await page.textContent('#held-count'), 'none');
});

test('a wave of identical requests: incoming +50, upstream +1, saved +49, on screen', async () => {
  for (const [model, prompt] of [['mock', `built-in mock wave ${RUN}`], ['slow', `slow provider wave ${RUN}`]]) {
    await nextPoll();
    const before = await figures('incoming', 'upstream', 'saved-calls');
    const outcomes = await wave(model, prompt);
    assert.equal(outcomes.filter((o) => o === 'leader').length, 1, `one leader on ${model}: ${outcomes}`);
    const after = await until(`the page shows the ${model} wave`, async () => {
      const f = await figures('incoming', 'upstream', 'saved-calls');
      return { ok: f.incoming >= before.incoming + WAVE, ...f };
    });
    assert.equal(after.incoming, before.incoming + WAVE, `incoming on ${model}`);
    assert.equal(after.upstream, before.upstream + 1, `upstream calls on ${model}`);
    assert.equal(after['saved-calls'], before['saved-calls'] + WAVE - 1, `saved calls on ${model}`);
  }

  // The 400 ms wave had real followers: their waits are on screen. Half
  // the followers are the built-in mock wave's, whose waits are short, so
  // the median sits between the two waves: the slow wave shows in the
  // upper percentiles.
  const waits = await figures('wait-p50', 'wait-p95', 'wait-p99', 'followers', 'duplicate-share');
  assert.ok(waits.followers >= WAVE - 1, `followers: ${JSON.stringify(waits)}`);
  assert.ok(waits['wait-p95'] > 200 && waits['wait-p50'] <= waits['wait-p95'] && waits['wait-p95'] <= waits['wait-p99'],
    `wait percentiles: ${JSON.stringify(waits)}`);
  assert.ok(waits['duplicate-share'] > 0.9, `duplicate share: ${JSON.stringify(waits)}`);

  // The page agrees with the API.
  const stats = (await http('GET', '/v1/stats', { key: ADMIN })).json;
  await nextPoll();
  const shown = await figures('incoming', 'upstream');
  assert.ok(shown.incoming >= stats.coalescing.incoming_requests);
  assert.ok(shown.upstream >= stats.coalescing.upstream_calls);

  // The chart has points, and the waves show as incoming far above upstream.
  const chart = await page.locator('#chart').getAttribute('data-points');
  assert.ok(Number(chart) >= 2, `chart points: ${chart}`);
  const peakIn = Number(await page.locator('#chart polyline[data-series=incoming]').getAttribute('data-max'));
  const peakUp = Number(await page.locator('#chart polyline[data-series=upstream]').getAttribute('data-max'));
  assert.ok(peakIn >= 10 && peakIn > 5 * peakUp, `chart peaks: incoming ${peakIn}/s, upstream ${peakUp}/s`);
});

/** A row's cell figure (its data-value) in a table. */
async function cell(testid, cls) {
  const v = await page.locator(`[data-testid="${testid}"] .${cls}`).getAttribute('data-value');
  return v === null || v === '' ? null : Number(v);
}

test('money, tokens and latency of the waves: what /v1/stats says, on screen', async () => {
  await nextPoll();
  const stats = (await http('GET', '/v1/stats', { key: ADMIN })).json.coalescing;
  const shown = await until('the page shows the figures of /v1/stats', async () => {
    await nextPoll();
    const f = await figures('saved-usd', 'spent-usd', 'calls-saved', 'tokens-saved', 'unpriced-saves', 'calls-saved-hour');
    return { ok: f['calls-saved'] === stats.saved_calls, ...f };
  });
  // The slow wave is priced (49 saved calls at gpt-4o-mini's price); the
  // mock wave is not: its 49 saves are counted apart, not as $0.
  assert.ok(stats.saved_cost_usd > 0, JSON.stringify(stats));
  assert.ok(Math.abs(shown['saved-usd'] - stats.saved_cost_usd) < 1e-9, `saved $: ${JSON.stringify(shown)}`);
  assert.ok(Math.abs(shown['spent-usd'] - stats.spent_cost_usd) < 1e-9, `spent $: ${JSON.stringify(shown)}`);
  assert.equal(shown['calls-saved'], 2 * (WAVE - 1));
  assert.equal(shown['calls-saved-hour'], 2 * (WAVE - 1), 'the whole run is within the last hour');
  assert.equal(shown['unpriced-saves'], stats.unpriced_saves);
  assert.equal(shown['tokens-saved'], stats.saved_input_tokens + stats.saved_output_tokens);
  assert.ok(shown['tokens-saved'] > 0);
  assert.match(await page.textContent('#saved-usd'), /^\$0\.0\d+$/);
  assert.equal(await page.getAttribute('#saved-usd', 'data-unknown'), 'false');

  // Request latency per route: 50 requests each; the slow provider takes 400 ms.
  assert.equal(await cell('latency-slow', 'count'), WAVE);
  assert.equal(await cell('latency-mock', 'count'), WAVE);
  const slow = { p50: await cell('latency-slow', 'p50'), p95: await cell('latency-slow', 'p95'), p99: await cell('latency-slow', 'p99') };
  assert.ok(slow.p50 >= 350 && slow.p50 <= slow.p95 && slow.p95 <= slow.p99, `slow latency: ${JSON.stringify(slow)}`);
  assert.ok(await cell('latency-mock', 'p99') < 350, 'the built-in mock answers at once');
  // The slow wave's 49 followers waited for their leader (the mock wave's
  // are mostly cache hits, which do not wait).
  const waited = await cell('latency-followers', 'count');
  assert.ok(waited >= WAVE - 1 && waited <= await figure('followers'), `followers' waits: ${waited}`);
  assert.ok(await cell('latency-followers', 'p95') >= 300, "followers' wait on the slow wave");
  // The slow target's upstream latency: its one call took 400 ms.
  assert.ok(await cell('health-slow-0', 'p50') >= 380, 'upstream latency of the slow target');
  assert.equal(await page.getAttribute('[data-testid="health-slow-0"] .price', 'data-value'), 'true');
  assert.equal(await page.getAttribute('[data-testid="health-mock-0"] .price', 'data-value'), 'false');
  // The charts of the last hour have the waves.
  const incoming = await page.locator('#hour-chart g[data-series=incoming]').getAttribute('data-sum');
  assert.ok(Number(incoming) >= 2 * WAVE, `hour chart: ${incoming}`);
  const savedUsd = await page.locator('#money-chart g[data-series=saved]').getAttribute('data-sum');
  assert.ok(Math.abs(Number(savedUsd) - stats.saved_cost_usd) < 1e-6, `money chart: ${savedUsd}`);
});

let failedJob;

test('an error burst opens a circuit; a contract violation; errors by class on screen', async () => {
  await nextPoll();
  const errors = ['err-provider', 'err-timeouts', 'err-rejections', 'err-contract', 'err-no-target', 'err-internal'];
  const before = await figures(...errors);
  assert.equal(await page.getAttribute('[data-testid="health-flaky-0"] .circuit', 'data-state'), 'closed');

  // A job on the provider answering 500: one attempt, failed.
  const job = await http('POST', '/v1/jobs', {
    key: ACME,
    headers: { 'idempotency-key': `ui-failed-${RUN}` },
    body: { request: { model: 'flaky', messages: [{ role: 'user', content: `failed job ${RUN}` }] } },
  });
  assert.equal(job.status, 201, job.text);
  failedJob = job.json.id;
  await until('the job fails', async () => {
    const j = (await http('GET', '/v1/admin/jobs/' + failedJob, { key: ADMIN })).json;
    return { ok: j.state === 'failed', state: j.state };
  });
  // Two chat requests: 500 each; three failures open the circuit.
  for (const i of [1, 2]) {
    const r = await chat('flaky', `burst ${i} ${RUN}`);
    assert.ok(r.status >= 500, `burst ${i}: ${r.status}`);
  }
  // Then the route has no target.
  for (const i of [3, 4]) {
    const r = await chat('flaky', `burst ${i} ${RUN}`);
    assert.equal(r.status, 503, `after the burst: ${r.text}`);
  }
  // The built-in mock's answer is no JSON: it breaks the support route's contract.
  const broken = await chat('support', `contract ${RUN}`);
  assert.ok(broken.status >= 500, broken.text);
  // A rejection: a model no route serves.
  assert.equal((await chat('no-such-model', 'x')).status, 404);

  const after = await until('the page shows the burst', async () => {
    const f = await figures(...errors);
    return { ok: f['err-provider'] >= before['err-provider'] + 3 && f['err-rejections'] >= before['err-rejections'] + 1, ...f };
  });
  assert.equal(after['err-provider'], before['err-provider'] + 3, 'three calls answered 500');
  assert.equal(after['err-no-target'], before['err-no-target'] + 2);
  assert.equal(after['err-contract'], before['err-contract'] + 1);
  assert.equal(after['err-rejections'], before['err-rejections'] + 1);
  assert.equal(after['err-timeouts'], before['err-timeouts']);
  assert.equal(after['err-internal'], before['err-internal']);
  assert.ok(await page.locator('#err-card-provider').evaluate((n) => n.classList.contains('alert')));
  assert.ok(await figure('err-provider-rate') > 0);

  // The target's health: circuit open, every call of its provider failed.
  const flaky = '[data-testid="health-flaky-0"]';
  await until('the circuit opens on screen', async () => ({ ok: (await page.getAttribute(flaky + ' .circuit', 'data-state')) === 'open' }));
  assert.equal(await cell('health-flaky-0', 'calls'), 3);
  assert.equal(await cell('health-flaky-0', 'errors'), 1);
  assert.match(await page.textContent(flaky + ' .errors'), /100\.0 %/);
  assert.equal(await cell('health-flaky-0', 'p50'), null, 'no successful call: no latency');
  assert.equal(await page.getAttribute('[data-testid="health-slow-0"] .circuit', 'data-state'), 'closed');
  const provider = await page.locator('#errors-chart g[data-series=provider]').getAttribute('data-sum');
  assert.ok(Number(provider) >= 3, `errors chart: ${provider}`);
});

test('calls saved: followers, cache hits, negative-cache hits and replays add up to the total', async () => {
  await nextPoll();
  const classes = ['followers', 'cache-hits', 'negative-hits', 'replays'];
  const before = await figures('saved-calls', ...classes);
  // A negative-cache hit: the same request again while its 500 is kept.
  const prompt = `refused twice ${RUN}`;
  const first = await chat('refusing', prompt);
  assert.ok(first.status >= 500, first.text);
  assert.equal(first.headers.get('idem-outcome'), 'leader');
  const second = await chat('refusing', prompt);
  assert.equal(second.status, first.status);
  assert.equal(second.headers.get('idem-outcome'), 'negative-hit');
  // A replay: the same Idempotency-Key again.
  const key = { 'idempotency-key': `ui-replay-${RUN}` };
  assert.equal((await chat('mock', `replayed ${RUN}`, ACME, key)).status, 200);
  const replayed = await chat('mock', `replayed ${RUN}`, ACME, key);
  assert.equal(replayed.headers.get('idem-outcome'), 'replay');

  const after = await until('the page shows the negative-cache hit and the replay', async () => {
    const f = await figures('saved-calls', ...classes);
    return {
      ok: f['negative-hits'] === before['negative-hits'] + 1 && f.replays === before.replays + 1
        && f['saved-calls'] === before['saved-calls'] + 2,
      ...f,
    };
  });
  assert.equal(after['saved-calls'], before['saved-calls'] + 2);
  // Every saved call is in exactly one class, and each class is named in the card.
  assert.equal(after['saved-calls'], classes.reduce((sum, c) => sum + after[c], 0), JSON.stringify(after));
  for (const c of classes) {
    assert.equal(await page.locator(`#saved-calls-card #${c}`).count(), 1, `${c} is in the saved calls card`);
  }
  assert.ok(after['negative-hits'] > 0 && after.replays > 0 && after.followers > 0 && after['cache-hits'] > 0,
    JSON.stringify(after));
  // The API says the same.
  const c = (await http('GET', '/v1/stats', { key: ADMIN })).json.coalescing;
  assert.equal(c.saved_calls, c.followers + c.cache_hits + c.negative_hits + c.replays);
});

let hedged;
let held;

test('jobs: by state, unknown attempts highlighted, attempt races counted', async () => {
  const before = await figures('jobs-succeeded', 'unknown-attempts', 'attempt-races');
  assert.equal(before['unknown-attempts'], 0);

  // On `slow`: the first attempt takes 400 ms, a hedge starts after 150 ms
  // on the built-in mock and wins; the first finishes later and is discarded.
  const a = await http('POST', '/v1/jobs', {
    key: BETA,
    headers: { 'idempotency-key': `ui-hedge-${RUN}` },
    body: { request: { model: 'slow', messages: [{ role: 'user', content: `hedged job ${RUN}` }] }, metadata: { order: 45 } },
  });
  assert.equal(a.status, 201, a.text);
  hedged = a.json.id;
  // On `fragile`: the provider never answers; after 300 ms the attempt is unknown.
  const b = await http('POST', '/v1/jobs', {
    key: ACME,
    headers: { 'idempotency-key': `ui-unknown-${RUN}` },
    body: { request: { model: 'fragile', messages: [{ role: 'user', content: `unanswered job ${RUN}` }] } },
  });
  assert.equal(b.status, 201, b.text);
  held = b.json.id;

  const after = await until('the page shows the jobs', async () => {
    const f = await figures('jobs-succeeded', 'unknown-attempts', 'attempt-races');
    return { ok: f['jobs-succeeded'] === before['jobs-succeeded'] + 1 && f['unknown-attempts'] === 1
      && f['attempt-races'] === before['attempt-races'] + 1, ...f };
  });
  assert.ok(after);
  assert.ok(await page.locator('#unknown-card').evaluate((n) => n.classList.contains('alert')), 'unknown attempts highlighted');
  await until('the held job is listed', async () => ({
    ok: await page.locator(`#held-jobs tr[data-job-id="${held}"]`).count() === 1,
  }));
  const heldRow = page.locator(`#held-jobs tr[data-job-id="${held}"]`);
  assert.match(await heldRow.textContent(), /acme/);
  assert.match(await heldRow.textContent(), /#1/);
  await until('both jobs in the recent list', async () => ({
    ok: await page.locator(`#recent-jobs tr[data-job-id="${hedged}"]`).count() === 1
      && await page.locator(`#recent-jobs tr[data-job-id="${held}"]`).count() === 1,
  }));
  assert.ok(await page.locator(`#recent-jobs tr[data-job-id="${held}"]`).evaluate((n) => n.classList.contains('held')));
  // A held job opens the collapsed table.
  assert.equal(await page.locator('#held-panel').evaluate((n) => n.open), true);
  assert.equal(await page.textContent('#held-count'), '1');

  // The provider that never answers: the attempt's call listens for a late
  // answer for 1 s (the route's late_result_window), then times out, and
  // one failure opens its circuit. The attempt stays unknown all the same.
  const fragile = page.locator('[data-testid="target-fragile-0"] .circuit');
  await until('the silent target\'s circuit opens', async () => ({ ok: (await fragile.getAttribute('data-state')) === 'open' }));
  assert.match(await fragile.textContent(), /probe in/);
  assert.equal(await page.locator('[data-testid="target-slow-0"] .circuit').getAttribute('data-state'), 'closed');
});

test('targets: certification for the contract, as certified', async () => {
  const cert = (i) => page.locator(`[data-testid="target-support-${i}"] .cert`).getAttribute('data-state');
  assert.deepEqual([await cert(0), await cert(1), await cert(2)], ['never', 'never', 'never']);
  assert.equal(await page.locator('[data-testid="target-slow-0"] .cert').getAttribute('data-state'), 'no contract');
  // Certify the fallbacks (what `idem certify --route support` does).
  const r = await http('POST', '/v1/admin/certify', { key: ADMIN, body: { route: 'support' } });
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.passed, false, 'the built-in mock does not answer in JSON');
  await until('the page shows the certifications', async () => {
    const states = [await cert(0), await cert(1), await cert(2)];
    return { ok: states.join() === 'never,certified,failed', states };
  });
  const allowed = (i) => page.locator(`[data-testid="target-support-${i}"] .failover`).getAttribute('data-value');
  assert.deepEqual([await allowed(1), await allowed(2)], ['true', 'false']);
  assert.equal(await page.locator('#routes tbody tr').count(), 9);
});

test('the job page shows the attempts on a timeline', async () => {
  await page.click(`#recent-jobs tr[data-job-id="${hedged}"] a`);
  await page.locator('#job-page').waitFor({ state: 'visible' });
  assert.ok(page.url().endsWith('#/jobs/' + hedged), page.url());
  await until('the job is shown', async () => ({ ok: (await page.textContent('#job-state')) === 'succeeded' }));
  assert.equal(await page.textContent('#job-tenant'), 'beta');
  assert.equal(await page.textContent('#job-completed-by'), '#2');
  const first = page.locator('[data-testid="attempt-bar-1"]');
  const second = page.locator('[data-testid="attempt-bar-2"]');
  await until('the first attempt is discarded', async () => ({ ok: (await first.getAttribute('data-state')) === 'discarded' }));
  assert.equal(await first.getAttribute('data-hedge'), 'false');
  assert.equal(await first.getAttribute('data-discarded'), 'true');
  assert.equal(await second.getAttribute('data-state'), 'succeeded');
  assert.equal(await second.getAttribute('data-hedge'), 'true');
  for (const bar of [first, second]) {
    const width = Number(await bar.locator('rect').getAttribute('width'));
    assert.ok(width >= 3, `a bar is drawn: ${width}`);
  }
  // The discarded attempt ran longer than the hedge that won.
  const w1 = Number(await first.locator('rect').getAttribute('width'));
  const w2 = Number(await second.locator('rect').getAttribute('width'));
  assert.ok(w1 > w2, `bar widths ${w1} > ${w2}`);
  mkdirSync(SHOTS, { recursive: true });
  await page.setViewportSize({ width: 1400, height: 720 });
  await page.screenshot({ path: path.join(SHOTS, 'job.png'), fullPage: true });
  await page.setViewportSize({ width: 1400, height: 1000 });

  await page.goto(base + '/ui#/jobs/' + held);
  await until('the held job is shown', async () => ({
    ok: (await page.locator('[data-testid="attempt-bar-1"]').getAttribute('data-state')) === 'unknown',
  }));
  assert.equal(await page.textContent('#job-state'), 'running');
  assert.equal(await page.locator('[data-testid="attempt-1"]').getAttribute('data-state'), 'unknown');

  // A failed attempt: the provider's status (from its reason) and the reason.
  await page.goto(base + '/ui#/jobs/' + failedJob);
  await until('the failed job is shown', async () => ({ ok: (await page.textContent('#job-state')) === 'failed' }));
  const attempt = page.locator('[data-testid="attempt-1"]');
  assert.equal(await attempt.getAttribute('data-state'), 'failed');
  assert.equal(await attempt.locator('.status').textContent(), '5xx');
  assert.equal(await attempt.locator('.reason').textContent(), 'provider_error');
  assert.match(await page.textContent('#job-error'), /provider_error/);

  await page.goto(base + '/ui#/jobs/00000000-0000-7000-8000-000000000000');
  await page.locator('#job-missing').waitFor({ state: 'visible' });
});

test('under load: the chart moves, and a screenshot of it', async () => {
  await page.goto(base + '/ui#/');
  await page.locator('#dashboard').waitFor({ state: 'visible' });
  // Bounded load for about 6 s: every 100 ms, 8 requests over 3 prompts on
  // the 400 ms provider, read past the cache so that they coalesce.
  const prompts = [0, 1, 2].map((i) => `load ${i} ${RUN}`);
  const pending = [];
  const started = Date.now();
  let shot = false;
  for (let round = 0; round < 60; round++) {
    for (let i = 0; i < 8; i++) {
      pending.push(chat('slow', prompts[(round + i) % 3], i % 2 ? ACME : BETA, { 'cache-control': 'no-cache' }));
    }
    if (!shot && Date.now() - started > 4500) {
      await nextPoll();
      mkdirSync(SHOTS, { recursive: true });
      await page.screenshot({ path: path.join(SHOTS, 'dashboard.png'), fullPage: true });
      shot = true;
    }
    await sleep(100);
  }
  const answers = await Promise.all(pending);
  assert.ok(answers.every((a) => a.status === 200), 'every request under load is answered');
  assert.ok(shot, 'a screenshot was taken under load');
  await nextPoll();
  const rateIn = await figure('rate-incoming');
  const inflight = await figure('inflight-flights');
  assert.ok(rateIn !== null && inflight !== null);
  const peakIn = Number(await page.locator('#chart polyline[data-series=incoming]').getAttribute('data-max'));
  assert.ok(peakIn > 20, `the load shows on the chart: ${peakIn}/s`);
});

/** The page is no wider than the window (nothing scrolls sideways). */
async function noHorizontalOverflow(what) {
  const { scroll, inner } = await page.evaluate(() => ({
    scroll: document.documentElement.scrollWidth, inner: window.innerWidth,
  }));
  assert.ok(scroll <= inner, `${what}: the page is ${scroll} px wide in a ${inner} px window`);
}

test('at 400 px wide: the same figures, one column, no sideways scrolling', async () => {
  await page.goto(base + '/ui#/');
  await page.locator('#dashboard').waitFor({ state: 'visible' });
  await nextPoll();
  const ids = ['saved-usd', 'spent-usd', 'calls-saved', 'tokens-saved', 'err-provider', 'err-no-target', 'err-contract', 'err-rejections'];
  const wide = await figures(...ids);
  const wideCircuit = await page.getAttribute('[data-testid="health-flaky-0"] .circuit', 'data-state');
  await page.setViewportSize({ width: 400, height: 900 });
  await nextPoll();
  const narrow = await figures(...ids);
  assert.deepEqual(narrow, wide, 'the same figures at 400 px');
  assert.equal(await page.getAttribute('[data-testid="health-flaky-0"] .circuit', 'data-state'), wideCircuit);
  assert.equal(wideCircuit, 'open');
  for (const id of ['saved-usd', 'err-provider', 'health', 'latency', 'money-chart']) {
    assert.ok(await page.locator('#' + id).isVisible(), `#${id} is shown at 400 px`);
  }
  // The panels are stacked: a card and a chart fit in the window.
  const box = await page.locator('#money-chart').boundingBox();
  assert.ok(box && box.x >= 0 && box.x + box.width <= 400, `the money chart fits: ${JSON.stringify(box)}`);
  await noHorizontalOverflow('the dashboard at 400 px');
  mkdirSync(SHOTS, { recursive: true });
  await page.screenshot({ path: path.join(SHOTS, 'dashboard-narrow.png'), fullPage: true });

  await page.goto(base + '/ui#/jobs/' + hedged);
  await until('the job is shown at 400 px', async () => ({ ok: (await page.textContent('#job-state')) === 'succeeded' }));
  await noHorizontalOverflow('a job at 400 px');
  await page.setViewportSize({ width: 1400, height: 1000 });
  await page.goto(base + '/ui#/');
  await page.locator('#dashboard').waitFor({ state: 'visible' });
  await noHorizontalOverflow('the dashboard at 1400 px');
});

test('the coalescing backend and Redis status are shown', async () => {
  const backend = await page.textContent('#backend');
  const redis = await page.getAttribute('#redis-status', 'data-value');
  if (REDIS) {
    assert.equal(backend, 'redis');
    assert.equal(redis, 'connected');
  } else {
    assert.equal(backend, 'memory');
    assert.equal(redis, 'not used');
  }
  assert.equal(await figure('redis-errors'), 0);
  const tenants = await page.locator('#tenants tbody tr').count();
  assert.equal(tenants, 2);
});

test('the keys page: budgets, states, a key made and revoked on the page', async () => {
  // Two keys through the admin API: one with a budget, one without, revoked.
  const budgeted = `ci-budget-${RUN}`;
  const plain = `no-budget-${RUN}`;
  const a = await http('POST', '/v1/admin/keys', {
    key: ADMIN, body: { tenant: 'acme', name: budgeted, budget_usd: 5, budget_period: '30d', rpm: 60 },
  });
  assert.equal(a.status, 201, a.text);
  assert.equal(typeof a.json.key, 'string', 'the secret is in the answer to the creation');
  assert.equal(a.json.budget.limit_usd, 5);
  const b = await http('POST', '/v1/admin/keys', { key: ADMIN, body: { tenant: 'acme', name: plain } });
  assert.equal(b.status, 201, b.text);
  assert.equal(b.json.budget.limit_usd, null);
  const revoked = await http('POST', `/v1/admin/keys/${b.json.id}/revoke`, { key: ADMIN });
  assert.equal(revoked.status, 200, revoked.text);
  assert.equal(revoked.json.state, 'revoked');
  // The keys endpoint is the admin's only.
  assert.equal((await http('GET', '/v1/admin/keys')).status, 401);
  assert.equal((await http('GET', '/v1/admin/keys', { key: ACME })).status, 403);

  // The page: reached from the header's link, like the other views.
  await page.goto(base + '/ui#/');
  await page.locator('#dashboard').waitFor({ state: 'visible' });
  await page.click('#nav-keys');
  await page.locator('#keys-page').waitFor({ state: 'visible' });
  assert.ok(page.url().endsWith('#/keys'), page.url());
  assert.ok(await page.locator('#dashboard').isHidden());
  assert.ok(await page.locator('#nav-keys').evaluate((n) => n.classList.contains('current')));
  const row = (id) => page.locator(`#keys tr[data-key-id="${id}"]`);
  await until('both keys are listed', async () => ({
    ok: await row(a.json.id).count() === 1 && await row(b.json.id).count() === 1,
  }));

  // The first: its name, active, $0 spent of its $5.00 budget per 30 days.
  const first = row(a.json.id);
  assert.equal(await first.locator('.name').textContent(), budgeted);
  assert.equal(await first.locator('.tenant').textContent(), 'acme');
  assert.equal(await first.locator('.hint-cell').textContent(), a.json.hint);
  assert.equal(await first.locator('.state').getAttribute('data-state'), 'active');
  assert.equal((await first.locator('.state').textContent()).trim(), 'active');
  assert.equal(await first.locator('.budget').getAttribute('data-limit'), '5');
  assert.equal(await first.locator('.budget .limit-usd').textContent(), '$5.00');
  assert.match(await first.locator('.budget').textContent(), /\$0\.00 of \$5\.00 \/ 30d/);
  assert.equal(await first.locator('.budget .spend-bar').count(), 1, 'a bar of the spend against the budget');
  assert.match(await first.locator('.limits').textContent(), /60 rpm/);
  assert.ok(!await first.evaluate((n) => n.classList.contains('key-revoked')), 'an active key is not greyed');
  assert.equal(await first.locator('button.revoke').count(), 1);

  // The second: greyed, revoked, no budget, nothing left to revoke.
  const second = row(b.json.id);
  assert.equal(await second.locator('.name').textContent(), plain);
  assert.ok(await second.evaluate((n) => n.classList.contains('key-revoked')), 'a revoked key is greyed');
  assert.equal(await second.locator('.state').getAttribute('data-state'), 'revoked');
  assert.match(await second.locator('.state').textContent(), /revoked/);
  assert.equal(await second.locator('.budget').getAttribute('data-limit'), '');
  assert.match(await second.locator('.budget').textContent(), /no budget/);
  assert.equal(await second.locator('.spend-bar').count(), 0);
  assert.equal(await second.locator('button.revoke').count(), 0);
  const color = (loc) => loc.locator('.name').evaluate((n) => getComputedStyle(n).color);
  assert.notEqual(await color(second), await color(first), 'the revoked row is drawn grey');

  // A key made with the page's form: its secret is shown once, and works.
  const made = `from-the-page-${RUN}`;
  await page.click('#key-create-panel summary');
  await page.fill('#key-tenant', 'beta');
  await page.fill('#key-name', made);
  await page.fill('#key-budget', '2.5');
  await page.selectOption('#key-period', '7d');
  await page.click('#key-create-submit');
  await page.locator('#key-secret-box').waitFor({ state: 'visible' });
  const secret = await page.textContent('#key-secret');
  assert.match(secret, /^sk-idem-/);
  const madeId = await page.locator('#key-secret-box').getAttribute('data-key-id');
  assert.equal(await page.textContent('#key-secret-for'), `beta / ${made}`);
  const own = await http('GET', '/v1/key', { key: secret });
  assert.equal(own.status, 200, own.text);
  assert.equal(own.json.key.id, madeId);
  await until('the new key is listed', async () => ({ ok: await row(madeId).count() === 1 }));
  assert.equal(await row(madeId).locator('.name').textContent(), made);
  assert.match(await row(madeId).locator('.budget').textContent(), /\$2\.50 \/ 7d/);
  assert.equal(await page.inputValue('#key-name'), '', 'the form is emptied');
  assert.ok(!(await page.evaluate(() => JSON.stringify({ ...sessionStorage, ...localStorage }))).includes(secret),
    'the secret is kept nowhere');
  // The gateway's refusal is shown, and no secret.
  await page.fill('#key-tenant', 'no such tenant!');
  await page.fill('#key-name', `refused-${RUN}`);
  await page.click('#key-create-submit');
  await page.locator('#key-create-error').waitFor({ state: 'visible' });
  assert.match(await page.textContent('#key-create-error'), /not created: `tenant`: names are/);
  assert.ok(await page.locator('#key-secret-box').isHidden());

  // Revoking asks first: dismissed, nothing changes; accepted, the key is revoked.
  let asked = '';
  page.once('dialog', (d) => { asked = d.message(); d.dismiss(); });
  await page.click(`#keys [data-testid="revoke-${madeId}"]`);
  assert.match(asked, new RegExp(`Revoke the key "${made}"`));
  await sleep(1500);
  assert.equal(await row(madeId).getAttribute('data-state'), 'active');
  page.once('dialog', (d) => d.accept());
  await page.click(`#keys [data-testid="revoke-${madeId}"]`);
  await until('the key made on the page is revoked', async () => ({
    ok: await row(madeId).evaluate((n) => n.classList.contains('key-revoked')),
  }));
  assert.equal((await http('GET', `/v1/admin/keys/${madeId}`, { key: ADMIN })).json.state, 'revoked');
  assert.equal((await http('GET', '/v1/key', { key: secret })).status, 401, 'the revoked secret is refused');

  // Narrow, the page fits.
  await page.setViewportSize({ width: 400, height: 900 });
  await nextPoll();
  await noHorizontalOverflow('the keys page at 400 px');
  await page.setViewportSize({ width: 1400, height: 1000 });

  // Leaving the page forgets the secret.
  await page.click('#nav-dashboard');
  await page.locator('#dashboard').waitFor({ state: 'visible' });
  assert.ok(await page.locator('#keys-page').isHidden());
  assert.equal(await page.textContent('#key-secret'), '');
  await page.goto(base + '/ui#/keys');
  await page.locator('#keys-page').waitFor({ state: 'visible' });
  assert.ok(await page.locator('#key-secret-box').isHidden());
  await until('the keys are listed again', async () => ({ ok: await row(madeId).count() === 1 }));
  mkdirSync(SHOTS, { recursive: true });
  await page.screenshot({ path: path.join(SHOTS, 'keys.png'), fullPage: true });
  await page.goto(base + '/ui#/');
  await page.locator('#dashboard').waitFor({ state: 'visible' });
});

test('signing out forgets the key; nothing left this origin; no script errors', async () => {
  await page.click('#sign-out');
  await page.locator('#login').waitFor({ state: 'visible' });
  assert.equal(await page.evaluate(() => sessionStorage.getItem('idem.adminKey')), null);
  assert.deepEqual(foreignRequests, [], 'the page fetched nothing from another origin');
  assert.deepEqual(pageErrors, [], 'no script errors');
});
