import { copyFileSync, readFileSync } from 'node:fs';
import { request } from 'node:http';
import { join, resolve } from 'node:path';
import { describe, expect, it } from 'vitest';
import { timeoutFor } from '../helpers/budget.js';
import { tempDir } from '../helpers/config.js';
import { runToEnd, startBackend, startProcess } from '../helpers/processes.js';
import { eventually, inOneMinute } from '../helpers/time.js';

// The README's Try-it, run as written against the real processes at the shipped settings and
// the shipped config (a copy: the test does not edit config/gateway.yaml), and its shown
// answers compared with the real ones: header names and order, JSON field names, order and
// shapes. Values that vary (ids, times, counts) are matched by their form, not their digits.

const ROOT = resolve(import.meta.dirname, '../..');
const README = readFileSync(join(ROOT, 'README.md'), 'utf8');
const TOKEN = 'change-me-0123456789'; // the README's

/** The first fenced block that opens after the first line containing `marker`. */
function blockAfter(marker: string): string {
  const lines = README.split('\n');
  const at = lines.findIndex((l) => l.includes(marker));
  expect(at, `README.md has ${marker}`).toBeGreaterThan(-1);
  const fences = lines.flatMap((l, i) => (l.startsWith('```') ? [i] : []));
  for (let f = 0; f + 1 < fences.length; f += 2) {
    if (fences[f]! > at) return lines.slice(fences[f]! + 1, fences[f + 1]).join('\n');
  }
  throw new Error(`no block after ${marker}`);
}

/** A shown value's form: digits stand for any digits, an ISO time for any, a UUID for any. */
function form(shown: string): RegExp {
  const escaped = shown.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
  return new RegExp(
    `^${escaped
      .replace(/[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}/g, 'UUID')
      .replace(/[0-9]+/g, '[0-9]+')
      .replace(/UUID/g, '[0-9a-f-]+')}$`,
  );
}

/** Where a shown JSON value and the real one differ in shape: field names and order, types, fixed words. */
function shapeDiff(shown: unknown, real: unknown, path = '$'): string[] {
  if (shown !== null && typeof shown === 'object') {
    if (real === null || typeof real !== 'object') return [`${path}: shown an object, real ${JSON.stringify(real)}`];
    const [a, b] = [Object.keys(shown), Object.keys(real)];
    if (a.join() !== b.join()) return [`${path}: shown fields ${a.join(', ')}; real ${b.join(', ')}`];
    return a.flatMap((k) => shapeDiff((shown as Record<string, unknown>)[k], (real as Record<string, unknown>)[k], `${path}.${k}`));
  }
  if (typeof shown === 'string')
    return typeof real === 'string' && form(shown).test(real) ? [] : [`${path}: shown "${shown}", real ${JSON.stringify(real)}`];
  if (typeof shown === 'number') return typeof real === 'number' ? [] : [`${path}: shown a number, real ${JSON.stringify(real)}`];
  return shown === real ? [] : [`${path}: shown ${JSON.stringify(shown)}, real ${JSON.stringify(real)}`];
}

/** A shown answer (status line, some headers, body) against a real one: the shown headers in order, each value by its form. */
function compareAnswer(shownText: string, res: Answer): string[] {
  const [head = '', body = ''] = shownText.split('\n\n');
  const [statusLine = '', ...fields] = head.split('\n');
  const problems: string[] = [];
  if (statusLine !== `HTTP/1.1 ${res.status} ${res.statusText}`) problems.push(`status: shown ${statusLine}, real ${res.status}`);
  const realNames = res.names;
  let last = -1;
  for (const field of fields) {
    const name = field.slice(0, field.indexOf(':'));
    const value = field.slice(name.length + 1).trim();
    const at = realNames.indexOf(name);
    if (at < 0) problems.push(`header ${name}: shown, not in the real answer`);
    else if (at < last) problems.push(`header ${name}: shown after ${realNames[last]}, comes before it`);
    else if (!form(value).test(res.headers[name]!)) problems.push(`header ${name}: shown "${value}", real "${res.headers[name]}"`);
    last = Math.max(last, at);
  }
  if (body.trim().startsWith('{') || body.trim().startsWith('['))
    problems.push(...shapeDiff(JSON.parse(body), JSON.parse(res.text), 'body'));
  return problems;
}

interface Answer {
  status: number;
  statusText: string;
  /** Header names in the order they came (fetch sorts them). */
  names: string[];
  headers: Record<string, string>;
  text: string;
}

/** One request as curl makes it, with the answer's header names in wire order. */
function call(url: string, token: string, method = 'GET'): Promise<Answer> {
  return new Promise((done, fail) => {
    const req = request(url, { method, headers: { authorization: `Bearer ${token}` } }, (res) => {
      let text = '';
      res.setEncoding('utf8').on('data', (c: string) => (text += c));
      res.on('end', () => {
        const names = res.rawHeaders.filter((_, i) => i % 2 === 0).map((n) => n.toLowerCase());
        const headers = Object.fromEntries(Object.entries(res.headers).map(([k, v]) => [k, String(v)]));
        done({ status: res.statusCode ?? 0, statusText: res.statusMessage ?? '', names, headers, text });
      });
    });
    req.once('error', fail);
    req.end();
  });
}

describe('README.md examples', () => {
  it('the Try-it answers as the README shows', { timeout: timeoutFor(20_000, 20_000) }, async () => {
    const { dir, cleanup } = tempDir();
    const config = join(dir, 'gateway.yaml');
    copyFileSync(join(ROOT, 'config/gateway.yaml'), config);
    const backend = await startBackend();
    const gateway = await startProcess(
      'dist/gateway/server.js',
      { GATEWAY_PORT: '0', ADMIN_PORT: '0', BACKEND_URL: backend.url, GATEWAY_CONFIG: config, ADMIN_TOKEN: TOKEN },
      (l) => l.msg === 'gateway ready',
    );
    try {
      const ready = gateway.logs.find((l) => l.msg === 'gateway ready')!;
      const [url, admin] = [String(ready.address), String(ready.admin)];
      let id = '';
      let key = '';
      const newKey = async () => {
        id = `demo-${Date.now()}`;
        const made = await runToEnd(process.execPath, [
          'dist/gateway/auth/cli.js',
          'create',
          '--plan',
          'free',
          '--id',
          id,
          '--config',
          config,
        ]);
        expect(made.code, made.stderr).toBe(0);
        key = made.stdout.trim();
        // The running gateway picks the new key up by itself (file watch).
        await eventually(async () => (await fetch(`${url}/v1/me/usage`, { headers: { authorization: `Bearer ${key}` } })).status === 200);
      };
      const get = (path: string) => call(`${url}${path}`, key);
      await newKey();

      await inOneMinute(async () => {
        expect(
          compareAnswer(blockAfter('curl -i -H "Authorization: Bearer $KEY" http://127.0.0.1:3000/v1/pets'), await get('/v1/pets')),
        ).toEqual([]);
        let refused: Answer | undefined;
        for (let i = 0; i < 61 && !refused; i++) {
          const res = await get('/v1/pets');
          if (res.status === 429) refused = res;
        }
        expect(refused, 'a 429 within the free plan’s 60 a minute').toBeDefined();
        expect(compareAnswer(blockAfter('past the limit answers'), refused!)).toEqual([]);
      }, newKey);

      const usage = await call(`${admin}/admin/keys/${id}/usage`, TOKEN);
      const shownUsage = JSON.parse(blockAfter('/admin/keys/$ID/usage'));
      expect(shapeDiff(shownUsage, JSON.parse(usage.text))).toEqual([]);

      // "Keep sending after that (more than 10 refusals within 60 s) and the key is banned" (a new
      // minute in between admits 60 more first).
      let banned = false;
      for (let i = 0; i < 80 && !banned; i++) banned = JSON.parse((await get('/v1/pets')).text).code === 'key_banned';
      expect(banned, 'banned after more than 10 refusals').toBe(true);
      const unban = await call(`${admin}/admin/accounts/${id}/unban`, TOKEN, 'POST');
      const shownUnban = /\/unban\n# (\{.*\})\n/.exec(README)?.[1];
      expect(shownUnban).toBeDefined();
      expect(shapeDiff(JSON.parse(shownUnban!), JSON.parse(unban.text))).toEqual([]);
    } finally {
      await Promise.all([gateway.stop(), backend.stop()]);
      cleanup();
    }
  });
});
