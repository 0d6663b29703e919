import { randomUUID } from 'node:crypto';
import type { FastifyBaseLogger } from 'fastify';
import { LATE, within } from '../redis/client.js';
import { type RedisClient, redisProblem } from '../redis/client.js';
import { loopKey } from '../redis/keys.js';
import { defineScript, type Script, wiresArgs } from '../redis/wires.js';
import type { LoopConfig } from './active.js';
import { defineCursorScripts } from './cursors.js';

/** A new token is never below Redis's clock in ms: a failover that lost the last increment cannot hand one out twice. */
const LEAD = {
  keys: ['lock', 'fence'], // one slot
  argv: ['holder', 'ms'],
  lua: `local held = redis.call('GET', KEY.lock)
local mine = ARG.holder .. ':'
if held and string.sub(held, 1, #mine) == mine then
  redis.call('PEXPIRE', KEY.lock, ARG.ms)
  return tonumber(string.sub(held, #mine + 1))
end
if held then return 0 end
local t = redis.call('TIME')
local token = math.max(tonumber(redis.call('GET', KEY.fence) or '0') + 1, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
redis.call('SET', KEY.fence, string.format('%d', token))
redis.call('SET', KEY.lock, mine .. string.format('%d', token), 'PX', ARG.ms)
return token`,
} as const satisfies Script<string, string>;

const RENEW = {
  keys: ['lock'],
  argv: ['holder', 'ms'],
  lua: `if redis.call('GET', KEY.lock) ~= ARG.holder then return 0 end
return redis.call('PEXPIRE', KEY.lock, ARG.ms)`,
} as const satisfies Script<string, string>;

const RELEASE = {
  keys: ['lock'],
  argv: ['holder'],
  lua: `if redis.call('GET', KEY.lock) == ARG.holder then return redis.call('DEL', KEY.lock) end
return 0`,
} as const satisfies Script<string, string>;

/** Longer than a POST may take (POST_TIMEOUT_MS) and renewed every third: a round as slow as its sink keeps one leader. */
export const LEASE_MS = 15_000;
const RENEW_MS = LEASE_MS / 3;
/** A customer's sink answered in 6 s; below the lease, so a POST never outlives a lock that was not renewed. */
export const POST_TIMEOUT_MS = 10_000;

/**
 * A POST's signal: aborted when `lost` is, or once `ms` have passed. Not `AbortSignal.any([lost,
 * AbortSignal.timeout(ms)])`: on Node 20 nothing holds that timeout signal, a collection can take
 * it before it fires (nodejs/node#57736), and the POST then waits for ever (a leader stalled in
 * export-faults with its lock renewed). `done()` once the POST is over, answer read.
 */
export function postDeadline(lost: AbortSignal, ms = POST_TIMEOUT_MS): { signal: AbortSignal; done: () => void } {
  const c = new AbortController();
  const abort = () => c.abort(lost.reason);
  if (lost.aborted) abort();
  else lost.addEventListener('abort', abort, { once: true });
  const timer = setTimeout(() => c.abort(new DOMException(`no answer within ${ms} ms`, 'TimeoutError')), ms);
  timer.unref();
  return {
    signal: c.signal,
    done: () => {
      clearTimeout(timer);
      lost.removeEventListener('abort', abort);
    },
  };
}

/** `signal` is aborted as soon as the lead is, or may be, lost. */
export interface Lead {
  token: number;
  signal: AbortSignal;
}

/** The round sends nothing more and moves nothing. */
export class LeadLost extends Error {}

/** The far end failed, timed out or refused: what the failure metric counts, unlike a Redis failure. */
export class DeliveryFailed extends Error {
  readonly retryAfterMs?: number;
  /** About the sink's setup (a credential refused), not the events: an operator's to fix. */
  readonly setup: boolean;

  constructor(message: string, options?: ErrorOptions & { retryAfterMs?: number; setup?: boolean }) {
    super(message, options);
    this.retryAfterMs = options?.retryAfterMs;
    this.setup = options?.setup ?? false;
  }
}

type LeaderRedis = RedisClient & {
  lead(...keysThenArgs: Array<string | number>): Promise<number>;
  renewLead(...keysThenArgs: Array<string | number>): Promise<number>;
  releaseLead(...keysThenArgs: Array<string | number>): Promise<number>;
};

/**
 * One instance of a deployment at a time, under a Redis lock: a round whose renewal fails or finds the lock taken is
 * aborted, POST included, and its cursor moves carry its fencing token (cursors.ts). No round while Redis is down:
 * the store reports that, and the sink is not blamed.
 */
export abstract class LeaderLoop<Target, Config extends LoopConfig> {
  protected readonly redis: LeaderRedis;
  protected stopped = false;
  private readonly me = randomUUID();
  private timer?: NodeJS.Timeout;
  private failures = 0;
  private deliveryFailing = false;
  private leading = false;
  private running?: Promise<void>;
  private inRound?: AbortController;
  /** Given up by stop. */
  private holding?: { lock: string; holder: string };

  constructor(
    redis: RedisClient,
    protected readonly config: () => Config,
    protected readonly log: FastifyBaseLogger,
    private readonly name: string,
    private readonly counted: () => void = () => {},
  ) {
    defineScript(redis, 'lead', LEAD);
    defineScript(redis, 'renewLead', RENEW);
    defineScript(redis, 'releaseLead', RELEASE);
    defineCursorScripts(redis);
    this.redis = redis as LeaderRedis;
  }

  protected abstract target(config: Config): Target | undefined;
  /** `full`: the next round comes at once. */
  protected abstract round(config: Config, target: Target, lead: Lead): Promise<{ sent: number; full: boolean }>;
  protected abstract failed(target: Target, err: Error, retryInMs: number): void;
  /** A round that succeeded after failed deliveries. */
  protected recovered?(target: Target): void;

  start(): void {
    this.schedule(0);
  }

  /**
   * A round in flight is aborted as if the process died (the next leader resends with the same ids); the lock is
   * released only after it ended, so a rolling restart does not pause the loop for LEASE_MS.
   */
  async stop(): Promise<void> {
    this.stopped = true;
    if (this.timer) clearTimeout(this.timer);
    this.inRound?.abort(new LeadLost('this instance stops'));
    // A round held up by a Redis that does not answer is not waited for: the lock then lapses as a dead holder's would.
    if (this.running && (await within(this.running, STOP_WAIT_MS)) === LATE) return;
    const held = this.holding;
    this.holding = undefined;
    if (held && this.redis.status === 'ready') {
      const release = this.redis.releaseLead(...wiresArgs(RELEASE, { lock: held.lock }, { holder: held.holder })).catch(() => 0);
      const given = await within(release, STOP_WAIT_MS);
      if (given !== LATE && Number(given) === 1) this.log.info(`${this.name}: this instance stops; it gave up the lead`);
    }
  }

  private schedule(ms: number): void {
    if (this.stopped) return;
    this.timer = setTimeout(() => {
      this.running = this.tick().finally(() => (this.running = undefined));
    }, ms);
    this.timer.unref();
  }

  private async tick(): Promise<void> {
    const config = this.config();
    const target = this.target(config);
    // ioredis has no offline queue: until ready, every command is refused.
    if (!target || this.redis.status !== 'ready') return this.schedule(1000);
    const lock = loopKey(config.redisPrefix, this.name, 'lock');
    let holder: string | undefined;
    try {
      const since = performance.now();
      const token = await this.lead(lock);
      if (!token) {
        this.holding = undefined;
        return this.schedule(1000);
      }
      holder = `${this.me}:${token}`;
      this.holding = { lock, holder };
      if (this.stopped) return; // stop gives the lead up
      const { sent, full } = await this.held(lock, holder, token, since, (lead) => this.round(config, target, lead));
      this.counted();
      if (this.deliveryFailing) this.recovered?.(target);
      this.failures = 0;
      this.deliveryFailing = false;
      this.schedule(full ? 0 : sent > 0 ? 250 : 1000);
    } catch (err) {
      this.schedule(await this.failedRound(target, err as Error, lock, holder));
    }
  }

  /** What a failed round says, to whom, and when the next comes. */
  private async failedRound(target: Target, err: Error, lock: string, holder?: string): Promise<number> {
    if (err instanceof LeadLost) {
      if (this.stopped) return 0;
      this.log.warn({ cause: err.message }, `${this.name}: this instance lost the lead`);
      this.leading = false;
      this.holding = undefined;
      // A lead whose token was refused is given up, so the next one draws a newer token.
      if (holder) await this.redis.releaseLead(...wiresArgs(RELEASE, { lock }, { holder })).catch(() => {});
      return 1000;
    }
    let wait = backoffMs(++this.failures);
    if (err instanceof DeliveryFailed) {
      wait = Math.max(wait, Math.min(err.retryAfterMs ?? 0, MAX_BACKOFF_MS));
      this.deliveryFailing = true;
      this.failed(target, err, wait);
    } else {
      this.log.warn({ cause: redisProblem(this.redis, err), retryInMs: Math.round(wait) }, `${this.name}: a round failed on Redis`);
    }
    return wait;
  }

  private async lead(lock: string): Promise<number> {
    const fence = lock.replace(/:lock$/, ':fence');
    const token = Number(await this.redis.lead(...wiresArgs(LEAD, { lock, fence }, { holder: this.me, ms: LEASE_MS })));
    if (token && !this.leading) this.log.info({ pid: process.pid, token }, `${this.name}: this instance leads`);
    this.leading = token > 0;
    return token;
  }

  /** The deadline counts from when the last successful renewal was sent: a hung call cannot outlast the lease. */
  private async held<T>(lock: string, holder: string, token: number, since: number, round: (lead: Lead) => Promise<T>): Promise<T> {
    const controller = new AbortController();
    this.inRound = controller;
    const lose = (why: string) => {
      if (!controller.signal.aborted) controller.abort(new LeadLost(why));
    };
    let deadline: NodeJS.Timeout;
    const expireFrom = (sent: number) => {
      clearTimeout(deadline);
      deadline = setTimeout(() => lose('no renewal of the lock succeeded in time'), sent + LEASE_MS - RENEW_MS - performance.now());
      deadline.unref();
    };
    expireFrom(since);
    const renew = async () => {
      const sent = performance.now();
      try {
        if (Number(await this.redis.renewLead(...wiresArgs(RENEW, { lock }, { holder, ms: LEASE_MS }))) === 1) expireFrom(sent);
        else lose('another instance holds the lock');
      } catch (err) {
        lose(`the lock could not be renewed: ${redisProblem(this.redis, err)}`);
      }
    };
    const renewal = setInterval(() => void renew(), RENEW_MS);
    renewal.unref();
    try {
      return await round({ token, signal: controller.signal });
    } finally {
      this.inRound = undefined;
      clearInterval(renewal);
      clearTimeout(deadline!);
    }
  }
}

const MAX_BACKOFF_MS = 30_000;
/** For the round in flight to end, then again for the lock's release. */
const STOP_WAIT_MS = 1000;

/** Full jitter: up to 0.5 s, 1 s, 2 s ... 30 s. */
export function backoffMs(failures: number): number {
  return Math.random() * Math.min(MAX_BACKOFF_MS, 500 * 2 ** Math.max(0, failures - 1));
}
