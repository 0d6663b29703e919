import { randomUUID } from 'node:crypto';
import type { FastifyBaseLogger } from 'fastify';
import { LATE, within } from '../redis/client.js';
import { type RedisClient, redisProblem } from '../redis/client.js';
import { loopKey } from '../redis/keys.js';
import { defineScript, type Script, wiresArgs } from '../redis/wires.js';
import type { LoopConfig } from './active.js';
import { defineCursorScripts } from './cursors.js';

/**
 * Takes the lead, or keeps it. The lock holds `<holder>:<token>`; taking it draws a new fencing
 * token, the fence counter's next value but never below Redis's clock in ms, so a failover that
 * lost the last increment cannot hand the same token out twice. Returns the token, or 0.
 */
const LEAD = {
  keys: ['lock', 'fence'], // one slot
  argv: ['holder', 'ms'], // this loop's id, the lease
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

/** Keeps the lead during a round, only if it is still this holder's (`<id>:<token>`): 1, or 0. */
const RENEW = {
  keys: ['lock'],
  argv: ['holder', 'ms'],
  lua: `if redis.call('GET', KEY.lock) ~= ARG.holder then return 0 end
return redis.call('PEXPIRE', KEY.lock, ARG.ms)`,
} as const satisfies Script<string, string>;

/** Gives the lead up, if it is still this holder's. */
const RELEASE = {
  keys: ['lock'],
  argv: ['holder'],
  lua: `if redis.call('GET', KEY.lock) == ARG.holder then return redis.call('DEL', KEY.lock) end
return 0`,
} as const satisfies Script<string, string>;

/**
 * The lock's life. Longer than a POST may take (POST_TIMEOUT_MS), and renewed every third of
 * it while a round runs, so a round as slow as its sink allows keeps one leader.
 */
export const LEASE_MS = 15_000;
const RENEW_MS = LEASE_MS / 3;
/**
 * How long a POST to the sink or a receiver may take: a slow one (a customer's sink answered
 * in 6 s) is waited for, and it stays below the lease, so it never outlives a lock that was
 * not renewed.
 */
export const POST_TIMEOUT_MS = 10_000;

/** The lead for one round: its fencing token, and a signal aborted as soon as the lead is, or may be, lost. */
export interface Lead {
  token: number;
  signal: AbortSignal;
}

/** The lead was lost (or could not be renewed) during a round: the round sends nothing more and moves nothing. */
export class LeadLost extends Error {}

/**
 * The far end (the sink, a receiver) failed, timed out or refused: what the loop's failure
 * metric counts. `retryAfterMs`: the far end asked for at least that long before the next try.
 */
export class DeliveryFailed extends Error {
  readonly retryAfterMs?: number;

  constructor(message: string, options?: ErrorOptions & { retryAfterMs?: number }) {
    super(message, options);
    this.retryAfterMs = options?.retryAfterMs;
  }
}

type LeaderRedis = RedisClient & {
  lead(...keysThenArgs: Array<string | number>): Promise<number>;
  renewLead(...keysThenArgs: Array<string | number>): Promise<number>;
  releaseLead(...keysThenArgs: Array<string | number>): Promise<number>;
};

/**
 * A background loop that one instance of a deployment runs at a time, holding a lock in Redis
 * (`<prefix>:<environment>:{<name>}:lock`, lapsing LEASE_MS after its holder stops renewing
 * it): the usage exporter and the alert dispatcher. The lock is renewed before each round and
 * every third of its life during one; a round whose renewal fails or finds the lock taken is
 * aborted (its POST too), and every cursor move it makes carries its fencing token
 * (cursors.ts). A round reads only the accounts marked active (active.ts) and sweeps a few
 * more at a fixed pace (sweep.ts). It returns how much it sent: the next comes at once after a
 * full one (or one that left marked accounts of its pass unread), a quarter second after
 * some, a second after none; a failed round is tried again with
 * exponential backoff and full jitter. No round runs while Redis is not connected: the store
 * reports Redis, and the sink is not blamed for it.
 */
export abstract class LeaderLoop<Target, Config extends LoopConfig> {
  protected readonly redis: LeaderRedis;
  protected stopped = false;
  private readonly me = randomUUID();
  private timer?: NodeJS.Timeout;
  private failures = 0;
  private deliveryFailing = false;
  private leading = false;
  /** The tick in flight, if any: what stop waits for. */
  private running?: Promise<void>;
  /** The lead of the round in flight: aborted by stop. */
  private inRound?: AbortController;
  /** The lock this instance holds, and as whom (`<id>:<token>`): given up by stop. */
  private holding?: { lock: string; holder: string };

  constructor(
    redis: RedisClient,
    protected readonly config: () => Config,
    protected readonly log: FastifyBaseLogger,
    private readonly name: string,
    /** Told after each round that succeeded (what the rounds metric counts). */
    private readonly counted: () => void = () => {},
  ) {
    defineScript(redis, 'lead', LEAD);
    defineScript(redis, 'renewLead', RENEW);
    defineScript(redis, 'releaseLead', RELEASE);
    defineCursorScripts(redis);
    this.redis = redis as LeaderRedis;
  }

  /** What the config asks this loop to serve; undefined: nothing to do. */
  protected abstract target(config: Config): Target | undefined;
  /** One round under `lead`; returns what it sent, and whether that filled a batch. */
  protected abstract round(config: Config, target: Target, lead: Lead): Promise<{ sent: number; full: boolean }>;
  /** A failed delivery (DeliveryFailed), told once per failure. */
  protected abstract failed(target: Target, err: Error, retryInMs: number): void;
  /** A round that succeeded after failed deliveries. */
  protected recovered?(target: Target): void;

  start(): void {
    this.schedule(0);
  }

  /**
   * Stops: no round starts, a round in flight is aborted (its POST too) and moves no cursor, as if
   * the process had died, so the next leader sends its batch again with the same ids. Once it has
   * ended, the lead is given up (if it is still this instance's), so another instance leads at its
   * next tick (within a second) rather than once the lock lapses (LEASE_MS): a rolling restart
   * does not pause the loop. Never two rounds at once: the lock goes only after the round ended.
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
    // ioredis refuses every command until its connection is ready (no offline queue): at boot,
    // or while Redis is away, there is nothing a round could do.
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
      // Stopping: stop gives the lead up once this round has ended.
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
      // What the far end asked for, within the backoff's own ceiling.
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

  /**
   * Runs `round` holding the lead: renewed every RENEW_MS, and aborted when a renewal finds the
   * lock another's, fails, or has not succeeded by RENEW_MS before the lease would lapse
   * (counted from when the last successful one was sent: a hung call cannot outlast it).
   */
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
/** How long a stop waits for the round in flight to end, and then for the lock's release. */
const STOP_WAIT_MS = 1000;

/** Exponential backoff with full jitter: up to 0.5 s, 1 s, 2 s ... 30 s. */
export function backoffMs(failures: number): number {
  return Math.random() * Math.min(MAX_BACKOFF_MS, 500 * 2 ** Math.max(0, failures - 1));
}
