import type { QuotaSubject } from '../decision.js';
import type { Clock } from './clock.js';
import type { Lease, LeaseBook } from './lease-book.js';

export interface CreditLeasesOptions {
  leases: LeaseBook;
  clock: Clock;
  failing: () => boolean;
  /** A call of the subject's own that closes its lapsed leases (quota.lua takes them back with it). */
  close: (subject: QuotaSubject) => Promise<unknown>;
}

/**
 * Subjects holding credit leases, one timer each, at the end of the latest lease's time: then
 * its lapsed leases are closed in a call of their own, their unused credits back to the balance
 * well before Redis would give them back whole (quota.lua, HOLD_GRACE).
 */
export class CreditLeases {
  private readonly holders = new Map<string, { subject: QuotaSubject; timer?: NodeJS.Timeout }>();

  constructor(private readonly o: CreditLeasesOptions) {}

  /** A credit lease granted or given back: closed by the timer once it lapses, if no call closed it before. */
  watch(subject: QuotaSubject, lease: Lease): void {
    const holder = this.holders.get(subject.name) ?? { subject };
    holder.subject = subject;
    this.holders.set(subject.name, holder);
    if (holder.timer) return;
    holder.timer = setTimeout(() => this.closeLapsed(subject.name), Math.max(0, lease.until - this.o.clock.mono()) + 1).unref();
  }

  private closeLapsed(name: string): void {
    const holder = this.holders.get(name);
    if (!holder) return;
    holder.timer = undefined;
    const { leases } = this.o;
    let waiting = leases.lapse(name);
    if (waiting && !this.o.failing() && !leases.inFlight(name)) {
      void this.o.close(holder.subject);
      waiting = false;
    }
    // Leases still running (taken in a later minute), or to close once Redis answers: asked again in a second.
    if (waiting || leases.hasCurrent(name) || leases.hasAhead(name)) {
      holder.timer = setTimeout(() => this.closeLapsed(name), 1000).unref();
    } else this.holders.delete(name);
  }

  /** On stopping: every credit lease closed, its credits not handed out back to the balance. */
  async closeAll(): Promise<void> {
    const calls = [...this.holders.values()].map(({ subject, timer }) => {
      clearTimeout(timer);
      return this.o.leases.closeAll(subject.name) ? this.o.close(subject) : undefined;
    });
    this.holders.clear();
    await Promise.all(calls);
  }
}
