import { Writable } from 'node:stream';
import { pino } from 'pino';
import { describe, expect, it } from 'vitest';
import { LazyRequestLogger } from '../../gateway/observability/request-logger.js';

/** A pino logger writing into an array, with a fixed time so that lines compare. */
function capture(level = 'info') {
  const lines: string[] = [];
  const stream = new Writable({ write: (chunk, _enc, done) => (lines.push(String(chunk)), done()) });
  const logger = pino({ level, base: { pid: 1 }, timestamp: () => ',"time":0' }, stream);
  return { logger, lines };
}

describe('the lazy request logger', () => {
  it("writes the same lines as pino's child with the request id bound", () => {
    const a = capture();
    const b = capture();
    const lazy = new LazyRequestLogger(a.logger, { reqId: 'r-1' });
    const child = b.logger.child({ reqId: 'r-1' });
    for (const log of [lazy, child]) {
      log.info({ status: 200 }, 'request');
      log.warn('slow');
      log.error({ err: new Error('boom') }, 'request failed');
      log.debug('not at info');
      log.child({ step: 'proxy' }).info('nested');
    }
    expect(a.lines.length).toBe(4);
    expect(a.lines.map((l) => l.replace(/"stack":"[^"]*"/, ''))).toEqual(b.lines.map((l) => l.replace(/"stack":"[^"]*"/, '')));
    expect(JSON.parse(a.lines[0]!)).toMatchObject({ reqId: 'r-1', status: 200, msg: 'request' });
  });

  it("keeps a route's own level, as pino's child with that level does", () => {
    const a = capture();
    const b = capture();
    const lazy = new LazyRequestLogger(a.logger, { reqId: 'r-3' }, 'error');
    const child = b.logger.child({ reqId: 'r-3' }, { level: 'error' });
    for (const log of [lazy, child]) {
      log.warn('dropped at error');
      log.error('kept');
      expect(log.isLevelEnabled('warn')).toBe(false);
      expect(log.level).toBe('error');
    }
    expect(a.lines).toEqual(b.lines);
    expect(a.lines).toHaveLength(1);
  });

  it('makes no child for a request that logs nothing, nor for a line below the level', () => {
    const { logger } = capture('warn');
    let children = 0;
    const child = logger.child.bind(logger);
    logger.child = ((...args: Parameters<typeof child>) => (children++, child(...args))) as typeof logger.child;
    const lazy = new LazyRequestLogger(logger, { reqId: 'r-2' });
    lazy.info('below warn');
    lazy.debug('below warn');
    expect(lazy.level).toBe('warn');
    expect(children).toBe(0);
    lazy.warn('now');
    lazy.error('again');
    expect(children).toBe(1);
  });
});
