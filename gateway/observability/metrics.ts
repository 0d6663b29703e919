import type { WebhookMetrics } from '../usage/webhooks.js';
import type { ExportMetrics } from '../usage/exporter.js';
import { Counter, collectDefaultMetrics, Gauge, Histogram, type Metric, Registry } from 'prom-client';
import type { Refusal } from '../quota/decision.js';
import type { Operations, StoreCounts } from '../quota/store.js';

export type RejectionReason = Refusal | 'unauthenticated' | 'unavailable';

/** Label values are bounded: allow-listed route ids (or "none"), statuses, configured plans; key ids only when configured. */
export class GatewayMetrics {
  readonly registry = new Registry();
  readonly redisSeconds: Histogram<never>;
  readonly logLinesDropped: Counter<never>;
  /** Shadow mode's refusals not made; only keys on a plan or key with `enforce: false` add to it, so labels stay few. */
  readonly wouldReject: Counter<'reason' | 'plan'>;
  readonly overage: Counter<'plan'>;
  /** Requests and connections turned away (503 gateway_busy) or cut, by reason (http/connections.ts). */
  readonly pushback: Counter<'reason'>;
  readonly usage: ExportMetrics;
  readonly webhooks: WebhookMetrics;
  // Tallied in plain numbers, handed to prom-client when scraped: its inc() validates and hashes labels on every call,
  // costing more than the rest of the access line. Indexed by route, status, plan: no label string per request.
  private readonly requests: Series[] = [];
  private readonly requestIndex = new Map<string, Map<number, Map<string, Series>>>();
  private readonly rejections: Series[] = [];
  private readonly rejectionIndex = new Map<string, Series>();
  private readonly upstreamSeconds: TallyHistogram;

  constructor(private readonly keyLabels: boolean) {
    const registers = [this.registry];
    collectDefaultMetrics({ register: this.registry });
    new Counter({
      name: 'gateway_requests_total',
      help: 'Requests answered, by route, status and plan',
      labelNames: keyLabels ? ['route', 'status', 'plan', 'key'] : ['route', 'status', 'plan'],
      registers,
      collect: collectFrom(this.requests),
    });
    new Counter({
      name: 'gateway_rejections_total',
      help: 'Requests refused, by reason: minute, hour, day, month, credits (402), banned, unauthenticated, unavailable (QUOTA_STORE_FAILURE=closed)',
      labelNames: ['reason'],
      registers,
      collect: collectFrom(this.rejections),
    });
    this.wouldReject = new Counter({
      name: 'gateway_would_reject_total',
      help: 'Requests admitted in shadow mode (enforce: false) that an enforced plan would have refused, by reason and plan',
      labelNames: ['reason', 'plan'],
      registers,
    });
    this.overage = new Counter({
      name: 'gateway_overage_requests_total',
      help: "Requests admitted past their quota within the plan's overage (billed extra), by plan",
      labelNames: ['plan'],
      registers,
    });
    this.pushback = new Counter({
      name: 'gateway_pushback_total',
      help: 'Turned away with 503 gateway_busy (connections: GATEWAY_MAX_CONNECTIONS, in_flight: GATEWAY_MAX_IN_FLIGHT) or cut (pipeline: too many pipelined requests waiting, unread: a response not taken within GATEWAY_UNREAD_TIMEOUT_MS), by reason',
      labelNames: ['reason'],
      registers,
    });
    ({ usage: this.usage, webhooks: this.webhooks } = exportMetrics(registers));
    this.logLinesDropped = new Counter({
      name: 'gateway_log_lines_dropped_total',
      help: 'Log lines dropped because stdout did not keep up (more than 16 MiB waiting)',
      registers,
    });
    this.redisSeconds = new Histogram({
      name: 'gateway_redis_duration_seconds',
      help: 'Duration of the quota script call to Redis',
      buckets: [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.1, 0.25],
      registers,
    });
    this.upstreamSeconds = new TallyHistogram(
      'gateway_upstream_duration_seconds',
      'Time from sending a request to the backend to its response headers, by route',
      'route',
      [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10],
    );
    this.registry.registerMetric(this.upstreamSeconds as unknown as Metric);
  }

  get contentType(): string {
    return this.registry.contentType;
  }

  text(): Promise<string> {
    return this.registry.metrics();
  }

  watch(store: Pick<Operations, 'degraded' | 'activeBans' | 'counts'>): void {
    const registers = [this.registry];
    const counter = (name: string, help: string, read: (c: StoreCounts) => number, labels: Record<string, string> = {}) =>
      new Counter({
        name,
        help,
        labelNames: Object.keys(labels),
        registers,
        collect() {
          const counts = store.counts;
          if (!counts) return;
          this.reset();
          this.inc(labels, read(counts));
        },
      });
    counter(
      'gateway_quota_local_decisions_total',
      'Quota decisions made by this instance from its degraded budget because Redis was declared failing',
      (c) => c.degraded,
      { reason: 'failing' },
    );
    counter(
      'gateway_quota_refunds_failed_total',
      'Refunds (of 502/504 answers) Redis did not take: those requests stay counted',
      (c) => c.refundsFailed,
    );
    counter(
      'gateway_quota_calls_unsettled_total',
      'Quota calls given up on without a reply whose fate Redis no longer knew when it answered again: what they counted stays counted',
      (c) => c.unresolved,
    );
    new Counter({
      name: 'gateway_quota_statuses_dropped_total',
      help: 'Final statuses and account marks lost, by reason: status_cap (10,000 waiting: Redis failing a while), status_write (a failed write: those events go out with status null), mark (a failed mark: the sweep finds the account)',
      labelNames: ['reason'],
      registers,
      collect() {
        const dropped = store.counts?.dropped;
        if (!dropped) return;
        this.reset();
        for (const [reason, n] of Object.entries(dropped)) this.inc({ reason }, n);
      },
    });
    new Gauge({
      name: 'gateway_quota_instances',
      help: 'Live gateway instances (workers included) Redis knew of at the last heartbeat: the degraded budget divides by it',
      registers,
      aggregator: 'max',
      collect() {
        if (store.counts) this.set(store.counts.instances);
      },
    });
    counter(
      'gateway_quota_written_back_total',
      'Units admitted while Redis failed, added to its windows once it answered again',
      (c) => c.writtenBack,
    );
    new Gauge({
      name: 'gateway_bans_active',
      help: 'Keys this instance knows to be banned now',
      registers,
      aggregator: 'max', // workers share the bans they see through Redis: not a sum
      collect() {
        this.set(store.activeBans());
      },
    });
    new Gauge({
      name: 'gateway_quota_store_degraded',
      help: '1 while quota decisions come from the in-process fallback because Redis fails',
      registers,
      aggregator: 'max', // 1 if any worker is degraded
      collect() {
        this.set(store.degraded ? 1 : 0);
      },
    });
  }

  watchConnections(counts: { open: number; inFlight: number }): void {
    const registers = [this.registry];
    new Gauge({
      name: 'gateway_connections_open',
      help: 'Connections open on the public port',
      registers,
      collect() {
        this.set(counts.open);
      },
    });
    new Gauge({
      name: 'gateway_requests_in_flight',
      help: 'Requests in progress on the public port (GATEWAY_MAX_IN_FLIGHT caps them)',
      registers,
      collect() {
        this.set(counts.inFlight);
      },
    });
  }

  watchKeyRegistry(registry: { readonly silent: boolean; readonly silences: number }): void {
    const registers = [this.registry];
    new Gauge({
      name: 'gateway_key_registry_channel_silent',
      help: "1 while the key registry's change channel has not echoed within its check (keys are then read again every 2 s)",
      registers,
      aggregator: 'max',
      collect() {
        this.set(registry.silent ? 1 : 0);
      },
    });
    new Counter({
      name: 'gateway_key_registry_channel_silences_total',
      help: "Times the key registry's change channel was found silent and connected again",
      registers,
      collect() {
        this.reset();
        this.inc(registry.silences);
      },
    });
  }

  request(route: string, status: number, plan: string, key: string | undefined, rejected?: RejectionReason): void {
    let byStatus = this.requestIndex.get(route);
    if (!byStatus) this.requestIndex.set(route, (byStatus = new Map()));
    let byPlan = byStatus.get(status);
    if (!byPlan) byStatus.set(status, (byPlan = new Map()));
    const last = this.keyLabels ? `${plan} ${key ?? 'none'}` : plan;
    let t = byPlan.get(last);
    if (!t)
      byPlan.set(
        last,
        (t = newSeries(this.requests, this.keyLabels ? { route, status, plan, key: key ?? 'none' } : { route, status, plan })),
      );
    t.n++;
    if (rejected) {
      let r = this.rejectionIndex.get(rejected);
      if (!r) this.rejectionIndex.set(rejected, (r = newSeries(this.rejections, { reason: rejected })));
      r.n++;
    }
  }

  /** To the backend's response headers. */
  upstream(route: string, seconds: number): void {
    this.upstreamSeconds.observe(route, seconds);
  }
}

interface Series {
  labels: Record<string, string | number>;
  n: number;
}

function newSeries(all: Series[], labels: Series['labels']): Series {
  const s = { labels, n: 0 };
  all.push(s);
  return s;
}

function collectFrom(all: Series[]) {
  return function collect(this: Counter<string>) {
    this.reset();
    for (const s of all) this.inc(s.labels, s.n);
  };
}

/** Plain numbers on the hot path; get() gives what prom-client's Histogram would (a unit test compares the two). */
export class TallyHistogram {
  readonly type = 'histogram';
  readonly aggregator = 'sum';
  private readonly series = new Map<string, { counts: number[]; sum: number; count: number }>();

  constructor(
    readonly name: string,
    readonly help: string,
    private readonly label: string,
    private readonly buckets: readonly number[],
  ) {}

  observe(labelValue: string, value: number): void {
    let s = this.series.get(labelValue);
    if (!s) this.series.set(labelValue, (s = { counts: this.buckets.map(() => 0), sum: 0, count: 0 }));
    // A loop, not findIndex: no closure and no builtin call per request.
    const { buckets } = this;
    for (let i = 0; i < buckets.length; i++) {
      if (value <= buckets[i]!) {
        s.counts[i]!++;
        break;
      }
    }
    s.sum += value;
    s.count++;
  }

  get() {
    const values: Array<{ value: number; labels: Record<string, string | number>; metricName: string }> = [];
    for (const [labelValue, s] of this.series) {
      let cumulative = 0;
      this.buckets.forEach((le, i) => {
        cumulative += s.counts[i]!;
        values.push({ value: cumulative, labels: { le, [this.label]: labelValue }, metricName: `${this.name}_bucket` });
      });
      values.push({ value: s.count, labels: { le: '+Inf', [this.label]: labelValue }, metricName: `${this.name}_bucket` });
      values.push({ value: s.sum, labels: { [this.label]: labelValue }, metricName: `${this.name}_sum` });
      values.push({ value: s.count, labels: { [this.label]: labelValue }, metricName: `${this.name}_count` });
    }
    return { name: this.name, help: this.help, type: this.type, aggregator: this.aggregator, values };
  }

  reset(): void {
    this.series.clear();
  }
}

function exportMetrics(registers: Registry[]): { usage: ExportMetrics; webhooks: WebhookMetrics } {
  const exported = new Counter({ name: 'gateway_usage_events_exported_total', help: 'Usage events accepted by the sink', registers });
  const failed = new Counter({
    name: 'gateway_usage_export_failures_total',
    help: 'Batches of usage events the sink did not take (tried again)',
    registers,
  });
  const dropped = new Counter({
    name: 'gateway_usage_events_dropped_total',
    help: "Usage events dropped by their stream's cap (usage.export.maxEvents) before they were sent",
    registers,
  });
  const rejected = new Counter({
    name: 'gateway_usage_events_rejected_total',
    help: 'Usage events a sink refused for good (400, 413 or 422 for the event alone), set aside so the rest go on',
    registers,
  });
  const duplicates = new Counter({
    name: 'gateway_usage_events_duplicate_total',
    help: "Usage events a sink answered it already held (Stripe's 400 duplicate, Lago's 422 value_already_exist, a 409), counted as delivered",
    registers,
  });
  const lag = new Gauge({
    name: 'gateway_usage_export_lag_seconds',
    help: 'Age of the oldest usage event not yet sent, at the last batch',
    registers,
  });
  const rounds = new Counter({
    name: 'gateway_leader_rounds_total',
    help: 'Rounds the usage exporter and the alert dispatcher ran while leading, by loop',
    labelNames: ['loop'],
    registers,
  });
  const usage: ExportMetrics = {
    exported: (n) => exported.inc(n),
    failed: () => failed.inc(),
    dropped: (n) => dropped.inc(n),
    rejected: (n) => rejected.inc(n),
    duplicates: (n) => duplicates.inc(n),
    lag: (s) => lag.set(s),
    round: () => rounds.inc({ loop: 'usage-export' }),
  };
  const delivered = new Counter({
    name: 'gateway_webhooks_delivered_total',
    help: 'Alert webhooks the receiver acknowledged (2xx)',
    registers,
  });
  const undelivered = new Counter({
    name: 'gateway_webhook_failures_total',
    help: 'Alert webhook attempts that failed (tried again)',
    registers,
  });
  const webhooks: WebhookMetrics = {
    delivered: () => delivered.inc(),
    failed: () => undelivered.inc(),
    round: () => rounds.inc({ loop: 'alerts' }),
  };
  return { usage, webhooks };
}
