import { windows, type WindowState } from './decision.js';
import type { QuotaSubject } from './decision.js';
import type { Usage } from './store.js';

// An account's quota as a reader sees it: the consumer's own GET /v1/me/usage and the admin
// usage lookups show the same windows, from the store the gateway enforces with.

const iso = (ms: number) => new Date(ms).toISOString();
const view = (w: WindowState) => ({ limit: w.limit, used: w.used, remaining: Math.max(0, w.limit - w.used), resetAt: iso(w.resetMs) });

/** Who is asking about which quota: a key's consumer, as config.ts compiles it. */
interface Reader {
  account: string;
  plan: string;
  subject: QuotaSubject;
}

export function usageView({ account, plan, subject }: Reader, usage: Usage) {
  const [minute, day] = windows(subject.limits, usage.nowMs, usage.minuteUsed, usage.dayUsed);
  return {
    account,
    plan,
    limits: subject.limits,
    enforced: subject.enforce,
    windows: { minute: view(minute!), ...(day && { day: view(day) }) },
    ban: { active: usage.banUntilMs > 0, until: usage.banUntilMs > 0 ? iso(usage.banUntilMs) : null },
    recentRejections: usage.recentRejections,
    at: iso(usage.nowMs),
  };
}
