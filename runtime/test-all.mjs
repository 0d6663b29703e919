// `npm test`: every part in turn (build, typecheck, lint, format check, the suite, then the
// tests under CPU contention alone), each run whatever became of the ones before, so a lint
// error does not hide the tests' results (an `&&` chain skipped the rest at the first failure).
// At the end, one line a part with its outcome and time; the exit code fails if any part did.
// The checks' own tally goes to .checks-results.json, for .ci/run beside vitest's two files.
import { spawn } from 'node:child_process';
import { rmSync, writeFileSync } from 'node:fs';
import process from 'node:process';

const PARTS = [
  { name: 'build', script: 'build', check: true },
  { name: 'typecheck', script: 'typecheck', check: true },
  { name: 'lint', script: 'lint', check: true },
  { name: 'format check', script: 'format:check', check: true },
  { name: 'tests', script: 'test:suite' },
  { name: 'tests under contention', script: 'test:contention' },
];

/** Runs one npm script; resolves with its exit code, or its signal's name. */
const runScript = (script) =>
  new Promise((resolve) => {
    const child = spawn('npm', ['run', '-s', script], { stdio: 'inherit' });
    child.once('error', (err) => resolve(err.message));
    child.once('close', (code, signal) => resolve(signal ?? code));
  });

// A results file left by an earlier run must not be read as this run's.
for (const file of ['.vitest-results.json', '.vitest-contention-results.json', '.checks-results.json']) rmSync(file, { force: true });

const done = [];
for (const part of PARTS) {
  process.stderr.write(`\n== npm test: ${part.name} (npm run ${part.script})\n`);
  const started = Date.now();
  const outcome = await runScript(part.script);
  done.push({ ...part, ok: outcome === 0, outcome, seconds: (Date.now() - started) / 1000 });
  // Ctrl-C reaches the part and this process alike: stop here rather than start the next part.
  if (outcome === 'SIGINT' || outcome === 'SIGTERM') break;
}

const checks = done.filter((p) => p.check);
writeFileSync(
  '.checks-results.json',
  JSON.stringify({ passed: checks.filter((p) => p.ok).length, failed: checks.filter((p) => !p.ok).length, skipped: 0 }),
);
const width = Math.max(...PARTS.map((p) => p.name.length));
process.stderr.write('\nnpm test, part by part:\n');
for (const p of done) {
  const said = p.ok ? 'passed' : typeof p.outcome === 'number' ? `FAILED (exit ${p.outcome})` : `FAILED (${p.outcome})`;
  process.stderr.write(`  ${p.name.padEnd(width)}  ${said.padEnd(18)} ${p.seconds.toFixed(1)} s\n`);
}
for (const p of PARTS.slice(done.length)) process.stderr.write(`  ${p.name.padEnd(width)}  not run (stopped)\n`);
const failed = done.filter((p) => !p.ok).map((p) => p.name);
const stopped = done.length < PARTS.length;
process.stderr.write(
  failed.length === 0 && !stopped
    ? `all ${PARTS.length} parts passed\n`
    : `failed: ${failed.join(', ') || 'none'}${stopped ? '; stopped early' : ''}\n`,
);
process.exitCode = failed.length > 0 || stopped ? 1 : 0;
