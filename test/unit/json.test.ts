import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { jsonString } from '../../gateway/json.js';

describe('jsonString', () => {
  it('gives what JSON.stringify gives, for any string and for request ids', () => {
    // Any string, the characters JSON escapes among them (quote, backslash, controls, lone
    // surrogates); and ids as requestId() lets them through, which take the path without the call.
    const ids = fc.stringMatching(/^[A-Za-z0-9._:-]{1,128}$/);
    const special = fc.constantFrom('"', '\\', '\n', '\u0000', '\u001f', '\u2028', '\ud800', '/', ' ', 'é');
    const strings = fc.oneof(
      fc.string({ unit: 'binary' }),
      ids,
      fc.array(fc.oneof(special, ids)).map((a) => a.join('')),
    );
    fc.assert(
      fc.property(strings, (s) => {
        expect(jsonString(s)).toBe(JSON.stringify(s));
      }),
      { numRuns: 2_000 },
    );
  });
});
