import type { AttributeValue, HrTime } from '@opentelemetry/api';
import { ProtobufTraceSerializer } from '@opentelemetry/otlp-transformer';
import type { ReadableSpan } from '@opentelemetry/sdk-trace-base';

// Byte for byte what the SDK's ProtobufTraceSerializer writes for the gateway's spans, which costs some 64,000
// instructions a span (docs/performance.md). What the gateway's spans never carry (events, links, array values,
// a second resource or scope) goes to the SDK's serializer.

/** Thrown by a value the encoder does not write: the batch is the SDK's to serialise. */
const UNSUPPORTED = Symbol('unsupported');

let buf = Buffer.allocUnsafe(1 << 16);
let pos = 0;

function room(n: number): void {
  if (pos + n <= buf.length) return;
  const bigger = Buffer.allocUnsafe(Math.max(buf.length * 2, pos + n));
  buf.copy(bigger, 0, 0, pos);
  buf = bigger;
}

const varintSize = (v: number) => (v < 0x80 ? 1 : v < 0x4000 ? 2 : v < 0x200000 ? 3 : v < 0x10000000 ? 4 : 5);

function varint(v: number): void {
  room(5);
  while (v > 0x7f) {
    buf[pos++] = (v & 0x7f) | 0x80;
    v >>>= 7;
  }
  buf[pos++] = v;
}

/** A 64-bit varint of an integer (negative ones in two's complement, ten bytes), as the SDK writes int_value. */
function varint64(value: number): void {
  if (value >= 0 && value <= 0xffffffff) return varint(value);
  const abs = Math.abs(value);
  let low = abs >>> 0;
  let high = (abs / 0x100000000) >>> 0;
  if (value < 0) {
    low = ~low >>> 0;
    high = ~high >>> 0;
    low = (low + 1) >>> 0;
    if (low === 0) high = (high + 1) >>> 0;
  }
  room(10);
  while (high > 0 || low > 0x7f) {
    buf[pos++] = (low & 0x7f) | 0x80;
    low = ((low >>> 7) | (high << 25)) >>> 0;
    high >>>= 7;
  }
  buf[pos++] = low & 0x7f;
}

/** A length-delimited field's body starts `reserved` bytes on, for its length (lenEnd). */
function lenStart(reserved: number): number {
  room(reserved);
  const at = pos;
  pos += reserved;
  return at;
}

/** The body's length into the bytes reserved before it, moving the body when its varint needs another size. */
function lenEnd(at: number, reserved: number): void {
  let len = pos - at - reserved;
  const size = varintSize(len);
  if (size !== reserved) {
    room(size - reserved);
    buf.copyWithin(at + size, at + reserved, pos);
    pos += size - reserved;
  }
  while (len > 0x7f) {
    buf[at++] = (len & 0x7f) | 0x80;
    len >>>= 7;
  }
  buf[at] = len;
}

/** A string's UTF-8 bytes after their length: ASCII copied in one pass, anything else by Buffer's encoder. */
function str(s: string): void {
  const n = s.length;
  room(n * 3 + 5);
  const at = pos;
  varint(n);
  for (let i = 0; i < n; i++) {
    const c = s.charCodeAt(i);
    if (c > 0x7f) {
      pos = at;
      varint(Buffer.byteLength(s));
      pos += buf.write(s, pos, 'utf8');
      return;
    }
    buf[pos++] = c;
  }
}

/** The SDK's hexToBinary's values, for the characters ids are made of. */
const NIBBLE = new Uint8Array(128).map((_, c) => (c >= 48 && c <= 57 ? c - 48 : c >= 97 && c <= 102 ? c - 87 : (c - 55) & 0xff));

function hex(id: string): void {
  const n = id.length >>> 1;
  varint(n);
  room(n);
  for (let i = 0; i < id.length; i += 2) buf[pos++] = (NIBBLE[id.charCodeAt(i) & 0x7f]! << 4) | NIBBLE[id.charCodeAt(i + 1) & 0x7f]!;
}

/** An HrTime as fixed64 nanoseconds, exact past 2^53 as the SDK computes it. */
function fixed64Time(t: HrTime): void {
  const [seconds, nanos] = t;
  const lowerNanos = (seconds & 0xffff) * 1e9;
  const upperNanos = ((seconds / 0x10000) >>> 0) * 1e9;
  const lowWithCarry = (lowerNanos >>> 0) + (((upperNanos & 0xffff) * 0x10000) >>> 0) + nanos;
  const high = (Math.floor(lowerNanos / 0x100000000) + ((upperNanos / 0x10000) >>> 0) + Math.floor(lowWithCarry / 0x100000000)) >>> 0;
  room(8);
  buf.writeUInt32LE(lowWithCarry >>> 0, pos);
  buf.writeUInt32LE(high, pos + 4);
  pos += 8;
}

/** `field`: the whole KeyValue, kept from a value's second sighting in a row: method, route, plan, outcome repeat. */
interface Key {
  bytes: Buffer;
  last: AttributeValue | undefined;
  field: Buffer | undefined;
}
const keys = new Map<string, Key>();

function keyOf(name: string): Key {
  let key = keys.get(name);
  if (key === undefined) {
    const k = Buffer.from(name, 'utf8');
    key = { bytes: Buffer.concat([Buffer.from([0x0a]), varintBytes(k.length), k, Buffer.from([0x12])]), last: undefined, field: undefined };
    if (keys.size < 1000) keys.set(name, key); // the gateway's keys are a few constants
  }
  return key;
}

function varintBytes(v: number): Buffer {
  const out: number[] = [];
  while (v > 0x7f) {
    out.push((v & 0x7f) | 0x80);
    v >>>= 7;
  }
  out.push(v);
  return Buffer.from(out);
}

/** AnyValue: a string, a boolean, an integer within 64 bits or else a double, as the SDK chooses. */
function anyValue(value: AttributeValue | undefined): void {
  if (value == null) return; // an empty AnyValue, as the SDK writes it
  if (typeof value === 'string') {
    buf[pos++] = 0x0a;
    str(value);
  } else if (typeof value === 'number') {
    if (Number.isInteger(value) && value >= -(2 ** 63) && value < 2 ** 63) {
      buf[pos++] = 0x18;
      varint64(value);
    } else {
      room(9);
      buf[pos++] = 0x21;
      buf.writeDoubleLE(value, pos);
      pos += 8;
    }
  } else if (typeof value === 'boolean') {
    buf[pos++] = 0x10;
    buf[pos++] = value ? 1 : 0;
  } else throw UNSUPPORTED;
}

/** Span.attributes' tag: the only field whose KeyValues are kept (a resource's are written once). */
const SPAN_ATTRIBUTE = 0x4a;

function attributes(tag: number, attrs: Record<string, AttributeValue | undefined>): void {
  for (const name in attrs) {
    const value = attrs[name];
    const key = keyOf(name);
    if (tag === SPAN_ATTRIBUTE && value === key.last && key.field !== undefined) {
      room(key.field.length);
      buf.set(key.field, pos);
      pos += key.field.length;
      continue;
    }
    const k = key.bytes;
    const from = pos;
    room(k.length + 8);
    buf[pos++] = tag;
    const kv = lenStart(1);
    buf.set(k, pos);
    pos += k.length;
    const v = lenStart(1);
    anyValue(value);
    lenEnd(v, 1);
    lenEnd(kv, 1);
    if (value !== key.last) [key.last, key.field] = [value, undefined];
    else if (tag === SPAN_ATTRIBUTE) key.field = Buffer.from(buf.subarray(from, pos)); // seen twice in a row
  }
}

function span(s: ReadableSpan): void {
  if (s.events.length > 0 || s.links.length > 0) throw UNSUPPORTED;
  const ctx = s.spanContext();
  room(64);
  buf[pos++] = 0x0a;
  hex(ctx.traceId);
  buf[pos++] = 0x12;
  hex(ctx.spanId);
  const traceState = ctx.traceState?.serialize();
  if (traceState) {
    buf[pos++] = 0x1a;
    str(traceState);
  }
  const parent = s.parentSpanContext;
  if (parent?.spanId) {
    room(1);
    buf[pos++] = 0x22;
    hex(parent.spanId);
  }
  room(1);
  buf[pos++] = 0x2a;
  str(s.name);
  const kind = s.kind == null ? 0 : s.kind + 1;
  if (kind !== 0) {
    room(1);
    buf[pos++] = 0x30;
    varint(kind);
  }
  room(1);
  buf[pos++] = 0x39;
  fixed64Time(s.startTime);
  room(1);
  buf[pos++] = 0x41;
  fixed64Time(s.endTime);
  attributes(SPAN_ATTRIBUTE, s.attributes);
  const { status } = s;
  room(20);
  buf[pos++] = 0x50;
  varint(s.droppedAttributesCount);
  buf[pos++] = 0x60;
  varint(s.droppedEventsCount);
  buf[pos++] = 0x70;
  varint(s.droppedLinksCount);
  buf[pos++] = 0x7a;
  const st = lenStart(1);
  if (status.message) {
    buf[pos++] = 0x12;
    str(status.message);
  }
  room(6);
  buf[pos++] = 0x18;
  varint(status.code);
  lenEnd(st, 1);
  // Span.flags (field 16, fixed32): the trace flags, and whether the parent was remote, known.
  const flags = (ctx.traceFlags & 0xff) | 0x100 | (parent?.isRemote ? 0x200 : 0);
  room(6);
  buf[pos++] = 0x85;
  buf[pos++] = 0x01;
  buf.writeUInt32LE(flags >>> 0, pos);
  pos += 4;
}

/** Resource (field 1 of ResourceSpans) and InstrumentationScope (field 1 of ScopeSpans), each made once per object. */
const headers = new WeakMap<object, Buffer>();

function once(of: object, write: () => void): Buffer {
  let bytes = headers.get(of);
  if (bytes === undefined) {
    pos = 0;
    write();
    bytes = Buffer.from(buf.subarray(0, pos));
    headers.set(of, bytes);
  }
  return bytes;
}

function resourceField(resource: ReadableSpan['resource']): Buffer {
  return once(resource, () => {
    buf[pos++] = 0x0a;
    const at = lenStart(1);
    attributes(0x0a, resource.attributes);
    room(2);
    buf[pos++] = 0x10; // dropped_attributes_count, 0
    buf[pos++] = 0;
    lenEnd(at, 1);
  });
}

function scopeField(scope: ReadableSpan['instrumentationScope']): Buffer {
  return once(scope, () => {
    buf[pos++] = 0x0a;
    const at = lenStart(1);
    room(1);
    buf[pos++] = 0x0a;
    str(scope.name);
    if (scope.version) {
      room(1);
      buf[pos++] = 0x12;
      str(scope.version);
    }
    lenEnd(at, 1);
  });
}

/** Room before the spans for what precedes them: two tags and two lengths. */
const HEAD_ROOM = 12;

function encode(spans: ReadableSpan[]): Uint8Array {
  const { resource, instrumentationScope: scope } = spans[0]!;
  for (const s of spans) if (s.resource !== resource || s.instrumentationScope !== scope) throw UNSUPPORTED;
  const [res, sc] = [resourceField(resource), scopeField(scope)];
  const head = HEAD_ROOM + res.length + sc.length;
  pos = head;
  for (const s of spans) {
    room(3);
    buf[pos++] = 0x12; // ScopeSpans.spans
    const at = lenStart(2);
    span(s);
    lenEnd(at, 2);
  }
  if (scope.schemaUrl) {
    room(1);
    buf[pos++] = 0x1a;
    str(scope.schemaUrl);
  }
  const scopeSpans = sc.length + pos - head;
  const scopeEnd = pos;
  if (resource.schemaUrl) {
    room(1);
    buf[pos++] = 0x1a;
    str(resource.schemaUrl);
  }
  const resourceSpans = res.length + 1 + varintSize(scopeSpans) + scopeSpans + pos - scopeEnd;
  // What precedes the spans, written to end where they start.
  const start = head - sc.length - varintSize(scopeSpans) - 1 - res.length - varintSize(resourceSpans) - 1;
  const end = pos;
  pos = start;
  buf[pos++] = 0x0a; // ExportTraceServiceRequest.resource_spans
  varint(resourceSpans);
  pos += res.copy(buf, pos);
  buf[pos++] = 0x12; // ResourceSpans.scope_spans
  varint(scopeSpans);
  sc.copy(buf, pos);
  return new Uint8Array(buf.subarray(start, end));
}

export const FastProtobufTraceSerializer: typeof ProtobufTraceSerializer = {
  serializeRequest(spans) {
    if (spans.length === 0) return ProtobufTraceSerializer.serializeRequest(spans);
    try {
      return encode(spans);
    } catch (e) {
      if (e !== UNSUPPORTED) throw e;
      return ProtobufTraceSerializer.serializeRequest(spans);
    }
  },
  deserializeResponse: ProtobufTraceSerializer.deserializeResponse,
};
