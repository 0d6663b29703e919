import { execFile } from 'node:child_process';
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { promisify } from 'node:util';

/** TLS for a test's Redis: the CA file a client is given, and the server's and redis-cli's arguments. */
export interface RedisTls {
  caFile: string;
  serverArgs: string[];
  cliArgs: string[];
}

const run = promisify(execFile);

/**
 * A private CA made with openssl in `dir`, and a server certificate it signed for 127.0.0.1 and
 * localhost: what a managed Redis with its own CA presents. Nothing in the system trusts this
 * CA, so a client reaches the Redis only by being given it (REDIS_TLS_CA_FILE). Clients are not
 * asked for certificates (`tls-auth-clients no`), as on managed services.
 */
export async function privateCa(dir: string): Promise<RedisTls> {
  const at = (name: string) => join(dir, name);
  const ec = ['-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes'];
  await run('openssl', [
    'req',
    '-x509',
    ...ec,
    '-keyout',
    at('ca.key'),
    '-out',
    at('ca.pem'),
    '-days',
    '2',
    '-subj',
    '/CN=gateway test CA',
  ]);
  await run('openssl', ['req', ...ec, '-keyout', at('redis.key'), '-out', at('redis.csr'), '-subj', '/CN=localhost']);
  writeFileSync(at('san.ext'), 'subjectAltName=IP:127.0.0.1,DNS:localhost\n');
  await run('openssl', [
    'x509',
    '-req',
    '-in',
    at('redis.csr'),
    '-CA',
    at('ca.pem'),
    '-CAkey',
    at('ca.key'),
    '-CAcreateserial',
    '-out',
    at('redis.pem'),
    '-days',
    '2',
    '-extfile',
    at('san.ext'),
  ]);
  return {
    caFile: at('ca.pem'),
    serverArgs: [
      '--tls-cert-file',
      at('redis.pem'),
      '--tls-key-file',
      at('redis.key'),
      '--tls-ca-cert-file',
      at('ca.pem'),
      '--tls-auth-clients',
      'no',
    ],
    cliArgs: ['--tls', '--cacert', at('ca.pem')],
  };
}
