// A request's concurrency slot (quota.lua's), held until the request is over at both ends: its
// answer closed (sent, failed, timed out or cut by the client) and its backend call ended
// (headers back, or an error). A client that hangs up does not end the backend's work: the
// slot stays taken until the backend answers, so the backend never sees more than the limit.

/** The hold on one request's slot: `release` runs once, when nothing is open any more. */
export class SlotHold {
  /** The answer, plus the backend call while it runs. */
  private open = 1;
  private upstream = false;

  constructor(private readonly release: () => void) {}

  /** The backend call starts (the proxy sends the request). */
  upstreamStarted(): void {
    if (this.upstream || this.open === 0) return;
    this.upstream = true;
    this.open++;
  }

  /** The backend call ended: its headers arrived, or it failed. */
  upstreamEnded(): void {
    if (!this.upstream) return;
    this.upstream = false;
    this.end();
  }

  /** The answer closed (ServerResponse 'close': after it was sent, or when its connection went). */
  answered(): void {
    this.end();
  }

  private end(): void {
    if (--this.open === 0) this.release();
  }
}
