/**
 * Waits for the next UTC minute when fewer than `needMs` remain in this one, so a test that
 * counts within one minute window cannot straddle a boundary. Redis runs on this machine,
 * so its clock is this clock.
 */
export async function roomInMinute(needMs: number): Promise<void> {
  const left = 60_000 - (Date.now() % 60_000);
  if (left < needMs) await new Promise((r) => setTimeout(r, left + 20));
}

export const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
