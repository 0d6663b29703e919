import type { FastifyBaseLogger } from 'fastify';
import type { GatewayConfig, UsageExport } from '../config/config.js';
import { batchLimit } from '../config/usage-export.js';
import { commandTimeoutFor, type RedisClient } from '../redis/client.js';
import { subjectKey } from '../redis/keys.js';
import { accountsOf, ActiveIndex, type LoopConfig, type Marked } from './active.js';
import { countDropped, moveUsageCursor, readUsage, REFUSED, type UsageMove, type UsageRead, usagePending } from './cursors.js';
import { bundleEvents, consumable, ENTRY, type EncodedEvent, entryId, refundTypeOf, splitEvents, toCloudEvents } from './events.js';
import { Sweep } from './sweep.js';
import {
  closedEvent,
  CLOSE_RETRY_MS,
  type Due,
  defineCloseScripts,
  duePeriods,
  redisNow,
  forget,
  freeze,
  frozenStatement,
  markClosed,
  notePrices,
  notYet,
  periodsTouched,
} from './closes.js';
import { type Source, tallyAccount } from './periods.js';
import { DeliveryFailed, type Lead, LeaderLoop, LeadLost } from './leader.js';
import { ReplicaGate } from './replicated.js';
import type { Accepted, UsageSink } from './sink.js';

export interface ExportMetrics {
  exported(n: number): void;
  failed(): void;
  dropped(n: number): void;
  /** Events a sink refused for good, set aside. */
  rejected(n: number): void;
  /** Events a sink said it held already: a resend, delivered. */
  duplicates(n: number): void;
  lag(seconds: number): void;
  round(): void;
}

/** With batches of 500, a share of at least 8 events each of the round's room (ROUND_BATCHES); the rest go next round, at once. */
const ACCOUNTS_PER_ROUND = 250;
/** A round's own Redis calls and scheduling are paid once for up to this many sink batches: the leader's cost at a high rate. */
const ROUND_BATCHES = 4;
/** Two XLENs each (+1 HGET a registry key): idle cost under 100 Redis commands/s (150 in a registry); 100,000 accounts take 42 min. */
export const EXPORT_SWEEP_PER_SECOND = 40;

interface AccountRead extends UsageRead {
  name: string;
  /** False too once an entry waits for its status. */
  moreEntries: boolean;
  consumed: number;
}

interface Part {
  json: EncodedEvent;
  events: number;
}

export type ExportConfig = LoopConfig &
  Pick<GatewayConfig, 'usageExport'> & {
    /** By account, its billing day (1 when not named): what its events' periods are. */
    billingDays?: ReadonlyMap<string, number>;
    /** How long after a period's end an event of it may still be written (closes.ts): this instance's settings'. */
    settleMs?: number;
    /** The plans' prices (prices.ts, pricesInForce), noted when they change (closes.ts, notePrices). */
    prices?: string;
  };

/** Between two notes of the same prices (notePrices). */
const PRICES_AGAIN_MS = 60_000;

/** At the shipped settings (event-batches.ts, settleOf): a test holds the two equal. */
export const SETTLE_MS = 55_000;

export interface ExporterDeps {
  redis: RedisClient;
  config: () => ExportConfig;
  log: FastifyBaseLogger;
  metrics: ExportMetrics;
  sink: (target: UsageExport) => UsageSink;
  /** Replicas that must hold a round's events before they are sent (USAGE_EXPORT_ACK_REPLICAS; replicated.ts). */
  ackReplicas?: number;
  /** REDIS_TIMEOUT_MS, which the connection's command timeout comes from (replicated.ts keeps its WAIT below it). */
  timeoutMs?: number;
}

/**
 * Cursors move only once the sink accepted a batch: at least once, with stable ids, so a sink that dedupes by id
 * counts each request once. The cursors live beside each stream (one Cluster slot an account), surviving restarts.
 */
export class UsageExporter extends LeaderLoop<UsageExport, ExportConfig> {
  private readonly metrics: ExportMetrics;
  private readonly index: ActiveIndex;
  private readonly sweep: Sweep;
  private readonly sinkFor: (target: UsageExport) => UsageSink;
  private readonly replicas: ReplicaGate;
  private readMark = 0;
  /** Made again only when a reload changes the target. */
  private sink?: { target: UsageExport; sink: UsageSink };
  private nextClose = 0;
  private closeBackoffMs = 0;
  /** The prices this instance last noted (closes.ts, notePrices), and when. */
  private pricesNoted: { prices?: string; at: number } = { at: 0 };
  /** The ids of the events the sink set aside this round. */
  private readonly setAside = new Set<string>();

  constructor(deps: ExporterDeps) {
    super(deps.redis, deps.config, deps.log, 'usage-export', () => deps.metrics.round());
    this.metrics = deps.metrics;
    this.sinkFor = deps.sink;
    this.index = new ActiveIndex(deps.redis, 'usage-export');
    this.sweep = new Sweep(deps.redis, 'usage-export', EXPORT_SWEEP_PER_SECOND, usagePending);
    defineCloseScripts(deps.redis);
    this.replicas = new ReplicaGate(deps.redis, deps.ackReplicas ?? 0, deps.log, commandTimeoutFor(deps.timeoutMs ?? 1000));
  }

  protected target(config: ExportConfig): UsageExport | undefined {
    return config.usageExport;
  }

  private sinkOf(target: UsageExport): UsageSink {
    if (this.sink?.target !== target) this.sink = { target, sink: this.sinkFor(target) };
    return this.sink.sink;
  }

  protected failed(target: UsageExport, err: Error, retryInMs: number): void {
    this.metrics.failed();
    if (err instanceof DeliveryFailed && err.setup) {
      const sink = this.sinkOf(target).name;
      this.log.error(
        { sink, cause: err.message, retryInMs: Math.round(retryInMs) },
        'usage export: the sink refuses our credentials; events wait',
      );
      return;
    }
    this.log.warn({ sink: this.sinkOf(target).name, cause: err.message, retryInMs: Math.round(retryInMs) }, 'usage export: a batch failed');
  }

  protected override recovered(target: UsageExport): void {
    this.log.info({ sink: this.sinkOf(target).name }, 'usage export: the sink takes events again');
  }

  protected async round(config: ExportConfig, target: UsageExport, lead: Lead): Promise<{ sent: number; full: boolean }> {
    await this.sweep.step(config);
    await this.notePrices(config);
    const size = batchLimit(target);
    const { picked, more } = await this.index.take(config, Math.min(ACCOUNTS_PER_ROUND, size));
    const { account } = accountsOf(config);
    const known = picked.filter((m) => account(m.name) !== undefined);
    const now = Date.now();
    const room = size * ROUND_BATCHES;
    const reads = await this.fill(known, room, now);
    const source = `/pet-store-gateway/${config.environment}`;
    const refundType = refundTypeOf(config.usageExport?.format);
    const parts: Part[][] = [];
    const moves: Array<{ name: string; events: number; move: Omit<UsageMove, 'token'> }> = [];
    let oldest = now;
    let sent = 0;
    const touched: Due[] = [];
    const tallies: Array<{ parts: Source[]; day: number; frozen: number }> = [];
    this.setAside.clear();
    for (const r of reads) {
      const bundle = r.bundles.at(-1);
      if (r.entries.length > 0) oldest = Math.min(oldest, Number(entryId(r.entries, 0).split('-')[0]));
      if (bundle) oldest = Math.min(oldest, Number(r.bundles[0]!.id.split('-')[0]));
      if (r.consumed === 0 && !bundle) continue;
      const name = account(r.name)!;
      const { events, last, joined } = toCloudEvents(name, source, r.entries, r.statuses, r.consumed, refundType);
      // Each part tallied into its billing period (periods.ts), an event of a frozen period rewritten as a correction.
      const day = config.billingDays?.get(name) ?? 1;
      const sources: Source[] = events.map((json) => ({ gate: 0, json }));
      for (const b of r.bundles) sources.push({ gate: b.upto, json: bundleEvents(name, source, b, refundType) });
      const tallied = tallyAccount(sources, day, Number(r.frozen));
      const own: Part[] = tallied.parts.map((p, i) => ({
        json: p.json,
        events: i < events.length ? 1 : r.bundles[i - events.length]!.events,
      }));
      const n = events.length + r.bundles.reduce((sum, b) => sum + b.events, 0);
      for (const [startMs, endMs] of tallied.periods) touched.push({ name: r.name, startMs, endMs });
      tallies.push({ parts: tallied.parts, day, frozen: Number(r.frozen) });
      parts.push(own);
      sent += n;
      moves.push({
        name: r.name,
        events: n,
        move: {
          from: r.cursor,
          to: last,
          consumed: r.consumed,
          refs: joined,
          bundle,
          bundleFrom: r.bundles[0] && r.bundles[0].upto - r.bundles[0].events,
          frozen: r.frozen,
          stats: tallied.lines,
        },
      });
    }
    await Promise.all(reads.filter((r) => r.length >= target.maxEvents * 0.9 || r.unreported > 0).map((r) => this.countDropped(r.name)));
    this.metrics.lag((now - oldest) / 1000);
    const fair = interleaved(parts, Math.max(1, Math.floor(size / Math.max(1, parts.length))));
    const names = new Map(reads.map((r) => [account(r.name)!, r.name]));
    await this.readyToSend(config, touched, moves, lead, now - oldest);
    for (const batch of batches(fair, size)) await this.deliver(this.sinkOf(target), batch, lead, names);
    if (this.stopped) return { sent: 0, full: false };
    lead.signal.throwIfAborted();
    if (this.setAside.size > 0) this.tallyWithoutSetAside(moves, tallies, account);
    const moved = await Promise.all(moves.map(({ name, move }) => moveUsageCursor(this.redis, name, { ...move, token: lead.token })));
    moves.forEach(({ events }, i) => moved[i] === 'moved' && this.metrics.exported(events));
    const refused = moved.findIndex((m) => m !== 'moved');
    if (refused >= 0)
      throw new LeadLost(`the cursor of ${subjectKey.events(moves[refused]!.name)} was ${REFUSED[moved[refused] as 'fenced']}`);
    await this.closeDue(config, target, lead, source);
    // Sent all it read, and read less than it asked: nothing was left when the score was read, so unmarking is safe.
    const done = new Set(
      reads.filter((r) => !r.moreEntries && !r.moreBundles && r.consumed * ENTRY === r.entries.length).map((r) => r.name),
    );
    await this.index.unmark(
      config,
      picked.filter((m) => done.has(m.name) || account(m.name) === undefined),
    );
    return { sent, full: sent >= room || more };
  }

  /**
   * Before a round's events go: the periods they touch wait for their close, and the replicas
   * hold the events (replicated.ts): nothing the sink takes may be lost from Redis by a failover.
   */
  private async readyToSend(config: ExportConfig, touched: Due[], moves: Array<{ name: string }>, lead: Lead, waitedMs: number) {
    await periodsTouched(this.redis, config.redisPrefix, touched);
    await this.replicas.pass(
      moves.map((m) => m.name),
      lead.token,
      this.readMark,
      waitedMs,
    );
  }

  /** The events the sink set aside are not the period's: each account's parts tallied again without its own. */
  private tallyWithoutSetAside(
    moves: ReadonlyArray<{ name: string; move: Omit<UsageMove, 'token'> }>,
    tallies: ReadonlyArray<{ parts: Source[]; day: number; frozen: number }>,
    account: (name: string) => string | undefined,
  ): void {
    const byAccount = new Map<string, Set<string>>();
    for (const id of this.setAside) {
      const of = id.slice(0, id.indexOf('/'));
      if (!byAccount.has(of)) byAccount.set(of, new Set());
      byAccount.get(of)!.add(id);
    }
    moves.forEach(({ name, move }, i) => {
      const aside = byAccount.get(account(name)!);
      if (aside) move.stats = tallyAccount(tallies[i]!.parts, tallies[i]!.day, tallies[i]!.frozen, aside).lines;
    });
  }

  /**
   * The prices as they change, before the periods they price close: noted when this instance's
   * change, and once a minute besides (an instance of an older config may have noted its own
   * meanwhile, as in a rolling reload); the script writes nothing while they are the last noted.
   */
  private async notePrices(config: ExportConfig): Promise<void> {
    const now = Date.now();
    if (config.prices === undefined || (config.prices === this.pricesNoted.prices && now < this.pricesNoted.at + PRICES_AGAIN_MS)) return;
    await notePrices(this.redis, config.redisPrefix, config.prices);
    this.pricesNoted = { prices: config.prices, at: now };
  }

  /**
   * The periods ended that can close (closes.ts), a try a second at most: frozen, their close
   * events delivered in one batch, then marked closed. A period with nothing exported has no
   * close event; an account no longer configured leaves the index unclosed.
   */
  private async closeDue(config: ExportConfig, target: UsageExport, lead: Lead, source: string): Promise<void> {
    const now = Date.now();
    if (now < this.nextClose) return;
    this.nextClose = now + CLOSE_RETRY_MS;
    const { account } = accountsOf(config);
    const closing: Array<{ d: Due; name: string; statement: Awaited<ReturnType<typeof frozenStatement>> }> = [];
    // Due by Redis's clock: a host behind it would otherwise close a period late by as much.
    const at = await redisNow(this.redis);
    for (const d of await duePeriods(this.redis, config.redisPrefix, at)) {
      const name = account(d.name);
      if (name === undefined) {
        await forget(this.redis, config.redisPrefix, d);
        continue;
      }
      const frozen = await freeze(this.redis, d, lead.token, config.settleMs ?? SETTLE_MS);
      if (frozen === 'fenced') throw new LeadLost(`the period of ${subjectKey.statements(d.name)} was frozen by a newer lead`);
      if (frozen === 'not yet') await notYet(this.redis, config.redisPrefix, d, at, config.settleMs ?? SETTLE_MS);
      else closing.push({ d, name, statement: await frozenStatement(this.redis, d) });
    }
    const events = closing.filter((c) => c.statement.events + c.statement.credits.granted + c.statement.credits.purchased > 0);
    if (
      events.length > 0 &&
      !(await this.deliverCloses(
        target,
        events.map((c) => closedEvent(c.name, source, c.statement)),
        lead,
        events,
        now,
      ))
    )
      return;
    for (const { d, name, statement } of closing) {
      if (!(await markClosed(this.redis, config.redisPrefix, d, lead.token)))
        throw new LeadLost(`the period of ${subjectKey.statements(d.name)} was closed by a newer lead`);
      this.log.info(
        { account: name, period: statement.period.start, units: statement.totals.units, events: statement.events },
        'usage export: a billing period closed',
      );
    }
  }

  /**
   * The close events in the sink's batches. A failure holds up the closes alone (their own
   * backoff, up to 30 s), never the round: the events behind them go on at their pace.
   */
  private async deliverCloses(
    target: UsageExport,
    closes: EncodedEvent[],
    lead: Lead,
    of: ReadonlyArray<{ d: Due; name: string }>,
    now: number,
  ): Promise<boolean> {
    const sink = this.sinkOf(target);
    const names = new Map(of.map((c) => [c.name, c.d.name]));
    const size = batchLimit(target);
    try {
      for (let i = 0; i < closes.length; i += size) await this.deliver(sink, closes.slice(i, i + size), lead, names);
    } catch (err) {
      if (!(err instanceof DeliveryFailed)) throw err;
      this.closeBackoffMs = Math.min(30_000, Math.max(CLOSE_RETRY_MS, this.closeBackoffMs * 2));
      this.nextClose = now + this.closeBackoffMs;
      this.log.warn(
        { sink: sink.name, cause: err.message, periods: closes.length, retryInMs: this.closeBackoffMs },
        "usage export: the sink did not take the billing periods' close events; they are sent again",
      );
      return false;
    }
    this.closeBackoffMs = 0;
    return true;
  }

  /**
   * Equal shares of `room`, what some leave going to those that filled theirs (three passes at most): one busy
   * account takes the batch only when the others leave it room. Whole bundles may overshoot a share; batches() caps.
   */
  private async fill(marked: Marked[], room: number, now: number): Promise<AccountRead[]> {
    this.readMark = this.replicas.mark(); // the connection the round reads on (replicated.ts)
    const reads: AccountRead[] = marked.map((m) => ({
      name: m.name,
      cursor: '0-0',
      entries: [],
      statuses: new Map(),
      length: 0,
      bundleCursor: '0-0',
      bundles: [],
      moreBundles: true,
      unreported: 0,
      moreEntries: true,
      consumed: 0,
      frozen: '0',
    }));
    let wanting = reads;
    for (let pass = 0; pass < 3 && wanting.length > 0 && room > 0; pass++) {
      wanting = wanting.slice(0, room);
      const share = Math.max(1, Math.floor(room / wanting.length));
      const got = await Promise.all(
        wanting.map((r) => {
          const lastBundle = r.bundles.at(-1);
          return readUsage(this.redis, r.name, {
            after: pass === 0 ? undefined : r.entries.length > 0 ? entryId(r.entries, r.entries.length / ENTRY - 1) : r.cursor,
            count: r.moreEntries ? share : 0,
            bundlesAfter: pass === 0 ? undefined : (lastBundle?.id ?? r.bundleCursor),
            bundleEvents: r.moreBundles ? share : 0,
          });
        }),
      );
      wanting.forEach((r, i) => {
        const read = got[i]!;
        if (pass === 0) {
          r.frozen = read.frozen;
          r.cursor = read.cursor;
          r.bundleCursor = read.bundleCursor;
          r.entries = read.entries;
        } else for (const v of read.entries) r.entries.push(v);
        for (const [id, status] of read.statuses) r.statuses.set(id, status);
        for (const b of read.bundles) {
          r.bundles.push(b);
          room -= b.events;
        }
        r.length = read.length;
        r.unreported = read.unreported;
        const n = read.entries.length / ENTRY;
        r.moreEntries &&= n === share;
        if (r.moreBundles) r.moreBundles = read.moreBundles;
        room -= n;
        r.consumed = consumable(r.entries, r.statuses, now);
        if (r.consumed * ENTRY < r.entries.length) r.moreEntries = false;
      });
      wanting = wanting.filter((r) => r.moreEntries || r.moreBundles);
    }
    return reads;
  }

  /**
   * A refusal or a throw is a DeliveryFailed: no cursor moves; the lead's loss is a LeadLost. A
   * permanent refusal is sent again in halves down to the one event refused, which is set aside
   * (reject), so one bad event never holds the accounts behind it (issue 49): about 2·log2(batch) POSTs.
   */
  private async deliver(sink: UsageSink, batch: EncodedEvent[], lead: Lead, names: ReadonlyMap<string, string>): Promise<void> {
    const lost = lead.signal;
    lost.throwIfAborted();
    let answer: Accepted;
    try {
      answer = await sink.deliver(batch, lost, lead.token);
    } catch (err) {
      lost.throwIfAborted();
      throw new DeliveryFailed((err as Error).message, { cause: err });
    }
    if (answer.accepted === 'all') {
      for (const { event, reason } of answer.setAside ?? []) await this.reject(sink, event, reason, names);
      if (answer.held) this.metrics.duplicates(answer.held);
      return;
    }
    if (!answer.permanent) throw new DeliveryFailed(answer.reason, { retryAfterMs: answer.retryAfterMs, setup: answer.setup });
    const events = batch.length === 1 ? splitEvents(batch[0]!) : batch;
    if (events.length > 1) {
      const half = Math.ceil(events.length / 2);
      await this.deliver(sink, events.slice(0, half), lead, names);
      await this.deliver(sink, events.slice(half), lead, names);
    } else if (answer.permanent.status !== 409) await this.reject(sink, events[0]!, answer.reason, names);
    else this.metrics.duplicates(1);
    // A 409 for one event: the sink has it already, delivered.
  }

  /** One event a sink refused for good, kept by id in its account's slot (a resend writes the same field) and counted. */
  private async reject(sink: UsageSink, event: EncodedEvent, reason: string, names: ReadonlyMap<string, string>): Promise<void> {
    const { id, subject } = JSON.parse(event) as { id: string; subject: string };
    const name = names.get(subject);
    if (name === undefined) throw new DeliveryFailed(`${reason}, for an event of no account read this round`);
    const added = await this.redis.hset(
      subjectKey.eventsRejected(name),
      id,
      `{"reason":${JSON.stringify(reason)},"at":"${new Date().toISOString()}","event":${event}}`,
    );
    if (added > 0) this.metrics.rejected(1);
    this.setAside.add(id);
    this.log.error(
      { sink: sink.name, event: id, reason },
      'usage export: the sink refused an event for good; it is set aside, the rest go on',
    );
  }

  private async countDropped(name: string): Promise<void> {
    const dropped = await countDropped(this.redis, name);
    if (dropped > 0) {
      this.metrics.dropped(dropped);
      this.log.warn({ stream: subjectKey.events(name), dropped }, 'usage export: the stream was full; its oldest events were dropped');
    }
  }
}

/** Turns of about `quantum` events an account: every account's first events go in the first sink batch. */
function interleaved(accounts: ReadonlyArray<readonly Part[]>, quantum: number): Part[] {
  const out: Part[] = [];
  const next = accounts.map(() => 0);
  for (let left = accounts.length; left > 0; ) {
    left = 0;
    accounts.forEach((own, a) => {
      for (let taken = 0; taken < quantum && next[a]! < own.length; next[a]!++) {
        out.push(own[next[a]!]!);
        taken += own[next[a]!]!.events;
      }
      if (next[a]! < own.length) left++;
    });
  }
  return out;
}

/** A bundle is split into its events only when it is larger than a batch. */
export function batches(parts: readonly Part[], size: number): EncodedEvent[][] {
  const out: EncodedEvent[][] = [];
  let batch: EncodedEvent[] = [];
  let events = 0;
  const add = (json: EncodedEvent, n: number) => {
    if (events + n > size && batch.length > 0) {
      out.push(batch);
      batch = [];
      events = 0;
    }
    batch.push(json);
    events += n;
  };
  for (const p of parts) {
    if (p.events <= size) add(p.json, p.events);
    else for (const e of splitEvents(p.json)) add(e, 1);
  }
  if (batch.length > 0) out.push(batch);
  return out;
}
