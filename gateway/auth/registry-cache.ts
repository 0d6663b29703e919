import { randomUUID } from 'node:crypto';
import type { FastifyBaseLogger } from 'fastify';
import { Redis } from 'ioredis';
import { LRUCache } from 'lru-cache';
import type { Consumer, GatewayConfig, KeyEntry } from '../config/config.js';
import { GatewayError } from '../errors.js';
import { closeRedis, LATE, type RedisClient, secondConnection, within } from '../redis/client.js';
import { registryKeys } from '../redis/keys.js';
import { BLOOM_BITS, bloomBits, entryOf, setBits } from './registry.js';

// The key registry as each gateway instance reads it. A key is read from Redis once, then kept
// (bounded, least recently used out) until its change is announced on a channel; a key the
// Bloom filter has never seen is unknown at once, with no call to Redis. The channel is
// checked every second by an echo of this instance's own: a channel that went silent (a
// connection dead without a close) is replaced, and until it answers again nothing cached is
// trusted past SILENT_TRUST_MS. While Redis fails, a key read before keeps its last answer
// (fail open, as the file does); a key never read is refused with 503 at once.

interface Cached {
  /** The record as Redis held it (undefined: no such key), read at `at` (Date.now()). */
  entry: KeyEntry | undefined;
  at: number;
  /** Its consumer under `config`, built again only when the config changes. */
  config: GatewayConfig;
  consumer: Consumer | undefined;
}

/** How many keys an instance keeps built (the keys in use); the rest are asked of Redis when they come back. */
const CACHE_KEYS = 100_000;
/** A backstop while the channel answers: a cached key is read again after this. */
const CACHE_TTL_MS = 60_000;
/** How often the channel is checked, and how long its echo may take before it is declared silent. */
const CHECK_MS = 1000;
/**
 * While the channel is silent: the most a cached key or the filter is trusted. A change is then
 * enforced within detection (2 × CHECK_MS) plus this: the 5 s bound docs/keys.md states.
 */
const SILENT_TRUST_MS = 2000;
/** While silent: how long a new connection may take to subscribe before another is tried. */
const RETRY_MS = 3000;

/** A key the registry could not be asked about: the quota store's refusal while Redis fails. */
const UNAVAILABLE = () =>
  new GatewayError('quota_store_unavailable', 'The key registry is not answering; retry after 1 s', { 'retry-after': '1' });

export interface RegistryOptions {
  config: () => GatewayConfig;
  log: FastifyBaseLogger;
  /** Whether Redis is declared failing (the quota store's health): then no request waits on it. */
  failing: () => boolean;
  /** REDIS_TIMEOUT_MS: the longest a request waits for a key's record. */
  timeoutMs: number;
}

export type Lookup = Consumer | undefined | GatewayError;

export class KeyRegistry {
  private readonly names: ReturnType<typeof registryKeys>;
  private readonly cache = new LRUCache<string, Cached>({ max: CACHE_KEYS });
  private readonly pending = new Map<string, Promise<Lookup>>();
  /** Unset until read: every key is then asked of Redis, none refused unseen. */
  private bloom?: Buffer;
  private bloomAt = 0;
  /** Whether the last filter read held any key: one read back empty after it means Redis lost them. */
  private held = false;
  private subscriber!: RedisClient;
  private readonly firstLoad: Promise<void>;
  private loaded = () => {};
  /** The digests announced while the filter is being read. */
  private heard?: string[];
  /** This instance's own channel, whose echo proves the subscriber hears. */
  private readonly echo: string;
  /** Echoes sent, the last Redis took, and the last heard back. */
  private sent = 0;
  private taken = 0;
  private echoed = 0;
  /** Since when the channel has been silent (Date.now()); 0 while it answers. */
  private silentSince = 0;
  /** When the channel was last connected again while silent. */
  private triedAt = 0;
  /** When the filter was read back empty after holding keys; 0 otherwise. */
  private emptiedAt = 0;
  private readonly timer: NodeJS.Timeout;
  private saidUnread = false;
  private loading = false;
  private loadFailed = false;
  /** Digests whose change was announced while a read of theirs was in flight: that read may predate it. */
  private readonly changedInFlight = new Set<string>();
  /** Changes announced to this instance so far (what a test waits on). */
  announced = 0;
  /** Times the channel was found silent and replaced (a metric). */
  silences = 0;

  constructor(
    private readonly redis: RedisClient,
    private readonly o: RegistryOptions,
  ) {
    this.names = registryKeys(o.config().redisPrefix);
    this.echo = `${this.names.changed}:echo:${randomUUID()}`;
    this.firstLoad = new Promise((resolve) => (this.loaded = resolve));
    this.listen();
    this.timer = setInterval(() => void this.check(), CHECK_MS);
    this.timer.unref();
  }

  /** Resolves once the channel is subscribed and the filter read: keys issued before are known from then on. */
  ready(): Promise<void> {
    return this.firstLoad;
  }

  /** What an operator must know (for /readyz): a silent channel, a filter never read, keys lost. */
  problems(): string[] {
    const out: string[] = [];
    if (!this.bloom) out.push('key registry: not read yet (Redis has not answered since start): its keys answer 503 until it does');
    if (this.silentSince)
      out.push(
        `key registry: its change channel has been silent since ${new Date(this.silentSince).toISOString()}; keys are read again every ${SILENT_TRUST_MS / 1000} s meanwhile`,
      );
    return out;
  }

  /** What an operator should know but that does not stop traffic: keys Redis lost. */
  warnings(): string[] {
    if (!this.emptiedAt) return [];
    return [
      `key registry: its filter came back empty at ${new Date(this.emptiedAt).toISOString()} after holding keys: Redis lost the registry (a restart without persistence?); restore it or import the keys again`,
    ];
  }

  get silent(): boolean {
    return this.silentSince !== 0;
  }

  /** A subscriber of its own (a new one when the last went silent): on each (re)connection, subscribe and read the filter. */
  private listen(): void {
    const subscriber = secondConnection(this.redis);
    this.subscriber = subscriber;
    subscriber.on('message', (channel: string, message: string) => {
      if (channel === this.echo) this.echoed = Number(message);
      else this.changed(message);
    });
    subscriber.on('ready', () => this.startLoad(subscriber));
  }

  /** A load that fails (the main connection not back yet) is tried again by the next check. */
  private startLoad(subscriber: RedisClient): void {
    if (subscriber !== this.subscriber || this.loading) return;
    this.loading = true;
    this.load(subscriber)
      .then(
        () => {
          this.loadFailed = false;
          this.loaded();
        },
        (err: Error) => {
          this.loadFailed = true;
          this.o.log.warn({ cause: err.message }, 'key registry: could not read its filter; trying again');
        },
      )
      .finally(() => {
        this.loading = false;
      });
  }

  private async load(subscriber: RedisClient): Promise<void> {
    this.heard = [];
    await subscriber.subscribe(this.names.changed, this.echo);
    this.echoed = this.sent; // those sent before it subscribed never come back
    await this.readFilter();
    // A change announced while the channel was down would be missed otherwise.
    this.cache.clear();
    if (subscriber !== this.subscriber) return; // replaced meanwhile: the new one ends the silence
    if (this.silentSince) this.o.log.info('key registry: its change channel answers again');
    this.silentSince = 0;
  }

  private async readFilter(): Promise<void> {
    const bits = await this.redis.getBuffer(this.names.bloom);
    const bloom = Buffer.alloc(BLOOM_BITS / 8);
    bits?.copy(bloom);
    // Changes announced while the filter was read may be missing from it: added again.
    for (const digest of this.heard ?? []) setBits(bloom, digest);
    this.heard = undefined;
    if (this.held && !bits) {
      this.emptiedAt = Date.now();
      this.o.log.error(
        'key registry: its filter came back empty after holding keys: Redis lost every registry key (a restart without persistence?); they answer 401 until restored',
      );
    } else if (bits) this.emptiedAt = 0;
    this.held = bits !== null;
    this.bloom = bloom;
    this.bloomAt = Date.now();
  }

  /**
   * Each CHECK_MS: the echo Redis took last time heard back, or the channel declared silent and
   * replaced; while silent, the filter read again. Never declared for Redis's own failure (then
   * no echo is taken, and the quota store's health says so).
   */
  private async check(): Promise<void> {
    const now = Date.now();
    if (this.loadFailed && this.subscriber.status === 'ready') this.startLoad(this.subscriber);
    if (this.bloom && this.taken > this.echoed && !this.silentSince && !this.o.failing()) this.declareSilent(now);
    else if (this.silentSince && now - this.triedAt >= RETRY_MS && !this.o.failing()) this.reconnect(now);
    if (this.silentSince && now - this.bloomAt >= SILENT_TRUST_MS && !this.o.failing()) {
      await within(this.readFilter(), CHECK_MS).catch(() => {});
    }
    // Through the main connection: the echo comes back only if the subscriber's connection delivers.
    const n = ++this.sent;
    this.redis.publish(this.echo, String(n)).then(
      () => {
        this.taken = Math.max(this.taken, n);
      },
      () => {},
    );
  }

  /** Declared once; the channel is then connected again every RETRY_MS until one answers (load() ends the silence). */
  private declareSilent(now: number): void {
    this.silentSince = now;
    this.silences++;
    this.o.log.warn('key registry: its change channel is silent (no echo within 1 s): connecting it again');
    this.reconnect(now);
  }

  private reconnect(now: number): void {
    this.triedAt = now;
    const old = this.subscriber;
    this.listen();
    // A dead connection may never close by itself: its socket is dropped, not ended.
    void closeRedis(old, 'now');
    if (old instanceof Redis) old.stream?.destroy();
  }

  private changed(digest: string): void {
    this.announced++;
    this.changedHere(digest);
  }

  /**
   * A key this instance changed itself (its admin port or portal issued, revoked or rotated it):
   * known here before the answer, as its announcement makes it known everywhere else. A client
   * that uses a key the moment it is issued, through the same instance, is never refused.
   */
  changedHere(digest: string): void {
    this.cache.delete(digest);
    if (this.pending.has(digest)) this.changedInFlight.add(digest);
    this.heard?.push(digest);
    this.held = true;
    if (this.bloom) setBits(this.bloom, digest);
  }

  private mayHold(digest: string): boolean {
    const bloom = this.bloom;
    return !bloom || bloomBits(digest).every((bit) => (bloom[bit >> 3]! & (0x80 >> (bit & 7))) !== 0);
  }

  /**
   * The consumer of a digest: at once when cached or unknown to the filter; else Redis's
   * answer, once per digest in flight. While Redis fails: the last answer read, else 503.
   */
  lookup(digest: string): Lookup | Promise<Lookup> {
    const config = this.o.config();
    const hit = this.cache.get(digest);
    if (hit && Date.now() - hit.at < (this.silentSince ? SILENT_TRUST_MS : CACHE_TTL_MS)) return built(hit, config);
    if (!hit && !this.mayHold(digest)) return undefined;
    if (this.o.failing()) return hit ? built(hit, config) : this.unavailable();
    let asked = this.pending.get(digest);
    if (!asked) {
      asked = this.fetch(digest, hit, config).finally(() => {
        this.pending.delete(digest);
        this.changedInFlight.delete(digest); // one heard after the read: the cache entry went with it
      });
      this.pending.set(digest, asked);
    }
    return asked;
  }

  /**
   * Read again when the key's change is announced while its read is in flight: the answer may be
   * of before the change (it comes on another connection than the announcement), and cached it
   * would outlive a revoke for the cache's minute.
   */
  private async fetch(digest: string, hit: Cached | undefined, config: GatewayConfig): Promise<Lookup> {
    let f: Record<string, string> | typeof LATE;
    do {
      this.changedInFlight.delete(digest);
      f = await within(this.redis.hgetall(this.names.record(digest)), this.o.timeoutMs).catch((): typeof LATE => LATE);
    } while (f !== LATE && this.changedInFlight.has(digest));
    if (f === LATE) return hit ? built(hit, config) : this.unavailable();
    const entry = f.id ? entryOf(f) : undefined;
    const cached: Cached = { entry, at: Date.now(), config, consumer: entry && config.consumerOf(entry) };
    if (entry && !cached.consumer)
      this.o.log.warn({ keyId: entry.id, plan: entry.plan }, 'key registry: a key names a plan the config does not have');
    this.cache.set(digest, cached);
    return cached.consumer;
  }

  /** The 503 for a key never read; said once in the log when Redis has not answered since start. */
  private unavailable(): GatewayError {
    if (!this.bloom && !this.saidUnread) {
      this.saidUnread = true;
      this.o.log.warn('key registry: Redis has not answered since this instance started: its keys answer 503 until it does');
    }
    return UNAVAILABLE();
  }

  close(): void {
    clearInterval(this.timer);
    void closeRedis(this.subscriber, 'now');
  }
}

/** A cached record's consumer under the config in force: built again only after a reload. */
function built(hit: Cached, config: GatewayConfig): Consumer | undefined {
  if (hit.config !== config) {
    hit.config = config;
    hit.consumer = hit.entry && config.consumerOf(hit.entry);
  }
  return hit.consumer;
}
