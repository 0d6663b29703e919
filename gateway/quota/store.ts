import type { Decision, EventTag, QuotaSubject } from './decision.js';
import type { Period } from './period.js';
import type { Counts, Stored } from './windows.js';

// The contract both stores keep, in three parts by who calls them: each caller depends on the
// part it uses, and a new store (or a test's) sees which members make up each job.

/** A refunded request's plan and route: its refund event's statement line (usage/periods.ts). */
export interface RefundLine {
  plan: string;
  route: string;
}

/** The per-request path: one decision per request, its final status, and a refund (http/, admit.ts). */
export interface RequestPath {
  /**
   * One decision: admitted only if every window has room for the request's whole `cost` (units,
   * default 1). Returned as it is, not in a promise, when the store needs no I/O to make it.
   */
  consume(subject: QuotaSubject, cost?: number, tag?: EventTag): Decision | Promise<Decision>;
  /** The final status of an admitted request whose usage event was written (a store that records events). */
  recordStatus?(subject: QuotaSubject, eventId: string, status: number): void;
  /**
   * Gives an admitted request (its `cost` units) back to the windows it was counted in (at `countedAtMs`, the
   * decision's time), if they are still current, and to its credits: the gateway failed it (502/504), so the client
   * is not charged. The overage billed then takes back what no delivered unit is under any more (at most `cost`),
   * whether or not this request was billed as overage. Best effort: a refund that cannot be made leaves the unit counted.
   */
  refund(subject: QuotaSubject, countedAtMs: number, cost?: number, eventId?: string, line?: RefundLine): Promise<void>;
  /** An admission's concurrency slot (Decision.slot) given back: its request ended, whichever way. */
  release(subject: QuotaSubject, slot: string): void;
}

/** The account book: what a subject has used and holds, read without counting, and top-ups (admin/usage.ts, credits.ts). */
export interface AccountBook {
  peek(subject: QuotaSubject): Promise<Usage>;
  /**
   * Adds purchased credits to a subject that has credits, once per idempotency key: a retry,
   * however concurrent, adds nothing and answers what the first one did.
   */
  topUp(subject: QuotaSubject, topUp: TopUp): Promise<TopUpResult>;
  /** The subject's credits ledger, oldest first: every grant and top-up. */
  ledger(subject: QuotaSubject): Promise<LedgerEntry[]>;
  /** Its usage events: sent to the sink, waiting in its stream, dropped by the cap (a store that records events). */
  exportState?(subject: QuotaSubject): Promise<ExportState>;
}

/** Operations: the store's health and counts, an operator's unban, and its close (admin/app.ts, metrics, the wiring). */
export interface Operations {
  /** True while Redis is declared failing: decisions come from the degraded budget. */
  readonly degraded: boolean;
  /** While degraded, why (the last failure in one line); absent where the store cannot fail. */
  readonly degradedReason?: string;
  /** Bans this instance knows to be in force now. */
  activeBans(): number;
  /** A shared store's counts of what Redis failing cost (for the metrics). */
  readonly counts?: Readonly<StoreCounts>;
  /** Lifts the subject's ban and forgets its recent 429s (an operator's call); false when no ban was in force. */
  unban(subject: QuotaSubject): Promise<boolean>;
  /** Stops its timers (the heartbeat) and leaves what it registered. */
  close?(): Promise<void>;
}

/** A whole store: what the wiring builds and hands out, each part to the caller that needs it. */
export interface QuotaStore extends RequestPath, AccountBook, Operations {}

export interface StoreCounts {
  /** Decisions made from the degraded budget while Redis failed. */
  degraded: number;
  /** Refunds Redis did not take: those requests stay counted. */
  refundsFailed: number;
  /** Calls given up on without a reply that could not be resolved while Redis kept their reply: what they counted stays counted. */
  unresolved: number;
  /** Statuses and marks lost, by why: past the pending cap, a failed write of statuses, a failed mark. */
  dropped?: Readonly<Record<'status_cap' | 'status_write' | 'mark', number>>;
  /** Units admitted while Redis failed and written back to it since. */
  writtenBack: number;
  /** Live instances Redis knew of at the last heartbeat: what the degraded budget divides by. */
  instances: number;
}

/** Thrown by a store that fails closed (QUOTA_STORE_FAILURE=closed) when it cannot decide. */
export class QuotaStoreUnavailable extends Error {
  constructor() {
    super('The quota store is not answering');
  }
}

/** A subject's counters as they stand, read without counting (for the admin usage lookup): each window's admitted count. */
export type Usage = Counts & UsageBeyondCounts;
interface UsageBeyondCounts {
  nowMs: number;
  /** 0 when not banned. */
  banUntilMs: number;
  /** 429s within the ban window so far. */
  recentRejections: number;
  /** The billing period and its count, for a subject with a month window or credits. */
  period?: Period;
  monthUsed?: number;
  /**
   * The credits as they stand (grants due applied), for a subject with credits; `reserved`: taken
   * from them by leases not closed yet (Redis), spent or given back when they close.
   */
  credits?: { granted: number; purchased: number; reserved?: number };
  /** Units billed as overage in the current overage window (a subject with overage). */
  overageUsed?: number;
  /** Requests in flight now (a subject with a concurrency limit), and burst tokens left (with a burst). */
  inFlight?: number;
  burstLeft?: number;
}

/**
 * The reconciliation of an account's usage events: every event written is exported, pending or
 * dropped; every unit counted is in an event written or unsettled.
 */
export interface ExportState {
  exported: number;
  pending: number;
  dropped: number;
  /** Events a sink refused for good, set aside by id (`…:events:rejected`): not in `exported`. */
  rejected: number;
  /**
   * Units counted in leases whose events are not written: held by an instance (not handed out
   * yet, or waiting for their batch, at most USAGE_BATCH_MS), or lost with an instance that died.
   */
  unsettled: number;
}

export interface TopUp {
  amount: number;
  reason: string;
  idempotencyKey: string;
}

/** A top-up's answer: its ledger entry and the balance after it; `replayed` for a retry, `conflict` when the key came with another amount or reason. */
export interface TopUpResult {
  entryId: string;
  balance: number;
  replayed: boolean;
  conflict: boolean;
}

/**
 * One entry of the credits ledger (append-only): a period's grant, a top-up, or a credit lease its
 * holder never closed, given back whole once it lapsed (`lapsed`); and the balance after it.
 */
export interface LedgerEntry {
  id: string;
  atMs: number;
  kind: 'grant' | 'topup' | 'lapsed';
  amount: number;
  balance: number;
  /** A grant: the periods it covers, and what was left of the last grant and expired (without rollover). */
  periods?: number;
  expired?: number;
  /** A top-up: why, and its idempotency key. */
  reason?: string;
  idempotencyKey?: string;
}

/** What a top-up is, for its idempotency: the same key with another amount or reason is a conflict. */
export const topUpFingerprint = (t: TopUp) => `${t.amount}:${Buffer.from(t.reason).toString('base64url')}`;

/**
 * A subject's stored counters: each fixed window's start and admitted count under its stored
 * names (windows.ts: quota.lua's hash fields ms, mc, ds, dc, ...), and the ban's end.
 */
export interface Counters {
  stored: Stored;
  ban: number;
}

/** A top-up written, but held by fewer replicas than CREDITS_ACK_REPLICAS within CREDITS_ACK_TIMEOUT_MS. */
export class TopUpNotReplicated extends Error {
  constructor(
    readonly replicas: number,
    readonly wanted: number,
  ) {
    super(`the top-up reached ${replicas} of the ${wanted} replica(s) CREDITS_ACK_REPLICAS asks for`);
  }
}
