// idem's live dashboard. Plain JavaScript, no dependencies: served from the
// binary at /ui/app.js.
//
// - The admin key is kept in this tab's sessionStorage and sent only as
//   `Authorization: Bearer` on fetch calls to this origin; never in a URL.
// - Everything tenants can choose (keys, metadata, results) is written with
//   textContent: nothing here parses data as HTML.
// - The keys page (#/keys) shows a new key's secret once, from the answer
//   to its creation; it is never stored, and leaving the page forgets it.
// - The chart's history lives in this page only: each poll of /v1/stats adds
//   one sample; the rates are the differences between samples.
'use strict';

(() => {
  const KEY = 'idem.adminKey';
  const POLL_MS = 1000;
  const WINDOW_MS = 5 * 60 * 1000;
  const MAX_SAMPLES = 400;
  const SVG = 'http://www.w3.org/2000/svg'; // a namespace name, never fetched
  const JOB_STATES = ['queued', 'running', 'succeeded', 'failed', 'cancelled'];

  const $ = (id) => document.getElementById(id);
  const samples = [];
  let timer = null;
  let generation = 0;

  class AuthError extends Error {}
  class FetchError extends Error {}

  // ---------------------------------------------------------------- helpers

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    setAttrs(node, attrs);
    for (const c of children) {
      if (c === null || c === undefined) continue;
      node.append(c instanceof Node ? c : String(c));
    }
    return node;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    setAttrs(node, attrs);
    if (text !== undefined) node.textContent = String(text);
    return node;
  }

  function setAttrs(node, attrs) {
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === 'class') node.setAttribute('class', v);
      else node.setAttribute(k, String(v));
    }
  }

  const int = (n) => (typeof n === 'number' ? n.toLocaleString('en-US') : '–');
  const pct = (x) => (typeof x === 'number' ? (x * 100).toFixed(1) + ' %' : '–');
  const ratio = (x) => (typeof x === 'number' ? x.toFixed(3) : '–');
  function ms(x) {
    if (typeof x !== 'number') return '–';
    if (x >= 120000) return (x / 60000).toFixed(1) + ' min';
    if (x >= 10000) return (x / 1000).toFixed(1) + ' s';
    if (x >= 100) return x.toFixed(0) + ' ms';
    if (x >= 10) return x.toFixed(1) + ' ms';
    return x.toFixed(2) + ' ms';
  }
  function rate(x) {
    if (typeof x !== 'number' || !isFinite(x)) return '–';
    return x >= 100 ? x.toFixed(0) : x >= 10 ? x.toFixed(1) : x.toFixed(2);
  }
  const utc = (iso) => (iso ? String(iso).replace('T', ' ').replace('Z', '') : '–');
  const shortId = (id) => String(id).slice(0, 8) + '…' + String(id).slice(-4);

  // A figure: the text for people, the raw number in data-value for tests.
  function figure(id, value, text) {
    const node = $(id);
    if (!node) return;
    node.textContent = text;
    node.dataset.value = value === null || value === undefined ? '' : String(value);
  }

  function pill(text, kind) {
    return el('span', { class: 'pill ' + kind, 'data-state': text }, text);
  }

  function jobLink(id) {
    return el('a', { href: '#/jobs/' + encodeURIComponent(id), class: 'mono', title: id,
      'data-job-id': id }, shortId(id));
  }

  function showError(text) {
    const node = $('error');
    node.textContent = text || '';
    node.hidden = !text;
  }

  // ------------------------------------------------------------------- API

  function key() {
    return sessionStorage.getItem(KEY);
  }

  async function api(path) {
    const k = key();
    if (!k) throw new AuthError('no admin key');
    let resp;
    try {
      resp = await fetch(path, {
        headers: { Authorization: 'Bearer ' + k, Accept: 'application/json' },
        cache: 'no-store',
        credentials: 'omit',
        referrerPolicy: 'no-referrer',
      });
    } catch (e) {
      throw new FetchError(e.message);
    }
    if (resp.status === 401 || resp.status === 403) {
      const none = noAdminKey ? ': this gateway has no admin key, see above' : '';
      throw new AuthError(resp.status === 401 ? 'the key was not accepted (401)'
        : 'this is not an admin key (403)' + none);
    }
    if (resp.status === 404) return null;
    if (!resp.ok) throw new FetchError(path + ': HTTP ' + resp.status);
    try {
      return await resp.json();
    } catch (e) {
      throw new FetchError(path + ': ' + e.message);
    }
  }

  // A change (POST with a JSON body): the answer's status and JSON, the
  // gateway's refusal (4xx) included, for the page to show its message.
  async function send(path, body) {
    const k = key();
    if (!k) throw new AuthError('no admin key');
    let resp;
    try {
      resp = await fetch(path, {
        method: 'POST',
        headers: { Authorization: 'Bearer ' + k, Accept: 'application/json', 'Content-Type': 'application/json' },
        body: JSON.stringify(body || {}),
        cache: 'no-store',
        credentials: 'omit',
        referrerPolicy: 'no-referrer',
      });
    } catch (e) {
      throw new FetchError(e.message);
    }
    if (resp.status === 401) throw new AuthError('the key was not accepted (401)');
    let json = null;
    try {
      json = await resp.json();
    } catch (e) {
      // Not JSON: the status says enough.
    }
    return { status: resp.status, ok: resp.ok, json };
  }

  // What a refusal says: the gateway's message, or its status.
  function refusal(answer) {
    const err = answer.json && answer.json.error;
    return err && err.message ? String(err.message) : 'HTTP ' + answer.status;
  }

  // ---------------------------------------------------------------- screens

  function route() {
    if (/^#\/keys\/?$/.test(location.hash)) return { page: 'keys' };
    const m = /^#\/jobs\/([^/?#]+)$/.exec(location.hash);
    return m ? { page: 'job', id: decodeURIComponent(m[1]) } : { page: 'dashboard' };
  }

  function show(which) {
    $('login').hidden = which !== 'login';
    $('dashboard').hidden = which !== 'dashboard';
    $('job-page').hidden = which !== 'job';
    $('keys-page').hidden = which !== 'keys';
    $('sign-out').hidden = which === 'login';
    $('nav').hidden = which === 'login';
    $('nav-dashboard').classList.toggle('current', which === 'dashboard');
    $('nav-keys').classList.toggle('current', which === 'keys');
    // A new key's secret is shown once: leaving the page forgets it.
    if (which !== 'keys') {
      hideSecret();
      createError('');
      actionError('');
    }
  }

  function signedOut(message) {
    sessionStorage.removeItem(KEY);
    stop();
    show('login');
    showError('');
    const c = $('connection');
    c.textContent = 'signed out';
    c.className = 'pill muted';
    const e = $('login-error');
    e.textContent = message || '';
    e.hidden = !message;
    $('admin-key').value = '';
    $('admin-key').focus();
  }

  function stop() {
    generation += 1;
    if (timer) clearTimeout(timer);
    timer = null;
  }

  function start() {
    stop();
    const mine = generation;
    const r = route();
    show(r.page);
    if (r.page === 'job') {
      $('job-id').textContent = r.id;
      $('job-id').dataset.value = r.id;
    }
    const loop = async () => {
      if (mine !== generation) return;
      try {
        await tick(r);
        if (mine !== generation) return;
        showError('');
        const c = $('connection');
        c.textContent = 'live';
        c.className = 'pill ok';
      } catch (e) {
        if (mine !== generation) return;
        if (e instanceof AuthError) {
          signedOut(e.message);
          return;
        }
        const c = $('connection');
        if (e instanceof FetchError) {
          showError('Cannot reach the gateway: ' + e.message + ' (retrying)');
          c.textContent = 'retrying';
        } else {
          // A bug of this page, not the gateway's: say so, and keep trying.
          console.error(e);
          showError('The dashboard failed to draw: ' + e.message);
          c.textContent = 'error';
        }
        c.className = 'pill warn';
      }
      if (mine === generation) timer = setTimeout(loop, POLL_MS);
    };
    loop();
  }

  async function tick(r) {
    if (r.page === 'keys') {
      const [stats, keys] = await Promise.all([api('/v1/stats'), api('/v1/admin/keys')]);
      record(stats);
      renderKeys(keys);
      return;
    }
    if (r.page === 'job') {
      const [stats, job] = await Promise.all([api('/v1/stats'), api('/v1/admin/jobs/' + encodeURIComponent(r.id))]);
      record(stats);
      renderJob(job);
      return;
    }
    const [stats, routes, recent, held, timeline] = await Promise.all([
      api('/v1/stats'),
      api('/v1/admin/routes'),
      api('/v1/admin/jobs?limit=15'),
      api('/v1/admin/jobs?state=unknown&limit=15'),
      api('/v1/admin/timeline'),
    ]);
    record(stats);
    renderStats(stats);
    renderChart();
    if (timeline) renderHour(timeline);
    renderRoutes(routes ? routes.data : []);
    renderJobs(recent ? recent.data : [], held ? held.data : []);
  }

  // ------------------------------------------------------------- dashboard

  function record(stats) {
    if (!stats || !stats.coalescing) throw new AuthError('this is not an admin key (no figures for all tenants)');
    if (!stats.tenants) throw new AuthError('this is not an admin key (tenant figures only)');
    const t = Date.parse(stats.at) || Date.now();
    const c = stats.coalescing;
    const last = samples[samples.length - 1];
    // A restarted gateway starts its counters at zero: start a new history.
    if (last && (c.incoming_requests < last.incoming || c.upstream_calls < last.upstream)) samples.length = 0;
    if (last && t <= last.t) return;
    samples.push({ t, incoming: c.incoming_requests, upstream: c.upstream_calls });
    while (samples.length > MAX_SAMPLES || (samples.length > 2 && t - samples[0].t > WINDOW_MS + 2 * POLL_MS)) {
      samples.shift();
    }
    figure('replica', stats.replica, stats.replica || '–');
    figure('last-update', stats.at, utc(stats.at).slice(11) + ' UTC');
  }

  function renderStats(s) {
    const c = s.coalescing;
    figure('incoming', c.incoming_requests, int(c.incoming_requests));
    figure('upstream', c.upstream_calls, int(c.upstream_calls));
    figure('upstream-ratio', c.upstream_ratio, ratio(c.upstream_ratio));
    figure('duplicate-share', c.duplicate_share, pct(c.duplicate_share));
    figure('saved-calls', c.saved_calls, int(c.saved_calls));
    figure('followers', c.followers, int(c.followers));
    figure('cache-hits', c.cache_hits, int(c.cache_hits));
    figure('replays', c.replays, int(c.replays));
    figure('negative-hits', c.negative_hits, int(c.negative_hits));
    figure('bypass', c.bypass, int(c.bypass));
    figure('wait-p50', c.wait_p50_ms, ms(c.wait_p50_ms));
    figure('wait-p95', c.wait_p95_ms, ms(c.wait_p95_ms));
    figure('wait-p99', c.wait_p99_ms, ms(c.wait_p99_ms));
    figure('wait-timeout-share', c.wait_timeout_share, pct(c.wait_timeout_share));
    figure('wait-timeouts', c.wait_timeouts, int(c.wait_timeouts));
    figure('leader-errors-shared', c.leader_errors_shared, int(c.leader_errors_shared));
    figure('inflight-flights', s.inflight_flights, int(s.inflight_flights));
    figure('waiting-followers', s.waiting_followers, int(s.waiting_followers));
    figure('attempt-races', s.attempt_races, int(s.attempt_races));

    // `jobs` is null when the store could not be read (see `unreadable`).
    for (const st of JOB_STATES) {
      const n = s.jobs ? s.jobs[st] || 0 : null;
      figure('jobs-' + st, n, int(n));
    }
    figure('unknown-attempts', s.unknown_attempts, int(s.unknown_attempts));
    $('unknown-card').classList.toggle('alert', s.unknown_attempts > 0);

    figure('backend', s.backend, s.backend || '–');
    const rs = $('redis-status');
    let status = 'not used';
    let kind = 'muted';
    if (s.backend === 'redis') {
      if (s.redis_connected === true) { status = 'connected'; kind = 'ok'; }
      else if (s.redis_connected === false) { status = 'disconnected'; kind = 'bad'; }
      else { status = 'connecting'; kind = 'warn'; }
    }
    rs.textContent = status;
    rs.dataset.value = status;
    rs.className = 'pill ' + kind;
    figure('redis-errors', s.redis_errors, int(s.redis_errors));
    $('redis-errors').classList.toggle('bad', s.redis_errors > 0);

    const body = $('tenants').tBodies[0];
    const rows = Object.keys(s.tenants).sort().map((name) => {
      const t = s.tenants[name];
      return el('tr', { 'data-testid': 'tenant-' + name, 'data-tenant': name },
        el('td', null, name),
        el('td', { class: 'num', 'data-value': t.incoming_requests }, int(t.incoming_requests)),
        el('td', { class: 'num', 'data-value': t.upstream_calls }, int(t.upstream_calls)),
        el('td', { class: 'num' }, pct(t.duplicate_share)),
        el('td', { class: 'num' }, int(t.saved_calls)),
        el('td', { class: 'num' }, ms(t.wait_p95_ms)));
    });
    body.replaceChildren(...rows);
  }

  // The chart: rates between consecutive samples, drawn as SVG polylines.
  function renderChart() {
    const box = $('chart-box');
    const chart = $('chart');
    const W = Math.max(320, Math.floor(box.clientWidth || 800));
    const H = 220;
    const pad = { l: 46, r: 12, t: 12, b: 26 };
    chart.setAttribute('viewBox', `0 0 ${W} ${H}`);
    chart.setAttribute('width', W);
    chart.setAttribute('height', H);

    const points = [];
    for (let i = 1; i < samples.length; i++) {
      const a = samples[i - 1];
      const b = samples[i];
      const dt = (b.t - a.t) / 1000;
      if (dt <= 0) continue;
      points.push({ t: b.t, incoming: (b.incoming - a.incoming) / dt, upstream: (b.upstream - a.upstream) / dt });
    }
    const now = samples.length ? samples[samples.length - 1].t : Date.now();
    // The window grows with the history, from one minute up to five.
    const first = samples.length ? samples[0].t : now;
    const span = Math.min(WINDOW_MS, Math.max(60000, now - first));
    const t0 = now - span;
    const max = Math.max(1, ...points.map((p) => Math.max(p.incoming, p.upstream)));
    const top = niceCeil(max);
    const x = (t) => pad.l + ((t - t0) / span) * (W - pad.l - pad.r);
    const y = (v) => H - pad.b - (v / top) * (H - pad.t - pad.b);

    const nodes = [];
    for (let i = 0; i <= 4; i++) {
      const v = (top * i) / 4;
      nodes.push(svg('line', { x1: pad.l, x2: W - pad.r, y1: y(v), y2: y(v), class: 'grid' }));
      nodes.push(svg('text', { x: pad.l - 6, y: y(v) + 4, class: 'axis', 'text-anchor': 'end' },
        Number.isInteger(v) ? String(v) : rate(v)));
    }
    const step = span <= 60000 ? 10000 : span <= 150000 ? 30000 : 60000;
    for (let ago = 0; ago <= span + 1; ago += step) {
      const label = ago === 0 ? 'now' : ago < 60000 ? `-${ago / 1000} s`
        : ago % 60000 ? `-${(ago / 60000).toFixed(1)} min` : `-${ago / 60000} min`;
      const anchor = ago === 0 ? 'end' : ago + step > span + 1 ? 'start' : 'middle';
      nodes.push(svg('text', { x: x(now - ago), y: H - 8, class: 'axis', 'text-anchor': anchor }, label));
    }
    $('chart-window').textContent = span >= 60000 * 2 ? `${Math.round(span / 60000)} min`
      : `${Math.round(span / 1000)} s`;
    const line = (series) => points.map((p) => `${x(p.t).toFixed(1)},${y(p[series]).toFixed(1)}`).join(' ');
    if (points.length) {
      const area = `${x(points[0].t).toFixed(1)},${y(0)} ${line('incoming')} ${x(points[points.length - 1].t).toFixed(1)},${y(0)}`;
      nodes.push(svg('polygon', { points: area, class: 'area incoming' }));
    }
    nodes.push(svg('polyline', { points: line('incoming'), class: 'series incoming', 'data-series': 'incoming',
      'data-points': points.length, 'data-max': Math.max(0, ...points.map((p) => p.incoming)) }));
    nodes.push(svg('polyline', { points: line('upstream'), class: 'series upstream', 'data-series': 'upstream',
      'data-points': points.length, 'data-max': Math.max(0, ...points.map((p) => p.upstream)) }));
    chart.replaceChildren(...nodes);
    chart.dataset.points = String(points.length);

    const lastPoint = points[points.length - 1];
    figure('rate-incoming', lastPoint ? lastPoint.incoming : null, lastPoint ? rate(lastPoint.incoming) : '–');
    figure('rate-upstream', lastPoint ? lastPoint.upstream : null, lastPoint ? rate(lastPoint.upstream) : '–');
  }

  function niceCeil(v) {
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  function certKind(state) {
    return { certified: 'ok', failed: 'bad', stale: 'warn', never: 'muted' }[state] || 'muted';
  }

  function circuitKind(state) {
    return { closed: 'ok', half_open: 'warn', open: 'bad' }[state] || 'muted';
  }

  function renderRoutes(routes) {
    const rows = [];
    for (const r of routes) {
      r.targets.forEach((t, i) => {
        const cert = t.certification ? t.certification.state : 'no contract';
        const circuit = t.circuit ? t.circuit.state : 'unknown';
        const circuitCell = el('td', { class: 'circuit', 'data-state': circuit }, pill(circuit, circuitKind(circuit)));
        const notes = [];
        if (t.circuit && t.circuit.consecutive_failures > 0) {
          notes.push(`${t.circuit.consecutive_failures}/${t.circuit.failures_to_open} failures`);
        }
        if (t.circuit && typeof t.circuit.retry_in_ms === 'number') notes.push(`probe in ${ms(t.circuit.retry_in_ms)}`);
        if (notes.length) circuitCell.append(' ', el('span', { class: 'hint' }, notes.join(' · ')));
        rows.push(el('tr', { 'data-testid': `target-${r.route}-${t.index}`, class: i === 0 ? 'first' : null },
          el('td', null, i === 0 ? r.route : ''),
          el('td', null, i === 0 ? (r.failover === 'certified_only' ? 'certified only' : 'any target') : ''),
          el('td', null, el('span', { class: 'mono' }, `${t.provider} / ${t.model}`), t.primary ? el('span', { class: 'hint' }, ' primary') : null),
          el('td', { class: 'cert', 'data-state': cert }, t.certification ? pill(cert, certKind(cert)) : el('span', { class: 'hint' }, 'no contract')),
          el('td', { class: 'failover', 'data-value': t.failover_allowed }, t.failover_allowed ? 'yes' : 'no'),
          circuitCell));
      });
    }
    $('routes').tBodies[0].replaceChildren(...rows);
  }

  function stateKind(state) {
    return { succeeded: 'ok', failed: 'bad', cancelled: 'muted', running: 'info', queued: 'muted', unknown: 'warn' }[state] || 'muted';
  }

  function renderJobs(recent, held) {
    const heldIds = new Set(held.map((j) => j.id));
    const heldRows = held.map((j) => el('tr', { 'data-job-id': j.id, class: 'held' },
      el('td', null, jobLink(j.id)),
      el('td', null, j.tenant),
      el('td', null, j.route),
      el('td', null, pill(j.state, stateKind(j.state))),
      el('td', null, (j.unknown_attempts || []).map((n) => '#' + n).join(', ')),
      el('td', { class: 'mono' }, j.idempotency_key),
      el('td', null, utc(j.created_at))));
    $('held-jobs').tBodies[0].replaceChildren(...heldRows);
    $('held-empty').hidden = heldRows.length > 0;
    const panel = $('held-panel');
    panel.classList.toggle('alert', heldRows.length > 0);
    // Collapsed while empty; opened when a job is held (and closed again
    // once none is), whatever was clicked meanwhile.
    const wasHeld = panel.dataset.held === 'true';
    if (wasHeld !== heldRows.length > 0) panel.open = heldRows.length > 0;
    panel.dataset.held = String(heldRows.length > 0);
    figure('held-count', heldRows.length, heldRows.length ? int(heldRows.length) + (held.length >= 15 ? '+' : '') : 'none');

    const rows = recent.map((j) => el('tr', { 'data-job-id': j.id, class: heldIds.has(j.id) ? 'held' : null },
      el('td', null, jobLink(j.id)),
      el('td', null, j.tenant),
      el('td', null, j.route),
      el('td', null, pill(j.state, stateKind(j.state)), heldIds.has(j.id) ? pill('unknown attempt', 'warn') : null),
      el('td', null, j.completed_by === null || j.completed_by === undefined ? '–' : '#' + j.completed_by),
      el('td', { class: 'mono' }, j.idempotency_key),
      el('td', null, utc(j.created_at))));
    $('recent-jobs').tBodies[0].replaceChildren(...rows);
    $('recent-empty').hidden = rows.length > 0;
  }

  // -------------------------------------------------------------- keys page

  function keyStateKind(state) {
    return { active: 'ok', revoked: 'bad', expired: 'muted' }[state] || 'muted';
  }

  // Spend against the budget: a bar of spent, then reserved (calls under
  // way), over the limit; "no budget" when the key has none.
  function spendCell(b) {
    b = b || {};
    const limit = typeof b.limit_usd === 'number' ? b.limit_usd : null;
    const spent = typeof b.spent_usd === 'number' ? b.spent_usd : 0;
    const reserved = typeof b.reserved_usd === 'number' ? b.reserved_usd : 0;
    const td = el('td', { class: 'budget', 'data-limit': limit === null ? '' : limit,
      'data-spent': spent, 'data-reserved': reserved, 'data-remaining': b.remaining_usd ?? '' });
    if (limit === null) {
      td.append(el('span', { class: 'hint no-budget' }, 'no budget'),
        el('div', { class: 'spend-text' }, 'spent ' + usd(spent) + (reserved > 0 ? ' + ' + usd(reserved) + ' reserved' : '')));
    } else {
      const share = (x) => (limit > 0 ? Math.max(0, Math.min(100, (x / limit) * 100)) : (x > 0 ? 100 : 0));
      const used = share(spent);
      const held = Math.min(100 - used, share(reserved));
      const over = spent + reserved >= limit;
      const bar = svg('svg', { class: 'spend-bar' + (over ? ' full' : ''), viewBox: '0 0 100 8',
        preserveAspectRatio: 'none', role: 'img', 'data-share': limit > 0 ? (spent + reserved) / limit : '',
        'aria-label': `${usd(spent)} spent and ${usd(reserved)} reserved of ${usd(limit)}` });
      bar.append(svg('rect', { x: 0, y: 0, width: 100, height: 8, class: 'track' }),
        svg('rect', { x: 0, y: 0, width: used, height: 8, class: 'spent' }),
        svg('rect', { x: used, y: 0, width: held, height: 8, class: 'reserved' }));
      const text = el('div', { class: 'spend-text' },
        el('span', { class: 'spent-usd' }, usd(spent)), ' of ',
        el('span', { class: 'limit-usd' }, usd(limit)),
        b.period ? ' / ' + b.period : ' (lifetime)');
      if (reserved > 0) text.append(el('span', { class: 'hint' }, ' + ' + usd(reserved) + ' reserved'));
      td.append(bar, text);
      const notes = [];
      if (typeof b.remaining_usd === 'number') notes.push(usd(b.remaining_usd) + ' left');
      if (b.resets_at) notes.push('resets ' + utc(b.resets_at));
      if (notes.length) td.append(el('div', { class: 'hint' }, notes.join(' · ')));
    }
    return td;
  }

  function limitsCell(k) {
    const parts = [];
    if (typeof k.rpm === 'number') parts.push(int(k.rpm) + ' rpm');
    if (typeof k.tpm === 'number') parts.push(int(k.tpm) + ' tpm');
    const td = el('td', { class: 'limits', 'data-rpm': k.rpm ?? '', 'data-tpm': k.tpm ?? '' },
      parts.length ? parts.join(' · ') : el('span', { class: 'hint' }, 'no limit'));
    if (Array.isArray(k.models)) td.append(el('div', { class: 'hint models' }, 'models: ' + k.models.join(', ')));
    return td;
  }

  function renderKeys(list) {
    $('keys-missing').hidden = !!list;
    const keys = list && Array.isArray(list.data) ? list.data : [];
    const rows = keys.map((k) => {
      const inactive = k.state !== 'active';
      const stateCell = el('td', { class: 'state', 'data-state': k.state }, pill(k.state, keyStateKind(k.state)));
      if (k.state === 'revoked' && k.revoked_at) stateCell.append(el('div', { class: 'hint' }, utc(k.revoked_at)));
      else if (k.expires_at) stateCell.append(el('div', { class: 'hint' }, (k.state === 'expired' ? 'expired ' : 'expires ') + utc(k.expires_at)));
      const action = el('td', { class: 'actions' });
      if (k.state !== 'revoked') {
        const button = el('button', { type: 'button', class: 'revoke', 'data-testid': 'revoke-' + k.id }, 'Revoke');
        button.addEventListener('click', () => revokeKey(k));
        action.append(button);
      }
      return el('tr', { 'data-testid': 'key-' + k.id, 'data-key-id': k.id, 'data-state': k.state,
        class: inactive ? 'key-inactive key-' + k.state : null },
        el('td', { class: 'tenant' }, k.tenant),
        el('td', { class: 'name' }, k.name),
        el('td', { class: 'hint-cell mono', title: k.id }, k.hint),
        stateCell,
        spendCell(k.budget),
        limitsCell(k),
        el('td', { class: 'last-used', 'data-value': k.last_used_at || '' }, k.last_used_at ? utc(k.last_used_at) : 'never'),
        action);
    });
    $('keys').tBodies[0].replaceChildren(...rows);
    $('keys-empty').hidden = rows.length > 0 || !list;
    const active = keys.filter((k) => k.state === 'active').length;
    figure('keys-summary', keys.length, `${int(keys.length)} ${keys.length === 1 ? 'key' : 'keys'}, ${int(active)} active`);
  }

  // Reads the keys again at once after a change (the poll would, a second later).
  async function refreshKeys() {
    const mine = generation;
    try {
      const list = await api('/v1/admin/keys');
      if (mine === generation && route().page === 'keys') renderKeys(list);
    } catch (e) {
      // The next poll says what is wrong.
    }
  }

  function actionError(text) {
    const node = $('key-action-error');
    node.textContent = text || '';
    node.hidden = !text;
  }

  async function revokeKey(k) {
    actionError('');
    const question = `Revoke the key "${k.name}" (${k.hint}) of tenant ${k.tenant}? ` +
      'Calls with it are refused from now on; this cannot be undone.';
    if (!window.confirm(question)) return;
    try {
      const answer = await send('/v1/admin/keys/' + encodeURIComponent(k.id) + '/revoke');
      if (!answer.ok) actionError(`Cannot revoke ${k.name}: ${refusal(answer)}`);
    } catch (e) {
      if (e instanceof AuthError) { signedOut(e.message); return; }
      actionError(`Cannot revoke ${k.name}: ${e.message}`);
    }
    await refreshKeys();
  }

  function createError(text) {
    const node = $('key-create-error');
    node.textContent = text || '';
    node.hidden = !text;
  }

  async function createKey(ev) {
    ev.preventDefault();
    createError('');
    hideSecret();
    const body = { tenant: $('key-tenant').value.trim(), name: $('key-name').value.trim() };
    const budget = $('key-budget').value.trim();
    if (budget !== '') {
      const usdValue = Number(budget);
      if (!isFinite(usdValue) || usdValue < 0) { createError('The budget is a number of dollars, zero or more.'); return; }
      body.budget_usd = usdValue;
      if ($('key-period').value) body.budget_period = $('key-period').value;
    } else if ($('key-period').value) {
      createError('A period needs a budget.');
      return;
    }
    const submit = $('key-create-submit');
    submit.disabled = true;
    try {
      const answer = await send('/v1/admin/keys', body);
      if (!answer.ok || !answer.json || typeof answer.json.key !== 'string') {
        createError('The key was not created: ' + refusal(answer));
        return;
      }
      const k = answer.json;
      $('key-secret-for').textContent = `${k.tenant} / ${k.name}`;
      $('key-secret').textContent = k.key;
      $('key-secret-box').hidden = false;
      $('key-secret-box').dataset.keyId = k.id;
      $('key-create').reset();
      await refreshKeys();
    } catch (e) {
      if (e instanceof AuthError) { signedOut(e.message); return; }
      createError('The key was not created: ' + e.message);
    } finally {
      submit.disabled = false;
    }
  }

  function hideSecret() {
    $('key-secret').textContent = '';
    $('key-secret-for').textContent = '';
    $('key-secret-box').hidden = true;
    delete $('key-secret-box').dataset.keyId;
  }

  // -------------------------------------------------------------- job page

  function renderJob(job) {
    $('job-missing').hidden = !!job;
    $('job-fields').hidden = !job;
    if (!job) {
      $('job-state').textContent = '';
      $('timeline').replaceChildren();
      $('attempts').tBodies[0].replaceChildren();
      return;
    }
    const st = $('job-state');
    st.textContent = job.state;
    st.dataset.value = job.state;
    st.className = 'pill ' + stateKind(job.state);
    figure('job-tenant', job.tenant, job.tenant);
    figure('job-route', job.route, job.route);
    figure('job-key', job.idempotency_key, job.idempotency_key);
    figure('job-version', job.version, String(job.version));
    figure('job-completed-by', job.completed_by, job.completed_by === null ? '–' : '#' + job.completed_by);
    $('job-times').textContent = utc(job.created_at) + ' / ' + utc(job.updated_at);
    figure('job-error', job.error, job.error || '–');
    $('job-fingerprint').textContent = job.fingerprint;
    $('job-result').textContent = job.result === null ? '(none)' : JSON.stringify(job.result, null, 2);
    renderTimeline(job);
    renderAttempts(job);
  }

  function renderTimeline(job) {
    const attempts = job.attempts || [];
    const box = $('timeline-box');
    const tl = $('timeline');
    const W = Math.max(320, Math.floor(box.clientWidth || 800));
    const rowH = 30;
    const pad = { l: 190, r: 16, t: 10, b: 28 };
    const H = pad.t + pad.b + Math.max(1, attempts.length) * rowH;
    tl.setAttribute('viewBox', `0 0 ${W} ${H}`);
    tl.setAttribute('width', W);
    tl.setAttribute('height', H);

    const created = Date.parse(job.created_at);
    const now = Date.now();
    const ends = attempts.map((a) => (a.finished_at ? Date.parse(a.finished_at) : now));
    const t0 = Math.min(created, ...attempts.map((a) => Date.parse(a.started_at)));
    const t1 = Math.max(t0 + 10, ...ends, Date.parse(job.updated_at));
    const span = t1 - t0;
    const x = (t) => pad.l + ((t - t0) / span) * (W - pad.l - pad.r);

    const nodes = [svg('defs', null)];
    const hatch = svg('pattern', { id: 'hatch-discarded', patternUnits: 'userSpaceOnUse', width: 8, height: 8,
      patternTransform: 'rotate(45)' });
    hatch.append(svg('rect', { width: 8, height: 8, class: 'hatch-bg' }), svg('line', { x1: 0, y1: 0, x2: 0, y2: 8, class: 'hatch-line' }));
    nodes[0].append(hatch);
    for (let i = 0; i <= 4; i++) {
      const t = t0 + (span * i) / 4;
      nodes.push(svg('line', { x1: x(t), x2: x(t), y1: pad.t, y2: H - pad.b, class: 'grid' }));
      nodes.push(svg('text', { x: x(t), y: H - 8, class: 'axis', 'text-anchor': i === 0 ? 'start' : i === 4 ? 'end' : 'middle' },
        i === 0 ? '0' : '+' + ms(t - t0)));
    }
    if (!attempts.length) {
      nodes.push(svg('text', { x: pad.l, y: pad.t + 19, class: 'axis' }, 'no attempt yet'));
    }
    attempts.forEach((a, i) => {
      const yTop = pad.t + i * rowH + 5;
      const start = Date.parse(a.started_at);
      const end = ends[i];
      const w = Math.max(3, x(end) - x(start));
      const classes = ['bar', 'st-' + a.state];
      if (a.hedge) classes.push('hedge');
      if (!a.finished_at) classes.push('open');
      const g = svg('g', { 'data-testid': 'attempt-bar-' + a.n, 'data-n': a.n, 'data-state': a.state,
        'data-hedge': a.hedge, 'data-discarded': a.state === 'discarded', 'data-started': a.started_at,
        'data-finished': a.finished_at || '' });
      g.append(svg('text', { x: 8, y: yTop + 14, class: 'label' },
        `#${a.n} ${a.provider}/${a.model}`.slice(0, 28)));
      const rect = svg('rect', { x: x(start), y: yTop, width: w, height: rowH - 10, rx: 3, class: classes.join(' ') });
      rect.append(svg('title', null, `#${a.n} ${a.state}${a.hedge ? ' (hedge)' : ''}${a.reason ? ': ' + a.reason : ''}, ${ms(end - start)}`));
      g.append(rect);
      const tags = [a.state, a.hedge ? 'hedge' : null, a.finished_at ? ms(end - start) : 'in progress'].filter(Boolean).join(' · ');
      const labelX = x(start) + w + 6;
      const inside = labelX > W - 150;
      g.append(svg('text', { x: inside ? x(start) + 6 : labelX, y: yTop + 14, class: inside ? 'tag inside' : 'tag' }, tags));
      nodes.push(g);
    });
    // The moment the job was completed: the winner's compare-and-swap.
    if (job.state === 'succeeded' && job.completed_by !== null) {
      const winner = attempts.find((a) => a.n === job.completed_by);
      if (winner && winner.finished_at) {
        const xc = x(Date.parse(winner.finished_at));
        nodes.push(svg('line', { x1: xc, x2: xc, y1: pad.t - 4, y2: H - pad.b, class: 'completed', 'data-testid': 'completed-marker' }));
      }
    }
    tl.replaceChildren(...nodes);
    tl.dataset.attempts = String(attempts.length);
  }

  function renderAttempts(job) {
    const rows = (job.attempts || []).map((a) => {
      const end = a.finished_at ? Date.parse(a.finished_at) : null;
      const dur = end === null ? null : end - Date.parse(a.started_at);
      return el('tr', { 'data-testid': 'attempt-' + a.n, 'data-state': a.state, class: a.state === 'unknown' ? 'held' : null },
        el('td', null, '#' + a.n),
        el('td', { class: 'mono' }, `${a.provider} / ${a.model}`),
        el('td', null, pill(a.state, stateKind(a.state === 'discarded' ? 'cancelled' : a.state))),
        el('td', null, a.hedge ? 'hedge' : ''),
        el('td', { class: 'status', 'data-value': upstreamStatus(a) }, upstreamStatus(a)),
        el('td', { class: 'reason' }, a.reason || ''),
        el('td', null, utc(a.started_at)),
        el('td', null, a.finished_at ? utc(a.finished_at) : 'in progress'),
        el('td', { class: 'num' }, dur === null ? '–' : ms(dur)));
    });
    $('attempts').tBodies[0].replaceChildren(...rows);
  }

  // What a failed (or unknown) attempt's reason says of the provider's
  // answer: the attempt rows keep the reason, not the status code.
  function upstreamStatus(a) {
    if (a.state !== 'failed' && a.state !== 'unknown') return '';
    const reason = String(a.reason || '').replace(/^late_/, '');
    const known = {
      provider_error: '5xx',
      rate_limited: '429',
      request_rejected: '4xx',
      intermediary_error: '502/504',
      timeout: 'no answer (timeout)',
      connect_error: 'no answer (connect)',
      connection_lost: 'no answer (cut off)',
      leader_lost: 'no answer',
      contract_violation: '2xx, contract broken',
      bad_upstream_answer: '2xx, malformed',
      upstream_answer_too_large: '2xx, too large',
    };
    if (known[reason]) return known[reason];
    const code = /\b([1-5]\d\d)\b/.exec(reason);
    return code ? code[1] : '–';
  }

  // ------------------------------------------------------------- last hour

  // Dollars: `null` is unknown (nothing counted had a price), never $0.
  function usd(x) {
    if (typeof x !== 'number') return 'unknown';
    if (x === 0) return '$0.00';
    const a = Math.abs(x);
    const digits = a >= 100 ? 0 : a >= 1 ? 2 : a >= 0.01 ? 4 : 6;
    return '$' + x.toLocaleString('en-US', { minimumFractionDigits: digits, maximumFractionDigits: digits });
  }

  // Dollars on a chart's axis: two significant digits.
  const usdAxis = (x) => (x >= 1 ? '$' + x.toFixed(2) : '$' + Number(x.toPrecision(2)));

  function money(id, x) {
    figure(id, x, usd(x));
    const node = $(id);
    if (node) {
      node.classList.toggle('unknown', typeof x !== 'number');
      node.dataset.unknown = String(typeof x !== 'number');
    }
  }

  const share = (n, of) => (of > 0 ? n / of : null);

  function renderHour(tl) {
    const all = tl.since_start.counts;
    const hour = tl.last_hour.counts;
    const mins = Math.max(0, tl.last_hour.seconds) / 60;
    figure('hour-span', tl.last_hour.seconds, mins >= 59 ? 'last hour' : `last ${mins < 1 ? Math.round(mins * 60) + ' s' : Math.round(mins) + ' min'} (since start)`);

    money('saved-usd', all.saved_cost_usd);
    money('saved-usd-hour', hour.saved_cost_usd);
    money('spent-usd', all.spent_cost_usd);
    money('spent-usd-hour', hour.spent_cost_usd);
    figure('unpriced-saves', all.unpriced_saves, int(all.unpriced_saves));
    figure('unpriced-calls', all.unpriced_calls, int(all.unpriced_calls));
    figure('calls-saved', all.saved_calls, int(all.saved_calls));
    figure('calls-saved-hour', hour.saved_calls, int(hour.saved_calls));
    figure('upstream-hour', hour.upstream_calls, int(hour.upstream_calls));
    const savedTokens = (c) => c.saved_input_tokens + c.saved_output_tokens;
    const spentTokens = (c) => c.spent_input_tokens + c.spent_output_tokens;
    figure('tokens-saved', savedTokens(all), int(savedTokens(all)));
    figure('tokens-saved-input', all.saved_input_tokens, int(all.saved_input_tokens));
    figure('tokens-saved-cached', all.saved_cached_input_tokens, int(all.saved_cached_input_tokens));
    figure('tokens-saved-output', all.saved_output_tokens, int(all.saved_output_tokens));
    figure('tokens-saved-hour', savedTokens(hour), int(savedTokens(hour)));
    figure('tokens-spent', spentTokens(all), int(spentTokens(all)));
    figure('tokens-spent-input', all.spent_input_tokens, int(all.spent_input_tokens));
    figure('tokens-spent-output', all.spent_output_tokens, int(all.spent_output_tokens));
    figure('tokens-spent-hour', spentTokens(hour), int(spentTokens(hour)));

    const classes = [
      ['provider', hour.provider_errors, hour.upstream_calls],
      ['timeouts', hour.timeouts, hour.requests],
      ['rejections', hour.rejections, hour.requests],
      ['contract', hour.contract_violations, hour.requests],
      ['no-target', hour.no_target, hour.requests],
      ['internal', hour.internal_errors, hour.requests],
    ];
    for (const [name, n, of] of classes) {
      figure('err-' + name, n, int(n));
      const r = share(n, of);
      figure('err-' + name + '-rate', r, r === null ? '–' : pct(r));
      $('err-card-' + name).classList.toggle('alert', n > 0);
    }

    // The charts: the closed samples, then the interval in progress.
    const samples = tl.samples.slice();
    if (tl.current && tl.current.seconds > 0) samples.push(tl.current);
    const at = (s) => s.at_ms;
    const pts = (f) => samples.map((s) => ({ t: at(s), v: f(s) }));
    const end = Date.parse(tl.at) || Date.now();
    const first = samples.length ? samples[0].at_ms - samples[0].seconds * 1000 : end;
    const span = Math.min(3600000, Math.max(120000, end - first));
    const range = { t0: end - span, t1: end };
    lineChart('hour-chart', range, int, [
      { name: 'incoming', cls: 's0', points: pts((s) => s.requests) },
      { name: 'upstream', cls: 's1', points: pts((s) => s.upstream_calls) },
      { name: 'saved', cls: 's3', points: pts((s) => s.saved_calls) },
    ]);
    lineChart('money-chart', range, usdAxis, [
      { name: 'saved', cls: 's3', points: pts((s) => s.saved_cost_usd) },
      { name: 'spent', cls: 's1', points: pts((s) => s.spent_cost_usd) },
    ]);
    lineChart('errors-chart', range, int, [
      { name: 'provider', cls: 's2', points: pts((s) => s.provider_errors) },
      { name: 'timeouts', cls: 's4', points: pts((s) => s.timeouts) },
      { name: 'rejections', cls: 's5', points: pts((s) => s.rejections) },
      { name: 'contract', cls: 's6', points: pts((s) => s.contract_violations) },
    ]);
    const routeNames = Object.keys(tl.since_start.routes).sort();
    const latencySeries = routeNames.map((r, i) => ({ name: r, cls: 's' + (i % 6),
      points: pts((s) => (s.routes[r] ? s.routes[r].p95_ms : null)) }));
    latencySeries.push({ name: "followers' wait", cls: 's7', points: pts((s) => s.wait.p95_ms) });
    lineChart('latency-chart', range, ms, latencySeries);
    $('latency-legend').replaceChildren(...latencySeries.map((x) =>
      el('span', null, el('i', { class: 'swatch ' + x.cls }), x.name)));

    // Latency per route, and the followers' wait.
    const lastOf = (route) => {
      for (let i = samples.length - 1; i >= 0; i--) {
        const p = samples[i].routes[route];
        if (p && p.count) return samples[i].at_ms >= end - 15000 ? p : null;
      }
      return null;
    };
    const latencyRow = (testid, name, p, recent) => el('tr', { 'data-testid': testid, 'data-route': name },
      el('td', null, name),
      el('td', { class: 'num count', 'data-value': p.count }, int(p.count)),
      el('td', { class: 'num p50', 'data-value': p.p50_ms ?? '' }, ms(p.p50_ms)),
      el('td', { class: 'num p95', 'data-value': p.p95_ms ?? '' }, ms(p.p95_ms)),
      el('td', { class: 'num p99', 'data-value': p.p99_ms ?? '' }, ms(p.p99_ms)),
      el('td', { class: 'num recent', 'data-value': recent ? recent.p95_ms : '' }, recent ? ms(recent.p95_ms) : '–'));
    const rows = routeNames.map((r) => latencyRow('latency-' + r, r, tl.since_start.routes[r], lastOf(r)));
    const lastWait = samples.length ? samples[samples.length - 1].wait : null;
    rows.push(latencyRow('latency-followers', "followers' wait", tl.since_start.wait,
      lastWait && lastWait.count ? lastWait : null));
    $('latency').tBodies[0].replaceChildren(...rows);

    // Every route's targets: circuit, the provider's calls and errors, latency.
    const health = tl.targets.map((t, i) => {
      const first = i === 0 || tl.targets[i - 1].route !== t.route;
      const calls = t.provider_calls.last_hour;
      const errShare = t.provider_calls.error_share_last_hour;
      const circuit = t.circuit ? t.circuit.state : 'unknown';
      const lat = t.latency.total;
      return el('tr', { 'data-testid': `health-${t.route}-${t.index}`, class: first ? 'first' : null },
        el('td', null, first ? t.route : ''),
        el('td', null, el('span', { class: 'mono' }, `${t.provider} / ${t.model}`)),
        el('td', { class: 'circuit', 'data-state': circuit }, pill(circuit, circuitKind(circuit))),
        el('td', { class: 'num calls', 'data-value': calls.calls }, int(calls.calls)),
        el('td', { class: 'num errors' + (errShare > 0 ? ' bad' : ''), 'data-value': errShare ?? '',
          'data-errors': calls.errors }, errShare === null ? '–' : `${pct(errShare)} (${int(calls.errors)})`),
        el('td', { class: 'num p50', 'data-value': lat.p50_ms ?? '' }, ms(lat.p50_ms)),
        el('td', { class: 'num p95', 'data-value': lat.p95_ms ?? '' }, ms(lat.p95_ms)),
        el('td', { class: 'price', 'data-value': t.priced }, t.priced ? 'priced' : el('span', { class: 'hint' }, 'no price')));
    });
    $('health').tBodies[0].replaceChildren(...health);
  }

  // A small line chart of `series` ({name, cls, points: [{t, v}]}; a null
  // value is a gap) over `range`, in the SVG `id`.
  function lineChart(id, range, fmt, series) {
    const chart = $(id);
    const box = $(id + '-box');
    const W = Math.max(260, Math.floor(box.clientWidth || 600));
    const H = 170;
    const pad = { l: 62, r: 10, t: 10, b: 24 };
    chart.setAttribute('viewBox', `0 0 ${W} ${H}`);
    chart.setAttribute('width', W);
    chart.setAttribute('height', H);
    const { t0, t1 } = range;
    const values = series.flatMap((s) => s.points.map((p) => p.v)).filter((v) => typeof v === 'number');
    const max = Math.max(0, ...values);
    const top = max > 0 ? niceCeil(max) : 1;
    const x = (t) => pad.l + ((t - t0) / (t1 - t0)) * (W - pad.l - pad.r);
    const y = (v) => H - pad.b - (v / top) * (H - pad.t - pad.b);
    const nodes = [];
    for (let i = 0; i <= 2; i++) {
      const v = (top * i) / 2;
      nodes.push(svg('line', { x1: pad.l, x2: W - pad.r, y1: y(v), y2: y(v), class: 'grid' }));
      nodes.push(svg('text', { x: pad.l - 6, y: y(v) + 4, class: 'axis', 'text-anchor': 'end' }, i === 0 ? '0' : fmt(v)));
    }
    const mins = Math.round((t1 - t0) / 60000);
    nodes.push(svg('text', { x: pad.l, y: H - 6, class: 'axis', 'text-anchor': 'start' }, `-${mins} min`));
    nodes.push(svg('text', { x: W - pad.r, y: H - 6, class: 'axis', 'text-anchor': 'end' }, 'now'));
    if (!values.length) {
      nodes.push(svg('text', { x: pad.l + 8, y: pad.t + 20, class: 'empty-note' }, 'nothing yet'));
    }
    for (const s of series) {
      const shown = s.points.filter((p) => p.t >= t0);
      const known = shown.filter((p) => typeof p.v === 'number');
      // Runs of known values, split at the gaps.
      let run = [];
      const runs = [];
      for (const p of shown) {
        if (typeof p.v === 'number') run.push(p);
        else if (run.length) { runs.push(run); run = []; }
      }
      if (run.length) runs.push(run);
      const g = svg('g', { 'data-series': s.name, 'data-points': known.length,
        'data-max': Math.max(0, ...known.map((p) => p.v)),
        'data-sum': known.reduce((a, p) => a + p.v, 0) });
      for (const r of runs) {
        if (r.length === 1) {
          g.append(svg('circle', { cx: x(r[0].t), cy: y(r[0].v), r: 2.5, class: 'dot ' + s.cls }));
        } else {
          g.append(svg('polyline', { points: r.map((p) => `${x(p.t).toFixed(1)},${y(p.v).toFixed(1)}`).join(' '),
            class: 'series ' + s.cls }));
        }
      }
      nodes.push(g);
    }
    chart.replaceChildren(...nodes);
  }

  // ----------------------------------------------------------------- start

  // Whether the gateway has an admin key at all: without one, the card says
  // how to set one (every key would be refused).
  let noAdminKey = false;
  async function checkSetup() {
    try {
      const resp = await fetch('/ui/sign-in', { cache: 'no-store', credentials: 'omit' });
      if (resp.ok) noAdminKey = (await resp.json()).admin_key_configured === false;
    } catch (e) {
      // Unreachable: signing in says so.
    }
    $('no-admin-key').hidden = !noAdminKey;
  }

  async function signIn(ev) {
    ev.preventDefault();
    const value = $('admin-key').value.trim();
    if (!value) return;
    await checkSetup();
    sessionStorage.setItem(KEY, value);
    $('admin-key').value = '';
    try {
      await api('/v1/admin/routes');
    } catch (e) {
      signedOut(e instanceof AuthError ? e.message : 'Cannot reach the gateway: ' + e.message);
      return;
    }
    $('login-error').hidden = true;
    start();
  }

  function boot() {
    $('login-form').addEventListener('submit', signIn);
    $('sign-out').addEventListener('click', () => signedOut(''));
    $('key-create').addEventListener('submit', createKey);
    $('key-secret-hide').addEventListener('click', hideSecret);
    window.addEventListener('hashchange', () => { if (key()) start(); });
    if (key()) start();
    else signedOut('');
    checkSetup();
  }

  boot();
})();
