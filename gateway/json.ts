// JSON text written by hand on the hot paths (the access line, usage events): a leaf.

/** What JSON.stringify leaves as it is, but for its quotes: a request id (1 to 128 of [A-Za-z0-9._:-]) always is. */
const PLAIN = /^[\w.:-]*$/;

/**
 * A string as JSON text, as JSON.stringify gives it. JSON.stringify is a call into the runtime,
 * some 2,000 instructions for a request id of 36 characters under callgrind; the check and the
 * quotes about 900.
 */
export const jsonString = (s: string) => (PLAIN.test(s) ? `"${s}"` : JSON.stringify(s));
