// BullMQ side of jobtier's bench/compare.py: no-op jobs, written for this bench against
// BullMQ's documented API (Queue.addBulk, Worker, the worker's 'completed' event).
//
//   node bench.mjs enqueue --url redis://127.0.0.1:PORT/0 --jobs N [--batch 500]
//       adds N jobs with Queue.addBulk, BATCH per call, one call at a time; prints
//       compare: {"t0": s, "t1": s, "cpu": s} (epoch seconds around the adds; CPU of this process)
//   node bench.mjs worker --url ... --jobs N [--concurrency 50]
//       a Worker at CONCURRENCY running a no-op processor; prints compare: {"ready": true} once
//       connected, then compare: {"done": s, "completed": N, "failed": 0} at the N-th job
//       finished ('completed' or 'failed' event), and runs until it is stopped (SIGTERM).
//
// Queue and job options are BullMQ's defaults (completed jobs are kept, as by default).

import { Queue, Worker } from 'bullmq';

const QUEUE = 'compare';

function parse(argv) {
  const [role, ...rest] = argv;
  const opts = { role, url: 'redis://127.0.0.1:6379/0', jobs: 20000, batch: 500, concurrency: 50 };
  for (let i = 0; i < rest.length; i += 2) {
    const key = rest[i].replace(/^--/, '');
    if (!(key in opts)) throw new Error(`unknown option ${rest[i]}`);
    opts[key] = key === 'url' ? rest[i + 1] : Number(rest[i + 1]);
  }
  if (role !== 'enqueue' && role !== 'worker') throw new Error('role: enqueue or worker');
  return opts;
}

function connection(url) {
  const u = new URL(url);
  const db = Number(u.pathname.replace('/', '') || 0);
  // maxRetriesPerRequest null: what BullMQ requires of a Worker's connection
  return { host: u.hostname, port: Number(u.port), db, maxRetriesPerRequest: null };
}

const now = () => (performance.timeOrigin + performance.now()) / 1000;
const emit = (fields) => process.stdout.write(`compare: ${JSON.stringify(fields)}\n`);

async function enqueue(opts) {
  const queue = new Queue(QUEUE, { connection: connection(opts.url) });
  await queue.waitUntilReady();
  const cpu0 = process.cpuUsage();
  const t0 = now();
  for (let i = 0; i < opts.jobs; i += opts.batch) {
    const jobs = [];
    for (let j = i; j < Math.min(i + opts.batch, opts.jobs); j++) {
      jobs.push({ name: 'noop', data: { n: j } });
    }
    await queue.addBulk(jobs);
  }
  const t1 = now();
  const cpu = process.cpuUsage(cpu0);
  emit({ t0, t1, cpu: (cpu.user + cpu.system) / 1e6 });
  await queue.close();
}

async function work(opts) {
  let completed = 0;
  let failed = 0;
  const worker = new Worker(QUEUE, async () => null, {
    connection: connection(opts.url),
    concurrency: opts.concurrency,
  });
  const finished = () => {
    if (completed + failed === opts.jobs) emit({ done: now(), completed, failed });
  };
  worker.on('completed', () => {
    completed += 1;
    finished();
  });
  worker.on('failed', () => {
    failed += 1;
    finished();
  });
  worker.on('error', (err) => process.stderr.write(`worker error: ${err}\n`));
  await worker.waitUntilReady();
  emit({ ready: true });
  const stop = async () => {
    await worker.close(true);
    process.exit(0);
  };
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
}

const opts = parse(process.argv.slice(2));
await (opts.role === 'enqueue' ? enqueue(opts) : work(opts));
