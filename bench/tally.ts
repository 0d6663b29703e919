// What the period tally costs the export's leader (issue 49), an event, against what the leader
// already spends on the same event in the same run: parsing its JSON (the tally's first step) and
// framing a compact bundle into CloudEvents (events.ts, bundleEvents). A 250-event bundle (a
// full usagebatch.lua call) as the exporter reads it; no I/O, bounded (a few seconds).
// `npx tsx bench/tally.ts`
import { COMPACT } from '../gateway/quota/bundle.js';
import { bundleEvents } from '../gateway/usage/events.js';
import { tallyPart } from '../gateway/usage/periods.js';

const EVENTS = 250;
const ROUNDS = 2000;
const at = Date.now() - 60_000;
const lines = Array.from({ length: EVENTS }, (_, i) => `0 ${i} 200 ${i + 1},${i + 1} "r-${i}-0123456789ab"`).join('\n');
const heads = '"keyId":"pro-93d6d6","plan":"pro","route":"listPets","method":"GET"';
const bundle = {
  id: `${at}-0`,
  events: EVENTS,
  upto: EVENTS,
  data: `${COMPACT}minute,day${COMPACT}${at}${COMPACT}${heads}${COMPACT}${lines}`,
  refunds: '',
};
const json = bundleEvents('acme', '/pet-store-gateway/production', bundle);
JSON.parse(`[${json}]`); // a valid batch, or this throws

function perEvent(what: () => unknown): number {
  for (let i = 0; i < ROUNDS / 10; i++) what();
  const t0 = process.hrtime.bigint();
  for (let i = 0; i < ROUNDS; i++) what();
  return Number(process.hrtime.bigint() - t0) / ROUNDS / EVENTS;
}
const frame = perEvent(() => bundleEvents('acme', '/pet-store-gateway/production', bundle));
const parse = perEvent(() => JSON.parse(`[${json}]`));
const tally = perEvent(() => tallyPart(json, 1, 0));
console.log(`per event, ${EVENTS}-event bundles, ${ROUNDS} rounds:`);
console.log(`  framing (bundleEvents)   ${frame.toFixed(0).padStart(6)} ns`);
console.log(`  JSON.parse               ${parse.toFixed(0).padStart(6)} ns`);
console.log(
  `  tallyPart                ${tally.toFixed(0).padStart(6)} ns   ${(tally / frame).toFixed(1)}x framing, ${(tally / parse).toFixed(1)}x parse`,
);
