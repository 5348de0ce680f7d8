// The HTTP worker of bench/http_worker.py: the example Node worker's library with one no-op
// task, serving the queue $BENCH_QUEUE at $WORKER_CONCURRENCY.
import { Worker } from "../examples/node-worker/jobtier-worker.mjs";

const worker = new Worker({
  url: process.env.JOBTIER_URL,
  key: process.env.WORKER_KEY,
  worker: `bench-node-${process.pid}`,
  concurrency: Number(process.env.WORKER_CONCURRENCY ?? 50),
  wait: 5,
  tasks: {
    "bench.noop": { queue: process.env.BENCH_QUEUE, max_attempts: 1, handler: async () => null },
  },
});
process.on("SIGTERM", () => worker.stop());
await worker.run();
